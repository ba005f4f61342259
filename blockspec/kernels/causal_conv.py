"""The causal depthwise conv + SiLU of a Mamba-2 prefill chunk in one Triton launch, from the
request's committed conv window, writing the output and the next window (the last K - 1
inputs). The torch reference is ``Mamba2Mixer._conv`` (layers/mamba2.py) with the window
concatenation of ``Mamba2Mixer.extend``, which the CPU runs."""
from __future__ import annotations

from pathlib import Path

import torch

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2

_KERNELS = Path(__file__).with_name("_causal_conv_kernels.py")


def causal_conv1d(xbc: torch.Tensor, window: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """xbc [Bt,T,C] (rows may be views into a wider in_proj output; channels contiguous),
    window [Bt,C,K-1] (the inputs before position 0), depthwise weight [C,1,K] (or [C,K]),
    bias [C] or None. Returns silu(conv) [Bt,T,C] in xbc's dtype and the new window
    [Bt,C,K-1] in the window's dtype."""
    Bt, T, C = xbc.shape
    K = weight.shape[-1]
    if (window.shape != (Bt, C, K - 1) or weight.numel() != C * K
            or (bias is not None and bias.shape != (C,)) or T < 1):
        raise ValueError(f"causal_conv1d: xbc {tuple(xbc.shape)}, window {tuple(window.shape)}, "
                         f"weight {tuple(weight.shape)} do not fit together")
    if xbc.stride(-1) != 1:
        xbc = xbc.contiguous()
    w = weight.reshape(C, K).contiguous()
    out = torch.empty(Bt, T, C, dtype=xbc.dtype, device=xbc.device)
    new_window = torch.empty(Bt, C, K - 1, dtype=window.dtype, device=window.device)
    block_t, block_c = min(next_pow2(T), 16), 128
    grid = (Bt, -(-T // block_t), -(-C // block_c))
    load_kernels(_KERNELS)._causal_conv_kernel[grid](
        xbc, window, w, bias if bias is not None else w, out, new_window, T, C,
        xbc.stride(0), xbc.stride(1), *window.stride(), out.stride(0), out.stride(1),
        *new_window.stride(), K=K, HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_C=block_c,
        **({} if interpreting() else {"num_warps": 4}))
    return out, new_window
