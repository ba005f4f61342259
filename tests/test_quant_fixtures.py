"""Golden ModelOpt fixtures: integrity, bit-exact dequantization, quantized modules."""
import hashlib
import json
import pathlib

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from blockspec.quant.linear import (FP8Linear, NVFP4Linear, make_quant_embedding,
                                    make_quant_linear, stack_nvfp4_experts)
from blockspec.quant.nvfp4 import quantize_nvfp4
from blockspec.quant.quantize import dequantize_checkpoint

FIX = pathlib.Path(__file__).parent / "fixtures" / "modelopt"
QUANTIZED = ["w4a16_nvfp4", "nvfp4", "nvfp4_conservative", "fp8", "mixed_lightning"]


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def test_sha256sums_match_and_size_budget():
    lines = (FIX / "SHA256SUMS").read_text().split("\n")
    entries = [ln.split("  ", 1) for ln in lines if ln]
    assert len(entries) >= 20
    total = 0
    for digest, rel in entries:
        data = (FIX / rel).read_bytes()
        total += len(data)
        assert hashlib.sha256(data).hexdigest() == digest, rel
    assert total <= 1_000_000


@pytest.mark.parametrize("name", QUANTIZED)
def test_every_tensor_decodes_bit_exactly_like_modelopt(name):
    oracle = json.loads((FIX / name / "modelopt_dequant.json").read_text())["tensors"]
    dense = dequantize_checkpoint(FIX / name)
    kinds = {"nvfp4": 0, "fp8": 0, "dense": 0}
    for tname, ref in oracle.items():
        ours = dense[tname]
        assert ours.dtype == torch.float32 and list(ours.shape) == ref["shape"], tname
        assert _sha(ours) == ref["sha256"], f"{name}:{tname} differs from ModelOpt's decode"
        kinds[ref["kind"]] += 1
    assert kinds["nvfp4"] + kinds["fp8"] >= 12
    assert not any(k.endswith(("_scale", "_scale_2")) for k in dense)


def test_dequantized_unquantized_tensors_equal_the_dense_model():
    dense = load_file(str(FIX / "dense" / "model.safetensors"))
    deq = dequantize_checkpoint(FIX / "mixed_lightning")
    for name in ("backbone.embeddings.weight", "backbone.layers.1.mixer.q_proj.weight",
                 "backbone.layers.3.mixer.gate.weight", "backbone.layers.0.mixer.A_log"):
        assert torch.equal(deq[name], dense[name].float())
    # quantized ones are close to the dense originals
    w = dense["lm_head.weight"].float()
    assert (deq["lm_head.weight"] - w).norm() / w.norm() < 0.15


def _load_module(module, tensors, prefix):
    for local, buf in module.named_buffers():
        src = tensors[f"{prefix}.{local}"]
        assert module.logical_shape_message(local, src.shape) is None
        buf.copy_(src)


@pytest.mark.parametrize("name, prefix, fmt", [
    ("w4a16_nvfp4", "backbone.layers.0.mixer.in_proj", "w4a16_nvfp4"),
    ("nvfp4", "backbone.layers.3.mixer.experts.2.down_proj", "nvfp4"),
    ("mixed_lightning", "lm_head", "w4a16_nvfp4"),
    ("mixed_lightning", "backbone.layers.2.mixer.out_proj", "fp8"),
])
def test_quant_linear_loads_fixture_and_matches_reference(name, prefix, fmt):
    tensors = load_file(str(FIX / name / "model.safetensors"))
    w = tensors[prefix + ".weight"]
    out_f = w.shape[0]
    in_f = w.shape[1] * (1 if fmt == "fp8" else 2)
    mod = make_quant_linear(fmt, in_f, out_f, bias=False, dtype=torch.bfloat16, prefix=prefix)
    assert isinstance(mod, FP8Linear if fmt == "fp8" else NVFP4Linear)
    assert set(dict(mod.named_buffers())) == {k[len(prefix) + 1:] for k in tensors
                                               if k.startswith(prefix + ".")}
    _load_module(mod, tensors, prefix)
    ref_w = dequantize_checkpoint(FIX / name)[prefix + ".weight"]
    assert torch.equal(mod.dense_weight(), ref_w)
    x = torch.randn(3, in_f, generator=torch.Generator().manual_seed(0))
    assert torch.equal(mod(x), F.linear(x, ref_w))
    xb = x.bfloat16()
    assert torch.equal(mod(xb), F.linear(xb, ref_w.bfloat16()))
    # a model-wide dtype cast must not touch the quantized storage
    dtypes = {k: v.dtype for k, v in mod.named_buffers()}
    mod.to(torch.bfloat16)
    assert {k: v.dtype for k, v in mod.named_buffers()} == dtypes
    assert torch.equal(mod.dense_weight(), ref_w)


