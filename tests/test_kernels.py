"""Fused Triton kernels (norms, Mamba-2 steps) against their torch references on fresh random
inputs: the Triton interpreter on CPU, compiled on a GPU (``-m gpu``)."""
from __future__ import annotations

import pytest
import torch

from blockspec.layers.mamba2 import Mamba2Mixer
from blockspec.layers.norm import GatedGroupRMSNorm, RMSNorm
from blockspec.configs.nemotron_h import NemotronHConfig

from tests.triton_modes import GPU, MODES, mode  # noqa: F401  (mode: fixture)

pytest.importorskip("triton")




@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("width, residual", [(100, False), (96, True), (2688, True)])
def test_rms_norm_kernel_matches_reference(mode, width, residual):
    from blockspec.kernels.norm import rms_norm

    g = torch.Generator().manual_seed(width)
    norm = RMSNorm(width, 1e-5).to(mode)
    norm.weight.data = (1 + 0.1 * torch.randn(width, generator=g)).to(mode)
    x = (3 * torch.randn(5, width, generator=g)).to(mode)
    r = torch.randn(5, width, generator=g).to(mode) if residual else None
    h, y = rms_norm(x, norm.weight, norm.eps, residual=r)
    want_h = x + r if residual else x
    torch.testing.assert_close(h, want_h)
    torch.testing.assert_close(y, norm.reference(want_h), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_gated_rms_norm_kernel_matches_reference(mode):
    from blockspec.kernels.norm import gated_rms_norm

    g = torch.Generator().manual_seed(1)
    norm = GatedGroupRMSNorm(64, 16, 1e-5).to(mode)
    norm.weight.data = (1 + 0.1 * torch.randn(64, generator=g)).to(mode)
    v, z = torch.randn(7, 64, generator=g).to(mode), torch.randn(7, 64, generator=g).to(mode)
    torch.testing.assert_close(gated_rms_norm(v, z, norm.weight, 16, norm.eps), norm.reference(v, z),
                               rtol=1e-5, atol=1e-5)


def _mixer(seed: int, bias: bool, limit) -> Mamba2Mixer:
    cfg = NemotronHConfig.from_dict({
        "model_type": "nemotron_h", "hybrid_override_pattern": "M", "vocab_size": 16, "hidden_size": 32, "mamba_num_heads": 4,
        "mamba_head_dim": 8, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
        "chunk_size": 8, "use_conv_bias": bias, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "time_step_limit": limit})
    m = Mamba2Mixer(cfg, "m")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name == "A_log":
                p.copy_(torch.log(torch.linspace(0.5, 3.0, p.numel())))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5))
    return m


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("steps, commit, bias, limit", [
    (1, True, True, [0.0, float("inf")]), (3, False, True, [0.0, float("inf")]),
    (4, True, False, [0.01, 0.5]), (2, False, False, [0.05, 10.0])])
