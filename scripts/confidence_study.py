"""What predicts a draft position's acceptance: the acceptance EWMA, the draft's confidence of
an earlier step, or the draft's confidence of this step?

Runs a demo-family draft on the shipped GSM8K test split (CPU, fp32, greedy, batch 1, verify
width 8) and records, per verify, the draft's probability of each proposal (softmax of the
logits it drafted from: DFlash's base logits, DSpark's Markov-corrected ones) and the drafts
accepted. Then, per draft position reached (label: accepted or not):

* Brier scores of the predictors the width chooser could use: the per-position rate of the
  whole run (a constant fitted on the data itself), the request's acceptance EWMA one and two
  steps old (``speculative/adaptive.py``'s rows; launch-ahead decides from two steps old),
  the confidence one and two steps old, and this step's confidence;
* the tokens per ms of every fixed width, of the EWMA choice (two steps old) and of a choice
  made after the draft from this step's confidences (survival = product of the confidences),
  under a step-time table (default: one H200, quantized Lightning, published-size DFlash
  draft, batch 1, docs/benchmarks.md) plus ``--extra-ms`` per step for the read-back between
  draft and verify. Each verify is scored on its own (the text after it is the same at any
  width: verification is lossless).

    python scripts/confidence_study.py --member dflash_nvfp4 --questions 100
"""
from __future__ import annotations

import argparse
import json

import torch

import blockspec
from blockspec.demo_family import member_path
from blockspec.eval.gsm8k import DEFAULT_DATA, build_prompt
from blockspec.gsm8k_data.generator import read_jsonl
from blockspec.models.dspark import run_markov_block
from blockspec.speculative.adaptive import PRIOR

H200_B1_MS = (2.406, 3.225, 3.491, 3.688, 3.739, 4.012, 4.13, 4.381)   # widths 1..8
ALPHA = 0.25


def record(member: str, questions: int) -> list[list[tuple[int, list[float]]]]:
    """Per question, per verify: (drafts accepted, the draft's probability of each proposal)."""
    algo = "DSPARK" if member.startswith("dspark") else "DFLASH"
    eng = blockspec.Engine(speculative_algorithm=algo, device="cpu", dtype="float32",
                           speculative_draft_model_path=str(member_path(member)),
                           speculative_num_draft_tokens=8)
    w, seen, steps = eng.drafter, {}, []
    draft_logits, finish = w.draft_logits, w._finish

    def logits_hook(h):
        seen["logits"] = draft_logits(h)
        return seen["logits"]

    def walk_hook(base, h, anchor, temperature, u=None, **kw):   # keep the corrected logits
        toks, q, seen["logits"] = run_markov_block(
            w.draft.markov_head, base, h, anchor, temperature, u, return_logits=True,
            greedy_only=kw.get("greedy_only", False), with_probs=kw.get("with_probs", True))
        return toks, q

    def finish_hook(inp, key, width, proposal, verified, bitmask=None):
        out = finish(inp, key, width, proposal, verified, bitmask)
        drafts = proposal[0]
        p = torch.softmax(seen["logits"][:, :drafts.shape[1]].float(), -1)
        conf = p.gather(-1, drafts[..., None])[..., 0]
        steps.extend((int(out[b, 0]), conf[b].tolist()) for b in range(drafts.shape[0]))
        return out

    w.draft_logits, w._finish = logits_hook, finish_hook
    if algo == "DSPARK":
        w.draft.markov_walk = walk_hook
    traces = []
    for row in read_jsonl(DEFAULT_DATA)[:questions]:
        steps.clear()
        eng.generate(prompt=build_prompt(eng.tokenizer, row["question"]),
                     sampling_params={"max_new_tokens": 256, "temperature": 0})
        traces.append(list(steps))
    eng.shutdown()
    return traces


