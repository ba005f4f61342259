"""The adaptive width chooser, run on a measured step-time table against a simulated
acceptance profile, without a model: how close it gets to the best fixed width, and why not.

Each step the real ``WidthChooser`` picks a width for the batch; every request draws its
accepted drafts from the profile's per-position coins; the real ``AcceptanceEWMA`` folds the
step in; the chooser reads the rows back one step late, as launch-ahead does. A request ends
after 256 committed tokens (``simulate(tokens=)``) and a new one takes its slot; the
chooser's and the EWMA's rates can be set (``chooser_kw``, ``ewma_kw``) to tune them. Scored
by expected tokens (the profile's mean at the widths run, so the coins' noise does not rank
the policies) over the table's step time, against every fixed width. With
``--finish-together TOKENS`` the batch is the bench's instead: its requests start together and
are not replaced, the step costs the table of the size still running, and every policy is
scored by its simulated time, the tail included (``finish_together``).

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


def cost_table(tables: dict[int, list[float]]) -> CostTable:
    """A cost table measured as ``tables`` says: step ms at widths 1..W per batch size."""
    cost = CostTable()
    for size, row in tables.items():
        for w, ms in enumerate(row, 1):
            cost.measured[(size, w)] = ms / 1e3
    return cost


def accepted_drafts(p: list[float], width: int, rng: random.Random) -> int:
    """One request's accepted drafts in a verify at ``width``: the leading run of passed
    coins, position j passing with probability ``p[j]``."""
    a = 0
    while a < width - 1 and rng.random() < p[a]:
        a += 1
    return a


def simulate(profile: list[float], batch: int, cost_ms: list[float], steps: int,
             tokens: int = 256, seed: int = 0, warm: tuple[int | None, ...] = (),
             phases: tuple[int, int, float] | None = None, chooser_kw: dict | None = None,
             ewma_kw: dict | None = None) -> dict:
    """The chooser over ``steps`` steps, after ``steps // 2`` unscored ones at each width of
    ``warm`` (None: the chooser's), as the bench's pinned rows run before the adaptive one on
    the same engine. ``phases`` =
    (every, len, scale): on the last ``len`` of every ``every`` verifies of a request every
    probability is scaled by ``scale`` (the bench's ``--simulate-low-accept-phases``)."""
    W = len(cost_ms)
    cost = cost_table({batch: cost_ms})
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
        acc = [accepted_drafts(probs(b), w, rng) for b in range(batch)]
        cols = ewma.update(slots, ctr, torch.tensor(acc), w)
        return acc, cols[:, :W - 1].tolist(), ewma.engine.tolist()

    half = max(steps // 2, 1)
    for t in range(steps + half * len(warm)):
        warming = t < half * len(warm)
        w = (warm[t // half] if warming else None) or chooser.choose(batch)
        acc, rows, engine = step(w)
        if late is not None:
            chooser.observe(*late)       # launch-ahead: step t - 1's rows, read after t began
        late = (rows, engine)
        if not warming:
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


# one H100, main at ac15192: the live tables at the end of the adaptive rows of
# docs/logs/adaptive_widths_h100_2026-12-05c.jsonl
H100_MS = {1: [2.215, 3.1, 3.36, 3.535, 3.687, 3.819, 3.965, 4.122],
           4: [3.188, 4.089, 4.759, 4.972, 7.383, 7.712, 7.92, 8.095],
           16: [4.553, 8.425, 9.295, 9.474, 10.814, 11.52, 12.727, 13.159],
           64: [10.406, 14.508, 17.36, 20.336, 23.747, 24.66, 27.823, 32.988],
           128: [17.334, 25.005, 28.675, 33.621, 38.211, 41.678, 47.555, 55.972]}

# one H200, main at 301e673, simulated text: the live tables at the end of the tau-1.5 adaptive
# rows of docs/logs/adaptive_tau15_simtext_h200_2026-12-06.jsonl
H200_SIMTEXT_MS = {1: [2.0, 2.811, 3.047, 3.145, 3.243, 3.352, 3.453, 3.52],
                   4: [2.836, 3.548, 4.246, 4.58, 7.052, 7.537, 7.736, 8.018],
                   16: [4.247, 7.476, 8.591, 9.319, 10.738, 11.55, 12.999, 13.334],
                   64: [8.844, 13.397, 16.35, 19.426, 22.799, 23.887, 26.896, 30.801],
                   128: [12.917, 21.882, 25.664, 30.198, 34.495, 37.872, 43.588, 47.62]}
DEVICE_TABLES = {"h200": H200_MS, "h100": H100_MS, "h200-simtext": H200_SIMTEXT_MS}


def finish_together(profile: list[float], batch: int, tables: dict[int, list[float]],
                    tokens: int = 128, seed: int = 0, width: int | None = None,
                    chooser_kw: dict | None = None,
                    warm: tuple[int | None, ...] = ()) -> float:
    """Milliseconds for ``batch`` requests of ``tokens`` tokens that start together and are
    not replaced (the bench's batch): each step costs the table of the smallest size that
    holds the requests still running, at the width chosen (``width`` pins it). The tail that
    a fixed-length batch pays, which the steady state of ``simulate`` never sees. ``warm``:
    batches run first on the same chooser, untimed, pinned to each width given (None: the
    chooser's): the bench's pinned rows and its untimed warm-up run of the adaptive row, which
    teach the engine row before the timed run."""
    W = len(next(iter(tables.values())))
    cost = cost_table(tables)
    chooser = WidthChooser(range(1, W + 1), cost, **(chooser_kw or {}))
    ewma = AcceptanceEWMA(batch + 1, W - 1, torch.device("cpu"))
    rng = random.Random(seed)

    def run(pinned: int | None) -> float:
        done, ctr = [0] * batch, torch.zeros(batch, dtype=torch.long)
        ms, late = 0.0, None
        while True:
            live = [b for b in range(batch) if done[b] < tokens]
            if not live:
                return ms
            w = pinned or chooser.choose(len(live))
            acc = [accepted_drafts(profile, w, rng) for _ in live]
            slots = torch.tensor(live)
            rows = ewma.update(slots, ctr[slots], torch.tensor(acc), w)[:, :W - 1].tolist()
            if late is not None:
                chooser.observe(*late)
            late = (rows, ewma.engine.tolist())
            ms += cost.startup(len(live), w) * 1e3
            for b, a in zip(live, acc):
                done[b] += a + 1
                ctr[b] += 1

    for w in warm:
        run(w)
    return run(width)


def score_finish_together(profile_arg: str, batch: int, tables: dict[int, list[float]],
                          tokens: int, seeds: int, chooser_kw: dict | None = None,
                          warm: tuple[int | None, ...] = ()) -> dict:
    """``finish_together`` for the chooser and every fixed width, the mean of ``seeds``
    coin sequences each: tokens per ms, and the chooser (after ``warm``) against the best
    fixed width."""
    W = len(tables[batch])
    profile = (list(parse_profile(profile_arg)[1]) + [0.0] * W)[:W - 1]
    sizes = {s: row for s, row in tables.items() if s <= batch}

    def rate(width: int | None) -> float:
        ms = [finish_together(profile, batch, sizes, tokens, seed, width, chooser_kw,
                              warm if width is None else ())
              for seed in range(seeds)]
        return batch * tokens * len(ms) / sum(ms)

    fixed = {w: rate(w) for w in range(1, W + 1)}
    best = max(fixed, key=fixed.get)
    adaptive = rate(None)
    return {"batch": batch, "tokens": tokens, "profile": profile_arg, "chooser_kw": chooser_kw,
            "warm": ["a" if w is None else w for w in warm],
            "adaptive_tok_per_ms": round(adaptive, 4), "best_fixed": best,
            "x_best_fixed": round(adaptive / fixed[best], 4),
            "fixed_tok_per_ms": {w: round(v, 4) for w, v in fixed.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="dflash-published",
                    help="a named profile or P1,P2,... (bench's --simulate-accept-profile; "
                         "positions not given never accept)")
    ap.add_argument("--batch", default="1,4,16,64,128", help="batch sizes (with --cost-ms: one)")
    ap.add_argument("--cost-ms", default=None, help="step ms at widths 1..W (default: H200 table)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--phases", default=None, help="EVERY,LEN,SCALE: low-acceptance phases")
    ap.add_argument("--blind-margin", type=float, default=None,
                    help="the chooser's blind_margin (default adaptive.BLIND_MARGIN; 0: off)")
    ap.add_argument("--tie-margin", type=float, default=None,
                    help="the chooser's tie_margin (default adaptive.TIE_MARGIN; 0: off)")
    ap.add_argument("--finish-together", type=int, default=None, metavar="TOKENS",
                    help="score batches of TOKENS-token requests that start together and are "
                         "not replaced (the bench's batch, its tail included) instead")
    ap.add_argument("--device-table", choices=tuple(DEVICE_TABLES), default="h200",
                    help="the step tables of --finish-together and of the default --cost-ms")
    ap.add_argument("--warm", default="", help="W1,W2,...: unscored runs first on the chooser, "
                    "pinned to each width, 'a' the chooser's own (the bench: its --fixed-widths, "
                    "then the adaptive row's warm-up run); a batch each with --finish-together, "
                    "else steps / 2 each")
    args = ap.parse_args()
    chooser_kw = {k: v for k, v in (("blind_margin", args.blind_margin),
                                    ("tie_margin", args.tie_margin)) if v is not None}
    phases = None
    if args.phases:
        every, length, scale = args.phases.split(",")
        phases = (int(every), int(length), float(scale))
    batches = [int(b) for b in args.batch.split(",")]
    tables = DEVICE_TABLES[args.device_table]
    warm = tuple(None if w == "a" else int(w) for w in args.warm.split(",") if w)
    if args.finish_together:
        for b in batches:
            print(json.dumps(score_finish_together(args.profile, b, tables, args.finish_together,
                                                   args.seeds, chooser_kw, warm)))
        return
    for b in batches:
        table = [float(v) for v in args.cost_ms.split(",")] if args.cost_ms else tables[b]
        probs = list(parse_profile(args.profile)[1]) + [0.0] * len(table)
        profile = probs[:len(table) - 1]
        runs = [simulate(profile, b, table, args.steps, seed=s, warm=warm,
                         phases=phases, chooser_kw=chooser_kw)
                for s in range(args.seeds)]
        mean = sum(r["x_best_fixed"] for r in runs) / len(runs)
        print(json.dumps({**runs[0], "x_best_fixed_mean": round(mean, 4),
                          "x_best_fixed_min": min(r["x_best_fixed"] for r in runs),
                          "profile": args.profile, "chooser_kw": chooser_kw}))


if __name__ == "__main__":
    main()