def test_mamba_steps_kernel_matches_reference(mode, steps, commit, bias, limit):
    """Decode (commit) and verify (scratch) steps: outputs, final or per-step SSM states, conv
    windows and pre-conv scratch all match the torch reference, from a random committed state."""
    from blockspec.kernels.mamba_step import mamba_steps

    m = _mixer(steps, bias, limit).to(mode)
    g = torch.Generator().manual_seed(10 + steps)
    S, B = 5, 3
    slots = torch.tensor([3, 0, 4], device=mode)
    conv = torch.randn(S, m.conv_dim, 3, generator=g).to(mode)
    ssm = torch.randn(S, m.H, m.P, m.N, generator=g).to(mode)
    xs = torch.zeros(S, 6, m.conv_dim, device=mode)
    ss = torch.zeros(S, 6, m.H + m.d_inner + m.G * m.N, device=mode)
    zxbcdt = torch.randn(B * steps, m.d_inner + m.conv_dim + m.H, generator=g).to(mode)
    ref_state = (conv.clone(), ssm.clone(), xs.clone(), ss.clone())
    want = m.steps_reference(zxbcdt, ref_state[0], ref_state[1], slots, steps, commit,
                             ref_state[2], ref_state[3])
    got = mamba_steps(zxbcdt, conv_weight=m.conv1d.weight, conv_bias=m.conv1d.bias, dt_bias=m.dt_bias,
                      a_log=m.A_log, d_skip=m.D, conv_state=conv, ssm_state=ssm, slots=slots,
                      steps=steps, heads=m.H, head_dim=m.P, state_size=m.N, groups=m.G,
                      d_inner=m.d_inner, commit=commit, xbc_scratch=xs, step_scratch=ss,
                      dt_limit=tuple(limit))
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, want, **tol)
    for mine, theirs in zip((conv, ssm, xs, ss), ref_state):
        torch.testing.assert_close(mine, theirs, **tol)
    if commit:
        assert not torch.equal(ssm[3], torch.zeros_like(ssm[3])) and torch.equal(xs, torch.zeros_like(xs))
    else:
        assert torch.count_nonzero(ss[slots, :steps]) > 0


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("conv_kernel, width, head_dim", [(4, 4, 8), (4, 1, 8), (3, 6, 6)])
def test_commit_verify_kernel_matches_reference(mode, conv_kernel, width, head_dim):
    """All layers adopt the state after each row's accepted position: the SSM state replayed
    from the scratch's step inputs, the conv window shifted through the block's inputs (kernel
    vs the pool's torch code; the kernel's fma rounds once where torch rounds twice)."""
    from blockspec.cache import MambaStatePool
    from blockspec.kernels.mamba_step import commit_verify

    g = torch.Generator().manual_seed(conv_kernel * 10 + width)
    pools = []
    for _ in range(2):
        p = MambaStatePool(num_layers=3, num_slots=5, conv_dim=300, conv_kernel=conv_kernel,
                           num_heads=4, head_dim=head_dim, state_size=16, dtype=torch.float32,
                           device=mode, groups=2)
        p.ensure_verify(width)
        pools.append(p)
    for name in ("conv", "ssm", "xbc_scratch", "step_scratch"):
        value = torch.randn(getattr(pools[0], name).shape, generator=g)
        if name == "step_scratch":      # decays in (0, 1), as exp(dt * A) with A < 0 gives
            value[..., :4] = torch.rand(value[..., :4].shape, generator=g)
        for p in pools:
            getattr(p, name).copy_(value.to(mode))
    slots = torch.tensor([3, 0, 4], device=mode)
    index = torch.tensor([width - 1, 0, min(1, width - 1)], device=mode)
    before = pools[0].conv.clone(), pools[0].ssm.clone()
    pools[0].commit_verify_reference(slots, index)
    p = pools[1]
    commit_verify(p.conv, p.ssm, p.xbc_scratch, p.step_scratch, slots, index, groups=2)
    assert torch.equal(p.conv, pools[0].conv)
    torch.testing.assert_close(p.ssm, pools[0].ssm, rtol=1e-6, atol=1e-6)
    assert not torch.equal(p.conv, before[0]) and not torch.equal(p.ssm, before[1])
    assert torch.equal(p.conv[:, [1, 2]], before[0][:, [1, 2]])     # other slots untouched
    assert torch.equal(p.ssm[:, [1, 2]], before[1][:, [1, 2]])


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_verify_then_commit_kernels_equal_decode_kernel(mode):
    """Lossless speculation needs the committed state to be the one decoding would reach:
    verify T positions, commit position i (both kernels) == i + 1 decode steps of the step
    kernel, bit for bit, outputs included."""
    from blockspec.cache import MambaStatePool
    from blockspec.kernels.mamba_step import commit_verify, mamba_steps

    T = 5
    m = _mixer(T, True, [0.0, float("inf")]).to(mode)
    g = torch.Generator().manual_seed(77)
    pool = MambaStatePool(1, 3, m.conv_dim, 4, m.H, m.P, m.N, torch.float32, torch.device(mode),
                          groups=m.G)
    pool.ensure_verify(T)
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=g).to(mode))
    pool.ssm.copy_(torch.randn(pool.ssm.shape, generator=g).to(mode))
    zxbcdt = torch.randn(T, m.d_inner + m.conv_dim + m.H, generator=g).to(mode)
    kw = dict(conv_weight=m.conv1d.weight, conv_bias=m.conv1d.bias, dt_bias=m.dt_bias,
              a_log=m.A_log, d_skip=m.D, heads=m.H, head_dim=m.P, state_size=m.N, groups=m.G,
              d_inner=m.d_inner)
    slot = torch.tensor([1], device=mode)
    conv0, ssm0 = pool.conv.clone(), pool.ssm.clone()
    y_verify = mamba_steps(zxbcdt, conv_state=pool.conv[0], ssm_state=pool.ssm[0], slots=slot,
                           steps=T, commit=False, xbc_scratch=pool.xbc_scratch[0],
                           step_scratch=pool.step_scratch[0], **kw)
    assert torch.equal(pool.conv, conv0) and torch.equal(pool.ssm, ssm0)
    for i in (0, 2, T - 1):
        conv, ssm = conv0[0].clone(), ssm0[0].clone()
        ys = [mamba_steps(zxbcdt[t:t + 1], conv_state=conv, ssm_state=ssm, slots=slot, steps=1,
                          commit=True, **kw) for t in range(i + 1)]
        pool.conv.copy_(conv0)
        pool.ssm.copy_(ssm0)
        commit_verify(pool.conv, pool.ssm, pool.xbc_scratch, pool.step_scratch, slot,
                      torch.tensor([i], device=mode), groups=m.G)
        assert torch.equal(pool.ssm[0], ssm) and torch.equal(pool.conv[0], conv)
        assert torch.equal(y_verify[: i + 1], torch.cat(ys))


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("B", [1, 2, 4, 48])
def test_verify_layouts_equal_decode_steps(mode, B):
    """With 64-channel heads one request's verify and decode share 16-channel programs, and
    a verify of several requests runs whole heads where their decode runs 32 channels: the
    committed states and the outputs are decode's bit for bit (no contraction beyond the
    written fma), so greedy verification compares the logits decoding would make."""
    from blockspec.kernels.mamba_step import commit_verify, mamba_steps, step_config

    H, P, N, G, T = 2, 64, 16, 1, 3
    if B == 1:
        assert step_config(B, T, P) == step_config(B, 1, P) == (16, 4)
    else:                                                    # two layouts under test
        assert step_config(B, T, P) == (64, 2) and step_config(B, 1, P) == (32, 4)
    d_inner, C = H * P, H * P + 2 * G * N
    g = torch.Generator().manual_seed(5)
    conv_w = (torch.randn(C, 1, 4, generator=g) * 0.3).to(mode)
    kw = dict(conv_weight=conv_w, conv_bias=(torch.randn(C, generator=g) * 0.1).to(mode),
              dt_bias=(torch.randn(H, generator=g) * 0.1).to(mode),
              a_log=(torch.randn(H, generator=g) * 0.5).to(mode), d_skip=torch.randn(H).to(mode),
              heads=H, head_dim=P, state_size=N, groups=G, d_inner=d_inner)
    conv0 = torch.randn(1, B, C, 3, generator=g).to(mode)
    ssm0 = (torch.randn(1, B, H, P, N, generator=g) * 0.1).to(mode)
    zx = torch.randn(B, T, d_inner + C + H, generator=g).to(mode)
    xs = torch.zeros(1, B, T, C, device=mode)
    ss = torch.zeros(1, B, T, H + d_inner + G * N, device=mode)
    slots = torch.arange(B, device=mode)
    y_verify = mamba_steps(zx.reshape(B * T, -1), conv_state=conv0[0], ssm_state=ssm0[0],
                           slots=slots, steps=T, commit=False, xbc_scratch=xs[0],
                           step_scratch=ss[0], **kw).view(B, T, -1)
    conv, ssm = conv0.clone(), ssm0.clone()
    index = torch.full((B,), T - 1, device=mode)
    commit_verify(conv, ssm, xs, ss, slots, index, groups=G)
    dconv, dssm = conv0[0].clone(), ssm0[0].clone()
    ys = [mamba_steps(zx[:, t], conv_state=dconv, ssm_state=dssm, slots=slots, steps=1,
                      commit=True, **kw) for t in range(T)]
    assert torch.equal(ssm[0], dssm) and torch.equal(conv[0], dconv)
    assert torch.equal(y_verify, torch.stack(ys, dim=1))


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("T", [1, 3])
def test_step_layouts_leave_the_same_states(mode, T):
    """A request that moves between batch 1 (16-channel programs) and a larger batch (32
    channels, or whole heads) must carry one state: every layout leaves the same SSM state,
    conv window and verify scratch bit for bit (the update is elementwise); y may differ only
    in the sum's last bits."""
    from blockspec.kernels.mamba_step import mamba_steps

    H, P, N, G, B = 2, 64, 16, 1, 2
    d_inner, C = H * P, H * P + 2 * G * N
    g = torch.Generator().manual_seed(11)
    kw = dict(conv_weight=(torch.randn(C, 1, 4, generator=g) * 0.3).to(mode),
              conv_bias=(torch.randn(C, generator=g) * 0.1).to(mode),
              dt_bias=(torch.randn(H, generator=g) * 0.1).to(mode),
              a_log=(torch.randn(H, generator=g) * 0.5).to(mode),
              d_skip=torch.randn(H, generator=g).to(mode), heads=H, head_dim=P, state_size=N,
              groups=G, d_inner=d_inner, steps=T, commit=T == 1)
    conv0 = torch.randn(B, C, 3, generator=g).to(mode)
    ssm0 = (torch.randn(B, H, P, N, generator=g) * 0.1).to(mode)
    zx = torch.randn(B * T, d_inner + C + H, generator=g).to(mode)
    slots = torch.arange(B, device=mode)
    outs = []
    for block_p, warps in ((16, 4), (32, 4), (64, 2)):
        conv, ssm = conv0.clone(), ssm0.clone()
        xs = torch.zeros(B, T, C, device=mode)
        ss = torch.zeros(B, T, H + d_inner + G * N, device=mode)
        y = mamba_steps(zx, conv_state=conv, ssm_state=ssm, slots=slots, xbc_scratch=xs,
                        step_scratch=ss, block_p=block_p, num_warps=warps, **kw)
        outs.append((y, conv, ssm, xs, ss))
    y0, conv_a, ssm_a, xs_a, ss_a = outs[0]
    if T == 1:                       # decode wrote the states; a verify, the scratch
        assert not torch.equal(ssm_a, ssm0) and not torch.equal(conv_a, conv0)
    else:
        assert torch.equal(ssm_a, ssm0) and ss_a.abs().sum() > 0 and xs_a.abs().sum() > 0
    for y, *states in outs[1:]:
        for got, want in zip(states, (conv_a, ssm_a, xs_a, ss_a)):
            assert torch.equal(got, want)
        torch.testing.assert_close(y, y0, rtol=1e-5, atol=1e-6)
