"""The chunked SSD scan of a Mamba-2 prefill as Triton kernels: the four-stage decomposition of
the Mamba-2 paper's SSD algorithm (within-chunk cumsum of dt * A, each chunk's state
contribution, the sequential pass of states across chunks, the outputs from the entering
state plus the masked within-chunk matmul), so that the sequential part is only one
[P, N] update per chunk and everything else is batched matmuls. The torch reference is
``layers/mamba2.ssd_chunked_scan``, which the CPU runs."""
from __future__ import annotations

from pathlib import Path

import torch

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2

_KERNELS = Path(__file__).with_name("_ssd_scan_kernels.py")
# the dots' operand precision: "ieee" (fp32 on the CUDA cores), "tf32x3" (three tf32
# tensor-core passes) or "tf32". On an H200 at Lightning's shapes (8,192 tokens) ieee takes
# 20.0 ms, tf32x3 1.34 ms and tf32 0.71 ms; against the fp32 reference tf32x3 errs by 9e-7 of
# max |y|, tf32 by 6e-4 (scripts/bench_ssd_scan.py). The default follows x's dtype: fp32
# models get tf32x3 (as exact as ieee), 16-bit ones tf32, whose error is a fraction of the
# rounding their layer output gets (bf16 keeps 8 bits: 4e-3).
PRECISIONS = ("ieee", "tf32x3", "tf32")


def default_precision(dtype: torch.dtype) -> str:
    """The dot precision for inputs of ``dtype``: tf32x3 for fp32, tf32 for 16-bit floats."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, state: torch.Tensor, chunk: int, *,
             return_chunk_states: bool = False, precision: str | None = None):
    """x [Bt,T,H,P], dt [Bt,T,H] (after softplus), A [H], B/C [Bt,T,G,N] per group (G divides
    H; heads h*H/G .. share group h), state [Bt,H,P,N]; any float dtypes and strides (the
    innermost dims of x, B, C may be views into a wider row). Returns y [Bt,T,H,P] fp32
    (without the D skip), the final state [Bt,H,P,N] fp32 and, with ``return_chunk_states``,
    the state after every chunk [Bt, ceil(T/chunk), H, P, N] (the last is the final state),
    as ``ssd_chunked_scan``. ``precision``: one of ``PRECISIONS`` (default
    ``default_precision(x.dtype)``)."""
    Bt, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    if (dt.shape != (Bt, T, H) or A.shape != (H,) or B.shape != (Bt, T, G, N)
            or C.shape != B.shape or state.shape != (Bt, H, P, N) or H % G or T < 1
            or chunk < 1):
        raise ValueError(f"ssd_scan: shapes x {tuple(x.shape)}, dt {tuple(dt.shape)}, "
                         f"A {tuple(A.shape)}, B {tuple(B.shape)}, C {tuple(C.shape)}, "
                         f"state {tuple(state.shape)}, chunk {chunk} do not fit together")
    precision = precision or default_precision(x.dtype)
    if precision not in PRECISIONS:
        raise ValueError(f"ssd_scan: precision must be one of {PRECISIONS}, got {precision!r}")
    dev = x.device
    nchunks = -(-T // chunk)
    acs = torch.empty(Bt, H, nchunks, chunk, dtype=torch.float32, device=dev)
    # states[:, c] enters chunk c: [:, 0] the committed state, [:, c + 1] after chunk c
    states = torch.empty(Bt, nchunks + 1, H, P, N, dtype=torch.float32, device=dev)
    y = torch.empty(Bt, T, H, P, dtype=torch.float32, device=dev)
    kernels = load_kernels(_KERNELS)
    extra = {} if interpreting() else {"num_warps": 4}
    acs_strides = (acs.stride(0), acs.stride(1), acs.stride(2))
    st_strides = (states.stride(0), states.stride(1), states.stride(2), states.stride(3))
    x_strides = tuple(x.stride())
    dt_strides = tuple(dt.stride())
    b_strides = tuple(B.stride())

    block_h = min(next_pow2(H), 16)
    kernels._chunk_cumsum_kernel[(Bt * nchunks, -(-H // block_h))](
        dt, A, acs, T, *dt_strides, *acs_strides, H=H, Q=chunk,
        BLOCK_Q=next_pow2(chunk, 16), BLOCK_H=block_h, **extra)

    block_p, block_n = min(next_pow2(P, 16), 64), min(next_pow2(N, 16), 64)
    block_k = min(next_pow2(chunk, 16), 32)
    tiles = -(-P // block_p) * -(-N // block_n)
    kernels._chunk_state_kernel[(Bt * nchunks, H, tiles)](
        x, dt, B, acs, states, T, *x_strides, *dt_strides, *b_strides, *acs_strides,
        *st_strides, H=H, G=G, P=P, N=N, Q=chunk, BLOCK_P=block_p, BLOCK_N=block_n,
        BLOCK_K=block_k, PRECISION=precision, **extra)

    block = min(next_pow2(P * N), 1024)
    kernels._state_passing_kernel[(Bt, H, -(-(P * N) // block))](
        state, acs, states, T, *state.stride(), *acs_strides, *st_strides, N=N, PN=P * N,
        Q=chunk, BLOCK=block, **extra)

    block_m = min(next_pow2(chunk, 16), 64)
    tiles = -(-chunk // block_m) * -(-P // block_p)
    kernels._chunk_scan_kernel[(Bt * nchunks, H, tiles)](
        x, dt, B, C, acs, states, y, T, *x_strides, *dt_strides, *b_strides, *C.stride(),
        *acs_strides, *st_strides, *y.stride(), H=H, G=G, P=P, N=N, Q=chunk, BLOCK_M=block_m,
        BLOCK_P=block_p, BLOCK_N=next_pow2(N, 16), BLOCK_K=block_k, PRECISION=precision,
        **extra)
    if return_chunk_states:
        return y, states[:, -1], states[:, 1:]
    return y, states[:, -1]
