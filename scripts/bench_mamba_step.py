"""Launch-config sweep of the Mamba-2 step kernels at a preset's shapes (one layer), on the GPU:
``mamba_steps`` (decode T = 1 commits; verify T > 1 writes the scratch) over block_p x
num_warps, and ``commit_verify`` (all layers in one launch) over its own. A config is listed
only if the states it leaves (decode: the SSM state; verify: the scratch the commit replays)
match the built-in's bit for bit; its y may differ in the last bits (the C . state sum's
order follows the layout), and "~" marks where it differs from decode's (the built-in's for
decode; for a verify, T decode steps at the batch's decode layout: a verify that gives
another y than decoding would compares other logits).

    python scripts/bench_mamba_step.py [--preset nemotron-3.5-lightning] [--batch 1,16,64,128]
        [--widths 1,2,4,6,8] [--out FILE]
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blockspec.bench import presets  # noqa: E402
from blockspec.bench.jsonl import emit_text  # noqa: E402
from blockspec.bench.timing import graph_time_ms  # noqa: E402
from blockspec.kernels.mamba_step import commit_verify, mamba_steps  # noqa: E402


def timed(fn, reps: int = 20) -> float:
    """Microseconds of one call as the device runs it inside a decode step (``graph_time_ms``:
    eager launches back to back would time the host's launch path, ~50-100 us, not the
    kernel's few). CPU: one call, for a dry run under ``TRITON_INTERPRET=1``."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return graph_time_ms(fn, reps, 5) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="nemotron-3.5-lightning", choices=sorted(presets.PRESETS))
    p.add_argument("--batch", default="1,16,64,128")
    p.add_argument("--widths", default="1,2,4,6,8")
    p.add_argument("--layers", type=int, default=23, help="layers in the commit launch")
    p.add_argument("--shape", help="H,P,N,G instead of the preset's (a CPU dry run)")
    p.add_argument("--out")
    a = p.parse_args()
    cfg = presets.preset_config(a.preset)
    H, P, N, G = (tuple(int(v) for v in a.shape.split(",")) if a.shape else
                  (cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["ssm_state_size"],
                   cfg["n_groups"]))
    d_inner = H * P
    C = d_inner + 2 * G * N
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches = [int(b) for b in a.batch.split(",")]
    widths = [int(w) for w in a.widths.split(",")]
    S, Wmax = max(batches) + 1, max(widths)
    g = torch.Generator(device=dev).manual_seed(0)
    conv_w = torch.randn(C, 1, 4, device=dev, dtype=torch.bfloat16, generator=g) * 0.3
    conv_b = torch.randn(C, device=dev, dtype=torch.bfloat16, generator=g) * 0.1
    dt_bias = torch.randn(H, device=dev, generator=g) * 0.1
    a_log = torch.randn(H, device=dev, generator=g) * 0.5
    d_skip = torch.randn(H, device=dev, generator=g)
    layer = dict(conv_weight=conv_w, conv_bias=conv_b, dt_bias=dt_bias, a_log=a_log,
                 d_skip=d_skip, heads=H, head_dim=P, state_size=N, groups=G, d_inner=d_inner)
    conv0 = torch.randn(S, C, 3, device=dev, dtype=torch.bfloat16, generator=g)
    ssm0 = torch.randn(S, H, P, N, device=dev, generator=g) * 0.1
    xs = torch.zeros(S, Wmax, C, device=dev, dtype=torch.bfloat16)
    ss = torch.zeros(S, Wmax, H + d_inner + G * N, device=dev)
    lines = [f"{a.preset}: H={H} P={P} N={N} G={G}; mamba_steps us per layer (one launch)"]
    configs = [(bp, nw) for bp in (8, 16, 32, 64) for nw in (1, 2, 4, 8) if bp <= P]
    totals: dict[tuple[int, int], float] = {c: 0.0 for c in configs}
    for b, w in itertools.product(batches, widths):
        slots = torch.arange(b, device=dev)
        x = torch.randn(b * w, d_inner + C + H, device=dev, dtype=torch.bfloat16, generator=g)
        commit = w == 1

        def run(bp=None, nw=None, conv=None, ssm=None):
            return mamba_steps(x, conv_state=conv, ssm_state=ssm, slots=slots, steps=w,
                               commit=commit, xbc_scratch=xs, step_scratch=ss, block_p=bp,
                               num_warps=nw, **layer)

        def outcome(bp=None, nw=None):
            """y and the states the launch leaves (the scratch too: a verify writes it)."""
            xs.zero_()
            ss.zero_()
            conv, ssm = conv0.clone(), ssm0.clone()
            y = run(bp, nw, conv, ssm)
            return y, (conv, ssm, xs.clone(), ss.clone())

        ref, ref_states = outcome()
        if not commit:             # the y a verify must give: w decode steps at the batch's
            conv, ssm = conv0.clone(), ssm0.clone()      # decode layout (its default)
            rows = x.view(b, w, -1)
            ref = torch.stack([mamba_steps(rows[:, t], conv_state=conv, ssm_state=ssm,
                                           slots=slots, steps=1, commit=True, **layer)
                               for t in range(w)], dim=1).view(b * w, -1)
        work_c, work_s = conv0.clone(), ssm0.clone()     # timing: decode advances these
        base = timed(lambda: run(conv=work_c, ssm=work_s))
        row = []
        for bp, nw in configs:
            try:
                got, states = outcome(bp, nw)
            except Exception as e:      # noqa: BLE001 - a config the compiler refuses
                row.append(f"{bp}/{nw}:err({type(e).__name__})")
                continue
            same = all(torch.equal(a, b) for a, b in zip(states, ref_states))
            us = timed(lambda: run(bp, nw, work_c, work_s))
            totals[(bp, nw)] += us / base if same else float("inf")
            mark = ("" if torch.equal(got, ref) else "~") if same else "(states differ)"
            row.append(f"{bp}/{nw}:{us:.1f}{mark}")
        lines.append(f"B={b} T={w} built-in {base:.1f} | " + " ".join(row))
    best = sorted(totals.items(), key=lambda kv: kv[1])[:5]
    lines.append("mamba_steps configs by summed time / built-in over all cases (lower is better): "
                 + ", ".join(f"{bp}/{nw}={t / (len(batches) * len(widths)):.3f}"
                             for (bp, nw), t in best))
    L = a.layers
    convL = torch.randn(L, S, C, 3, device=dev, dtype=torch.bfloat16, generator=g)
    ssmL = torch.randn(L, S, H, P, N, device=dev, generator=g) * 0.1
    xsL = torch.randn(L, S, Wmax, C, device=dev, dtype=torch.bfloat16, generator=g)
    ssL = torch.rand(L, S, Wmax, H + d_inner + G * N, device=dev, generator=g)
    lines.append(f"commit_verify us ({L} layers, scratch width {Wmax}; state "
                 f"{L * H * P * N * 4 / 1e6:.0f} MB per request read and written)")
    for b in batches:
        slots = torch.arange(b, device=dev)
        index = torch.randint(0, Wmax, (b,), device=dev, generator=g)
        ref_c, ref_s = convL.clone(), ssmL.clone()
        commit_verify(ref_c, ref_s, xsL, ssL, slots, index, G)
        row = []
        for bp, nw in [(None, None)] + [(bp, nw) for bp in (1, 2, 4, 8, 16) for nw in (1, 2, 4, 8)]:
            c2, s2 = convL.clone(), ssmL.clone()
            commit_verify(c2, s2, xsL, ssL, slots, index, G, block_p=bp, num_warps=nw)
            same = torch.equal(c2, ref_c) and torch.equal(s2, ref_s)
            us = timed(lambda: commit_verify(c2, s2, xsL, ssL, slots, index, G, block_p=bp,
                                             num_warps=nw), reps=5)
            gbs = 2 * b * L * H * P * N * 4 / us / 1e3
            row.append(f"{bp}/{nw}:{us:.0f}us,{gbs:.0f}GB/s{'' if same else '(differs)'}")
        lines.append(f"B={b} " + " ".join(row))
    emit_text(lines, a.out)


if __name__ == "__main__":
    main()
