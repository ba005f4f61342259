"""The draft's one-launch context K/V write against ``write_context``'s per-layer torch path, on
fresh random inputs: the Triton interpreter on CPU, compiled on a GPU (``-m gpu``)."""
from __future__ import annotations

import pytest
import torch

from blockspec.bench import presets
from blockspec.bench.draft_presets import build_random_draft
from blockspec.cache import KVPool
from blockspec.kernels.draft_kv import write_draft_kv
from blockspec.models.draft import build_draft_model
from blockspec.configs.draft import parse_draft_config
from tests.spec_fixtures import draft_config
from tests.triton_modes import MODES, mode  # noqa: F401  (mode: fixture)

pytest.importorskip("triton")

HIDDEN = 64


def _draft(dtype: torch.dtype, device: torch.device, layers: int = 3, heads: int = 2, d: int = 16,
           thetas: list[float] | None = None):
    cfg = draft_config("dflash", hidden=HIDDEN, vocab=40, target_layers=6, block_size=4,
                       layers=layers)
    cfg.update(num_key_value_heads=heads, head_dim=d, num_attention_heads=2 * heads)
    model = build_draft_model(parse_draft_config(cfg), None, torch.float32)
    model.init_random_(std=0.3, generator=torch.Generator().manual_seed(4))
    for i, layer in enumerate(model.layers):     # distinct k_norm weights and RoPE bases per layer
        layer.self_attn.k_norm.weight.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(i))
        if thetas is not None:
            rot = layer.self_attn.rotary
            rot.inv_freq = 1.0 / (thetas[i] ** (torch.arange(0, d, 2).float() / d))
    model = model.to(device=device, dtype=dtype).eval()
    model.fuse()
    return model


def _pools(model, slots: int, dtype, device):
    return KVPool(len(model.layers), slots, model.num_kv_heads, model.head_dim, dtype, device)


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,heads,d", [(5, 2, 16), (1, 3, 8), (33, 1, 32)])
def test_fused_write_matches_per_layer_torch(mode, dtype, rows, heads, d):
    model = _draft(dtype, mode, heads=heads, d=d, thetas=[1e4, 5e5, 1e6])
    assert model.context_kv is not None
    g = torch.Generator().manual_seed(rows)
    feats = torch.randn(rows, model.config.fc_in_features, generator=g).to(mode, dtype)
    pos = torch.randint(0, 30000, (rows,), generator=g).to(mode)
    slots = torch.randperm(64, generator=g)[:rows].to(mode)
    ref, out = _pools(model, 64, dtype, mode), _pools(model, 64, dtype, mode)
    saved, model.context_kv = model.context_kv, None
    with torch.no_grad():
        model.write_context(feats, pos, slots, ref)              # the per-layer torch path
        model.context_kv = saved
        weight, norm, freq, eps = saved
        kv = torch.nn.functional.linear(model.project_context_hidden(feats), weight)
        write_draft_kv(kv, pos, slots, norm, freq, out.k, out.v, eps)
    untouched = torch.ones(64, dtype=torch.bool, device=mode)
    untouched[slots] = False
    assert not out.k[:, untouched].any() and not out.v[:, untouched].any()
    # V is the GEMM's V columns, copied (the stacked GEMM may sum in another order than the
    # per-layer one on a GPU, so the two paths' V agree to rounding, not bit for bit)
    layers, heads, d = out.v.shape[0], out.v.shape[2], out.v.shape[3]
    v_cols = kv.view(rows, layers, 2, heads, d)[:, :, 1].transpose(0, 1)
    assert torch.equal(out.v[:, slots], v_cols.to(dtype))
    torch.testing.assert_close(out.v, ref.v)
    assert ref.k[:, slots].abs().sum() > 0
    if dtype == torch.float32:
        torch.testing.assert_close(out.k, ref.k, rtol=1e-5, atol=1e-5)
    else:   # two roundings to bf16 (the interpreter truncates): within 2 ulps of the largest
        big = ref.k.float().abs().max().item()
        torch.testing.assert_close(out.k.float(), ref.k.float(), rtol=2 ** -6, atol=big * 2 ** -6)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_quantized_projections_stack_dequantized(mode):
    """A W4A16 draft (the published Nemotron 3.5 format) also writes its context in one GEMM:
    the stack holds its k/v projections dequantized, and the fused write matches the
    per-layer path through the quantized linears."""
    dtype = torch.float32 if mode.type == "cpu" else torch.bfloat16
    model = build_random_draft("dflash-nemotron35", presets.preset_config("tiny"), 4, mode, dtype)
    model.fuse()
    assert model.context_kv is not None
    weight = model.context_kv[0]
    attn = model.layers[1].self_attn
    rows = 2 * attn.num_kv_heads * attn.head_dim
    want = torch.cat([attn.k_proj.dense_weight(dtype), attn.v_proj.dense_weight(dtype)])
    assert weight.dtype == dtype and torch.equal(weight[rows:2 * rows], want)
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(5, model.config.fc_in_features, generator=g).to(mode, dtype)
    pos, slots = torch.arange(40, 45, device=mode), torch.tensor([3, 9, 0, 17, 6], device=mode)
    fast, ref = _pools(model, 32, dtype, mode), _pools(model, 32, dtype, mode)
    saved = model.context_kv
    with torch.no_grad():
        weight, norm, freq, eps = saved
        kv = torch.nn.functional.linear(model.project_context_hidden(feats), weight)
        write_draft_kv(kv, pos, slots, norm, freq, fast.k, fast.v, eps)
        model.context_kv = None
        model.write_context(feats, pos, slots, ref)              # the per-layer quantized path
        model.context_kv = saved
    assert ref.v[:, slots].abs().sum() > 0
    f32 = dtype == torch.float32
    tol = {"rtol": 1e-4, "atol": 1e-4} if f32 else {"rtol": 2 ** -6, "atol": 2e-2}
    torch.testing.assert_close(fast.v.float(), ref.v.float(), **tol)
    torch.testing.assert_close(fast.k.float(), ref.k.float(), **tol)


