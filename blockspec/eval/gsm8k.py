"""``blockspec eval gsm8k``: accuracy and speculative-decoding statistics on GSM8K-format data.

Any jsonl with ``question`` / ``answer`` rows works (the real GSM8K test set included); without
``--data`` the demo family's shipped test split is used.  Prompts go through the tokenizer's
chat template when it has one.  Decoding is greedy by default, so Normal, DFlash and DSpark
runs of one target must agree answer for answer (speculation is lossless); ``--save-outputs``
writes every output to compare them.

Reported: accuracy, mean accept length (tokens committed per verify, bonus included),
per-position acceptance (share of verifies whose draft i was accepted), the accept-length
histogram, verify count, completion tokens and output tok/s (generation wall time only).
``--plot`` draws the accept-length distribution and per-position acceptance (matplotlib);
``--json`` prints one JSON object on the last line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from tqdm import tqdm

from blockspec.args import EngineArgs
from blockspec.gsm8k_data.generator import read_jsonl
from blockspec.eval.answers import extract_answer, gold_answer, same_number
from blockspec.flags import engine_flags

DEFAULT_DATA = Path(__file__).resolve().parent.parent / "gsm8k_data" / "gsm8k_demo_test.jsonl"


@dataclass
class GSM8KResult:
    num_questions: int
    correct: int
    accuracy: float
    completion_tokens: int
    wall_s: float
    output_throughput: float
    verify_ct: int = 0
    accept_length: float = 0.0
    accept_histogram: list[int] = field(default_factory=list)
    per_position_acceptance: list[float] = field(default_factory=list)
    speculative_algorithm: str | None = None
    model_path: str | None = None
    draft_model_path: str | None = None
    predictions: list[str | None] = field(default_factory=list, repr=False)


def acceptance_stats(histogram: list[int]) -> tuple[int, float, list[float]]:
    """(verify count, mean accept length, per-position acceptance) of a summed histogram whose
    index a counts verifies that accepted a drafts (a + 1 tokens committed)."""
    verify = sum(histogram)
    if not verify:
        return 0, 0.0, []
    committed = sum((a + 1) * n for a, n in enumerate(histogram))
    per_pos = [sum(histogram[i + 1:]) / verify for i in range(len(histogram) - 1)]
    return verify, committed / verify, per_pos


def build_prompt(tokenizer, question: str) -> str:
    if tokenizer is not None and tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return question + "\n"


def run_gsm8k(engine, rows: list[dict], batch_size: int = 16, max_new_tokens: int = 256,
              temperature: float = 0.0, progress: bool = True,
              outputs: list[dict] | None = None) -> GSM8KResult:
    """Generate an answer for every row with ``engine`` and score it."""
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    correct = tokens = 0
    hist: list[int] = []
    preds: list[str | None] = []
    wall = 0.0
    bar = tqdm(total=len(rows), desc="gsm8k", unit="q", disable=not progress)
    for b0 in range(0, len(rows), batch_size):
        batch = rows[b0:b0 + batch_size]
        prompts = [build_prompt(engine.tokenizer, r["question"]) for r in batch]
        t0 = time.perf_counter()
        outs = engine.generate(prompt=prompts, sampling_params=params)
        wall += time.perf_counter() - t0
        for r, o in zip(batch, outs):
            pred, gold = extract_answer(o["text"]), gold_answer(r["answer"])
            ok = same_number(pred, gold)
            correct += ok
            preds.append(pred)
            m = o["meta_info"]
            tokens += m["completion_tokens"]
            h = m.get("spec_accept_histogram") or []
            hist += [0] * (len(h) - len(hist))
            for i, n in enumerate(h):
                hist[i] += n
            if outputs is not None:
                outputs.append({"question": r["question"], "gold": gold, "pred": pred,
                                "correct": ok, "output": o["text"]})
        bar.update(len(batch))
        bar.set_postfix(acc=f"{correct / len(preds):.3f}")
    bar.close()
    verify, accept_len, per_pos = acceptance_stats(hist)
    n = len(rows)
    return GSM8KResult(num_questions=n, correct=correct, accuracy=correct / n if n else 0.0,
                       completion_tokens=tokens, wall_s=wall,
                       output_throughput=tokens / wall if wall else 0.0, verify_ct=verify,
                       accept_length=accept_len, accept_histogram=hist,
                       per_position_acceptance=per_pos, predictions=preds)


def plot_acceptance(result: GSM8KResult, path: str | Path, title: str | None = None) -> Path:
    """Two panels: the accept-length distribution and the per-position acceptance."""
    try:
        import matplotlib  # lazy: an optional dependency (the plot extra)
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'blockspec[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after matplotlib.use('Agg')

    hist = result.accept_histogram
    if not hist:
        raise ValueError("--plot needs speculative decoding (no accept lengths were recorded)")
    total = sum(hist)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    lengths = list(range(1, len(hist) + 1))
    ax1.bar(lengths, [n / total for n in hist], color="#4c72b0")
    ax1.axvline(result.accept_length, color="#c44e52", linestyle="--",
                label=f"mean {result.accept_length:.2f}")
    ax1.set_xlabel("tokens committed per verify (accept length)")
    ax1.set_ylabel("share of verifies")
    ax1.set_xticks(lengths)
    ax1.legend()
    positions = list(range(1, len(hist)))
    ax2.bar(positions, result.per_position_acceptance, color="#55a868")
    ax2.set_ylim(0, 1)
    ax2.set_xticks(positions)
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("acceptance rate")
    draft = f" (draft {Path(result.draft_model_path).name})" if result.draft_model_path else ""
    width = f", verify width {len(hist)}"
    fig.suptitle(title or (f"{result.speculative_algorithm}{draft}: accuracy {result.accuracy:.3f}, "
                           f"accept length {result.accept_length:.2f}{width}, "
                           f"{result.num_questions} questions"))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- CLI ----------------------------------------------------------------------------------

def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("eval", help="evaluations (gsm8k)")
    tasks = p.add_subparsers(dest="task", required=True)
    g = tasks.add_parser("gsm8k", help="GSM8K-format accuracy + speculative statistics")
    g.add_argument("--data", help=f"GSM8K-format jsonl (default: the demo test split, "
                                  f"{DEFAULT_DATA.name})")
    g.add_argument("--num-questions", type=int, help="first N questions (default: all)")
    g.add_argument("--batch-size", type=int, default=16, help="prompts generated together")
    g.add_argument("--max-new-tokens", type=int, default=256, help="most tokens per answer")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy")
    g.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    g.add_argument("--plot", help="write a PNG of the accept-length distribution and "
                                  "per-position acceptance")
    g.add_argument("--save-outputs", help="write every question, prediction and output as jsonl")
    engine_flags(g, skip=("max_running_requests",))
    g.set_defaults(handler=main)
    return p


def main(ns: argparse.Namespace) -> int:
    from blockspec.engine import Engine  # lazy: torch loads only when the command runs

    data = Path(ns.data) if ns.data else DEFAULT_DATA
    if not data.is_file():
        raise ValueError(f"--data {data}: no such file")
    rows = read_jsonl(data)
    if ns.num_questions is not None:
        if ns.num_questions < 1:
            raise ValueError(f"--num-questions must be >= 1, got {ns.num_questions}")
        rows = rows[: ns.num_questions]
    if ns.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {ns.batch_size}")
    kwargs = {f.name: getattr(ns, f.name) for f in fields(EngineArgs)
              if f.name not in ("extra", "max_running_requests") and hasattr(ns, f.name)}
    engine = Engine(max_running_requests=ns.batch_size, **kwargs)
    outputs: list[dict] | None = [] if ns.save_outputs else None
    try:
        res = run_gsm8k(engine, rows, ns.batch_size, ns.max_new_tokens, ns.temperature,
                        progress=sys.stderr.isatty(), outputs=outputs)
    finally:
        engine.shutdown()
    res.speculative_algorithm = engine.args.speculative_algorithm
    res.model_path = engine.args.model_path
    res.draft_model_path = engine.args.speculative_draft_model_path
    if outputs is not None:
        with open(ns.save_outputs, "w", encoding="utf-8") as f:
            for o in outputs:
                f.write(json.dumps(o) + "\n")
    if ns.plot:
        plot_acceptance(res, ns.plot)
    print(f"gsm8k: {res.num_questions} questions from {data.name}: accuracy {res.accuracy:.4f} "
          f"({res.correct}/{res.num_questions}); {res.completion_tokens} completion tokens, "
          f"{res.output_throughput:.1f} tok/s")
    if res.verify_ct:
        print(f"{res.speculative_algorithm}: accept length {res.accept_length:.3f} over "
              f"{res.verify_ct} verifies; per-position acceptance "
              + " ".join(f"{x:.2f}" for x in res.per_position_acceptance))
    if ns.json:
        d = asdict(res)
        d.pop("predictions")
        print(json.dumps(d))
    return 0
