"""The Mamba-2 prefill kernels (chunked SSD scan, causal conv) against their torch references
on fresh random inputs: the Triton interpreter on CPU, compiled on a GPU (``-m gpu``)."""
from __future__ import annotations

import pytest
import torch

from blockspec.layers.mamba2 import ssd_chunked_scan
from tests.triton_modes import GPU, MODES, mode  # noqa: F401  (mode: fixture)

pytest.importorskip("triton")


def _inputs(shape, dtype, device, seed=0):
    Bt, T, H, G, P, N = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(Bt, T, H, P, generator=g)
    B = torch.randn(Bt, T, G, N, generator=g)
    C = torch.randn(Bt, T, G, N, generator=g)
    dt = torch.rand(Bt, T, H, generator=g) * 0.5
    A = -torch.rand(H, generator=g) - 0.2
    S0 = torch.randn(Bt, H, P, N, generator=g)
    x, B, C = (v.to(dtype) for v in (x, B, C))
    return [v.to(device) for v in (x, dt, A, B, C, S0)]


def _close(got, ref, rtol=1e-4):
    err = (got - ref).abs().max().item()
    assert err <= rtol * max(ref.abs().max().item(), 1.0), err


# (Bt, T, H, G, P, N), chunk: T not a multiple of the chunk, chunk 128 as Lightning, one
# token, per-head B/C (G = H), N and P below a tile
SHAPES = [((2, 11, 4, 2, 8, 5), 4), ((1, 37, 2, 1, 16, 16), 16), ((1, 21, 2, 2, 4, 8), 8),
          ((1, 1, 2, 1, 8, 16), 8), ((1, 150, 2, 1, 16, 32), 128)]


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("shape, chunk", SHAPES)
def test_ssd_scan_matches_reference(mode, shape, chunk):  # noqa: F811
    _check_scan(mode, shape, chunk)


@pytest.mark.parametrize("mode", [pytest.param("cuda", marks=GPU)], indirect=True)
def test_ssd_scan_lightning_dims(mode):  # noqa: F811
    """Lightning's head dims (P 64, N 128) and chunk over several chunks, two requests:
    compiled only (the interpreter would take minutes)."""
    _check_scan(mode, (2, 700, 8, 2, 64, 128), 128)


@pytest.mark.parametrize("mode", [pytest.param("cuda", marks=GPU)], indirect=True)
@pytest.mark.parametrize("precision", ["tf32x3"])
def test_ssd_scan_tensor_core_precisions(mode, precision):  # noqa: F811
    """The tensor-core operand precisions on Lightning's dims: tf32x3 within the fp32
    tolerance of the reference (plain tf32 is measured by scripts/bench_ssd_scan.py, not
    held to it)."""
    _check_scan(mode, (1, 700, 8, 2, 64, 128), 128, precision=precision)


def test_ssd_scan_refuses_an_unknown_precision():
    from blockspec.kernels.ssd_scan import ssd_scan

    with pytest.raises(ValueError, match="precision"):
        ssd_scan(*_inputs((1, 4, 2, 1, 4, 4), torch.float32, "cpu"), 4, precision="fp16")