def predictors(traces, gamma: int) -> dict:
    """Brier score of each predictor over every position reached (first two verifies of a
    request left out, so every lagged predictor exists)."""
    names = ("ewma_lag1", "ewma_lag2", "confidence_lag1", "confidence_lag2", "confidence_now")
    rows = []
    for steps in traces:
        ewma, past = [PRIOR] * gamma, []
        for t, (a, c) in enumerate(steps):
            past.append(list(ewma))              # past[t]: after the verifies before t
            for j in range(gamma):
                if a >= j and t >= 2:
                    rows.append((j, float(a > j), past[t][j], past[t - 1][j],
                                 steps[t - 1][1][j], steps[t - 2][1][j], c[j]))
            for j in range(min(a + 1, gamma)):
                ewma[j] += ALPHA * (float(a > j) - ewma[j])
    x = torch.tensor(rows, dtype=torch.float64)
    pos, y = x[:, 0].long(), x[:, 1]
    rate = torch.zeros(gamma, dtype=torch.float64).index_add_(0, pos, y)
    rate /= torch.bincount(pos, minlength=gamma).clamp_min(1)
    mean_conf = torch.zeros(gamma, dtype=torch.float64).index_add_(0, pos, x[:, 6])
    mean_conf /= torch.bincount(pos, minlength=gamma).clamp_min(1)
    brier = {"position_rate_of_the_run": float(((rate[pos] - y) ** 2).mean())}
    for i, name in enumerate(names):
        brier[name] = float(((x[:, 2 + i] - y) ** 2).mean())
    return {"positions_scored": len(rows), "rate_by_position": [round(v, 3) for v in rate.tolist()],
            "mean_confidence_by_position": [round(v, 3) for v in mean_conf.tolist()],
            "brier": {k: round(v, 4) for k, v in brier.items()}}


def throughput(traces, cost_ms: list[float], extra_ms: float) -> dict:
    """Tokens per ms of each width policy, every verify scored on its own."""
    steps = [s for tr in traces for s in tr]
    W = len(cost_ms)

    def tokens(a: int, w: int) -> int:
        return min(a, w - 1) + 1

    def best(p: list[float], extra: float) -> int:
        e, run, pick, score = 1.0, 1.0, 1, 1.0 / cost_ms[0]
        for w in range(2, W + 1):
            run *= p[w - 2]
            e += run
            if e / (cost_ms[w - 1] + extra) > score:
                pick, score = w, e / (cost_ms[w - 1] + extra)
        return pick

    out = {f"fixed_w{w}": sum(tokens(a, w) for a, _ in steps) / (cost_ms[w - 1] * len(steps))
           for w in range(1, W + 1)}
    tok = ms = 0.0
    for trace in traces:                       # the chooser's EWMA, two verifies old
        ewma, hist = [PRIOR] * (W - 1), []
        for a, _ in trace:
            hist.append(list(ewma))
            w = best(hist[-2] if len(hist) > 1 else hist[-1], 0.0)
            tok, ms = tok + tokens(a, w), ms + cost_ms[w - 1]
            for j in range(min(a + 1, W - 1)):
                ewma[j] += ALPHA * (float(a > j) - ewma[j])
    out["ewma_choice"] = tok / ms
    tok = ms = 0.0
    for a, c in steps:                         # after the draft, from its own confidences
        w = max(best(c, extra_ms), 2)   # the draft ran: width 2 at least
        tok, ms = tok + tokens(a, w), ms + cost_ms[w - 1] + extra_ms
    out["confidence_now_choice"] = tok / ms
    return {k: round(v, 4) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--member", default="dflash_nvfp4",
                    choices=("dflash", "dspark", "dflash_nvfp4", "dspark_nvfp4"))
    ap.add_argument("--questions", type=int, default=100)
    ap.add_argument("--cost-ms", default=",".join(map(str, H200_B1_MS)),
                    help="step ms at widths 1..8")
    ap.add_argument("--extra-ms", type=float, default=0.05)
    args = ap.parse_args()
    traces = record(args.member, args.questions)
    cost = [float(v) for v in args.cost_ms.split(",")]
    res = {"member": args.member, "questions": args.questions,
           "verifies": sum(len(t) for t in traces), **predictors(traces, len(cost) - 1),
           "tok_per_ms": throughput(traces, cost, args.extra_ms), "cost_ms": cost,
           "extra_ms": args.extra_ms}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
