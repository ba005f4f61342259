"""Mamba-2 decode and verify steps in one Triton kernel per layer: the causal conv over the
committed window, softplus(dt), the SSM recurrence and the D skip, reading the request's state
from the pool through its slot and writing back the final state (decode), or leaving it alone
and writing each block position's recurrence inputs into the verify scratch (verify); the
commit replays the accepted positions from those inputs. The references are
``Mamba2Mixer.steps_reference`` (layers/mamba2.py) and
``MambaStatePool.commit_verify_reference``, which the CPU runs."""
from __future__ import annotations

from pathlib import Path

import torch

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2

_KERNELS = Path(__file__).with_name("_mamba_step_kernels.py")


def step_config(batch: int, steps: int, head_dim: int) -> tuple[int, int]:
    """(head channels per program, warps) of a ``mamba_steps`` launch, from the CUDA-graph
    replays of ``scripts/bench_mamba_step.py`` on an H100 (Lightning's heads, 23 launches).
    One request: 16 channels on 4 warps, decode and verify alike (width 7: 7.9 us a layer
    against 9.7 with 32; decode 4.7 against 4.8). Several: a verify takes whole heads on 2
    warps (batch 16 width 2: 14.5 against 23.6; batch 4 width 4: 9.7 against 12.6), decode
    32 channels on 4. The state update is elementwise, so every layout leaves the same states
    bit for bit; y's C . state sum follows the layout, so a request's verify must share its
    decode's layout or give its y anyway: whole heads on 2 warps give 32 channels' y
    (tests/test_kernels.py on the GPU), 16 channels on 4 do not (an H100 run of that test,
    docs/benchmarks.md), hence one request keeps one layout for both."""
    if batch == 1:
        return min(head_dim, 16), 4
    if steps > 1:
        return min(head_dim, 64), 2
    return min(head_dim, 32), 4


