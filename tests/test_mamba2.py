"""Mamba-2 state disciplines: chunked scan vs recurrence, multi-step verify + commit."""
from __future__ import annotations

import torch

from blockspec.layers.mamba2 import Mamba2Mixer, ssd_chunked_scan, ssm_recurrent_steps
from blockspec.configs.nemotron_h import NemotronHConfig


def _mixer(seed: int = 0) -> Mamba2Mixer:
    cfg = NemotronHConfig.from_dict({
        "model_type": "nemotron_h", "hybrid_override_pattern": "M", "vocab_size": 16, "hidden_size": 24,
        "mamba_num_heads": 4, "mamba_head_dim": 6, "ssm_state_size": 5, "n_groups": 2, "conv_kernel": 4,
        "chunk_size": 3})
    m = Mamba2Mixer(cfg, "m", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "proj" in name or "conv" in name else 0.5))
        m.A_log.copy_(torch.rand(4, generator=g))
    return m


def test_chunked_scan_equals_recurrence():
    g = torch.Generator().manual_seed(1)
    T, H, P, N = 11, 3, 4, 5
    x, B, C = (torch.randn(T, H, d, generator=g) for d in (P, N, N))
    dt = torch.rand(T, H, generator=g)
    A = -torch.rand(H, generator=g) - 0.1
    S0 = torch.randn(H, P, N, generator=g)
    for chunk in (1, 4, 16):
        y, S = ssd_chunked_scan(x[None], dt[None], A, B[None], C[None], S0[None], chunk)
        y_ref, states = ssm_recurrent_steps(x[None], dt[None], A, B[None], C[None], S0[None])
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(S, states[:, -1], rtol=1e-5, atol=1e-5)


class Pool:
    """One layer's worth of MambaStatePool: state tensors for ``slots`` requests + verify scratch."""

    def __init__(self, m: Mamba2Mixer, slots: int, width: int, g: torch.Generator) -> None:
        from blockspec.cache import MambaStatePool

        self.p = MambaStatePool(1, slots, m.conv_dim, m.K, m.H, m.P, m.N, torch.float32,
                                torch.device("cpu"), groups=m.G)
        self.p.ensure_verify(width)
        self.p.conv.copy_(torch.randn(self.p.conv.shape, generator=g))
        self.p.ssm.copy_(torch.randn(self.p.ssm.shape, generator=g))

    def clone(self) -> "Pool":
        other = object.__new__(Pool)
        other.p = type(self.p).__new__(type(self.p))
        for name in ("conv", "ssm", "xbc_scratch", "step_scratch"):
            setattr(other.p, name, getattr(self.p, name).clone())
        other.p.groups = self.p.groups
        return other

    def steps(self, m: Mamba2Mixer, u: torch.Tensor, slots: torch.Tensor, commit: bool) -> torch.Tensor:
        T = u.shape[0] // slots.shape[0]
        return m.forward_steps(u, self.p.conv[0], self.p.ssm[0], slots, T, commit,
                               self.p.xbc_scratch[0], self.p.step_scratch[0])

    def raw_steps(self, m: Mamba2Mixer, zxbcdt: torch.Tensor, slots: torch.Tensor,
                  commit: bool) -> torch.Tensor:
        """The reference steps on in_proj outputs (no GEMM, so row counts cannot round)."""
        T = zxbcdt.shape[0] // slots.shape[0]
        return m.steps_reference(zxbcdt, self.p.conv[0], self.p.ssm[0], slots, T, commit,
                                 self.p.xbc_scratch[0], self.p.step_scratch[0])


