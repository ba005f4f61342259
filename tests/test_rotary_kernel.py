"""The fused rotary kernel against the torch reference on fresh random inputs: the Triton
interpreter on CPU, compiled on a GPU (``-m gpu``)."""
from __future__ import annotations

import pytest
import torch

from blockspec.kernels.rotary import rotary, rotary_supported
from blockspec.layers import rotary as rotary_layer
from blockspec.kernels.rotary import apply_rotary_reference, rope_inv_freq
from blockspec.layers.rotary import RotaryEmbedding

from tests.triton_modes import GPU, MODES, mode  # noqa: F401  (mode: fixture)

pytest.importorskip("triton")




def _ordered(x: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns as integers in the order of the values they encode (+0 and -0 both
    0), so the difference of two is their distance in bf16 ulps."""
    bits = x.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def _assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: equal up to cos/sin rounding at large angles; bf16/fp16: at most one ulp apart
    (the interpreter casts fp32 to bf16 by truncation, not round-to-nearest)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    elif out.dtype == torch.bfloat16:
        ulps = (_ordered(out) - _ordered(ref)).abs().max().item()
        assert ulps <= 1, f"kernel and reference {ulps} bf16 ulps apart"
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -10, atol=1e-6)


def _inputs(lead: tuple[int, ...], heads: int, d: int, dtype: torch.dtype, seed: int,
            max_pos: int = 32768) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(*lead, heads, d, generator=g)).to(dtype)
    pos = torch.randint(0, max_pos, lead, generator=g)
    pos.view(-1)[0] = 0                      # identity rotation
    pos.view(-1)[-1] = max_pos - 1           # the largest angles
    return x, pos


SHAPES = [((5,), 1, 16), ((2, 3, 4), 4, 64), ((3,), 32, 128), ((2, 3), 3, 96)]


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("lead, heads, d", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kernel_matches_reference(mode, lead, heads, d, dtype):
    x, pos = _inputs(lead, heads, d, dtype, seed=heads * d + len(lead))
    x, pos = x.to(mode), pos.to(mode)
    inv_freq = rope_inv_freq(d, 10000.0, device=mode)
    x_before = x.clone()
    out = rotary(x, pos, inv_freq)
    ref = apply_rotary_reference(x, pos, inv_freq=inv_freq)
    _assert_matches(out, ref)
    assert torch.equal(x, x_before), "the kernel must not write its input"
    assert out.data_ptr() != x.data_ptr()
    assert not torch.equal(out, x), "positions > 0 must rotate something"


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_rotary_kernel_fp16_and_small_theta(mode):
    """fp16 input and a small theta (fast-turning frequencies) at positions near 32k."""
    x, pos = _inputs((2, 6), 2, 32, torch.float16, seed=5)
    x, pos = x.to(mode), (pos + 30000).clamp(max=32767).to(mode)
    inv_freq = rope_inv_freq(32, 500.0, device=mode)
    _assert_matches(rotary(x, pos, inv_freq), apply_rotary_reference(x, pos, inv_freq=inv_freq))


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_rotary_kernel_broadcast_positions_and_strided_input(mode):
    """x a head slice of a fused q|k projection (rows and heads strided, last dim contiguous),
    positions [T] int32 broadcast over the batch, frequencies held in bf16 (a module cast)."""
    g = torch.Generator().manual_seed(11)
    b, t, heads, d = 2, 5, 4, 64
    qk = torch.randn(b, t, 3 * heads, d, generator=g).to(mode)
    x = qk[:, :, heads:2 * heads]
    assert not x.is_contiguous()
    pos = torch.randint(0, 20000, (t,), generator=g, dtype=torch.int32).to(mode)
    inv_freq = rope_inv_freq(d, 1e6, device=mode).to(torch.bfloat16)
    assert rotary_supported(x, pos, inv_freq)
    out = rotary(x, pos, inv_freq)
    _assert_matches(out, apply_rotary_reference(x, pos, inv_freq=inv_freq))
    assert out.is_contiguous()


def test_rotary_supported_refuses_what_the_kernel_does_not_cover():
    x = torch.zeros(2, 5, 4, 64)
    f = rope_inv_freq(64, 10000.0)
    assert rotary_supported(x, torch.zeros(2, 5, dtype=torch.long), f)
    assert rotary_supported(x, torch.zeros(5, dtype=torch.long), f)
    assert not rotary_supported(x, torch.zeros(2, 5), f)                         # float positions
    assert not rotary_supported(x, torch.zeros(3, 2, 5, dtype=torch.long), f)    # more dims than x's
    assert not rotary_supported(x, torch.zeros(4, dtype=torch.long), f)          # not broadcastable
    assert not rotary_supported(x, torch.zeros(2, 5, dtype=torch.long), f[:16])  # wrong frequencies
    assert not rotary_supported(x.double(), torch.zeros(2, 5, dtype=torch.long), f)


def test_apply_rotary_takes_the_kernel_when_triton_is_on(monkeypatch):
    """The layer's dispatch, in the interpreter: with use_triton on, RotaryEmbedding runs the
    kernel (seen through a spy) and matches the reference; positions the kernel does not cover
    (float) go to the reference."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(rotary_layer, "use_triton", lambda x: True)
    calls = []
    monkeypatch.setattr(rotary_layer, "rotary", lambda *a: calls.append(1) or rotary(*a))
    rope = RotaryEmbedding(32, 10000.0)
    x, pos = _inputs((2, 3), 4, 32, torch.bfloat16, seed=3)
    _assert_matches(rope(x, pos), apply_rotary_reference(x, pos, inv_freq=rope.inv_freq))
    assert calls == [1]
    ref = apply_rotary_reference(x, pos.float(), inv_freq=rope.inv_freq)
    assert torch.equal(rope(x, pos.float()), ref)
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kernel_prefill_sized_on_gpu(dtype):
    """32k rows of 32 heads x 128 at positions 0..32767 (a long prefill), and the layer's CUDA
    path (no grad) lands on the same numbers."""
    g = torch.Generator().manual_seed(7)
    n = 32768
    x = torch.randn(n, 32, 128, generator=g).to("cuda", dtype)
    pos = torch.arange(n, device="cuda")
    inv_freq = rope_inv_freq(128, 10000.0, device="cuda")
    out = rotary(x, pos, inv_freq)
    _assert_matches(out, apply_rotary_reference(x, pos, inv_freq=inv_freq))
    # the layer's frequencies were computed on the CPU (they may differ from inv_freq above in
    # the last bit), so compare against the kernel on those
    rope = RotaryEmbedding(128, 10000.0).cuda()
    with torch.no_grad():
        assert torch.equal(rope(x, pos), rotary(x, pos, rope.inv_freq))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rotary_kernel_replays_in_a_cuda_graph():
    """Captured once, the launch reads whatever positions and x the static buffers hold."""
    rope = RotaryEmbedding(64, 10000.0).cuda()
    x = torch.zeros(8, 4, 64, device="cuda", dtype=torch.bfloat16)
    pos = torch.zeros(8, dtype=torch.long, device="cuda")
    with torch.no_grad():
        rope(x, pos)                                   # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = rope(x, pos)
        for seed in (1, 2):
            x_new, pos_new = _inputs((8,), 4, 64, torch.bfloat16, seed=seed)
            x.copy_(x_new)
            pos.copy_(pos_new)
            graph.replay()
            _assert_matches(out, apply_rotary_reference(x, pos, inv_freq=rope.inv_freq))