def mamba_steps(zxbcdt: torch.Tensor, *, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                dt_bias: torch.Tensor, a_log: torch.Tensor, d_skip: torch.Tensor,
                conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor, steps: int,
                heads: int, head_dim: int, state_size: int, groups: int, d_inner: int,
                commit: bool, xbc_scratch: torch.Tensor | None = None,
                step_scratch: torch.Tensor | None = None,
                dt_limit: tuple[float, float] = (0.0, float("inf")),
                block_p: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """``zxbcdt`` [B*T, z | xBC | dt] (the in_proj output, rows b*T + t); one layer's pools
    ``conv_state`` [S, C, 3] and ``ssm_state`` [S, H, P, N] (fp32); scratch [S, T', C] and
    [S, T', H + d_inner + G * N] (fp32 step inputs, ``MambaStatePool``) for verify.
    ``block_p`` / ``num_warps``: launch overrides for ``scripts/bench_mamba_step.py``
    (default ``step_config``).
    Returns y [B*T, d_inner] fp32 (D skip included)."""
    rows, width = zxbcdt.shape
    conv_dim = d_inner + 2 * groups * state_size
    if width != d_inner + conv_dim + heads or rows != slots.shape[0] * steps:
        raise ValueError(f"mamba_steps: zxbcdt {tuple(zxbcdt.shape)} does not match B={slots.shape[0]}, "
                         f"T={steps}, d_inner={d_inner}, conv_dim={conv_dim}, heads={heads}")
    if zxbcdt.stride(-1) != 1:
        zxbcdt = zxbcdt.contiguous()
    auto_p, auto_w = step_config(slots.shape[0], steps, head_dim)
    block_p, num_warps = block_p or auto_p, num_warps or auto_w
    if head_dim % block_p or state_size & (state_size - 1) or block_p & (block_p - 1):
        raise ValueError("mamba_steps needs power-of-two head_dim blocks and state size")
    y = torch.empty(rows, d_inner, dtype=torch.float32, device=zxbcdt.device)
    lo, hi = dt_limit
    clamp = lo > 0.0 or hi != float("inf")
    if not commit and (step_scratch is None or xbc_scratch is None
                       or step_scratch.shape[-1] != heads + d_inner + groups * state_size
                       or step_scratch.stride(-1) != 1):
        raise ValueError(f"mamba_steps: a verify needs xbc_scratch and step_scratch "
                         f"[S, T', {heads + d_inner + groups * state_size}] (contiguous rows)")
    ssm_s = step_scratch if step_scratch is not None else ssm_state
    xbc_s = xbc_scratch if xbc_scratch is not None else conv_state
    # no contraction beyond the written fma: every layout rounds the state update alike
    extra = {} if interpreting() else {"num_warps": num_warps, "enable_fp_fusion": False}
    kernels = load_kernels(_KERNELS)
    kernels._mamba_steps_kernel[(slots.shape[0], heads, head_dim // block_p)](
        zxbcdt, conv_weight.reshape(conv_dim, -1), conv_bias if conv_bias is not None else d_skip,
        dt_bias, a_log, d_skip, conv_state, ssm_state, slots, y, ssm_s, xbc_s,
        zxbcdt.stride(0), zxbcdt.stride(0), conv_state.stride(0), ssm_state.stride(0),
        ssm_s.stride(0), ssm_s.stride(1), xbc_s.stride(0), xbc_s.stride(1), y.stride(0),
        float(lo), float(min(hi, 3.0e38)),
        T=steps, H=heads, P=head_dim, N=state_size, G=groups, DINNER=d_inner, CONV=conv_dim,
        BLOCK_P=block_p,
        COMMIT=commit, HAS_BIAS=conv_bias is not None, CLAMP=clamp, **extra)
    if commit:
        block = 256
        kernels._conv_window_kernel[(slots.shape[0], -(-conv_dim // block))](
            zxbcdt, conv_state, slots, zxbcdt.stride(0), conv_state.stride(0), DINNER=d_inner,
            CONV=conv_dim, T=steps, BLOCK=block, **({} if interpreting() else {"num_warps": 4}))
    return y


def commit_verify(conv: torch.Tensor, ssm: torch.Tensor, xbc_scratch: torch.Tensor,
                  step_scratch: torch.Tensor, slots: torch.Tensor, index: torch.Tensor,
                  groups: int, block_p: int | None = None, num_warps: int | None = None) -> None:
    """Every layer adopts, for slot ``slots[b]``, the state after verify position ``index[b]``:
    the SSM state by replaying positions 0..index from the step inputs in the scratch, the
    conv window shifted by index + 1 inputs; all layers in one launch. Pools as in
    ``MambaStatePool``; its torch code is the reference. ``block_p`` / ``num_warps``: launch
    overrides for ``scripts/bench_mamba_step.py`` (the replay is elementwise: any split gives
    the same bits)."""
    L, _, C, keep = conv.shape
    _, _, H, P, N = ssm.shape
    width = step_scratch.shape[2]
    if not (conv.is_contiguous() and ssm.is_contiguous() and step_scratch.is_contiguous()
            and xbc_scratch.is_contiguous()):
        raise ValueError("commit_verify: the state pools and scratch must be contiguous")
    if step_scratch.shape[-1] != H + H * P + groups * N or H % groups:
        raise ValueError(f"commit_verify: step_scratch rows of {step_scratch.shape[-1]}, "
                         f"expected H + H*P + G*N = {H + H * P + groups * N} (G={groups})")
    block_n = next_pow2(N, 2)
    cap = 4 if block_p is None else block_p     # 4 channels on one warp: best of the sweep
    block_p = 1
    while (block_p * 2 <= cap and block_p * 2 <= P and P % (block_p * 2) == 0
           and block_p * 2 * block_n <= 4096):
        block_p *= 2
    block_c = 256
    ssm_chunks = H * (P // block_p)
    grid = (L, slots.shape[0], ssm_chunks + -(-C // block_c))
    load_kernels(_KERNELS)._commit_verify_kernel[grid](
        ssm, step_scratch, conv, xbc_scratch, slots, index, C,
        ssm.stride(0), ssm.stride(1), step_scratch.stride(0), step_scratch.stride(1),
        step_scratch.stride(2), conv.stride(0), conv.stride(1), xbc_scratch.stride(0),
        xbc_scratch.stride(1), xbc_scratch.stride(2), H=H, P=P, N=N, G=groups, W=width,
        KEEP=keep, BLOCK_J=next_pow2(keep, 2), BLOCK_P=block_p, BLOCK_N=block_n,
        BLOCK_C=block_c, SSM_CHUNKS=ssm_chunks,
        **({} if interpreting() else {"num_warps": num_warps or 1, "enable_fp_fusion": False}))
