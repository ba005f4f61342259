"""Large-M (prefill) launch configs of the W4A16 kernel: one small table, separate from decode's.

A prefill call multiplies thousands of rows by each decoded weight tile, so unlike decode
(few MB moved, time set by the launch) it is bound by the tensor cores and by the in-tile
decode, which costs ~3.3 instructions per weight whatever M is: only a tall row tile
(``block_m`` 64/128) and a wide weight tile (``block_n`` 128/256) amortize it over enough
multiply-adds. No split-K (thousands of tiles already fill the GPU); ``swap`` keeps the
decoded weights in registers as wgmma's A operand (x from shared memory); ``n_inner`` runs
a row block's N tiles next to each other, so an expert's rows are read from L2 once rather
than once per N tile (the routed x of a 2048-token chunk is larger than the L2); ``x_perm``
copies x with each K chunk in the decode's stream order, so the kernel loads x tiles straight
into shared memory instead of unpacking 64-bit words in registers (K a multiple of
``block_k``; else ignored). ``dequant`` leaves the kernel for cuBLAS on a dequantized copy of
the weights (``nvfp4_dequant.py``), where that measured faster (the tile keys then unused).

``PREFILL_TABLE`` is keyed by ``(kind, N, K, m_bucket)``: kind ``"dense"`` (``w4a16_linear``,
M = rows of x) or ``"grouped"`` (``grouped_w4a16``, M = (token, expert) rows of all experts),
``m_bucket`` from ``m_bucket``. ``scripts/tune_w4a16_prefill.py`` measures candidates on the
GPU and prints the entries to paste here; an M between measured buckets takes the nearest
one below (else above), a shape with none ``DEFAULT_PREFILL``.
The decode path never reads this table: a dense call takes it from ``DENSE_PREFILL_ROWS``
rows on (an N of ``WIDE_N`` or more, an output head, only where the table names its shape), a
grouped one from ``GROUPED_PREFILL_ROWS_PER_EXPERT`` rows per expert on.
"""
from __future__ import annotations

# Below these a call keeps the decode-era configs (w4a16_tuned.py and the built-ins).
DENSE_PREFILL_ROWS = 512
GROUPED_PREFILL_ROWS_PER_EXPERT = 48
WIDE_N = 8192  # dense N from which the decode-era built-ins stay unless the table names it
# Lower edges of the M buckets (a call's bucket is the largest edge <= M; smaller M -> first).
M_EDGES = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
PREFILL_KEYS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "swap", "n_inner",
                "x_perm", "dequant")

DEFAULT_PREFILL = {
    "dense": {"block_m": 128, "block_n": 128, "block_k": 128, "num_warps": 8,
              "num_stages": 3, "swap": True, "n_inner": False, "x_perm": False},
    "grouped": {"block_m": 128, "block_n": 128, "block_k": 128, "num_warps": 8,
                "num_stages": 3, "swap": True, "n_inner": True, "x_perm": False},
}

# (kind, N, K, m_bucket) -> config: Lightning's shapes (routed up/down, shared expert up/down),
# from the sweep on one H200 (scripts/tune_w4a16_prefill.py --tokens 2048 8192, then 8192 16384,
# then 16384 32768 with the dequant candidate; M = prompt tokens, grouped rows = 6 x tokens).
# An M between two entries takes the one below, so a config is listed only where it changes.
_G128 = {"block_m": 128, "block_n": 128, "block_k": 64, "swap": True, "n_inner": True}
PREFILL_TABLE: dict[tuple[str, int, int, int], dict] = {
    ("grouped", 2688, 1856, 8192): {**_G128, "num_warps": 8, "num_stages": 3, "x_perm": True},
    ("grouped", 2688, 1856, 32768): {**_G128, "num_warps": 4, "num_stages": 3, "x_perm": False},
    ("grouped", 2688, 1856, 65536): {"dequant": True},
    ("grouped", 1856, 2688, 8192): {"block_m": 128, "block_n": 256, "block_k": 128,
                                    "num_warps": 8, "num_stages": 3, "swap": True,
                                    "n_inner": True, "x_perm": True},
    ("dense", 2688, 3712, 2048): {"block_m": 128, "block_n": 128, "block_k": 128, "num_warps": 8,
                                  "num_stages": 3, "swap": True, "n_inner": False, "x_perm": False},
    ("dense", 2688, 3712, 8192): {"dequant": True},
    ("dense", 3712, 2688, 2048): {"block_m": 128, "block_n": 256, "block_k": 128, "num_warps": 8,
                                  "num_stages": 3, "swap": False, "n_inner": False,
                                  "x_perm": False},
    ("dense", 3712, 2688, 8192): {"dequant": True},
}