def test_wrong_packed_shape_message_states_logical_shapes():
    mod = make_quant_linear("w4a16_nvfp4", 64, 98, prefix="backbone.layers.0.mixer.in_proj")
    assert mod.logical_shape_message("weight", (98, 32)) is None
    msg = mod.logical_shape_message("weight", (98, 64))
    assert "[98, 32]" in msg and "logical [out, in] [98, 64]" in msg
    assert "logical [98, 128]" in msg and "backbone.layers.0.mixer.in_proj.weight" in msg
    msg = mod.logical_shape_message("weight_scale", (98, 2))
    assert "[98, 4]" in msg and "logical [98, 32]" in msg
    fp8 = make_quant_linear("fp8", 64, 98, prefix="p")
    assert "[98, 64]" in fp8.logical_shape_message("weight", (64, 98))


def test_nvfp4_needs_in_features_multiple_of_16():
    with pytest.raises(ValueError, match="in_features % 16"):
        make_quant_linear("w4a16_nvfp4", 40, 8, prefix="x")
    with pytest.raises(ValueError, match="unknown quantized format"):
        make_quant_linear("int4", 32, 8, prefix="x")


def test_quant_linear_bias_added():
    mod = make_quant_linear("w4a16_nvfp4", 32, 4, bias=True, dtype=torch.float32, prefix="x")
    w = torch.randn(4, 32)
    p, s, s2 = quantize_nvfp4(w)
    mod.weight.copy_(p)
    mod.weight_scale.copy_(s)
    mod.weight_scale_2.copy_(s2)
    mod.bias.copy_(torch.arange(4.0))
    x = torch.randn(2, 32)
    assert torch.allclose(mod(x), x @ mod.dense_weight().T + torch.arange(4.0))


def test_packed_embedding_lookup_dequantizes_rows():
    dense = load_file(str(FIX / "dense" / "model.safetensors"))["backbone.embeddings.weight"]
    p, s, s2 = quantize_nvfp4(dense)
    emb = make_quant_embedding("w4a16_nvfp4", dense.shape[0], dense.shape[1],
                               dtype=torch.bfloat16, prefix="model.embed_tokens")
    emb.weight.copy_(p)
    emb.weight_scale.copy_(s)
    emb.weight_scale_2.copy_(s2)
    ids = torch.tensor([[5, 0, 127], [5, 5, 9]])
    out = emb(ids)
    full = emb.dense_weight(torch.bfloat16)
    assert out.shape == (2, 3, dense.shape[1]) and out.dtype == torch.bfloat16
    assert torch.equal(out, full[ids])
    assert (full.float() - dense.float()).norm() / dense.float().norm() < 0.15


def test_stack_experts_shares_memory_with_modules():
    tensors = load_file(str(FIX / "w4a16_nvfp4" / "model.safetensors"))
    mods = []
    for e in range(4):
        prefix = f"backbone.layers.3.mixer.experts.{e}.up_proj"
        mod = make_quant_linear("w4a16_nvfp4", 32, 16, prefix=prefix)
        _load_module(mod, tensors, prefix)
        mods.append(mod)
    before = [m.dense_weight() for m in mods]
    w, s, s2 = stack_nvfp4_experts(mods)
    assert w.shape == (4, 16, 16) and s.shape == (4, 16, 2) and s2.shape == (4,)
    for e, m in enumerate(mods):
        assert m.weight.data_ptr() == w[e].data_ptr()
        assert torch.equal(m.dense_weight(), before[e])
