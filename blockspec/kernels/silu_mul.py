"""silu(gate) * up (the Qwen3-style draft MLP's activation) in one launch from the fused
gate/up projection's output. torch runs it as two kernels (silu, then the product), which
every draft layer pays each speculative step. ``silu_mul_reference`` is the torch code."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from blockspec.kernels.triton_loader import interpreting, load_kernels

_KERNELS = Path(__file__).with_name("_silu_mul_kernels.py")
_BLOCK = 1024


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [..., 2I]`` (gate first) -> ``silu(gate) * up`` [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu_mul_reference`` in one launch (silu rounded to the dtype before the product, as
    torch's two kernels round; the exponential may differ from torch's in the last bits)."""
    two = gate_up.shape[-1]
    if two % 2:
        raise ValueError(f"silu_mul: gate_up's last dim must be even (gate | up), got {two}")
    inter = two // 2
    x = gate_up.reshape(-1, two)
    if x.stride(-1) != 1 or (interpreting() and x.storage_offset()):
        x = x.contiguous()
    y = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    if x.shape[0] and inter:
        load_kernels(_KERNELS)._silu_mul_kernel[(x.shape[0], -(-inter // _BLOCK))](
            x, y, inter, x.stride(0), y.stride(0), BLOCK=_BLOCK,
            **({} if interpreting() else {"num_warps": 4}))
    return y.view(*gate_up.shape[:-1], inter)
