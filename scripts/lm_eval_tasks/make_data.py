"""Writes the two local data files of the blockspec lm-eval tasks (stdlib only, deterministic).

  arith_mc.jsonl     50 grade-school arithmetic items, 4 numeric choices each (loglikelihood).
                     The context is a one-step word problem plus the start of its worked answer
                     in the GSM8K calculator style ("Mia has 23+48 = <<23+48="); the choices are
                     candidate results (the true one and 3 near misses), each scored with the
                     closing ">>" ("71>>", utils.arith_choices).
  gsm8k_demo20.jsonl the first 20 rows of blockspec's shipped GSM8K-style test split
                     (blockspec/gsm8k_data/gsm8k_demo_test.jsonl, what `blockspec eval gsm8k`
                     uses), copied verbatim (generate_until).

Run: python3 scripts/lm_eval_tasks/make_data.py
"""
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPLIT = HERE.parent.parent / "blockspec" / "gsm8k_data" / "gsm8k_demo_test.jsonl"
NAMES = [("Mia", "she"), ("Liam", "he"), ("Nora", "she"), ("Omar", "he"), ("Ava", "she"),
         ("Lucas", "he"), ("Emma", "she"), ("Diego", "he")]
ITEMS = ["apples", "stickers", "marbles", "pencils", "cookies", "books", "shells", "cards"]


def item(rng: random.Random, i: int) -> dict:
    name, he = rng.choice(NAMES)
    things = rng.choice(ITEMS)
    kind = i % 4
    if kind == 0:
        a, b = rng.randint(12, 480), rng.randint(12, 480)
        q = f"{name} has {a} {things}. {he.capitalize()} gets {b} more. How many {things} does {name} have now?"
        step, ans = f"{name} has {a}+{b} = <<{a}+{b}=", a + b
    elif kind == 1:
        a = rng.randint(60, 900)
        b = rng.randint(11, a - 10)
        q = f"{name} has {a} {things}. {he.capitalize()} gives away {b} of them. How many {things} are left?"
        step, ans = f"There are {a}-{b} = <<{a}-{b}=", a - b
    elif kind == 2:
        a, b = rng.randint(11, 99), rng.randint(2, 12)
        q = f"A box holds {a} {things}. {name} buys {b} boxes. How many {things} does {he} have?"
        step, ans = f"{name} has {a}*{b} = <<{a}*{b}=", a * b
    else:
        b, ans = rng.randint(2, 12), rng.randint(3, 60)
        a = b * ans
        q = f"{name} has {a} {things}. {he.capitalize()} shares them equally among {b} friends. How many {things} does each friend get?"
        step = f"Each friend gets {a}/{b} = <<{a}/{b}="
    wrong = set()
    for d in rng.sample([-10, -2, -1, 1, 2, 10, 20, -20], 8):
        if len(wrong) == 3:
            break
        if ans + d > 0:
            wrong.add(ans + d)
    choices = [ans, *sorted(wrong)]
    rng.shuffle(choices)
    return {"question": q, "context": q + "\n" + step,
            "choices": [str(c) for c in choices], "label": choices.index(ans)}


def main() -> None:
    rng = random.Random(20260601)
    rows = [item(rng, i) for i in range(50)]
    with open(HERE / "arith_mc.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    lines = SPLIT.read_text().splitlines()[:20]
    (HERE / "gsm8k_demo20.jsonl").write_text("\n".join(lines) + "\n")
    print(f"wrote {len(rows)} rows to arith_mc.jsonl, {len(lines)} to gsm8k_demo20.jsonl")


if __name__ == "__main__":
    main()
