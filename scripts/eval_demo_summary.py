"""Summary of ``scripts/eval_demo_cpu.sh``'s runs: accuracy, accept length and per-position
acceptance per run, answers compared question for question with the run's own target alone
(``target`` or ``target_mixed``), and a PNG of accept length against verify width for DFlash
and DSpark.

    python3 scripts/eval_demo_summary.py eval_out [widths.png]
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def main(out: Path, png: Path | None) -> None:
    def preds(name: str) -> list:
        return [json.loads(ln)["pred"] for ln in (out / f"{name}.jsonl").read_text().splitlines()]

    base = {"target": preds("target"), "target_mixed": preds("target_mixed")}
    print(f"{'run':22s} {'acc':>6s} {'wall s':>7s} {'same answers as':>22s} {'width':>5s} "
          f"{'accept':>6s}  per-position acceptance")
    runs = {}
    for f in sorted(out.glob("*.json")):
        name = f.stem
        r = json.loads(f.read_text())
        runs[name] = r
        ref = "target_mixed" if "mixed" in name else "target"
        p = preds(name)
        same = sum(a == b for a, b in zip(p, base[ref]))          # bs1_*: a prefix
        width = len(r["accept_histogram"]) or "-"
        pp = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"])
        print(f"{name:22s} {r['accuracy']:6.3f} {r['wall_s']:7.1f} {f'{ref} {same}/{len(p)}':>22s} "
              f"{width!s:>5s} {r['accept_length']:6.3f}  {pp}")
    if png is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for algo, color, dy in (("dflash", "#4c72b0", -13), ("dspark", "#c44e52", 6)):
        pts = sorted((len(r["accept_histogram"]), r["accept_length"]) for n, r in runs.items()
                     if re.fullmatch(rf"{algo}(_w\d+)?", n))
        ax.plot([w for w, _ in pts], [a for _, a in pts], "o-", color=color,
                label=f"{algo} (trained at width 8)")
        for w, a in pts:
            ax.annotate(f"{a:.2f}", (w, a), textcoords="offset points", xytext=(0, dy),
                        ha="center", fontsize=8, color=color)
    widths = sorted({len(r["accept_histogram"]) for r in runs.values() if r["accept_histogram"]})
    ax.plot(widths, widths, ":", color="gray", label="every draft accepted")
    ax.plot(widths, [w / 2 for w in widths], "--", color="gray", label="0.5 x verify width")
    ax.set_xlabel("verify width (anchor + drafts)")
    ax.set_ylabel("accept length (tokens per verify)")
    ax.set_xticks(widths)
    n = runs["dflash"]["num_questions"]
    ax.set_title(f"demo family, CPU fp32 greedy, {n} questions")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    print(f"wrote {png}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
