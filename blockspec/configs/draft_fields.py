"""Lookup helpers every draft-config family shares: a checkpoint family keeps a field in one of
several places (``dflash_config``, ``dspark_config``, ``text_config``, the top level), so a
lookup is an ordered list of (mapping, key) candidates, and a missing field is ``MISSING``
rather than ``None`` (``null`` in a config means "not set" too)."""
from __future__ import annotations

from typing import Any, Mapping

MISSING = object()


class DraftConfigError(ValueError):
    """A draft checkpoint's config (or its pairing with a target) cannot be served."""


def sub(d: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``d[key]`` when it is a mapping, else an empty one."""
    v = d.get(key)
    return v if isinstance(v, Mapping) else {}


def first(*candidates: tuple[Mapping[str, Any], str]) -> Any:
    """Value of the first (mapping, key) pair whose key is present and not None."""
    for m, k in candidates:
        if k in m and m[k] is not None:
            return m[k]
    return MISSING


def dflash_then_top(d: Mapping[str, Any], key: str) -> Any:
    return first((sub(d, "dflash_config"), key), (d, key))


def dspark_lookup(d: Mapping[str, Any], key: str, prefixed: str | None = None) -> Any:
    """DSpark's order: ``dspark_<key>`` > ``dspark_config.<key>`` > ``text_config.<key>`` > top
    level > ``dflash_config.<key>``."""
    return first((d, prefixed or f"dspark_{key}"), (sub(d, "dspark_config"), key),
                 (sub(d, "text_config"), key), (d, key), (sub(d, "dflash_config"), key))


def positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value \
            or int(value) <= 0:
        raise DraftConfigError(f"draft config: {what} must be a positive integer, got {value!r}")
    return int(value)


def as_int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise DraftConfigError(f"draft config: {what} must be a list of integers, got {value!r}")
    return [int(v) for v in value]