def m_bucket(m: int) -> int:
    """Bucket of M (rows): the largest ``M_EDGES`` entry <= m (the first for smaller m)."""
    label = M_EDGES[0]
    for edge in M_EDGES:
        if m >= edge:
            label = edge
    return label


def is_dense_prefill(m: int, n: int = 0, k: int = 0) -> bool:
    """``m`` rows are a prefill call; a wide N (an output head, which speculative decoding
    also runs at hundreds of rows) only where the table has an entry for its (N, K): the
    built-in tiles were tuned for it."""
    if m < DENSE_PREFILL_ROWS:
        return False
    return n < WIDE_N or any(key[:3] == ("dense", n, k) for key in PREFILL_TABLE)


def is_grouped_prefill(rows: int, experts: int) -> bool:
    """Enough rows per expert (on average) for the tall row tiles to be mostly full."""
    return rows >= GROUPED_PREFILL_ROWS_PER_EXPERT * max(1, experts)


def check_prefill_config(cfg: dict) -> dict:
    """``cfg`` validated (keys of ``PREFILL_KEYS``; tile sizes powers of two the kernel takes)."""
    unknown = sorted(set(cfg) - set(PREFILL_KEYS))
    if unknown:
        raise ValueError(f"prefill config: unknown option(s) {unknown}; allowed: {PREFILL_KEYS}")
    for name in ("block_m", "block_n", "block_k", "num_warps", "num_stages"):
        v = cfg.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"prefill config: {name} must be a positive integer, got {v!r}")
        if name != "num_stages" and v & (v - 1):
            raise ValueError(f"prefill config: {name} must be a power of two, got {v}")
    if cfg.get("block_k", 64) < 64 or cfg.get("block_n", 64) < 16 or cfg.get("block_m", 16) < 16:
        raise ValueError(f"prefill config: block_k >= 64, block_n >= 16, block_m >= 16 ({cfg})")
    if cfg.get("swap") and cfg.get("block_n", 64) % 64:
        raise ValueError(f"prefill config: swap (wgmma) needs block_n a multiple of 64 ({cfg})")
    if cfg.get("dequant") and cfg.get("x_perm"):
        raise ValueError(f"prefill config: dequant reads x in its own K order, not x_perm ({cfg})")
    return dict(cfg)


def _entry(kind: str, n: int, k: int, m: int) -> dict | None:
    """The table entry of the shape at M's bucket, else at the nearest measured bucket below
    it, else the nearest above (a sweep at a few M covers the ones between)."""
    measured = sorted(b for (kd, nn, kk, b) in PREFILL_TABLE if (kd, nn, kk) == (kind, n, k))
    if not measured:
        return None
    want = m_bucket(m)
    below = [b for b in measured if b <= want]
    return PREFILL_TABLE[(kind, n, k, below[-1] if below else measured[0])]


def prefill_config(kind: str, n: int, k: int, m: int) -> dict:
    """The launch config of a large-M call: its table entry (``_entry``), else the kind's
    default (with the K block narrowed to 64 where 128 does not divide K: a ragged K takes the
    masked path)."""
    if kind not in DEFAULT_PREFILL:
        raise ValueError(f"prefill kind must be one of {tuple(DEFAULT_PREFILL)}, got {kind!r}")
    cfg = dict(DEFAULT_PREFILL[kind])
    entry = _entry(kind, n, k, m)
    if entry is not None:
        cfg.update(entry)
    elif k % cfg["block_k"]:
        cfg["block_k"] = 64
    return cfg


for _key, _cfg in PREFILL_TABLE.items():  # a malformed entry fails at import, naming its key
    try:
        check_prefill_config(_cfg)
    except ValueError as _e:
        raise ValueError(f"PREFILL_TABLE[{_key!r}]: {_e}") from None
