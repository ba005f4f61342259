"""Loaders for the blockspec lm-eval tasks: read the JSONL next to this file (no hub access)."""
import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _load(name: str) -> datasets.DatasetDict:
    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_arith_mc(**kwargs) -> datasets.DatasetDict:
    return _load("arith_mc.jsonl")


def load_gsm8k_demo20(**kwargs) -> datasets.DatasetDict:
    return _load("gsm8k_demo20.jsonl")


def arith_choices(doc: dict) -> list[str]:
    """Each choice closes the calculator annotation ("22>>"), so no choice ("2") is scored as a
    prefix of another ("22")."""
    return [c + ">>" for c in doc["choices"]]
