"""Paged attention in Triton: reads K/V in place through the block table (no gather of the
context), for decode, verify, prefill chunks and draft blocks alike (``attention/base.py`` has
the contract; ``attention/triton_paged.py`` is the backend that calls this).

Layout of the work: a program owns one *tile* of one KV head, i.e. ``BLOCK_M`` consecutive
(query position, query head of that KV group) pairs of one request, so the GQA group shares
every K/V load (Lightning: 16 query heads per KV head fill a 16-row tile at decode). A tile's
keys can be split across ``SPLITS`` programs (flash-decoding); a second kernel merges the
partial softmax states. Tile tables are built on the device for uniform batches, so the
whole thing runs inside a CUDA graph. The reference the tests compare against is the torch
backend (``attention/torch_native.py``), which kernels/ does not import.
"""
from __future__ import annotations

from pathlib import Path

import torch

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2, sm_count

BLOCK_N = 64
_LOG2E = 1.4426950408889634  # the kernels keep scores in base 2 (see _paged_attention_kernels)
_KERNELS = Path(__file__).with_name("_paged_attention_kernels.py")
# Prefill-sized tiles (from PREFILL_ROWS (query, head) rows per request and KV head on: an
# eager prefill chunk, a prefill graph's bucket) take this launch config; decode and verify
# keep pick_block_m's tile, BLOCK_N keys and Triton's default warps and stages. Measured on
# one H200 by scripts/tune_attention_prefill.py (an 8,192-query chunk after 8,192 cached
# tokens, Lightning's GQA 32/2 x 128): 256-row tiles (16 queries x a 16-head group) over
# 128-key blocks, 8 warps, 2 stages, whole key blocks unmasked: 4.16 ms (397 TFLOP/s) against
# 6.29 ms (262 TFLOP/s) for 64-row tiles, masked, 4 warps, 3 stages.
PREFILL_ROWS = 1024
# full_blocks: the key blocks a whole tile sees run without masks (the rest masked).
PREFILL_CONFIG = {"block_m": 256, "block_n": 128, "num_warps": 8, "num_stages": 2,
                  "full_blocks": True}
# fp32 inputs (tests, fp32 models) need twice the shared memory per tile: the 64-row tiles
PREFILL_CONFIG_FP32 = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3,
                       "full_blocks": True}


def pick_block_m(rows_per_request: int) -> int:
    """Tile height: the (query, head) rows of one request per KV head, 16 to 64."""
    m = 16
    while m < rows_per_request and m < 64:
        m *= 2
    return m


def launch_config(rows_per_request: int, dtype: torch.dtype) -> dict:
    """Tile height, key block, warps and stages for requests of ``rows_per_request`` (query,
    head) rows per KV head: ``PREFILL_CONFIG`` (``PREFILL_CONFIG_FP32`` for 32-bit inputs)
    from ``PREFILL_ROWS`` rows on, else ``pick_block_m``'s tile with the built-in key block
    and Triton's defaults."""
    if rows_per_request >= PREFILL_ROWS:
        return dict(PREFILL_CONFIG if dtype.itemsize <= 2 else PREFILL_CONFIG_FP32)
    return {"block_m": pick_block_m(rows_per_request), "block_n": BLOCK_N, "num_warps": None,
            "num_stages": None, "full_blocks": False}


