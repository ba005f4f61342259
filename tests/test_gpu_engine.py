"""GPU runs of the engine (skipped without CUDA): same tokens as on CPU, speculative output equal
to target-only output on the GPU, and Triton W4A16 kernels against the torch reference path."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockspec import Engine
from blockspec.tiny_model import write_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FIXTURES = Path(__file__).parent / "fixtures" / "modelopt"
PROMPTS = [[5, 17, 33, 8, 60, 21, 9], [44, 3], [12, 70, 71, 72, 15, 16, 90, 4]]
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("gpu") / "demo")


def test_cuda_fp32_matches_cpu(demo):
    cpu = Engine(model_path=str(demo), device="cpu", dtype="float32").generate(input_ids=PROMPTS, sampling_params=GREEDY)
    gpu = Engine(model_path=str(demo), device="cuda", dtype="float32").generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in gpu] == [o["output_ids"] for o in cpu]


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_cuda_speculative_equals_target_only(demo, kind):
    from blockspec.bench.draft_presets import build_random_draft
    from blockspec.bench.presets import preset_config

    # fp32: verify (T rows) and decode (1 row) GEMMs round alike enough for exact greedy; in
    # bf16 different GEMM shapes may legitimately flip near-tied argmaxes (as in every engine)
    target = Engine(model_path=str(demo), device="cuda", dtype="float32")
    ref = target.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    draft = build_random_draft(kind, preset_config("tiny"), 4 if kind == "dflash" else 3,
                        torch.device("cuda"), torch.float32)
    spec = Engine.from_model(target.model, draft=draft).generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in ref]


@pytest.mark.parametrize("name", ["w4a16_nvfp4", "mixed_lightning"])
def test_triton_modules_match_reference_on_engine_activations(name):
    """Every packed Linear of a loaded engine, on the activations it really sees in a forward,
    against the torch reference (exact dequant rounded to bf16, then matmul). Compared per module:
    whole-model logits of a tiny random MoE amplify bf16-level differences through routing flips,
    and the v2 kernel is slightly more exact than the reference (it never rounds the weights)."""
    import torch.nn.functional as F

    from blockspec.quant.linear import NVFP4Linear

    e = Engine(model_path=str(FIXTURES / name), device="cuda", dtype="bfloat16")
    seen: dict[str, torch.Tensor] = {}

    def keeper(name: str):
        def hook(mod, inp, out) -> None:      # must return None: a value would replace the output
            seen.setdefault(name, inp[0].detach())
        return hook

    hooks = [m.register_forward_hook(keeper(n))
             for n, m in e.model.named_modules() if isinstance(m, NVFP4Linear)]
    e.runner.score([[5, 17, 33, 8, 60, 21, 9], [44, 3, 100, 101]])
    for h in hooks:
        h.remove()
    modules = dict(e.model.named_modules())
    assert seen
    for n, x in seen.items():
        m = modules[n]
        got = m(x).float()
        ref = F.linear(x, m.dense_weight(torch.bfloat16)).float()
        assert ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)) < 1e-2, n


def test_fp8_quantization_fused_into_the_norms_changes_no_bit(monkeypatch):
    """The mixed Lightning fixture (FP8 Mamba projections, static scales from ModelOpt): decode
    with the norms quantizing for the FP8 linears gives the same tokens and logprobs, to the
    bit, as with the linears quantizing themselves."""
    from blockspec.quant.linear import FP8Linear

    def run():
        e = Engine(model_path=str(FIXTURES / "mixed_lightning"), device="cuda", dtype="bfloat16")
        try:
            outs = e.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
        finally:
            e.shutdown()
        return [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in outs]

    calls = []
    orig = FP8Linear.forward_quantized
    monkeypatch.setattr(FP8Linear, "forward_quantized",
                        lambda self, xq, dt: calls.append(1) or orig(self, xq, dt))
    fused = run()
    assert calls                                      # the fused path ran
    monkeypatch.setattr(FP8Linear, "fused_input_scale", lambda self, x: None)
    assert run() == fused


def test_triton_prefill_kernels_give_the_torch_tokens(demo, monkeypatch):
    """Greedy tokens of prompts spanning several SSD chunks (the tiny model's chunk is 16) and
    several prefill chunks (each from the previous one's committed state) are the same with the
    Triton kernels (the prefill scan counted) as with the torch references everywhere
    (BLOCKSPEC_DISABLE_TRITON=1)."""
    from blockspec.layers import mamba2

    scans = []
    kernel = mamba2.ssd_scan

    def counted(*args, **kwargs):
        scans.append(args[0].shape[1])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(mamba2, "ssd_scan", counted)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (70, 41)]
    fast = Engine(model_path=str(demo), device="cuda", dtype="float32", chunked_prefill_size=48)
    got = fast.generate(input_ids=prompts, sampling_params=GREEDY)
    assert scans and max(scans) > 16
    monkeypatch.setenv("BLOCKSPEC_DISABLE_TRITON", "1")
    ref = Engine(model_path=str(demo), device="cuda", dtype="float32", chunked_prefill_size=48)
    want = ref.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
