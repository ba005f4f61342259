"""The adaptive width chooser, run on a measured step-time table against a simulated
acceptance profile, without a model: how close it gets to the best fixed width, and why not.

Each step the real ``WidthChooser`` picks a width for the batch; every request draws its
accepted drafts from the profile's per-position coins; the real ``AcceptanceEWMA`` folds the
step in; the chooser reads the rows back one step late, as launch-ahead does. A request ends
after 256 committed tokens (``simulate(tokens=)``) and a new one takes its slot; the
chooser's and the EWMA's rates can be set (``chooser_kw``, ``ewma_kw``) to tune them. Scored
by expected tokens (the profile's mean at the widths run, so the coins' noise does not rank
the policies) over the table's step time, against every fixed width.

    python scripts/simulate_chooser.py --profile 0.5 --batch 1 \\
        --cost-ms 2.371,3.209,3.47,3.698,3.791,4.01,4.173,4.488
"""
from __future__ import annotations

import argparse
import json
import random
from collections import Counter

import torch

from blockspec.bench.accept_profile import parse_profile
from blockspec.speculative.adaptive import (AcceptanceEWMA, CostTable, WidthChooser,
                                             expected_tokens)

# one H200, quantized Lightning, published-size DFlash draft: widths 1..8 per batch size
# (cost_ms_by_width of docs/logs/adaptive_widths_h200_2026-12-03c.jsonl)
H200_MS = {1: [2.335, 3.238, 3.533, 3.698, 3.841, 4.073, 4.218, 4.526],
           4: [3.088, 4.316, 6.121, 6.376, 6.869, 7.215, 7.397, 7.681],
           16: [5.58, 7.501, 8.572, 8.712, 10.022, 10.851, 12.181, 12.483],
           64: [8.577, 13.017, 15.884, 18.916, 22.284, 23.423, 26.243, 30.099],
           128: [13.162, 22.299, 26.364, 31.158, 35.37, 38.805, 44.535, 48.689]}


def simulate(profile: list[float], batch: int, cost_ms: list[float], steps: int,
             tokens: int = 256, seed: int = 0, warm_width: int | None = None,
             phases: tuple[int, int, float] | None = None, chooser_kw: dict | None = None,
             ewma_kw: dict | None = None) -> dict:
    """The chooser over ``steps`` steps (after ``steps // 2`` at ``warm_width``, when given, as
    the bench's pinned rows run before the adaptive one on the same engine). ``phases`` =
    (every, len, scale): on the last ``len`` of every ``every`` verifies of a request every
    probability is scaled by ``scale`` (the bench's ``--simulate-low-accept-phases``)."""
    W = len(cost_ms)
    cost = CostTable()
    for w, ms in enumerate(cost_ms, 1):
        cost.measured[(batch, w)] = ms / 1e3
    chooser = WidthChooser(range(1, W + 1), cost, **(chooser_kw or {}))
    ewma = AcceptanceEWMA(batch + 1, W - 1, torch.device("cpu"), **(ewma_kw or {}))
    rng = random.Random(seed)
    slots = torch.arange(batch)
    ctr, done = torch.zeros(batch, dtype=torch.long), [0] * batch
    widths, exp_tokens, ms, late = Counter(), 0.0, 0.0, None
    fixed_tokens = Counter()

    def probs(b: int) -> list[float]:
        if phases is not None and int(ctr[b]) % phases[0] >= phases[0] - phases[1]:
            return [p * phases[2] for p in profile]
        return profile

    def step(w: int) -> tuple:
        acc = []
        for b in range(batch):
            p, a = probs(b), 0
            while a < w - 1 and rng.random() < p[a]:
                a += 1
            acc.append(a)
        cols = ewma.update(slots, ctr, torch.tensor(acc), w)
        return acc, cols[:, :W - 1].tolist(), ewma.engine.tolist()

    for t in range(steps + (steps // 2 if warm_width else 0)):
        warm = warm_width is not None and t < steps // 2
        w = warm_width if warm else chooser.choose(batch)
        acc, rows, engine = step(w)
        if late is not None:
            chooser.observe(*late)       # launch-ahead: step t - 1's rows, read after t began
        late = (rows, engine)
        if not warm:
            widths[w] += 1
            exp_tokens += sum(expected_tokens(probs(b), w) for b in range(batch))
            ms += cost_ms[w - 1]
            for v in range(1, W + 1):
                fixed_tokens[v] += sum(expected_tokens(probs(b), v) for b in range(batch))
        for b, a in enumerate(acc):
            done[b] += a + 1
            ctr[b] += 1
            if done[b] >= tokens:
                done[b], ctr[b] = 0, 0
    fixed = {w: fixed_tokens[w] / (cost_ms[w - 1] * sum(widths.values()))
             for w in range(1, W + 1)}
    best = max(fixed, key=fixed.get)
    rate = exp_tokens / ms
    return {"batch": batch, "adaptive_tok_per_ms": round(rate, 4), "best_fixed": best,
            "best_fixed_tok_per_ms": round(fixed[best], 4),
            "x_best_fixed": round(rate / fixed[best], 4), "x_width1": round(rate / fixed[1], 4),
            "width_histogram": [widths[w] for w in range(1, W + 1)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="dflash-published",
                    help="a named profile or P1,P2,... (bench's --simulate-accept-profile; "
                         "positions not given never accept)")
    ap.add_argument("--batch", default="1,4,16,64,128", help="batch sizes (with --cost-ms: one)")
    ap.add_argument("--cost-ms", default=None, help="step ms at widths 1..W (default: H200 table)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--warm-width", type=int, default=None,
                    help="first run as many steps pinned to this width (the bench's pinned rows)")
    ap.add_argument("--phases", default=None, help="EVERY,LEN,SCALE: low-acceptance phases")
    ap.add_argument("--blind-margin", type=float, default=None,
                    help="the chooser's blind_margin (default adaptive.BLIND_MARGIN; 0: off)")
    ap.add_argument("--tie-margin", type=float, default=None,
                    help="the chooser's tie_margin (default adaptive.TIE_MARGIN; 0: off)")
    args = ap.parse_args()
    chooser_kw = {k: v for k, v in (("blind_margin", args.blind_margin),
                                    ("tie_margin", args.tie_margin)) if v is not None}
    phases = None
    if args.phases:
        every, length, scale = args.phases.split(",")
        phases = (int(every), int(length), float(scale))
    batches = [int(b) for b in args.batch.split(",")]
    for b in batches:
        table = [float(v) for v in args.cost_ms.split(",")] if args.cost_ms else H200_MS[b]
        probs = list(parse_profile(args.profile)[1]) + [0.0] * len(table)
        profile = probs[:len(table) - 1]
        runs = [simulate(profile, b, table, args.steps, seed=s, warm_width=args.warm_width,
                         phases=phases, chooser_kw=chooser_kw)
                for s in range(args.seeds)]
        mean = sum(r["x_best_fixed"] for r in runs) / len(runs)
        print(json.dumps({**runs[0], "x_best_fixed_mean": round(mean, 4),
                          "x_best_fixed_min": min(r["x_best_fixed"] for r in runs),
                          "profile": args.profile, "chooser_kw": chooser_kw}))


if __name__ == "__main__":
    main()
