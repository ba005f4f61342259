"""The W4A16 kernel's tuned launch configs: one per problem class, read from a JSON table.

Decode calls move only a few MB each, so their time is set by the launch config (tile,
split-K, warps, stages) rather than by bandwidth, and the best config differs per problem
class; an H200 sweep (``scripts/bench_w4a16_decode.py --write-table``) stores one per class
in ``w4a16_tuned.json`` beside this file. ``kernels/w4a16.py`` lays the entry of a call's class
(``tuned_config``) over its built-in defaults. Entries are validated when the table is read,
so a malformed one fails before any launch, naming the file and the key.
"""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

TUNED_PATH = Path(__file__).with_name("w4a16_tuned.json")
TUNED_ENV = "BLOCKSPEC_W4A16_TUNED"  # another table's path, or "none" for built-ins only
TUNED_KEYS = ("block_n", "block_k", "k_slices", "split_k", "num_warps", "num_stages", "maxnreg")
# Upper edges of the row buckets (dense: rows of x) and of the block-count buckets (grouped:
# row blocks in the table, one per (token, expert) pair at decode); doubling past the last.
ROW_EDGES = (1, 4, 8, 16, 32, 64)
BLOCK_EDGES = (8, 32, 64)
_KEY_RE = {"dense": re.compile(r"dense N=\d+ K=\d+ rows=(\d+(?:-\d+)?)"),
           "grouped": re.compile(r"grouped N=\d+ K=\d+ block_m=\d+ blocks=(\d+(?:-\d+)?)")}


class TunedTableError(ValueError):
    """The tuned-config table is unreadable or one of its entries is malformed."""


def bucket(value: int, edges: tuple[int, ...]) -> str:
    """Label of the bucket holding ``value`` (>= 1): ``"lo-hi"``, or ``"n"`` for one value."""
    lo, hi, i = 1, edges[0], 0
    while value > hi:
        i += 1
        lo, hi = hi + 1, edges[i] if i < len(edges) else hi * 2
    return str(lo) if lo == hi else f"{lo}-{hi}"


def problem_key(n: int, k: int, m: int, blocks: int | None = None) -> str:
    """Table key of a v2 call: dense by the rows ``m`` of x, grouped (``blocks`` given) by its
    rows per block ``m`` and the bucket of its row-block count."""
    if blocks is None:
        return f"dense N={n} K={k} rows={bucket(m, ROW_EDGES)}"
    return f"grouped N={n} K={k} block_m={m} blocks={bucket(blocks, BLOCK_EDGES)}"


def check_v2_tile(block_n: int, block_k: int, k_slices: int) -> None:
    """Raise ValueError for a tile the v2 kernel cannot run: ``tl.arange`` needs powers of
    two, the x/W words need ``block_k % 64 == 0``, the batched dot ``k_slices`` in 1, 2, 4."""
    ok = (block_n >= 16 and block_n & (block_n - 1) == 0 and block_k >= 64
          and block_k & (block_k - 1) == 0 and k_slices in (1, 2, 4))
    if not ok:
        raise ValueError(f"v2 needs block_k a power of two >= 64, block_n a power of two >= 16 "
                         f"and k_slices in (1, 2, 4) (got {block_k}, {block_n}, {k_slices})")


def _check_key(key: str) -> None:
    kind = key.split(" ", 1)[0]
    match = _KEY_RE[kind].fullmatch(key) if kind in _KEY_RE else None
    if match is None:
        raise ValueError("expected 'dense N=<n> K=<k> rows=<bucket>' or "
                         "'grouped N=<n> K=<k> block_m=<m> blocks=<bucket>'")
    label = match.group(1)
    want = bucket(int(label.split("-")[0]), ROW_EDGES if kind == "dense" else BLOCK_EDGES)
    if label != want:  # a key no call can produce would silently never match
        raise ValueError(f"bucket {label!r} is not one of the buckets (the one holding "
                         f"{label.split('-')[0]} is {want!r})")


def _check_entry(cfg: object) -> dict:
    if not isinstance(cfg, dict):
        raise ValueError(f"expected an object of {TUNED_KEYS}, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - set(TUNED_KEYS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; allowed: {TUNED_KEYS}")
    for name, value in cfg.items():
        if value is None and name in ("split_k", "maxnreg"):  # auto / the compiler's choice
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if cfg.get("maxnreg") is not None and not 24 <= cfg["maxnreg"] <= 255:
        raise ValueError(f"maxnreg must be in [24, 255] (registers per thread), got "
                         f"{cfg['maxnreg']}")
    warps = cfg.get("num_warps", 4)
    if warps & (warps - 1) or warps > 32:
        raise ValueError(f"num_warps must be a power of two <= 32, got {warps}")
    check_v2_tile(cfg.get("block_n", 16), cfg.get("block_k", 64), cfg.get("k_slices", 1))
    return dict(cfg)


def parse_tuned_table(data: object, source: str) -> dict[str, dict]:
    """Validated ``configs`` of a table (``{"configs": {key: {option: value}}, ...}``; other
    top-level fields are notes).  Errors name ``source`` and the entry's key."""
    if not isinstance(data, dict) or not isinstance(data.get("configs"), dict):
        raise TunedTableError(f"{source}: expected a JSON object with a 'configs' object")
    table = {}
    for key, cfg in data["configs"].items():
        try:
            _check_key(key)
            table[key] = _check_entry(cfg)
        except ValueError as e:
            raise TunedTableError(f"{source}: entry {key!r}: {e}") from None
    return table


@functools.lru_cache(maxsize=8)
def _read_tuned(path: str, required: bool) -> dict[str, dict]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        if required:
            raise TunedTableError(f"{path}: no such tuned-config table ({TUNED_ENV})") from None
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TunedTableError(f"{path}: not valid JSON: {e}") from None
    return parse_tuned_table(data, path)


def tuned_table() -> dict[str, dict]:
    """The tuned configs in force, read once per path: ``$BLOCKSPEC_W4A16_TUNED`` if set (a
    path, or ``none``), else the packaged ``w4a16_tuned.json`` (a missing one counts as empty)."""
    env = os.environ.get(TUNED_ENV, "")
    if env.lower() == "none":
        return {}
    return _read_tuned(env or str(TUNED_PATH), bool(env))


def tuned_config(n: int, k: int, m: int, blocks: int | None = None) -> dict:
    """The tuned entry for the call's class (``problem_key``), or {} where the table has none."""
    return dict(tuned_table().get(problem_key(n, k, m, blocks), {}))

