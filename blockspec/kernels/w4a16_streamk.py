"""The MoE W4A16 pair calls of a speculative verify, scheduled stream-K.

A verify's few tokens route to ~20-40 distinct experts a layer; with one program per
(distinct expert, N tile) the count of programs follows the routing, so a call's last wave
is often a sliver (an H200 profile of a 7-token verify: 1.39 waves up, 1.01 down, the SMs
idle a quarter to a third of the call). Here a fixed grid of ``ctas_per_sm`` programs per SM
splits the call's flat sequence of K steps into equal shares, so every SM works to the end
whatever the routing; an item cut by a share boundary is summed by the last of its pieces
(``_w4a16_streamk_kernels.py``). Same operands, layout and exact decode as ``pair_w4a16``'s
dedup mode; the result rows are in the same order (routed pairs token-major, then each
token's shared slices), so the combine is unchanged.
"""
from __future__ import annotations

from pathlib import Path

import torch

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2, sm_count

_KERNELS = Path(__file__).with_name("_w4a16_streamk_kernels.py")
MAX_TOKENS = 16          # a tile's rows are the tokens of one expert
# Launch config when the caller names none (H200, docs/benchmarks.md)
DEFAULTS = {"block_n": 64, "num_warps": 2, "num_stages": 3, "ctas_per_sm": 6}

# Item counters per (device, stream): the last piece of an item resets its counter, so they
# stay zero between launches. Allocate them (run once) before capturing a CUDA graph.
_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _counters(device: torch.device, items: int) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    buf = _COUNTERS.get((device, stream))
    if buf is None or buf.numel() < items:
        buf = torch.zeros(max(items, 4096), dtype=torch.int32, device=device)
        _COUNTERS[(device, stream)] = buf
    return buf


def pair_w4a16_streamk(x: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor,
                       weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, *,
                       x_per_pair: bool = False, relu2: bool = False, shared_parts: int = 0,
                       block_n: int | None = None, block_k: int | None = None,
                       num_warps: int | None = None, num_stages: int | None = None,
                       ctas_per_sm: int | None = None, maxnreg: int | None = None
                       ) -> torch.Tensor:
    """``pair_w4a16(..., dedup=True, distinct=True)`` (same arguments and result) for up to
    ``MAX_TOKENS`` tokens, each naming an expert at most once (top-k routing). ``block_k``
    must divide K (default 128 where it does, else 64)."""
    e, n, half_k = weight.shape
    k = half_k * 2
    tokens, topk = ids.shape
    if not 0 < tokens <= MAX_TOKENS:
        raise ValueError(f"pair_w4a16_streamk: 1 to {MAX_TOKENS} tokens, got {tokens}")
    pairs = tokens * topk
    rows = pairs + tokens * shared_parts
    if x.shape != (rows if x_per_pair else tokens, k):
        raise ValueError(f"pair_w4a16_streamk: x {tuple(x.shape)}, expected "
                         f"({rows if x_per_pair else tokens}, {k})")
    block_k = block_k or (128 if k % 128 == 0 else 64)
    if k % block_k or block_k % 64:
        raise ValueError(f"pair_w4a16_streamk: block_k={block_k} must be a multiple of 64 "
                         f"dividing K={k}")
    block_n = block_n or DEFAULTS["block_n"]
    interp = interpreting()
    out_dtype = x.dtype
    x = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
    if x.stride(-1) != 1 or x.stride(0) % 4 or x.data_ptr() % 8:
        x = x.contiguous().clone()
    n_tiles = -(-n // block_n)
    progs = sm_count(x.device, cpu=4) * (ctas_per_sm or DEFAULTS["ctas_per_sm"])
    out = torch.empty((rows, n), dtype=torch.float32 if interp else torch.bfloat16,
                      device=x.device)
    part = torch.empty(progs * 2 * 16 * block_n, dtype=torch.float32, device=x.device)
    counters = _counters(x.device, (pairs + shared_parts) * n_tiles)
    ws2 = weight_scale_2.reshape(e).to(torch.float32)
    s3 = weight_scale.contiguous().view(torch.uint8)
    opts = {} if interp else {"num_warps": num_warps or DEFAULTS["num_warps"],
                              "num_stages": num_stages or DEFAULTS["num_stages"]}
    if maxnreg and not interp:
        opts["maxnreg"] = maxnreg
    load_kernels(_KERNELS)._w4a16_pairs_streamk_kernel[(progs,)](
        x, weight.contiguous(), s3, ws2, out, part, counters, ids.contiguous(),
        n, progs, x.stride(0), weight.stride(0), weight.stride(1), s3.stride(0), s3.stride(1),
        out.stride(0),
        TOKENS=tokens, TOPK=topk, P_BLOCK=next_pow2(pairs, 16), SHARED=shared_parts,
        SHARED_BASE=e - shared_parts, N_TILES=n_tiles, K_ITERS=k // block_k,
        BLOCK_N=block_n, BLOCK_K=block_k, X_PER_PAIR=x_per_pair, RELU2=relu2,
        DECODE=2 if interp else 1, SCALE_WORDS=block_k >= 128, EVEN_N=n % block_n == 0,
        INTERP=interp, PROGS=progs if interp else 0,
        ITEMS=(pairs + shared_parts) * n_tiles if interp else 0, **opts)
    return out if out.dtype == out_dtype else out.to(out_dtype)
