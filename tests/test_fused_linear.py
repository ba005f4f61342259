"""Sibling projections stacked into one GEMM (``layers/fused_linear.py``): dense and NVFP4
stacks give each projection's own output, and the modules keep their checkpoint bytes."""
import copy

import pytest
import torch

from blockspec.bench import presets
from blockspec.bench.draft_presets import build_random_draft
from blockspec.layers.fused_linear import fuse_linears
from blockspec.layers.linear import Linear
from blockspec.quant.linear import NVFP4Linear, stack_nvfp4_rows
from blockspec.quant.nvfp4 import quantize_nvfp4


def _nvfp4(n: int, k: int, seed: int, scale: float) -> NVFP4Linear:
    g = torch.Generator().manual_seed(seed)
    m = NVFP4Linear(k, n)
    p, s, s2 = quantize_nvfp4(torch.randn(n, k, generator=g) * scale)
    m.weight.copy_(p), m.weight_scale.copy_(s), m.weight_scale_2.copy_(s2)
    return m


def test_nvfp4_siblings_stack_with_their_own_global_scales():
    mods = [_nvfp4(n, 64, seed=i, scale=0.1 * (1 + 4 * i)) for i, n in enumerate((48, 16, 16))]
    assert len({float(m.weight_scale_2) for m in mods}) == 3
    before = [m.state_dict() for m in mods]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(7))
    want = torch.cat([m(x) for m in mods], dim=-1)
    fused = fuse_linears(*mods)
    assert fused is not None and fused.quantized
    assert fused.weight.shape == (80, 32) and fused.scale2.shape == (80,)
    torch.testing.assert_close(fused(x), want, rtol=1e-6, atol=1e-6)
    for m, sd in zip(mods, before):      # the same checkpoint bytes, now views of the stack
        assert all(torch.equal(m.state_dict()[k], v) for k, v in sd.items())
    assert mods[1].weight.data_ptr() == fused.weight[48:].data_ptr()
    torch.testing.assert_close(torch.cat([m(x) for m in mods], dim=-1), want, rtol=0, atol=0)
    torch.testing.assert_close(fused.rows(48)(x), want[:, 48:], rtol=1e-6, atol=1e-6)


def test_what_does_not_stack():
    q = _nvfp4(16, 64, seed=1, scale=0.1)
    assert fuse_linears(q, Linear(64, 16, bias=False)) is None        # mixed kinds
    assert fuse_linears(q, _nvfp4(16, 32, seed=2, scale=0.1)) is None  # another input width
    biased = NVFP4Linear(64, 16, bias=True)
    assert stack_nvfp4_rows([q, biased]) is None
    assert fuse_linears(Linear(64, 8, bias=True), Linear(64, 8, bias=False)) is None
    dense = fuse_linears(Linear(64, 8, bias=False), Linear(64, 4, bias=False))
    assert dense is not None and not dense.quantized and dense.weight.shape == (12, 64)


@pytest.mark.parametrize("kind", ["dflash-nemotron35", "dspark-nemotron35"])
def test_w4a16_draft_fuses_qkv_and_gate_up(kind):
    """The published-format drafts (every Linear W4A16) now run q/k/v and gate/up as one
    W4A16 GEMM each: the same K/V and MLP output as the separate projections."""
    block = 4 if kind.startswith("dflash") else 3
    plain = build_random_draft(kind, presets.preset_config("tiny"), block, torch.device("cpu"),
                               torch.float32)
    fused = copy.deepcopy(plain)
    fused.fuse()
    g = torch.Generator().manual_seed(4)
    for lp, lf in zip(plain.layers, fused.layers):
        assert lf.self_attn.qkv is not None and lf.self_attn.qkv.quantized
        assert lf.mlp.gate_up is not None and lf.mlp.gate_up.quantized
        x = torch.randn(6, plain.config.hidden_size, generator=g)
        pos = torch.arange(6)
        for a, b in zip(lp.self_attn.project_kv(x, pos), lf.self_attn.project_kv(x, pos)):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lf.mlp(x), lp.mlp(x), rtol=1e-5, atol=1e-6)
