#!/usr/bin/env python
"""Regenerate the golden ModelOpt fixtures under ``tests/fixtures/modelopt/``.

Why: the loader and the quantizer must agree with checkpoints that this project did not write.
This script builds a tiny random Nemotron-H with transformers, quantizes it with the official
NVIDIA ModelOpt package and exports it with ModelOpt's own HF exporter.  The outputs are
committed; CI never installs ModelOpt.

Run it in a separate virtualenv (ModelOpt is heavy and pins its own stack)::

    python -m venv /work/venv-modelopt
    /work/venv-modelopt/bin/pip install torch==2.13.0
    /work/venv-modelopt/bin/pip install transformers==5.23.0 nvidia-modelopt==0.47.0 \
        requests safetensors
    /work/venv-modelopt/bin/python scripts/make_modelopt_fixtures.py [--tp2]

Outputs (all deterministic; same bytes across runs):

- ``dense/``: the pre-quantization model exactly as ``save_pretrained`` writes it (bf16), so
  ``blockspec.quant.quantize_checkpoint`` can be compared byte for byte with ModelOpt.
- one folder per recipe with ModelOpt's exported files as written (``config.json``,
  ``hf_quant_config.json``, ``model.safetensors``, ``generation_config.json``) and
  ``modelopt_dequant.json``: per tensor, the sha256 of ModelOpt's *own* fp32 dequantization
  (``NVFP4QTensor.dequantize`` / ``FP8QTensor.dequantize``), so the oracle is ModelOpt, not us.
- ``SHA256SUMS`` over every file.

The exclude lists are left as ModelOpt 0.47.0 writes them (with its ``.\\x00...name_sentinel``
corruption), because a loader must tolerate what is out there.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import pathlib
import shutil

import torch

MODEL_SEED = 1234
CALIB_SEED = 99
ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "modelopt"
TP2_OUT = ROOT / "tests" / "fixtures" / "modelopt_tp2"
TP2_RECIPES = ("nvfp4", "mixed_lightning")


def build_model(tp2: bool = False):
    """A tiny Nemotron-H covering Mamba (M), attention (*), MoE (E) and dense MLP (-) blocks.

    hidden 32 keeps every K a multiple of 16; in_proj has 98 outputs (not a multiple of 16)
    on purpose.  The router gate is redrawn because HF zero-initialises it.  ``tp2``: a
    variant two tensor-parallel ranks can split (2 Mamba groups, expert width 32, so each
    rank's slice of a packed row-parallel input is whole scale groups of 16).
    """
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(
        vocab_size=128,
        hidden_size=32,
        layers_block_type=["linear_attention", "full_attention", "linear_attention", "moe", "mlp"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=32,
        mamba_num_heads=2,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2 if tp2 else 1,
        conv_kernel=4,
        chunk_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32 if tp2 else 16,
        moe_shared_expert_intermediate_size=32,
        routed_scaling_factor=2.5,
        max_position_embeddings=256,
        eos_token_id=2,
    )
    cfg.architectures = ["NemotronHForCausalLM"]
    torch.manual_seed(MODEL_SEED)
    model = NemotronHForCausalLM(cfg).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(MODEL_SEED + 1)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mixer.gate"):
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.5)
                module.e_score_correction_bias.copy_(
                    torch.randn(module.e_score_correction_bias.shape, generator=gen) * 0.1)
        # Give the routed experts different magnitudes (distinct global scales) and one
        # all-zero block of 16 (ModelOpt sets its block scale to 1.0).
        experts = model.model.layers[3].mixer.experts
        for e in range(experts.up_proj.shape[0]):
            experts.up_proj[e].mul_(1.0 + e)
            experts.down_proj[e].mul_(1.0 + 0.5 * e)
        experts.up_proj[1, 3, 0:16].zero_()
    return model


def calib_batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(CALIB_SEED)
    return [torch.randint(0, 128, (2, 12), generator=gen) for _ in range(2)]


def lightning_like_cfg(mtq) -> dict:
    """ModelOpt's Lightning 3.5 layout with plain max-calibrated NVFP4 (MSE 4/6 needs CUDA).

    W4A16 NVFP4: routed experts, shared experts, lm_head.  FP8 static: Mamba in/out_proj.
    FP8 KV cache.  Attention BF16.
    """
    nvfp4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
    fp8 = {"num_bits": (4, 3), "axis": None}
    return {
        "algorithm": "max",
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*mixer.experts*weight_quantizer", "enable": True, "cfg": nvfp4},
            {"quantizer_name": "*mixer.shared_experts*weight_quantizer", "enable": True,
             "cfg": nvfp4},
            {"quantizer_name": "*mixer.in_proj*weight_quantizer", "enable": True, "cfg": fp8},
            {"quantizer_name": "*mixer.in_proj*input_quantizer", "enable": True, "cfg": fp8},
            {"quantizer_name": "*mixer.out_proj*weight_quantizer", "enable": True, "cfg": fp8},
            {"quantizer_name": "*mixer.out_proj*input_quantizer", "enable": True, "cfg": fp8},
            {"quantizer_name": "*[kv]_bmm_quantizer", "enable": True, "cfg": {"num_bits": (4, 3)}},
            {"quantizer_name": "lm_head.weight_quantizer", "enable": True, "cfg": nvfp4},
        ],
    }


def recipes(mtq) -> dict[str, dict]:
    return {
        "w4a16_nvfp4": mtq.W4A16_NVFP4_CFG,
        "nvfp4": mtq.NVFP4_DEFAULT_CFG,
        "nvfp4_conservative": mtq.MAMBA_MOE_NVFP4_CONSERVATIVE_CFG,
        "fp8": mtq.FP8_DEFAULT_CFG,
        "mixed_lightning": lightning_like_cfg(mtq),
    }


def modelopt_dequant_hashes(folder: pathlib.Path) -> dict:
    """sha256 of ModelOpt's own fp32 dequantization of every weight (plain fp32 cast if dense)."""
    from safetensors.torch import load_file
    from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor

    tensors = load_file(str(folder / "model.safetensors"))
    out = {}
    for name in sorted(tensors):
        if not name.endswith(".weight"):
            continue
        base = name[: -len(".weight")]
        w = tensors[name]
        scale = tensors.get(base + ".weight_scale")
        scale2 = tensors.get(base + ".weight_scale_2")
        if scale is not None and scale2 is not None and w.dtype == torch.uint8:
            shape = (w.shape[0], w.shape[1] * 2)
            q = NVFP4QTensor(torch.Size(shape), torch.float32, w)
            deq = q.dequantize(dtype=torch.float32, scale=scale, double_scale=scale2,
                               block_sizes={-1: 16})
            kind = "nvfp4"
        elif scale is not None and w.dtype == torch.float8_e4m3fn:
            q = FP8QTensor(w.shape, torch.float32, w)
            deq = q.dequantize(dtype=torch.float32, scale=scale)
            kind = "fp8"
        else:
            deq = w.to(torch.float32)
            kind = "dense"
        deq = deq.contiguous()
        out[name] = {
            "kind": kind,
            "shape": list(deq.shape),
            "sha256": hashlib.sha256(deq.numpy().tobytes()).hexdigest(),
            "absmax": float(deq.abs().max()),
        }
    return out


def activation_amax(model, n_experts: int) -> dict[str, float]:
    """Calibrated activation amax per activation-scale tensor name (checkpoint space).

    ``quantize_checkpoint(..., act_amax=...)`` takes these so that its ``input_scale`` /
    ``k_scale`` / ``v_scale`` can be compared byte for byte with ModelOpt's.  Fused experts have
    one input quantizer per projection, shared by every expert of the layer.
    """
    from modelopt.torch.quantization.nn import TensorQuantizer

    out: dict[str, float] = {}
    for qname, q in model.named_modules():
        if not isinstance(q, TensorQuantizer) or not q.is_enabled or q.amax is None:
            continue
        if "weight_quantizer" in qname:
            continue
        name = "backbone." + qname[len("model."):] if qname.startswith("model.") else qname
        amax = float(q.amax.float().max())
        if name.endswith(".experts.up_proj_input_quantizer") or name.endswith(
                ".experts.down_proj_input_quantizer"):
            parent, attr = name.rsplit(".", 1)
            proj = attr[: -len("_input_quantizer")]
            for e in range(n_experts):
                out[f"{parent}.{e}.{proj}.input_scale"] = amax
        elif name.endswith(".input_quantizer"):
            out[name[: -len("input_quantizer")] + "input_scale"] = amax
        elif name.endswith(".k_bmm_quantizer"):
            out[name[: -len("k_bmm_quantizer")] + "k_proj.k_scale"] = amax
        elif name.endswith(".v_bmm_quantizer"):
            out[name[: -len("v_bmm_quantizer")] + "v_proj.v_scale"] = amax
        else:
            raise RuntimeError(f"unexpected enabled quantizer {qname}")
    return dict(sorted(out.items()))


def write_sha256sums(root: pathlib.Path) -> None:
    lines = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != "SHA256SUMS"):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        lines.append(f"{digest}  {path.relative_to(root).as_posix()}")
    (root / "SHA256SUMS").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ap.add_argument("--tp2", action="store_true",
                    help=f"the tensor-parallel variant ({', '.join(TP2_RECIPES)}) into "
                         "tests/fixtures/modelopt_tp2")
    args = ap.parse_args()
    args.out = args.out or (TP2_OUT if args.tp2 else DEFAULT_OUT)

    import modelopt
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    out: pathlib.Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    base = build_model(args.tp2)
    base.save_pretrained(str(out / "dense"))
    batches = calib_batches()

    for name, qcfg in recipes(mtq).items():
        if args.tp2 and name not in TP2_RECIPES:
            continue
        model = copy.deepcopy(base)

        def forward_loop(m, _batches=batches):
            with torch.no_grad():
                for ids in _batches:
                    m(input_ids=ids)

        mtq.quantize(model, qcfg, forward_loop)
        # Read before export: the exporter unfuses the experts and drops their quantizers.
        act_amax = activation_amax(model, base.config.n_routed_experts)
        folder = out / name
        export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=str(folder))
        hashes = modelopt_dequant_hashes(folder)
        meta = {
            "producer": {"modelopt": modelopt.__version__, "torch": torch.__version__},
            "recipe": name,
            "act_amax": act_amax,
            "tensors": hashes,
        }
        (folder / "modelopt_dequant.json").write_text(json.dumps(meta, indent=1, sort_keys=True)
                                                      + "\n")
        print(f"{name}: {sum(p.stat().st_size for p in folder.iterdir())} bytes")

    write_sha256sums(out)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"total {total} bytes in {out}")


if __name__ == "__main__":
    main()
