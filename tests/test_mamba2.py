"""Mamba-2 state disciplines: chunked scan vs recurrence, multi-step verify + commit."""
from __future__ import annotations

import torch

from blockspec.layers.mamba2 import Mamba2Mixer, ssd_chunked_scan, ssm_recurrent_steps
from blockspec.models.nemotron_h_config import NemotronHConfig


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


def test_multi_step_commit_equals_single_steps():
    m = _mixer()
    g = torch.Generator().manual_seed(2)
    T = 6
    u = torch.randn(1, T, 24, generator=g)
    conv0 = torch.randn(1, m.conv_dim, 3, generator=g)
    ssm0 = torch.randn(1, 4, 6, 5, generator=g)
    conv_keep, ssm_keep = conv0.clone(), ssm0.clone()
    out_multi, vs = m.steps(u, conv0, ssm0)
    # the committed state is untouched by a verify pass
    assert torch.equal(conv0, conv_keep) and torch.equal(ssm0, ssm_keep)
    for i in range(T):
        conv, ssm = conv_keep.clone(), ssm_keep.clone()
        outs = []
        for t in range(i + 1):   # i+1 single decode steps, each committing its state
            o, v1 = m.steps(u[:, t:t + 1], conv, ssm)
            conv, ssm = Mamba2Mixer.committed_state(conv, v1, torch.zeros(1, dtype=torch.long))
            outs.append(o)
        win, st = Mamba2Mixer.committed_state(conv_keep, vs, torch.tensor([i]))
        # same math; only the in_proj GEMM shape differs ([T,d] vs [1,d]), hence fp32 rounding
        torch.testing.assert_close(win, conv, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(st, ssm, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out_multi[:, :i + 1], torch.cat(outs, 1), rtol=1e-5, atol=1e-6)


def test_extend_matches_steps_and_writes_state():
    m = _mixer(3)
    g = torch.Generator().manual_seed(4)
    u = torch.randn(7, 24, generator=g)
    conv0, ssm0 = torch.randn(1, m.conv_dim, 3, generator=g), torch.randn(1, 4, 6, 5, generator=g)
    out_ext, conv, ssm = m.extend(u[None], conv0, ssm0)     # chunked SSD, chunk 3
    out_steps, vs = m.steps(u[None], conv0, ssm0)
    torch.testing.assert_close(out_ext, out_steps, rtol=1e-4, atol=1e-5)
    win, st = Mamba2Mixer.committed_state(conv0, vs, torch.tensor([6]))
    torch.testing.assert_close(conv, win)
    torch.testing.assert_close(ssm, st, rtol=1e-4, atol=1e-5)


def test_commit_picks_per_row_index():
    m = _mixer(5)
    g = torch.Generator().manual_seed(6)
    u = torch.randn(3, 4, 24, generator=g)
    conv0, ssm0 = torch.randn(3, m.conv_dim, 3, generator=g), torch.randn(3, 4, 6, 5, generator=g)
    _, vs = m.steps(u, conv0, ssm0)
    idx = torch.tensor([0, 3, 1])
    win, st = Mamba2Mixer.committed_state(conv0, vs, idx)
    for b, i in enumerate(idx.tolist()):
        full = torch.cat([conv0[b], vs.xbc[b, : i + 1].t()], dim=1)
        assert torch.equal(win[b], full[:, -3:])
        assert torch.equal(st[b], vs.ssm[b, i])