def uniform_tiles(batch: int, q_len: int, group: int, block_m: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile tables (request, first row) for ``q_len`` rows per request, built on the device."""
    per = -(-q_len * group // block_m)
    i = torch.arange(batch * per, device=device, dtype=torch.int32)
    return i // per, (i % per) * block_m


def ragged_tiles(q_lens: list[int], group: int, block_m: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile tables for requests of different lengths (prefill chunks; host-built)."""
    req, row0 = [], []
    for b, q in enumerate(q_lens):
        for r in range(0, q * group, block_m):
            req.append(b)
            row0.append(r)
    both = torch.tensor([req, row0], dtype=torch.int32).to(device, non_blocking=True)
    return both[0], both[1]


def pick_splits(programs: int, device: torch.device) -> int:
    """Split the keys of each tile until about two waves of programs cover the GPU."""
    splits = 1
    while programs * splits < 2 * sm_count(device, cpu=2) and splits < 32:
        splits *= 2
    return splits


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor,
                    q_start: torch.Tensor, tile_req: torch.Tensor, tile_row0: torch.Tensor, *,
                    page_size: int, block_m: int, scale: float, causal: bool = True,
                    window: int | None = None, sink: torch.Tensor | None = None,
                    splits: int = 1, block_n: int = BLOCK_N, num_warps: int | None = None,
                    num_stages: int | None = None, full_blocks: bool = False) -> torch.Tensor:
    """q [N, Hq, D] -> [N, Hq, D]; see ``attention/base.py`` for the semantics. ``tile_*`` from
    ``uniform_tiles`` / ``ragged_tiles`` with the same ``block_m``; ``block_n`` keys per
    inner step (a power of two >= 16); ``num_warps`` / ``num_stages`` of the attention launch
    (None: Triton's defaults); ``full_blocks``: key blocks every row of a tile sees whole
    run without masks."""
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    if hq % hkv:
        raise ValueError(f"paged_attention needs Hq % Hkv == 0, got Hq={hq}, Hkv={hkv}")
    block_d = next_pow2(d, 16)    # tiles are powers of two >= 16; D is masked
    q = q.contiguous()
    out = torch.empty_like(q)
    tiles = tile_req.shape[0]
    interpret = interpreting()
    kernels = load_kernels(_KERNELS)
    attn, merge = kernels._attn_kernel, kernels._merge_kernel
    # the interpreter needs a fixed trip count (reading seq_lens is fine on the CPU)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"paged_attention: block_n must be a power of two >= 16, got {block_n}")
    static_iters = -(-int(seq_lens.max()) // block_n) + 1 if interpret else 0
    ieee = q.dtype == torch.float32
    # without sinks a placeholder pointer (never read: HAS_SINK and SPLITS gate every load), left
    # unwritten: a zero fill would be one more launch per attention call
    sink_t = (sink.float() * _LOG2E).contiguous() if sink is not None else q.new_empty(
        1, dtype=torch.float32)
    if splits > 1:
        rows = tiles * hkv * splits * block_m
        pm = torch.empty(rows, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        po = torch.empty(rows * block_d, dtype=torch.float32, device=q.device)
    else:
        pm = pl = po = sink_t
    common = dict(G=hq // hkv, D=d, BLOCK_D=block_d, BLOCK_M=block_m, SPLITS=splits,
                  HAS_SINK=sink is not None)
    launch = {} if interpret else {k: v for k, v in (("num_warps", num_warps),
                                                     ("num_stages", num_stages)) if v is not None}
    attn[(tiles, hkv, splits)](
        q, k_cache, v_cache, out, pm, pl, po, block_table, req_slots, seq_lens, q_start,
        tile_req, tile_row0, sink_t, scale * _LOG2E, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1), block_table.stride(0),
        PAGE=page_size, BLOCK_N=block_n, CAUSAL=causal, WINDOWED=window is not None,
        IEEE=ieee, STATIC_ITERS=static_iters, FULL_BLOCKS=full_blocks, EVEN_D=block_d == d,
        **common, **launch)
    if splits > 1:
        merge_m, merge_d = min(block_m, 16), min(block_d, 32)
        chunks = (block_m // merge_m) * (block_d // merge_d)
        merge[(tiles, hkv, chunks)](out, pm, pl, po, q_start, tile_req, tile_row0, sink_t,
                                    out.stride(0), out.stride(1), MERGE_M=merge_m,
                                    MERGE_D=merge_d, **common)
    return out
