"""The fused FP8 activation quantization against its torch reference, bit for bit, and the FP8
W8A8 linear's choice of activation scale: the Triton interpreter on CPU, compiled on a GPU
(``-m gpu``)."""
from __future__ import annotations

import pytest
import torch

from blockspec.kernels.fp8_quant import quantize_fp8_act, quantize_fp8_act_reference
from blockspec.quant import linear as qlinear
from blockspec.quant.linear import FP8Linear, fp8_w8a8_reference, prepare_fp8

from tests.triton_modes import GPU, MODES, mode  # noqa: F401  (mode: fixture)

pytest.importorskip("triton")


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> None:
    assert got.dtype == torch.float8_e4m3fn and got.shape == want.shape
    bad = (_bits(got) != _bits(want)).nonzero()
    if bad.numel():
        where = tuple(bad[0].tolist())
        raise AssertionError(f"{bad.shape[0]} of {got.numel()} codes differ; first at {where}: "
                             f"x={x[where].item()!r} -> kernel {_bits(got)[where].item():#04x}, "
                             f"torch {_bits(want)[where].item():#04x}")


def _activations(rows: int, k: int, dtype: torch.dtype, scale: float, seed: int) -> torch.Tensor:
    """x such that x / scale covers every case of the cast, mixed at random positions: spread
    over all binades, exact ties (j + 0.5 steps, 15.5 rounding up into the next binade),
    beyond +-448, the subnormal range (ties of its 2^-9 step too), tiny values that round to
    zero, +-0 and +-inf. With a power-of-two scale the ties stay exact ties after the divide."""
    g = torch.Generator().manual_seed(seed)
    n = rows * k
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    e = torch.randint(-6, 9, (n,), generator=g).float()
    spread = torch.exp2(e) * (1 + torch.rand(n, generator=g))
    ties = (torch.randint(8, 16, (n,), generator=g) + 0.5) * torch.exp2(e - 3)
    beyond = 448 * (1 + 3 * torch.rand(n, generator=g))
    sub = torch.where(torch.rand(n, generator=g) < 0.5, torch.rand(n, generator=g) * 2 ** -6,
                      (torch.randint(0, 8, (n,), generator=g) + 0.5) * 2 ** -9)
    tiny = torch.rand(n, generator=g) * 2 ** -10
    kind = torch.randint(0, 20, (n,), generator=g)
    v = torch.where(kind < 6, spread, ties)
    v = torch.where(kind == 12, beyond, v)
    v = torch.where((kind == 13) | (kind == 14), sub, v)
    v = torch.where(kind == 15, tiny, v)
    v = torch.where(kind == 16, 0.0, v)
    v = torch.where(kind == 17, float("inf"), v)
    return (sign * v * scale).to(dtype).reshape(rows, k)


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("rows, k", [(1, 2688), (4, 4096), (33, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [2.0 ** -4, 0.0371])
def test_quantize_matches_reference_bitwise(mode, rows, k, dtype, scale):
    x = _activations(rows, k, dtype, scale, seed=rows * 7 + k).to(mode)
    s = torch.tensor(scale, device=mode)
    got = quantize_fp8_act(x, s)
    _assert_same_bits(got, quantize_fp8_act_reference(x, s), x)
    # the scale is read on the device: a new value in the same tensor is honoured
    s.fill_(scale * 3)
    _assert_same_bits(quantize_fp8_act(x, s), quantize_fp8_act_reference(x, s), x)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_quantize_every_e4m3_boundary(mode):
    """fp32 inputs on every E4M3 value, every midpoint between two (the ties) and the fp32
    values just beside each midpoint, both signs, plus the clamp, zero and fp32-subnormal
    edges: each must land on the code torch's cast gives."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[~codes.isnan()].unique()
    mids = (codes[1:] + codes[:-1]) / 2
    up = torch.nextafter(mids, torch.tensor(float("inf")))
    down = torch.nextafter(mids, torch.tensor(float("-inf")))
    edges = torch.tensor([0.0, -0.0, 2 ** -10, 448.0, 448.5, 464.0, 480.0, 1e30, 1e-42, -1e-42,
                          float("inf"), float("-inf")])
    v = torch.cat([codes, mids, up, down, -mids, -up, -down, edges])
    x = v.reshape(1, -1).to(mode)
    s = torch.tensor(1.0, device=mode)
    _assert_same_bits(quantize_fp8_act(x, s), quantize_fp8_act_reference(x, s), x)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_quantize_strided_and_batched_inputs(mode):
    """Rows with a stride past K, a column-strided view (made contiguous) and [B, T, K]."""
    s = torch.tensor(0.02, device=mode)
    wide = _activations(9, 160, torch.bfloat16, 0.02, seed=5).to(mode)
    for x in (wide[:, :100], wide[:, ::2], wide.reshape(3, 3, 160)):
        got = quantize_fp8_act(x, s)
        assert got.shape == x.shape and got.is_contiguous()
        _assert_same_bits(got, quantize_fp8_act_reference(x, s), x)


@pytest.mark.parametrize("mode", [MODES[1]], indirect=True)
def test_quantize_keeps_nan_on_gpu(mode):
    """NaN stays NaN, as in torch (compiled only: the interpreter's fp8 cast maps NaN to a
    finite code)."""
    x = torch.randn(2, 64, device=mode).bfloat16()
    x[0, 3] = float("nan")
    x[1, 60] = float("nan")
    s = torch.tensor(0.01, device=mode)
    got = quantize_fp8_act(x, s).float()
    want = quantize_fp8_act_reference(x, s).float()
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == 2
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def _fp8_linear(kind: str, device: torch.device, k: int = 256, n: int = 64) -> FP8Linear:
    """An FP8 layer as a checkpoint leaves it: static input scale 0.01 (small enough that the
    test activations clip at it, so the static and dynamic scales give different outputs),
    a zero one, or none."""
    g = torch.Generator().manual_seed(11)
    lin = FP8Linear(k, n, bias=True, dtype=torch.bfloat16, has_input_scale=kind != "missing")
    lin.weight.copy_((torch.randn(n, k, generator=g) * 8).to(torch.float8_e4m3fn))
    lin.weight_scale.fill_(0.01)
    lin.bias.copy_(torch.randn(n, generator=g))
    if kind != "missing":
        lin.input_scale.fill_(0.01 if kind == "static" else 0.0)
    return lin.to(device)


def _expected_scale(lin: FP8Linear, kind: str, x: torch.Tensor) -> torch.Tensor:
    return lin.input_scale if kind == "static" else x.abs().amax().float() / 448


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("kind", ["static", "zero", "missing"])
def test_fp8_linear_scale_choice_and_w8a8_reference(mode, kind, monkeypatch):
    """The layer takes the static scale when there is a positive one, else amax(|x|) / 448,
    decided by prepare_fp8 alone; on a GPU its forward (the kernel, then _scaled_mm) matches
    fp8_w8a8_reference at that scale, and not at the other one."""
    lin = _fp8_linear(kind, mode)
    x = (torch.randn(5, 256, generator=torch.Generator().manual_seed(2)) * 8).bfloat16().to(mode)
    prepare_fp8(lin)
    calls = []
    monkeypatch.setattr(FP8Linear, "prepare", lambda self: calls.append(self))
    want = _expected_scale(lin, kind, x)
    for _ in range(2):
        got = lin.activation_scale(x)
        assert got.shape == () and torch.equal(got, want)
    assert not calls, "the scale choice was made again without a change of input_scale"
    if kind == "static":
        assert lin.activation_scale(x) is lin.input_scale    # no kernel: the buffer itself
    if mode.type != "cuda":
        return
    other = x.abs().amax().float() / 448 if kind == "static" else torch.tensor(0.01, device=mode)
    with monkeypatch.context() as mp, torch.no_grad():
        mp.setattr(qlinear, "_quantize_act", _refuse)     # the forward must not take the torch cast
        y = lin(x).float()
    ref = fp8_w8a8_reference(x, lin.weight, lin.weight_scale, want, lin.bias).float()
    wrong = fp8_w8a8_reference(x, lin.weight, lin.weight_scale, other, lin.bias).float()
    assert ((y - ref).abs().max() / ref.abs().max()) < 1e-2
    assert ((wrong - ref).abs().max() / ref.abs().max()) > 0.1


def _refuse(*_args):
    raise AssertionError("the torch reference ran where the kernel should have")


def test_fp8_scale_choice_follows_a_later_load():
    """A decision made before the checkpoint's scale arrives (loader's copy_, a fill_, or a new
    tensor) is made again, never kept stale."""
    lin = FP8Linear(32, 16, has_input_scale=True)
    x = torch.randn(3, 32)
    assert not lin.prepare()                                # zeros at construction: dynamic
    lin.input_scale.copy_(torch.tensor(0.25))               # what load_state does
    assert lin.static_scale() and lin.activation_scale(x) is lin.input_scale
    lin.input_scale.fill_(0.0)
    assert not lin.static_scale()
    torch.testing.assert_close(lin.activation_scale(x), x.abs().amax() / 448, rtol=0, atol=0)
    lin.input_scale = torch.tensor(0.5)
    assert lin.static_scale() and lin.activation_scale(x) is lin.input_scale
    assert not FP8Linear(32, 16, has_input_scale=False).static_scale()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["static", "zero", "missing"])
def test_fp8_linear_in_a_cuda_graph_without_host_sync(kind, monkeypatch):
    """After prepare_fp8 the forward makes no host read (eager under sync_debug_mode('error'))
    and replays in a CUDA graph on new activations, the dynamic scale recomputed on the
    device; BLOCKSPEC_DISABLE_TRITON=1 sends it back to the torch quantization."""
    dev = torch.device("cuda")
    lin = _fp8_linear(kind, dev)
    prepare_fp8(lin)
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(4, 256, generator=g) * 8).bfloat16().to(dev)
    with torch.no_grad(), monkeypatch.context() as patch:
        patch.setattr(qlinear, "_quantize_act", _refuse)
        lin(x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            lin(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = lin(x)
        x.copy_((torch.randn(4, 256, generator=g) * 4).bfloat16().to(dev))
        graph.replay()
    ref = fp8_w8a8_reference(x, lin.weight, lin.weight_scale, _expected_scale(lin, kind, x),
                             lin.bias).float()
    assert ((y.float() - ref).abs().max() / ref.abs().max()) < 1e-2
    monkeypatch.setenv("BLOCKSPEC_DISABLE_TRITON", "1")
    monkeypatch.setattr(qlinear, "quantize_fp8_act", _refuse)
    with torch.no_grad():
        torch.testing.assert_close(lin(x).float(), y.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("residual", [False, True])
def test_norms_with_fp8_output_equal_norm_then_quantize(mode, residual):
    """The norms' E4M3 epilogue is the FP8 linear's input quantization of their unquantized
    output, bit for bit (RMSNorm with and without the residual add, and the gated group norm)."""
    from blockspec.kernels.norm import gated_rms_norm, rms_norm

    g = torch.Generator().manual_seed(3 + residual)
    x = (4 * torch.randn(5, 2688, generator=g)).to(torch.bfloat16).to(mode)
    r = torch.randn(5, 2688, generator=g).to(torch.bfloat16).to(mode) if residual else None
    w = (1 + 0.3 * torch.randn(2688, generator=g)).to(torch.bfloat16).to(mode)
    scale = torch.tensor(0.0123, device=mode)
    h, y = rms_norm(x, w, 1e-5, residual=r)
    h8, y8 = rms_norm(x, w, 1e-5, residual=r, fp8_scale=scale)
    assert torch.equal(h8, h)
    _assert_same_bits(y8, quantize_fp8_act_reference(y, scale), y)
    v = (3 * torch.randn(5, 512, generator=g)).to(mode)               # fp32, as the mixer's y
    z = torch.randn(5, 512, generator=g).to(torch.bfloat16).to(mode)
    gw = (1 + 0.3 * torch.randn(512, generator=g)).to(torch.bfloat16).to(mode)
    plain = gated_rms_norm(v, z, gw, 128, 1e-5)
    _assert_same_bits(gated_rms_norm(v, z, gw, 128, 1e-5, fp8_scale=scale),
                      quantize_fp8_act_reference(plain, scale), plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_linear_takes_its_input_prequantized():
    """forward_quantized(x quantized at fused_input_scale) == forward(x), bit for bit; the
    fused scale is offered only on the fused path with a static scale."""
    torch.manual_seed(0)
    lin = FP8Linear(2688, 1024, dtype=torch.bfloat16).cuda()
    lin.weight.copy_((0.05 * torch.randn(1024, 2688, device="cuda")).to(torch.float8_e4m3fn))
    lin.weight_scale.fill_(0.5)
    lin.input_scale.fill_(0.02)
    prepare_fp8(lin)
    x = torch.randn(3, 2688, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        scale = lin.fused_input_scale(x)
        assert scale is lin.input_scale
        got = lin.forward_quantized(quantize_fp8_act(x, scale), torch.bfloat16)
        assert torch.equal(got, lin(x))
        assert lin.fused_input_scale(x.cpu()) is None
    lin.input_scale.fill_(0.0)                      # no static scale: the linear quantizes
    with torch.inference_mode():
        assert lin.fused_input_scale(x) is None


def test_norm_modules_with_fp8_output_on_the_reference_path():
    """Off the fused path the norm modules still honour ``fp8_scale``: their torch output,
    quantized by the reference cast (what a caller of either path receives)."""
    from blockspec.layers.norm import GatedGroupRMSNorm, RMSNorm

    g = torch.Generator().manual_seed(11)
    scale = torch.tensor(0.021)
    norm = RMSNorm(96, 1e-5, dtype=torch.bfloat16)
    norm.weight.data = (1 + 0.3 * torch.randn(96, generator=g)).to(torch.bfloat16)
    x = (4 * torch.randn(3, 96, generator=g)).to(torch.bfloat16)
    r = torch.randn(3, 96, generator=g).to(torch.bfloat16)
    _assert_same_bits(norm(x, fp8_scale=scale), quantize_fp8_act_reference(norm.reference(x), scale), x)
    h, y = norm.add_forward(x, r, fp8_scale=scale)
    assert torch.equal(h, x + r)
    _assert_same_bits(y, quantize_fp8_act_reference(norm.reference(x + r), scale), h)
    gated = GatedGroupRMSNorm(64, 16, 1e-5, dtype=torch.bfloat16)
    v, z = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g).to(torch.bfloat16)
    want = gated.reference(v, z)
    _assert_same_bits(gated(v, z, fp8_scale=scale), quantize_fp8_act_reference(want, scale), want)
    assert norm(x).dtype == torch.bfloat16                        # no scale: unchanged
