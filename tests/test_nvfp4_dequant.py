"""The NVFP4 dequant kernel against its torch reference (bit for bit, fresh random bytes), the
dequantized GEMMs against the W4A16 references, and the prefill table sending a shape there.
Interpreter on CPU; compiled with ``-m gpu``."""
import pytest
import torch

from blockspec.kernels import nvfp4_dequant as nd
from blockspec.kernels import w4a16 as tw
from blockspec.kernels import w4a16_prefill as wp
from blockspec.kernels.triton_loader import triton_available
from blockspec.kernels.w4a16_layout import to_kernel_layout
from blockspec.quant.nvfp4 import quantize_nvfp4
from tests.triton_modes import MODES, mode  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not importable")


def _random_packed(e, n, k, seed, device):
    """Random bytes: every E2M1 code and every finite E4M3 scale (subnormal, negative, zero)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    s = torch.randint(0, 256, (e, n, k // 16), dtype=torch.uint8, generator=g)
    s[(s & 0x7F) == 0x7F] = 0x38   # no NaN scales
    s2 = torch.rand(e, generator=g) * 0.02 + 1e-4
    return (to_kernel_layout(w).to(device), s.view(torch.float8_e4m3fn).to(device),
            s2.to(device))


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("e, n, k", [(3, 40, 96), (1, 33, 272)])
def test_dequant_is_the_reference_bit_for_bit(mode, dtype, e, n, k):
    w, s, s2 = _random_packed(e, n, k, seed=n * k + e, device=mode)
    got = nd.nvfp4_dequant(w, s, s2, dtype)
    want = nd.nvfp4_dequant_reference(w, s, s2, dtype)
    assert got.shape == (e, n, k) and got.dtype == dtype
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))   # -0 and +0 differ
    flat = nd.nvfp4_dequant(w[0], s[0], s2[:1], dtype)                  # one matrix
    assert flat.shape == (n, k) and torch.equal(flat.view(torch.int16), want[0].view(torch.int16))


def test_dequant_names_bad_shapes():
    w, s, s2 = _random_packed(2, 16, 64, seed=1, device="cpu")
    with pytest.raises(ValueError, match="weight_scale must be"):
        nd.nvfp4_dequant(w, s[:, :, :2], s2)
    with pytest.raises(ValueError, match="one value per expert"):
        nd.nvfp4_dequant(w, s, s2[:1])
    with pytest.raises(ValueError, match="uint8"):
        nd.nvfp4_dequant(w.to(torch.int16), s, s2)


def _quantized(e, n, k, seed, device):
    g = torch.Generator().manual_seed(seed)
    ws = [quantize_nvfp4((torch.randn(n, k, generator=g) * 0.05 * (1 + i % 3)).bfloat16())
          for i in range(e)]
    p, s, s2 = (torch.stack(t) for t in zip(*ws))
    return to_kernel_layout(p).to(device), s.to(device), s2.to(device)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("relu2", [False, True])
def test_dequant_gemms_match_the_w4a16_references(mode, relu2):
    w, s, s2 = _quantized(4, 64, 128, seed=7, device=mode)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 128, generator=g).bfloat16().to(mode)
    sq = (lambda y: torch.square(torch.relu(y))) if relu2 else (lambda y: y)
    dense = tw.w4a16_linear(x, w[0], s[0], s2[0], relu2=relu2, dequant=True)
    assert _rel(dense, sq(tw.w4a16_linear_reference(x, w[0], s[0], s2[0]))) < 1e-2
    offsets = torch.tensor([0, 5, 5, 24], device=mode)          # 3 of the 4 experts, one empty
    grouped = tw.grouped_w4a16(x, offsets, w, s, s2, relu2=relu2, dequant=True)
    want = sq(tw.grouped_w4a16_reference(x, offsets, w[:3], s[:3], s2[:3]))
    assert grouped.shape == (24, 64) and _rel(grouped, want) < 1e-2


def test_the_table_sends_a_prefill_shape_to_the_dequant_path(monkeypatch):
    """An entry ``{"dequant": True}`` makes the launchers call the dequantized GEMMs (and the
    MoE gather skip the stream order), other shapes and sizes keep the kernel."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    for name in ("dequant_linear", "dequant_grouped"):
        real = getattr(tw, name)
        monkeypatch.setattr(tw, name, lambda *a, _r=real, _n=name, **k: calls.append(_n)
                            or _r(*a, **k))
    n, k, experts, rows = 64, 128, 2, 2 * wp.GROUPED_PREFILL_ROWS_PER_EXPERT
    monkeypatch.setitem(wp.PREFILL_TABLE, ("grouped", n, k, 512), {"dequant": True})
    monkeypatch.setitem(wp.PREFILL_TABLE, ("dense", n, k, 512), {"dequant": True})
    w, s, s2 = _quantized(experts, n, k, seed=2, device="cpu")
    x = torch.randn(rows, k).bfloat16()
    offsets = torch.tensor([0, 40, rows])
    assert tw.grouped_x_chunk(n, k, rows, experts) == 0
    y = tw.grouped_w4a16(x, offsets, w, s, s2)
    assert calls == ["dequant_grouped"]
    assert _rel(y, tw.grouped_w4a16_reference(x, offsets, w, s, s2)) < 1e-2
    tw.w4a16_linear(torch.randn(wp.DENSE_PREFILL_ROWS, k).bfloat16(), w[0], s[0], s2[0])
    assert calls[-1] == "dequant_linear"
    tw.w4a16_linear(torch.randn(8, k).bfloat16(), w[0], s[0], s2[0])   # decode size
    tw.grouped_w4a16(x, offsets, w, s, s2, dequant=False)               # an explicit no
    assert len(calls) == 2


def test_dequant_and_x_perm_do_not_mix():
    with pytest.raises(ValueError, match="dequant"):
        wp.check_prefill_config({"dequant": True, "x_perm": True})
    assert wp.check_prefill_config({"dequant": True}) == {"dequant": True}


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_every_tile_gives_the_same_bits(mode):
    """The tile keywords (``scripts/bench_nvfp4_dequant.py`` sweeps them) change nothing but
    speed, ragged edges included."""
    w, s, s2 = _random_packed(2, 50, 208, seed=5, device=mode)
    want = nd.nvfp4_dequant_reference(w, s, s2).view(torch.int16)
    for block_n, block_w in ((16, 32), (64, 128)):
        got = nd.nvfp4_dequant(w, s, s2, block_n=block_n, block_w=block_w)
        assert torch.equal(got.view(torch.int16), want)