def _check_scan(device: torch.device, shape, chunk, precision=None):
    from blockspec.kernels.ssd_scan import ssd_scan

    args = _inputs(shape, torch.float32, device)
    y, S, bounds = ssd_scan(*args, chunk, return_chunk_states=True, precision=precision)
    y_ref, S_ref, bounds_ref = ssd_chunked_scan(*args, chunk, return_chunk_states=True)
    assert bounds.shape == (shape[0], -(-shape[1] // chunk), shape[2], shape[4], shape[5])
    _close(y, y_ref)
    _close(S, S_ref)
    _close(bounds, bounds_ref)
    assert torch.equal(bounds[:, -1], S)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_ssd_scan_bf16_inputs_and_strided_views(mode):  # noqa: F811
    """bf16 x / B / C as column views of one wider row (as the in_proj output splits them),
    fp32 state: at tf32x3 the math is as exact as fp32, so the result matches the reference
    on the same values."""
    from blockspec.kernels.ssd_scan import ssd_scan

    Bt, T, H, G, P, N = 2, 19, 4, 2, 8, 16
    x, dt, A, B, C, S0 = _inputs((Bt, T, H, G, P, N), torch.bfloat16, mode, seed=3)
    row = torch.cat([x.reshape(Bt, T, -1), B.reshape(Bt, T, -1), C.reshape(Bt, T, -1)], dim=-1)
    xv, Bv, Cv = row.split([H * P, G * N, G * N], dim=-1)
    xv, Bv, Cv = xv.reshape(Bt, T, H, P), Bv.reshape(Bt, T, G, N), Cv.reshape(Bt, T, G, N)
    assert not xv.is_contiguous()
    y, S = ssd_scan(xv, dt, A, Bv, Cv, S0, 8, precision="tf32x3")
    y_ref, S_ref = ssd_chunked_scan(x.float(), dt, A, B.float(), C.float(), S0, 8)
    _close(y, y_ref)
    _close(S, S_ref)


def test_ssd_scan_default_precision_follows_the_dtype():
    from blockspec.kernels.ssd_scan import default_precision

    assert default_precision(torch.float32) == "tf32x3"
    assert default_precision(torch.bfloat16) == "tf32"
    assert default_precision(torch.float16) == "tf32"


@pytest.mark.parametrize("mode", [pytest.param("cuda", marks=GPU)], indirect=True)
def test_ssd_scan_bf16_default_within_bf16_rounding(mode):  # noqa: F811
    """bf16 inputs take tf32 dots by default: on Lightning's dims over several chunks the
    outputs and states stay within half a bf16 step (2e-3) of the fp32 reference on the same
    values, the rounding the layer's bf16 output gets anyway."""
    from blockspec.kernels.ssd_scan import ssd_scan

    x, dt, A, B, C, S0 = _inputs((1, 700, 8, 2, 64, 128), torch.bfloat16, mode, seed=4)
    y, S = ssd_scan(x, dt, A, B, C, S0, 128)
    y_ref, S_ref = ssd_chunked_scan(x.float(), dt, A, B.float(), C.float(), S0, 128)
    _close(y, y_ref, rtol=2e-3)
    _close(S, S_ref, rtol=2e-3)


def test_reference_groups_and_chunk_states():
    """The reference takes B / C per group like per head, and its chunk states are the final
    states of the prefixes ending at each chunk boundary."""
    x, dt, A, B, C, S0 = _inputs((1, 10, 4, 2, 3, 5), torch.float32, "cpu", seed=5)
    y, S, bounds = ssd_chunked_scan(x, dt, A, B, C, S0, 4, return_chunk_states=True)
    y_h, S_h = ssd_chunked_scan(x, dt, A, B.repeat_interleave(2, 2), C.repeat_interleave(2, 2),
                                S0, 4)
    torch.testing.assert_close(y, y_h)
    torch.testing.assert_close(S, S_h)
    for c, end in enumerate((4, 8, 10)):
        _, S_end = ssd_chunked_scan(x[:, :end], dt[:, :end], A, B[:, :end], C[:, :end], S0, 4)
        torch.testing.assert_close(bounds[:, c], S_end)


def test_ssd_scan_rejects_mismatched_shapes():
    from blockspec.kernels.ssd_scan import ssd_scan

    x, dt, A, B, C, S0 = _inputs((1, 6, 4, 2, 3, 5), torch.float32, "cpu")
    with pytest.raises(ValueError, match="ssd_scan"):
        ssd_scan(x, dt, A, B[:, :, :1].expand(1, 6, 3, 5), C, S0, 4)


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("T, bias, dtype", [(9, True, torch.float32), (2, False, torch.float32),
                                            (1, True, torch.float32), (20, True, torch.bfloat16)])
def test_causal_conv_matches_mixer_conv(mode, T, bias, dtype):  # noqa: F811
    """Output and next window against ``Mamba2Mixer._conv`` and the window extend keeps, on a
    column view of a wider row; short chunks (T < K - 1) take part of the old window."""
    from blockspec.configs.nemotron_h import NemotronHConfig
    from blockspec.kernels.causal_conv import causal_conv1d
    from blockspec.layers.mamba2 import Mamba2Mixer

    cfg = NemotronHConfig.from_dict({
        "model_type": "nemotron_h", "hybrid_override_pattern": "M", "vocab_size": 16,
        "hidden_size": 24, "mamba_num_heads": 4, "mamba_head_dim": 6, "ssm_state_size": 5,
        "n_groups": 2, "conv_kernel": 4, "use_conv_bias": bias})
    m = Mamba2Mixer(cfg, "m", dtype=dtype).to(mode)
    g = torch.Generator().manual_seed(T)
    with torch.no_grad():
        m.conv1d.weight.copy_(torch.randn(m.conv1d.weight.shape, generator=g))
        if bias:
            m.conv1d.bias.copy_(torch.randn(m.conv_dim, generator=g))
    row = torch.randn(2, T, m.conv_dim + 7, generator=g).to(dtype).to(mode)
    xbc = row[..., 3:3 + m.conv_dim]
    window = torch.randn(2, m.conv_dim, 3, generator=g).to(dtype).to(mode)
    out, new_window = causal_conv1d(xbc, window, m.conv1d.weight, m.conv1d.bias)
    ref = m._conv(xbc, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2      # bf16: the reference rounds each op
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    assert out.dtype == dtype
    full = torch.cat([window, xbc.transpose(1, 2)], dim=2)
    assert torch.equal(new_window, full[..., -3:])


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_extend_with_kernels_equals_references(mode, monkeypatch):  # noqa: F811
    """``Mamba2Mixer.extend`` on the Triton path (forced on CPU, under the interpreter) gives the
    output, window and state of the torch path, from a nonzero committed state over several
    scan chunks (a partial last one)."""
    from blockspec.configs.nemotron_h import NemotronHConfig
    from blockspec.layers import mamba2

    cfg = NemotronHConfig.from_dict({
        "model_type": "nemotron_h", "hybrid_override_pattern": "M", "vocab_size": 16,
        "hidden_size": 24, "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 16,
        "n_groups": 2, "conv_kernel": 4, "chunk_size": 4})
    m = mamba2.Mamba2Mixer(cfg, "m", dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "proj" in name or "conv" in name
                                                         else 0.5))
    m = m.to(mode)
    u = torch.randn(2, 10, 24, generator=g).to(mode)
    conv0 = torch.randn(2, m.conv_dim, 3, generator=g).to(mode)
    ssm0 = torch.randn(2, m.H, m.P, m.N, generator=g).to(mode)
    calls = []

    def counting(scan):
        def wrapped(*args, **kwargs):
            calls.append(scan.__name__)
            return scan(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(mamba2, "ssd_scan", counting(mamba2.ssd_scan))
    with torch.no_grad():
        if mode.type == "cpu":
            monkeypatch.setattr(mamba2, "use_triton", lambda x: True)
        fast = m.extend(u, conv0, ssm0)
        monkeypatch.setattr(mamba2, "use_triton", lambda x: False)
        ref = m.extend(u, conv0, ssm0)
    assert calls == ["ssd_scan"]
    for got, want in zip(fast, ref):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