def test_verify_then_commit_equals_decode_steps():
    """A verify of T positions leaves the committed state alone; committing index i afterwards
    gives the state (and outputs) of i + 1 single decode steps."""
    m = _mixer()
    g = torch.Generator().manual_seed(2)
    T = 6
    u = torch.randn(T, 24, generator=g)
    slot = torch.tensor([1])
    base = Pool(m, 3, T, g)
    verify = base.clone()
    out_multi = verify.steps(m, u, slot, commit=False)
    assert torch.equal(verify.p.conv, base.p.conv) and torch.equal(verify.p.ssm, base.p.ssm)
    for i in range(T):
        dec = base.clone()
        outs = [dec.steps(m, u[t:t + 1], slot, commit=True) for t in range(i + 1)]
        com = verify.clone()
        com.p.commit_verify(slot, torch.tensor([i]))
        # same math; only the in_proj GEMM shape differs ([T,d] vs [1,d]), hence fp32 rounding
        torch.testing.assert_close(com.p.conv, dec.p.conv, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(com.p.ssm, dec.p.ssm, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out_multi[: i + 1], torch.cat(outs), rtol=1e-5, atol=1e-6)


def test_extend_matches_steps_and_writes_state():
    m = _mixer(3)
    g = torch.Generator().manual_seed(4)
    u = torch.randn(7, 24, generator=g)
    pool = Pool(m, 1, 1, g)
    conv0, ssm0 = pool.p.conv[0].clone(), pool.p.ssm[0].clone()
    out_ext, conv, ssm = m.extend(u[None], conv0, ssm0)     # chunked SSD, chunk 3
    out_steps = pool.steps(m, u, torch.tensor([0]), commit=True)
    torch.testing.assert_close(out_ext[0], out_steps, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(conv, pool.p.conv[0])
    torch.testing.assert_close(ssm, pool.p.ssm[0], rtol=1e-4, atol=1e-5)


def test_commit_picks_per_row_index():
    """Each row adopts its own accepted position: bit for bit the verify recurrence's state
    there (the commit replays the verify's own inputs), and, up to the rounding of step
    shapes, what as many decode steps give; slots outside the batch are untouched."""
    m = _mixer(5)
    g = torch.Generator().manual_seed(6)
    width = m.d_inner + m.conv_dim + m.H
    zxbcdt = torch.randn(3 * 4, width, generator=g)
    pool = Pool(m, 4, 4, g)
    slots = torch.tensor([2, 0, 3])
    before = pool.clone()
    pool.raw_steps(m, zxbcdt, slots, commit=False)
    idx = torch.tensor([0, 3, 1])
    pool.p.commit_verify(slots, idx)
    # the verify's own per-position states, from its inputs
    _, xbc, dt_raw = zxbcdt.view(3, 4, width).split([m.d_inner, m.conv_dim, m.H], dim=-1)
    x, Bm, Cm, dt = m._ssm_inputs(m._conv(xbc, before.p.conv[0][slots]), dt_raw)
    _, states = ssm_recurrent_steps(x, dt, -torch.exp(m.A_log.float()), Bm, Cm,
                                    before.p.ssm[0][slots])
    rows = zxbcdt.view(3, 4, width)
    for b, (s, i) in enumerate(zip(slots.tolist(), idx.tolist())):
        assert torch.equal(pool.p.ssm[0, s], states[b, i])
        dec = before.clone()
        for t in range(i + 1):
            dec.raw_steps(m, rows[b, t:t + 1], torch.tensor([s]), commit=True)
        assert torch.equal(pool.p.conv[0, s], dec.p.conv[0, s])
        torch.testing.assert_close(pool.p.ssm[0, s], dec.p.ssm[0, s], rtol=1e-6, atol=1e-7)
    assert not torch.equal(pool.p.ssm[0, 2], before.p.ssm[0, 2])
    assert torch.equal(pool.p.ssm[0, 1], before.p.ssm[0, 1])      # a slot not in the batch
    assert torch.equal(pool.p.conv[0, 1], before.p.conv[0, 1])


def test_step_scratch_is_small():
    """A verify position keeps H + H*P + G*N floats of recurrence inputs, not an H*P*N state."""
    m = _mixer()
    pool = Pool(m, 2, 6, torch.Generator().manual_seed(0))
    assert pool.p.step_scratch.shape == (1, 2, 6, m.H + m.H * m.P + m.G * m.N)
    assert pool.p.inputs_per_position == m.H + m.H * m.P + m.G * m.N