def test_biased_projections_keep_the_torch_path():
    cfg = draft_config("dflash", hidden=HIDDEN, vocab=40, target_layers=6, block_size=4)
    cfg["attention_bias"] = True
    model = build_draft_model(parse_draft_config(cfg), None, torch.float32)
    model.fuse()
    assert model.context_kv is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_write_context_takes_the_kernel_on_cuda(monkeypatch):
    dev = torch.device("cuda")
    model = _draft(torch.bfloat16, dev)
    feats = torch.randn(7, model.config.fc_in_features, device=dev, dtype=torch.bfloat16)
    pos, slots = torch.arange(100, 107, device=dev), torch.arange(7, device=dev) * 3
    fast, ref = _pools(model, 32, torch.bfloat16, dev), _pools(model, 32, torch.bfloat16, dev)
    with torch.no_grad():
        model.write_context(feats, pos, slots, fast)
        monkeypatch.setenv("BLOCKSPEC_DISABLE_TRITON", "1")
        model.write_context(feats, pos, slots, ref)
    torch.testing.assert_close(fast.v, ref.v)
    torch.testing.assert_close(fast.k.float(), ref.k.float(), rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,q_heads,kv_heads,d,layer", [(4, 4, 2, 16, 1), (1, 3, 1, 8, 0),
                                                          (9, 8, 2, 32, 2)])
def test_block_qkv_matches_torch(mode, dtype, rows, q_heads, kv_heads, d, layer):
    """A draft block's q (q_norm + rotary) and its K/V cache write in one launch, against the
    norms', rotaries' and backends' torch math; other slots and layers stay untouched."""
    from blockspec.kernels.draft_kv import draft_block_qkv, draft_block_qkv_reference
    from blockspec.layers.norm import RMSNorm
    from blockspec.kernels.rotary import rope_inv_freq

    g = torch.Generator().manual_seed(rows * 31 + d)
    qkv = (2 * torch.randn(rows, (q_heads + 2 * kv_heads) * d, generator=g)).to(mode, dtype)
    pos = torch.randint(0, 30000, (rows,), generator=g).to(mode)
    slots = torch.randperm(40, generator=g)[:rows].to(mode)
    q_norm, k_norm = RMSNorm(d, 1e-6, dtype), RMSNorm(d, 1e-5, dtype)
    q_norm.weight.data.uniform_(0.5, 1.5, generator=g)
    k_norm.weight.data.uniform_(0.5, 1.5, generator=g)
    q_norm, k_norm = q_norm.to(mode), k_norm.to(mode)
    freq = rope_inv_freq(d, 5e5).to(mode)
    pools = [torch.zeros(3, 40, kv_heads, d, dtype=dtype, device=mode) for _ in range(4)]
    args = (qkv, pos, slots, q_norm, k_norm, freq)
    want = draft_block_qkv_reference(*args, pools[0], pools[1], layer, q_heads)
    got = draft_block_qkv(*args, pools[2], pools[3], layer, q_heads)
    assert got.shape == (rows, q_heads, d) and got.dtype == dtype
    touched = torch.zeros(3, 40, dtype=torch.bool, device=mode)
    touched[layer, slots] = True
    assert not pools[2][~touched].any() and not pools[3][~touched].any()
    assert torch.equal(pools[3], pools[1])             # V: copied as it comes
    for fast, ref in ((got, want), (pools[2], pools[0])):
        if dtype == torch.float32:
            torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
        else:   # two roundings to bf16: within 2 ulps of the largest
            big = ref.float().abs().max().item()
            torch.testing.assert_close(fast.float(), ref.float(), rtol=2 ** -6,
                                       atol=big * 2 ** -6)


def test_block_qkv_names_bad_shapes():
    from blockspec.kernels.draft_kv import draft_block_qkv
    from blockspec.layers.norm import RMSNorm

    norm = RMSNorm(8)
    pool = torch.zeros(2, 10, 1, 8)
    with pytest.raises(ValueError, match=r"qkv must be \[N, \(2 \+ 2 x 1\) x 8\]"):
        draft_block_qkv(torch.zeros(3, 24), torch.zeros(3, dtype=torch.long),
                        torch.zeros(3, dtype=torch.long), norm, norm, torch.ones(4), pool, pool,
                        0, 2)
    with pytest.raises(ValueError, match="layer 2 outside the pools' 2"):
        draft_block_qkv(torch.zeros(3, 32), torch.zeros(3, dtype=torch.long),
                        torch.zeros(3, dtype=torch.long), norm, norm, torch.ones(4), pool, pool,
                        2, 2)
    with pytest.raises(ValueError, match="pools must be"):
        draft_block_qkv(torch.zeros(3, 32), torch.zeros(3, dtype=torch.long),
                        torch.zeros(3, dtype=torch.long), norm, norm, torch.ones(4), pool[0],
                        pool[0], 0, 2)
