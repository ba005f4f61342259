"""Seeded GSM8K-format problem generator with train/test splits disjoint by construction.

A question belongs to the test split iff a hash of its text says so (``is_test_question``), and
each split's generator keeps only its own questions: no question can ever be in both, whatever
the seeds or sizes.  Output rows are ``{"question", "answer"}`` with GSM8K's answer layout:
reasoning lines with ``<<a*b=c>>`` annotations, then ``#### N``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from blockspec.gsm8k_data.templates import TEMPLATES, Draw, Reject

TEST_PERCENT = 5          # share of the question space that belongs to the test split
SPLITS = ("train", "test")
MAX_TRIES = 1000


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str           # reasoning lines + "#### N"
    value: int            # N
    template: str

    def to_json(self) -> dict:
        return {"question": self.question, "answer": self.answer}


def is_test_question(question: str) -> bool:
    digest = hashlib.sha256(question.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < TEST_PERCENT


def make_problem(rng: random.Random) -> Problem:
    """One problem from a uniformly chosen template (redrawing numbers that break the rules)."""
    template = rng.choice(TEMPLATES)
    for _ in range(MAX_TRIES):
        d = Draw(rng)
        try:
            question, value = template(d)
        except Reject:
            continue
        answer = "\n".join(d.lines) + f"\n#### {value}"
        return Problem(question, answer, value, template.__name__)
    raise RuntimeError(f"template {template.__name__} rejected {MAX_TRIES} draws in a row")


def iter_split(split: str, seed: int) -> Iterator[Problem]:
    """Endless distinct problems of one split, deterministic in (split, seed)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"{split}:{seed}")
    want_test = split == "test"
    seen: set[str] = set()
    while True:
        p = make_problem(rng)
        if is_test_question(p.question) != want_test or p.question in seen:
            continue
        seen.add(p.question)
        yield p


def generate_split(split: str, n: int, seed: int = 0) -> list[Problem]:
    it = iter_split(split, seed)
    return [next(it) for _ in range(n)]


def write_jsonl(problems: list[Problem] | list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps(p.to_json() if isinstance(p, Problem) else p) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    """GSM8K-format rows; each must have ``question`` and ``answer`` (named in the error)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e})") from None
            if not isinstance(row, dict) or "question" not in row or "answer" not in row:
                raise ValueError(f"{path}:{i}: a GSM8K row needs 'question' and 'answer' fields")
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blockspec.gsm8k_data.generator",
                                 description="write GSM8K-format demo train/test jsonl files")
    ap.add_argument("--out", required=True, help="output folder (train.jsonl, test.jsonl)")
    ap.add_argument("--train", type=int, default=200_000, help="train problems")
    ap.add_argument("--test", type=int, default=500, help="test problems")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    out = Path(ns.out)
    write_jsonl(generate_split("train", ns.train, ns.seed), out / "train.jsonl")
    write_jsonl(generate_split("test", ns.test, ns.seed), out / "test.jsonl")
    print(f"wrote {ns.train} train and {ns.test} test problems to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
