"""GSM8K answer extraction, as the GSM8K evaluation scripts do it.

Gold: the number after ``####`` in the reference answer.  Prediction: the number after the
first ``####`` in the model output ("strict match"); without one, the last number in the
output ("flexible extract").  Numbers lose thousands separators, a leading ``$`` and a
trailing ``.``; two answers are equal when they are the same number (``72`` == ``72.0``).
"""
from __future__ import annotations

import re

_HASH_RE = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
_NUM_RE = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def _clean(num: str) -> str:
    return num.replace(",", "").rstrip(".")


def gold_answer(answer: str) -> str | None:
    """The reference value of a GSM8K ``answer`` field (``#### N``), or None."""
    m = _HASH_RE.search(answer)
    if m:
        return _clean(m.group(1))
    nums = _NUM_RE.findall(answer)
    return _clean(nums[-1]) if nums else None


def extract_answer(text: str) -> str | None:
    """The value a model output commits to, or None when it has no number."""
    m = _HASH_RE.search(text)
    if m:
        return _clean(m.group(1))
    nums = _NUM_RE.findall(text)
    return _clean(nums[-1]) if nums else None


def same_number(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return a == b
