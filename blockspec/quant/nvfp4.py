"""NVFP4 (ModelOpt layout): E2M1 codes, nibble packing, exact dequantization, quantizer.

A weight W [N, K] is stored as

- ``weight``          uint8 [N, K/2]: two 4-bit E2M1 codes per byte, element 2j in the LOW nibble;
- ``weight_scale``    float8_e4m3fn [N, K/16]: one scale per block of 16 along K;
- ``weight_scale_2``  float32 0-dim: one global scale (a multiplier, not a divisor).

Decoding follows ModelOpt's own ``NVFP4QTensor.dequantize`` operation for operation, so the
fp32 result is bit-identical to ModelOpt's (checked against committed fixtures):
``W = E2M1[code] * (fp32(weight_scale) * weight_scale_2)``.  The bracket matters: the scales are
multiplied first, once per block, then each code value is multiplied by that product.

The quantizer reproduces ModelOpt's exporter byte for byte for the same (bf16) weights and the
same ``weight_scale_2`` (see ``quantize_nvfp4``).
"""
from __future__ import annotations

import functools

import torch

GROUP_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0

# Code c: bit 3 = sign, bits 0-2 index the magnitude.  Code 8 ("-0") decodes to +0.0, as in
# ModelOpt's table: with -0.0 the fp32 bytes of a dequantized weight would differ.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Midpoints between neighbouring magnitudes; the ones at 0.75, 1.75, 3.5 sit just below an
# even-mantissa value, so an exact tie there rounds up (ties to even), elsewhere down.
_E2M1_BOUNDS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_ROUNDING_UP: tuple[float, ...] = (0.75, 1.75, 3.5)


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 code values as fp32 (index = code). One table per device, made once: a lookup
    inside a captured CUDA graph must not copy a new table from the host."""
    return _e2m1_table(str(torch.device(device)) if device is not None else "cpu")


@functools.lru_cache(maxsize=None)
def _e2m1_table(device: str) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to even mantissa, saturating at 6) -> uint8 codes.

    The sign bit is set for every negative input, also when the magnitude rounds to 0
    (giving code 8, -0), exactly as ModelOpt does; that matters for byte equality.
    Loops over the 7 bounds instead of broadcasting so a large matrix needs O(n) memory.
    """
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for b in _E2M1_BOUNDS:
        code += (mag > b).to(torch.uint8)
    for b in _TIES_ROUNDING_UP:
        code += (mag == b).to(torch.uint8)
    code |= (x < 0).to(torch.uint8) << 3
    return code


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes (0..15) -> [..., K/2] bytes; element 2j goes to the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of codes along the last dim: {codes.shape}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] uint8 codes, low nibble first."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def block_scales_fp32(weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Per-block multiplier fp32(weight_scale) * weight_scale_2, rounded once in fp32."""
    return weight_scale.to(torch.float32) * weight_scale_2.to(torch.float32)


def dequantize_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor,
                     weight_scale_2: torch.Tensor, dtype: torch.dtype = torch.float32,
                     group_size: int = GROUP_SIZE) -> torch.Tensor:
    """Packed [..., N, K/2] -> dense [..., N, K]: computed in fp32, then cast to ``dtype``.

    ``weight_scale_2`` may be 0-dim or broadcastable per leading index ([E, 1, 1] for stacked
    experts).
    """
    codes = unpack_nibbles(weight)
    k = codes.shape[-1]
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of the group size {group_size}")
    values = e2m1_table(weight.device)[codes.long()]
    blocks = values.view(*codes.shape[:-1], k // group_size, group_size)
    scale = block_scales_fp32(weight_scale, weight_scale_2)
    out = (blocks * scale.unsqueeze(-1)).reshape(codes.shape)
    return out.to(dtype)


def dequantize_nvfp4_rows(weight: torch.Tensor, weight_scale: torch.Tensor,
                          weight_scale_2: torch.Tensor, rows: torch.Tensor,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize only ``rows`` of a packed matrix (embedding lookups); same rule as above."""
    return dequantize_nvfp4(weight[rows], weight_scale[rows], weight_scale_2, dtype=dtype)


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """weight_scale_2 = amax / (6 * 448) in fp32 (ModelOpt's per-tensor scale)."""
    a = torch.as_tensor(amax).to(torch.float32)
    return a / (E2M1_MAX * E4M3_MAX)


def tensor_amax(w: torch.Tensor) -> torch.Tensor:
    """max |w| as fp32 (exact: computed in the tensor's own dtype, then widened)."""
    return torch.maximum(w.max().abs(), w.min().abs()).to(torch.float32)


def quantize_nvfp4(w: torch.Tensor, weight_scale_2: torch.Tensor | None = None,
                   group_size: int = GROUP_SIZE
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense [N, K] -> (packed uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2).

    Reproduces ModelOpt's exporter byte for byte when ``w`` is the same tensor in the same
    dtype (ModelOpt quantizes the weight in the export dtype, bf16 for these models):

    - ``weight_scale_2 = amax(w) / 2688`` unless given (fused q/k/v share the max of theirs);
    - block scale = ``block_amax / (6 * weight_scale_2)`` in fp32, all-zero blocks -> 1.0,
      clamped to [2^-9, 448], cast to E4M3;
    - codes = ``round_e2m1(w / (fp32(block_scale) * weight_scale_2))`` (division in fp32).
    """
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features={k} is not a multiple of the NVFP4 group size {group_size}")
    if weight_scale_2 is None:
        weight_scale_2 = nvfp4_global_scale(tensor_amax(w))
    ws2 = weight_scale_2.to(torch.float32)
    blocks = w.view(n, k // group_size, group_size)
    block_amax = blocks.abs().amax(dim=-1).to(torch.float32)
    scale = block_amax / (E2M1_MAX * ws2)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    weight_scale = scale.clamp(min=2.0 ** -9, max=E4M3_MAX).to(torch.float8_e4m3fn)
    divisor = block_scales_fp32(weight_scale, ws2).unsqueeze(-1)
    scaled = (blocks.to(torch.float32) / divisor).view(n, k)
    packed = pack_nibbles(e2m1_codes(scaled))
    return packed, weight_scale, ws2.reshape(())

