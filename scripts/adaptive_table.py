"""Adaptive verify width against the fixed widths and AR, from ``blockspec bench`` JSON lines.

    python scripts/adaptive_table.py AR.jsonl SPEC.jsonl [SPEC.jsonl ...]

AR.jsonl: rows of a plain (no draft) run; SPEC.jsonl: rows of an adaptive run with
``--fixed-widths`` (one row per pinned width, then the adaptive row, per batch size). Rates
are ``expected_decode_tok_per_s`` where the row has it (the profile's mean at the widths run,
so coin noise does not decide the ranking), else ``decode_tok_per_s``; the realised rate of the
adaptive row is shown beside it.

A row is flagged when the adaptive row's live step time at the width it ran most differs from
that width's pinned step by more than ``DRIFT`` (a batch's step cost follows what its rows
commit, through MoE routing; an adaptive row whose exploration committed other tokens is then
not comparable with its pinned rows), and when the AR row committed other text than the
speculative rows (``simulated_text``: run AR with ``--simulate-text``).
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict


def rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().startswith("{")]


DRIFT = 0.10


def rate(r: dict) -> float:
    return r.get("expected_decode_tok_per_s") or r["decode_tok_per_s"]


def spread(r: dict) -> str:
    """A row's verify steps per request, mean/max (the batch waits for its slowest request)."""
    m = r.get("verify_steps_mean")
    return f" ({m:g}/{r['verify_steps_max']})" if m is not None else ""


def drift(ad: dict, runs: dict) -> str | None:
    """A warning when the adaptive row's live step at its most-run width is more than
    ``DRIFT`` away from that width's pinned step (None when comparable or not measured). The
    pinned step is the pinned row's own live entry where it has one: both are then full-batch
    device times, while a row's ``step_ms`` also averages the cheaper steps of a batch whose
    requests have begun to finish."""
    hist, live = ad.get("width_histogram"), ad.get("cost_ms_by_width")
    if not hist or not live or not any(hist):
        return None
    w = max(range(len(hist)), key=hist.__getitem__) + 1
    row = runs.get(w, {})
    own = row.get("cost_ms_by_width") or []
    pinned = own[w - 1] if len(own) >= w else row.get("step_ms")
    if not pinned or w > len(live):
        return None
    off = live[w - 1] / pinned - 1.0
    if abs(off) <= DRIFT:
        return None
    return (f"  not comparable: the adaptive row's width-{w} steps took {live[w - 1]:g} ms, "
            f"{off:+.0%} against {pinned:g} ms pinned (its committed tokens route differently)")


def text_mismatch(ar_row: dict | None, ad: dict) -> str | None:
    """A warning when the AR row committed other text than the speculative rows (the model's
    own argmax against the bench's simulated text: their MoE routing differs)."""
    if ar_row is None or bool(ar_row.get("simulated_text")) == bool(ad.get("simulated_text")):
        return None
    which = "the simulated" if ar_row.get("simulated_text") else "the model's own"
    return (f"  x AR not comparable: the AR row committed {which} text, the speculative rows "
            f"the other (run both with the same --simulate-text)")


def main(argv: list[str]) -> int:
    ar = {r["batch_size"]: r for r in rows(argv[0]) if r.get("speculative") is None}
    for path in argv[1:]:
        by_batch: dict[int, dict] = defaultdict(dict)
        label = None
        for r in rows(path):
            if r.get("speculative") is None:      # an AR row logged beside the run
                continue
            by_batch[r["batch_size"]][r.get("pinned_width")] = r
            label = label or (r.get("simulated_accept_profile"), r.get("speculative"))
        print(f"{path}: {label}")
        print("batch | AR tok/s | best fixed (w) | adaptive: tok/s (realised) mean width | "
              "x best fixed | x AR | fixed widths tok/s (verify steps a request: mean/max)")
        for b, runs in sorted(by_batch.items()):
            fixed = {w: rate(r) for w, r in runs.items() if w is not None}
            ad = runs.get(None)
            if not fixed or ad is None:
                continue
            best = max(fixed, key=fixed.get)
            a = ar.get(b, {}).get("decode_tok_per_s")
            print(f"{b} | {a or '-'} | {fixed[best]:.0f} (w{best}) | {rate(ad):.0f} "
                  f"({ad['decode_tok_per_s']:.0f}) {ad.get('mean_verify_width')} | "
                  f"{rate(ad) / fixed[best]:.3f} | {rate(ad) / a if a else float('nan'):.3f} | "
                  + " ".join(f"w{w}:{v:.0f}{spread(runs[w])}" for w, v in sorted(fixed.items()))
                  + f" | adaptive{spread(ad)}")
            for warning in (drift(ad, runs), text_mismatch(ar.get(b), ad)):
                if warning:
                    print(warning)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
