"""W4A16 NVFP4 GEMM launchers: bf16 activations x packed E2M1 weights decoded in registers.

One kernel (``_w4a16_kernels.py``, which says how it decodes) serves every shape of use:

- dense: ``y[M, N] = x[M, K] @ W^T`` with ``W`` packed [N, K/2] (+ [N, K/16] E4M3 scales and a
  0-dim global scale, or one per row [N]: sibling projections stacked, never dequantized);
- grouped (MoE): rows of ``x`` sorted by expert, ``expert_offsets[e]:expert_offsets[e+1]`` are
  expert e's rows, weights stacked [E, N, K/2] / [E, N, K/16] / [E];
- pairs (MoE at decode): one block per (token, expert) pair, no sort (``pair_w4a16``).

On CUDA, calls of up to 16 rows (pairs, and dense ones given no tile keyword) go to the CUDA
kernel of ``w4a16_cuda.py`` instead; tile keywords ask for this module's Triton kernel.

Every function here (``_reference`` ones too) takes packed weights in the kernel's layout
(``w4a16_layout.to_kernel_layout``, converted once after loading), which lets the inline-PTX
decode make 8 weights from 9 integer ops and 4 bf16x2 multiplies (``scripts/sass_w4a16.py``).
M <= 16 uses mma with the weights as B, larger M ``W @ x^T`` (wgmma); small N splits K.

Variants (``variant=`` or ``BLOCKSPEC_W4A16_VARIANT``; default ``v2``): ``v2`` as above, ``v2w``
always swapped (wgmma), ``v2t`` the decode by Triton ops instead of PTX (comparisons). v2 takes
the tile, split-K, warps and stages of the call's problem class from the tuned table
(``w4a16_tuned.py``), else the built-ins; keywords override both. Prefill sizes take
``w4a16_prefill``'s table, which may send a shape to cuBLAS on a dequantized copy.

Triton is imported only when a kernel is launched (``triton_loader.load_kernels``). Under
``TRITON_INTERPRET=1`` (CPU tensors) every variant runs the same kernel with the decode in fp32
(the interpreter's bf16 dot and casts are unreliable): the same exact products.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

from blockspec.kernels.grouped_mm import grouped_mm_ok
from blockspec.kernels.nvfp4_dequant import dequant_grouped, dequant_linear
from blockspec.kernels.tile_counters import tile_counters
from blockspec.kernels.triton_loader import interpreting, load_kernels, sm_count
from blockspec.kernels.w4a16_blocks import expert_blocks, grouped_blocks  # noqa: F401 (MoE's)
from blockspec.kernels.w4a16_layout import from_kernel_layout
from blockspec.kernels.w4a16_cuda import cuda_ok, dense_w4a16_cuda, pair_w4a16_cuda
from blockspec.kernels.w4a16_prefill import is_dense_prefill, is_grouped_prefill, prefill_config
from blockspec.kernels.w4a16_tuned import check_v2_tile, tuned_config
from blockspec.quant.nvfp4 import GROUP_SIZE, dequantize_nvfp4

_KERNELS = Path(__file__).with_name("_w4a16_kernels.py")
# DECODE values of the v2 kernel: pure-Triton bf16 decode, inline-PTX bf16 decode, fp32 decode
# (the interpreter, whose bf16 dot and casts are unreliable).
_DEC_TRITON, _DEC_ASM, _DEC_FP32 = 0, 1, 2


def v2_kernel():   # the jitted v2 kernel for the current mode (compiled, or the interpreter's)
    return load_kernels(_KERNELS)._w4a16_v2_kernel


def _pick_split_k(programs: int, k: int, block_k: int, sms: int, waves: float = 2.0) -> int:
    """Split K until ~``waves`` waves of programs cover the ``sms`` SMs (small-N expert shapes
    need it; v2 asks for 1.5, best on an H200 sweep). Takes the SM count, not a device, so the
    decode sweep can plan splits without one."""
    k_blocks = -(-k // block_k)
    target = waves * sms
    split = 1
    while programs * split < target and split * 2 <= k_blocks and split < 16:
        split *= 2
    return split


def split_plan(k: int, chunk: int, split: int) -> tuple[int, int]:
    """(splits launched, K per split) for ``split`` asked-for splits of whole ``chunk``s of K
    (fewer if K runs out: the sweep skips splits that would launch the same kernel twice)."""
    k_per_split = -(-k // split)
    k_per_split = -(-k_per_split // chunk) * chunk
    return -(-k // k_per_split), k_per_split


def _builtin_v2_config(n: int, k: int, m: int) -> dict:
    """Tile shape of the v2 kernels when neither the caller nor the tuned table names one (best
    of an older H200 sweep, at shapes other than decode's).

    M <= 16 (decode): mma with the weights as B; wide N (lm_head) takes 128-row tiles on
    2 warps, narrow N (experts) 64-row tiles plus split-K (``_pick_split_k``, ~1.5 waves).
    Larger M: the swapped wgmma form (``swap``), 32-row blocks of x for narrow N, 256-row
    tiles of 64-wide K blocks on 8 warps for wide N.  Otherwise the K block is the widest
    that divides K (a ragged K takes the slower masked path).
    """
    wide = n >= 8192
    cfg = {"block_m": 16 if m <= 16 else (32 if m <= 32 or not wide else 64),
           "block_n": 128 if wide else 64, "block_k": 128 if k % 128 == 0 else 64,
           "k_slices": 1, "swap": m > 16, "num_warps": 2 if wide else 4, "num_stages": 3,
           "split_k": None, "maxnreg": None}
    if m > 16 and wide:
        cfg.update(block_n=256, block_k=64, num_warps=8)
    return cfg


def v2_default_config(n: int, k: int, m: int, *, blocks: int | None = None,
                      block_m: int | None = None, tuned: bool = True) -> dict:
    """Launch config of the v2 kernels for what the caller leaves unnamed: the tuned entry of
    the call's class over the built-in defaults (``_builtin_v2_config``). ``m``: rows of x for
    a dense call, rows per block for a grouped one (``blocks`` row blocks); ``block_m``: a
    dense call's chosen row block; ``split_k`` None: ``_pick_split_k`` decides."""
    cfg = _builtin_v2_config(n, k, m if block_m is None else block_m)
    if tuned:
        cfg.update(tuned_config(n, k, m, blocks))
    return cfg


def _launch_v2(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               ws2: torch.Tensor, tables: tuple[torch.Tensor, ...] | None, num_blocks: int,
               block_m: int, n: int, k: int, out_dtype: torch.dtype, variant: str,
               block_n: int | None = None, block_k: int | None = None,
               k_slices: int | None = None, split_k: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None,
               maxnreg: int | None = None, pairs: dict | None = None,
               relu2: bool = False, prefill: dict | None = None, swap: bool | None = None,
               n_inner: bool | None = None, x_perm: bool | None = None,
               x_ordered: int = 0) -> torch.Tensor:
    """``tables``: (expert, row0, row1) per row block for the grouped GEMM, None for dense.
    ``pairs`` (``pair_w4a16``): ``ids`` [tokens, topk], ``x_per_pair``, ``dedup``; one block
    per pair, ``num_blocks`` = pairs, ``out`` has a row per pair. ``relu2``: relu(.)^2 of
    the rounded output, in the kernel's epilogue. Keywords left None come from ``prefill`` (a large-M call's ``w4a16_prefill`` config: no
    split-K), else ``v2_default_config``; the tuned table applies to ``v2`` only (the other
    variants are comparisons, and ``v2w`` needs its own tile shapes). ``n_inner``: the grid
    runs a row block's N tiles side by side; ``x_perm`` (prefill): x copied with each K
    chunk in the kernel's stream order; ``x_ordered`` = C: x already is (``stream_order(x, C)``),
    C must be the config's K block."""
    interpret = interpreting()
    kernel = v2_kernel()
    if tables is None and pairs is None:
        cfg = v2_default_config(n, k, x.shape[0], block_m=block_m, tuned=variant == "v2")
    else:
        cfg = v2_default_config(n, k, block_m, blocks=num_blocks, tuned=variant == "v2")
    if prefill:
        cfg = {**cfg, "split_k": 1, "k_slices": 1, "maxnreg": None, **prefill}
    block_n = block_n or cfg["block_n"]
    block_k = block_k or cfg["block_k"]
    slices = k_slices or cfg["k_slices"]
    swap = variant == "v2w" or ((cfg["swap"] if swap is None else swap) and slices == 1
                                and block_n % 64 == 0)
    check_v2_tile(block_n, block_k, slices)
    if swap and (slices != 1 or block_n % 64):
        raise ValueError("v2w (wgmma) needs k_slices=1 and block_n a multiple of 64")
    chunk = block_k * slices
    tiles_n = -(-n // block_n)
    split = (split_k or cfg["split_k"]
             or _pick_split_k(num_blocks * tiles_n, k, chunk, sm_count(x.device, cpu=4),
                              waves=1.5))
    split, k_per_split = split_plan(k, chunk, split)
    # The kernel reads x as int64 words (4 bf16) and W as uint16 words (4 nibbles).
    if x.dtype != torch.bfloat16:
        x = x.to(torch.bfloat16)
    if x.stride(0) % 4 or x.data_ptr() % 8:
        x = x.clone()
    x_perm = (bool(cfg.get("x_perm") if x_perm is None else x_perm) and pairs is None
              and slices == 1 and k % chunk == 0)
    if x_ordered:
        if x_ordered != chunk or slices != 1 or k % chunk or pairs is not None:
            raise ValueError(f"x_ordered={x_ordered}: x in stream order needs K blocks of "
                             f"{x_ordered} with no K slices (the config has {block_k} x {slices})")
        x_perm = True
    elif x_perm:  # each K chunk in the kernel's stream order (one copy of x)
        x = stream_order(x, chunk)
    if weight.data_ptr() % 2:
        weight = weight.clone()
    rows = x.shape[0] if pairs is None else pairs["rows"]
    out = torch.empty((rows, n), dtype=torch.float32 if interpret else out_dtype,
                      device=x.device)
    num_tiles = num_blocks * tiles_n
    if split > 1:
        part = torch.empty(split * num_tiles * block_m * block_n, dtype=torch.float32,
                           device=x.device)
        counters = tile_counters(x.device, num_tiles)
    else:
        part, counters = out, ws2  # pointer arguments the kernel reads only when SPLIT > 1
    w3 = weight if weight.dim() == 3 else weight.unsqueeze(0)
    s3 = weight_scale if weight_scale.dim() == 3 else weight_scale.unsqueeze(0)
    s3 = s3.view(torch.uint8)
    if interpret:
        decode, extra = _DEC_FP32, {}
    else:
        decode = _DEC_TRITON if variant == "v2t" else _DEC_ASM
        extra = {"num_warps": num_warps or cfg["num_warps"],
                 "num_stages": num_stages or cfg["num_stages"]}
        if (maxnreg or cfg["maxnreg"]) is not None:  # a register cap buys CTAs per SM
            extra["maxnreg"] = maxnreg or cfg["maxnreg"]
    if pairs is not None:
        ids = pairs["ids"]
        tables, m_arg = (ids.reshape(-1),) * 3, ids.shape[0]
        extra.update(PAIRS=1, TOPK=ids.shape[1], X_PER_PAIR=pairs["x_per_pair"],
                     DEDUP=pairs["dedup"], DISTINCT=pairs["distinct"], SHARED=pairs["shared"],
                     SHARED_BASE=w3.shape[0] - pairs["shared"])
    else:
        m_arg = rows
    n_inner = bool(cfg.get("n_inner") if n_inner is None else n_inner) and num_blocks < 65536
    extra.update(N_INNER=n_inner, X_PERM=x_perm)
    grid = (tiles_n, num_blocks, split) if n_inner else (num_blocks, tiles_n, split)
    kernel[grid](
        x, w3, s3, ws2, out, part, counters, *(tables or (ws2, ws2, ws2)),
        m_arg, n, k, k_per_split, num_tiles,
        x.stride(0), w3.stride(0), w3.stride(1), s3.stride(0), s3.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SLICES=slices, SPLIT=split,
        SWAP=swap, DECODE=decode, GROUPED=tables is not None and pairs is None,
        EVEN_N=n % block_n == 0,
        MASK_K=interpret or k % chunk != 0, SCALE_WORDS=k % 64 == 0 and block_k >= 128,
        K_ITERS=k_per_split // chunk if interpret else 0, RELU2=relu2,
        COL_SCALE=tables is None and pairs is None and ws2.numel() > 1, **extra,
    )
    return out if out.dtype == out_dtype else out.to(out_dtype)


VARIANTS = ("v2", "v2t", "v2w")
VARIANT_ENV = "BLOCKSPEC_W4A16_VARIANT"


def default_variant() -> str:
    """``BLOCKSPEC_W4A16_VARIANT`` if set, else ``v2`` (fastest on every shape on the H200,
    docs/benchmarks.md)."""
    v = os.environ.get(VARIANT_ENV, "") or "v2"
    if v not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV}={v!r}: expected one of {VARIANTS}")
    return v


def _variant(variant: str | None) -> str:
    variant = variant or default_variant()
    if variant not in VARIANTS:
        raise ValueError(f"unknown W4A16 variant {variant!r}: expected one of {VARIANTS}")
    return variant


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> tuple[int, int]:
    n, half_k = weight.shape[-2], weight.shape[-1]
    k = half_k * 2
    if x.shape[-1] != k:
        raise ValueError(f"x has K={x.shape[-1]} but the packed weight holds K={k} "
                         f"(stored [.., {n}, {half_k}])")
    if k % GROUP_SIZE:
        raise ValueError(f"K={k} is not a multiple of {GROUP_SIZE}")
    if weight.dtype != torch.uint8:
        raise TypeError(f"packed weight must be uint8, got {weight.dtype}")
    if weight_scale.shape[-2:] != (n, k // GROUP_SIZE):
        raise ValueError(f"weight_scale shape {tuple(weight_scale.shape)} does not match "
                         f"[.., {n}, {k // GROUP_SIZE}]")
    return n, k


def w4a16_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor, bias: torch.Tensor | None = None, *,
                 variant: str | None = None, block_m: int | None = None,
                 block_n: int | None = None, block_k: int | None = None,
                 k_slices: int | None = None, split_k: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None,
                 maxnreg: int | None = None, relu2: bool = False, swap: bool | None = None,
                 n_inner: bool | None = None, x_perm: bool | None = None,
                 dequant: bool | None = None) -> torch.Tensor:
    """``x[..., K] @ dequant(W)^T (+ bias)`` -> ``[..., N]`` in x's dtype, via the Triton kernel
    (``weight`` in the kernel layout), or where the prefill table says ``dequant`` (or
    ``dequant=True``) cuBLAS on a dequantized copy (``nvfp4_dequant.dequant_linear``).

    ``variant``: one of ``VARIANTS`` (default: ``default_variant()``); the other keywords
    override the tile configuration (``maxnreg``: a register cap per thread). ``relu2``:
    relu(.)^2 of the rounded result in the kernel's epilogue (an expert's up projection;
    not with a bias, which is added after the kernel). From ``DENSE_PREFILL_ROWS`` rows on
    the unnamed tile keywords come from ``w4a16_prefill.prefill_config`` (``swap``,
    ``n_inner``, ``x_perm``: see ``_launch_v2``).
    """
    n, k = _check(x, weight, weight_scale)
    if relu2 and bias is not None:
        raise ValueError("w4a16_linear: relu2 is fused before the bias is added; pass one")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out_dtype = x.dtype
    if m == 0:
        return x.new_empty((*lead, n))
    cfg = {"block_n": block_n, "block_k": block_k, "split_k": split_k, "num_warps": num_warps,
           "num_stages": num_stages}
    tiled = any(v is not None for v in (variant, block_m, k_slices, maxnreg, swap, n_inner,
                                        x_perm, *cfg.values()))
    variant = _variant(variant)
    per_row = weight_scale_2.numel() > 1     # stacked siblings (quant.linear.stack_nvfp4_rows)
    if per_row and (weight_scale_2.numel() != n or dequant):
        raise ValueError(f"weight_scale_2 holds {weight_scale_2.numel()} values: one, or one per "
                         f"output row ({n}) and no dequant=True, expected")
    ws2 = weight_scale_2.reshape(-1).to(torch.float32).contiguous()
    w, s = weight.contiguous(), weight_scale.contiguous()
    pre = prefill_config("dense", n, k, m) if is_dense_prefill(m, n, k) else {}
    pre_m = pre.pop("block_m", None)
    block_m = block_m or pre_m or _builtin_v2_config(n, k, m)["block_m"]
    table_says = pre.pop("dequant", False) and not per_row   # measured on sm90 bf16
    if not (tiled or dequant) and cuda_ok(x2, w, m, "dense"):   # the CUDA kernel's dense mode
        y = dense_w4a16_cuda(x2, w, s, ws2, relu2=relu2)
    elif (table_says if dequant is None else dequant) and grouped_mm_ok(x2):
        y = dequant_linear(x2, w, s, ws2, relu2)
    else:
        y = _launch_v2(x2, w, s, ws2, None, -(-m // block_m), block_m, n, k, out_dtype, variant,
                       k_slices=k_slices, maxnreg=maxnreg, relu2=relu2, prefill=pre, swap=swap,
                       n_inner=n_inner, x_perm=x_perm, **cfg)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, n)


def w4a16_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           weight_scale_2: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch ``w4a16_linear`` (same arguments, kernel layout): exact fp32 dequant, cast to
    x's dtype, ``F.linear``."""
    s2 = weight_scale_2.reshape(-1, 1) if weight_scale_2.numel() > 1 else weight_scale_2
    w = dequantize_nvfp4(from_kernel_layout(weight), weight_scale, s2, dtype=x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def grouped_w4a16(x: torch.Tensor, expert_offsets: torch.Tensor, weight: torch.Tensor,
                  weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, *,
                  blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int] | None = None,
                  variant: str | None = None, block_n: int | None = None,
                  block_k: int | None = None, k_slices: int | None = None,
                  split_k: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, maxnreg: int | None = None,
                  relu2: bool = False, swap: bool | None = None,
                  n_inner: bool | None = None, x_perm: bool | None = None,
                  x_ordered: int = 0, dequant: bool | None = None) -> torch.Tensor:
    """MoE: ``x[T, K]`` sorted by expert; rows ``offsets[e]:offsets[e+1]`` use expert e.

    ``weight`` [E, N, K/2] uint8, ``weight_scale`` [E, N, K/16] E4M3, ``weight_scale_2`` [E]
    fp32.  Returns ``[T, N]`` in x's dtype.  The offsets may cover only the stack's first
    experts (the MoE's stacks end in the shared expert's slices, which only the pair path
    reads).  ``blocks`` (from ``grouped_blocks``) lets the up and down projections of one MoE
    layer share the row-block table.  ``variant``, the tile keywords and ``relu2`` (an expert's
    up projection: relu(.)^2 in the epilogue) are as in ``w4a16_linear``; from
    ``GROUPED_PREFILL_ROWS_PER_EXPERT`` rows per expert on the unnamed ones come from
    ``prefill_config`` (whose ``block_m`` ``grouped_blocks`` takes). ``x_ordered``: x is
    already in the kernel's stream order for K blocks of that size (``grouped_x_chunk``).
    ``dequant`` (None: the prefill table's say): ``nvfp4_dequant.dequant_grouped`` instead.
    """
    n, k = _check(x, weight, weight_scale)
    if weight.dim() != 3:
        raise ValueError(f"grouped weights must be [E, N, K/2], got {tuple(weight.shape)}")
    e = weight.shape[0]
    if not 2 <= expert_offsets.numel() <= e + 1:
        raise ValueError(f"expert_offsets needs 2 to E+1={e + 1} entries (one more than the "
                         f"experts it covers), got {expert_offsets.numel()}")
    t = x.shape[0]
    if t == 0:
        return x.new_empty((0, n))
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    if blocks is None:
        blocks = grouped_blocks(expert_offsets.to(x.device), t)
    blk_expert, row0, row1, nb, block_m = blocks
    experts = expert_offsets.numel() - 1
    pre = prefill_config("grouped", n, k, t) if is_grouped_prefill(t, experts) else {}
    pre.pop("block_m", None)  # the row blocks' own
    ws2 = weight_scale_2.reshape(e).to(torch.float32)
    table_says = pre.pop("dequant", False)
    if (table_says if dequant is None else dequant) and grouped_mm_ok(x2, n, k):
        if x_ordered:
            raise ValueError("grouped_w4a16: dequant takes x in its natural K order")
        return dequant_grouped(x2, expert_offsets, weight, weight_scale, ws2, relu2)
    cfg = {"block_n": block_n, "block_k": block_k, "split_k": split_k, "num_warps": num_warps,
           "num_stages": num_stages}
    w, s = weight.contiguous(), weight_scale.contiguous()
    return _launch_v2(x2, w, s, ws2, (blk_expert, row0, row1), nb, block_m, n, k, x.dtype,
                      _variant(variant), k_slices=k_slices, maxnreg=maxnreg,
                      relu2=relu2, prefill=pre, swap=swap, n_inner=n_inner, x_perm=x_perm,
                      x_ordered=x_ordered, **cfg)


def stream_order(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``x`` [rows, K] with each ``chunk`` of K in the kernel's stream order (element 4i + r of
    a chunk at r * chunk / 4 + i): what ``x_perm`` reads. A copy."""
    rows, k = x.shape
    return x.reshape(rows, k // chunk, chunk // 4, 4).transpose(-1, -2).reshape(rows, k)


def grouped_x_chunk(n: int, k: int, rows: int, experts: int) -> int:
    """The K block whose stream order a prefill-sized ``grouped_w4a16`` wants x in (its config
    has ``x_perm``), else 0: a caller that gathers x anyway permutes it there for free."""
    if not is_grouped_prefill(rows, experts):
        return 0
    cfg = prefill_config("grouped", n, k, rows)
    return cfg["block_k"] if cfg.get("x_perm") and k % cfg["block_k"] == 0 else 0


# A pair tile's rows are the tokens of one expert under ``dedup`` (BLOCK_M = 16 at decode).
PAIR_DEDUP_MAX_TOKENS = 16


def pair_w4a16(x: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor,
               weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, *,
               x_per_pair: bool = False, dedup: bool = False, relu2: bool = False,
               distinct: bool = False, shared_parts: int = 0,
               **tile: int | None) -> torch.Tensor:
    """MoE at decode sizes, one launch: pair p = (token p // k, expert ``ids.flat[p]``) ->
    row p of the ``[T*k, N]`` result in x's dtype (``x`` [T, K], or one row per output row
    with ``x_per_pair``). Stacked weights as in ``grouped_w4a16``; no sort, gather or
    row-block table (the kernel reads ``ids``). ``dedup`` (at most ``PAIR_DEDUP_MAX_TOKENS``
    tokens): the pairs of one expert share a program, which decodes the expert's weights once
    and multiplies them by all its tokens' rows in one MMA tile (a speculative verify's tokens
    often share experts; decoding, not only reading, is what a W4A16 call pays for);
    ``distinct`` promises no token names an expert twice (top-k routing), which skips the
    kernel's repeat count. ``relu2`` applies relu(.)^2 to the rounded result (an expert's up
    projection). On CUDA, up to 16 tokens: ``w4a16_cuda.py``'s kernel (``tile`` unused).

    ``shared_parts`` = S > 0: the stack's last S experts are slices of the shared expert,
    which every token uses without being routed to them: the result gets S more rows per
    token after the routed ones (row T*k + t*S + s), in the same launch. ``tile``: the tile
    keywords of ``w4a16_linear``."""
    n, k = _check(x, weight, weight_scale)
    if weight.dim() != 3:
        raise ValueError(f"pair_w4a16: weight must be stacked [E, N, K/2], got "
                         f"{tuple(weight.shape)}")
    if ids.dim() != 2:
        raise ValueError(f"pair_w4a16: ids must be [tokens, k], got {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"pair_w4a16: ids must be int32 or int64, got {ids.dtype}")
    e = weight.shape[0]
    if not 0 <= shared_parts < e:
        raise ValueError(f"pair_w4a16: shared_parts={shared_parts} does not fit {e} experts")
    tokens, topk = ids.shape
    pairs = tokens * topk
    rows = pairs + tokens * shared_parts
    want = rows if x_per_pair else tokens
    if x.shape[0] != want:
        raise ValueError(f"pair_w4a16: x has {x.shape[0]} rows, expected {want} "
                         f"({'one per output row' if x_per_pair else 'one per token'})")
    if dedup and tokens > PAIR_DEDUP_MAX_TOKENS:
        raise ValueError(f"pair_w4a16: dedup takes at most {PAIR_DEDUP_MAX_TOKENS} tokens, "
                         f"got {tokens}")
    if pairs == 0:
        return x.new_empty((rows, n))
    ws2 = weight_scale_2.reshape(e).to(torch.float32)
    if (dedup or tokens == 1) and cuda_ok(x, weight, tokens, "pairs"):
        return pair_w4a16_cuda(x, ids, weight, weight_scale, ws2, x_per_pair=x_per_pair,
                               relu2=relu2, distinct=distinct, shared_parts=shared_parts, rows=rows)
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    ids = ids.contiguous()      # read in its own dtype: no conversion kernel per call
    blocks = pairs + (shared_parts if dedup else tokens * shared_parts)
    variant = default_variant()
    return _launch_v2(x2, weight.contiguous(), weight_scale.contiguous(), ws2, None, blocks, 16,
                      n, k, x.dtype, variant, relu2=relu2, **tile,
                      pairs={"ids": ids, "x_per_pair": x_per_pair, "dedup": dedup,
                             "distinct": distinct, "shared": shared_parts, "rows": rows})


def pair_w4a16_reference(x: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor,
                         weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, *,
                         x_per_pair: bool = False, relu2: bool = False,
                         shared_parts: int = 0) -> torch.Tensor:
    """Pure torch ``pair_w4a16`` (same arguments, kernel layout): each output row through its
    exactly dequantized expert."""
    tokens, topk = ids.shape
    e = weight.shape[0]
    experts = ids.reshape(-1).tolist() + [e - shared_parts + s for _ in range(tokens)
                                          for s in range(shared_parts)]
    token_of = [p // topk for p in range(tokens * topk)] + [t for t in range(tokens)
                                                           for _ in range(shared_parts)]
    out = []
    for r, ex in enumerate(experts):
        w = dequantize_nvfp4(from_kernel_layout(weight[ex]), weight_scale[ex],
                             weight_scale_2.reshape(-1)[ex], dtype=x.dtype)
        row = r if x_per_pair else token_of[r]
        out.append(F.linear(x[row:row + 1], w))
    y = torch.cat(out) if out else x.new_empty((0, weight.shape[-2]))
    return torch.square(F.relu(y)) if relu2 else y


def grouped_w4a16_reference(x: torch.Tensor, expert_offsets: torch.Tensor, weight: torch.Tensor,
                            weight_scale: torch.Tensor,
                            weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Pure torch ``grouped_w4a16`` (kernel layout): each expert's rows through its exactly
    dequantized weight."""
    n = weight.shape[-2]
    out = x.new_zeros((x.shape[0], n))
    offs = [int(v) for v in expert_offsets.tolist()]
    for e in range(weight.shape[0]):
        a, b = offs[e], offs[e + 1]
        if a == b:
            continue
        w = dequantize_nvfp4(from_kernel_layout(weight[e]), weight_scale[e],
                             weight_scale_2.reshape(-1)[e], dtype=x.dtype)
        out[a:b] = F.linear(x[a:b], w)
    return out
