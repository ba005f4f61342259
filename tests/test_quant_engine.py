"""The engine on real ModelOpt exports: greedy tokens and logprobs equal transformers' NemotronH
built from the dequantized weights (ModelOpt's dequantization rule, decoded by us and checked
bit-exact against ModelOpt elsewhere)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from blockspec import Engine
from blockspec.quant.quantize import dequantize_checkpoint
from tests.hf_oracle import hf_greedy, hf_logits

FIXTURES = Path(__file__).parent / "fixtures" / "modelopt"
NAMES = ["w4a16_nvfp4", "nvfp4", "nvfp4_conservative", "fp8", "mixed_lightning"]
PROMPTS = [[5, 17, 33, 8, 60, 21, 9], [44, 3, 100, 101]]


def _hf_from_dequantized(folder: Path, dst: Path):
    from transformers import NemotronHForCausalLM

    dst.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(cfg))
    dense = {k: v.float().contiguous() for k, v in dequantize_checkpoint(folder).items()}
    save_file(dense, str(dst / "model.safetensors"))
    return NemotronHForCausalLM.from_pretrained(str(dst), dtype=torch.float32).eval()


@pytest.mark.parametrize("name", NAMES)
def test_engine_matches_transformers_on_dequantized(name, tmp_path, caplog):
    folder = FIXTURES / name
    hf = _hf_from_dequantized(folder, tmp_path / "dense")
    with caplog.at_level(logging.WARNING, logger="blockspec"):
        e = Engine(model_path=str(folder), device="cpu", dtype="float32")
    assert "unexpected" not in caplog.text
    sp = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    outs = e.generate(input_ids=PROMPTS, sampling_params=sp, return_logprob=True)
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_greedy(hf, prompt, 32)
        assert out["output_ids"] == ref
        # logprobs of the generated tokens under the reference (full recompute) within 1e-3
        logits = hf_logits(hf, prompt + ref)[len(prompt) - 1: -1]
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ref)[:, None])[:, 0]
        got = torch.tensor([lp for lp, _ in out["meta_info"]["output_token_logprobs"]])
        assert (got - want).abs().max() < 1e-3


def test_quantized_modules_are_packed():
    e = Engine(model_path=str(FIXTURES / "mixed_lightning"), device="cpu", dtype="float32")
    layers = e.model.backbone.layers
    assert e.model.lm_head.weight.dtype == torch.uint8                       # W4A16_NVFP4
    assert layers[0].mixer.in_proj.weight.dtype == torch.float8_e4m3fn       # FP8
    assert layers[1].mixer.q_proj.weight.dtype == torch.float32              # attention dense
    assert layers[3].mixer.experts[0].up_proj.weight.dtype == torch.uint8    # experts via parent entry
