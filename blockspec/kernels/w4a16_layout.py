"""The W4A16 kernel's layout of packed NVFP4 weights: the checkpoint's bits, moved within each
16-bit word so that the decode needs fewer instructions.

A ModelOpt checkpoint packs two E2M1 codes per byte (K = 2b in the low nibble, 2b + 1 in the
high one), so a little-endian 16-bit word w holds K = 4w + r in nibble r (bits 4r..4r+3). The
kernel (``kernels/w4a16.py``) turns stream r's code ``s e1 e0 m`` into the bf16 bits
``s << 15 | e1 e0 m << 6`` of each of the two words in a 32-bit register.  From the checkpoint's
nibbles that costs an AND, a multiply and an AND per stream; with the bits placed as below one
shift and an AND (streams 0 and 1), a shared byte swap, a shift and an AND (stream 2), or an AND
merged with the byte swap (stream 3) do it: 9 integer instructions per 8 weights instead of 13.
The K order, the scales and the shapes are unchanged (the permutation stays inside each word),
so row and 16-column slices of a converted tensor are converted slices.

Bit positions of stream r's (m, e0, e1, s) in the kernel's word (a permutation of 0..15):
"""
from __future__ import annotations

import functools

import torch

# (m, e0, e1, s) of nibble r -> bit positions in the kernel's 16-bit word
STREAM_BITS = ((4, 5, 6, 13), (0, 1, 2, 9), (10, 11, 12, 3), (14, 7, 8, 15))


@functools.lru_cache(maxsize=None)
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(checkpoint word -> kernel word, kernel word -> checkpoint word), int32 [65536] each,
    on ``device`` (built once per device, not copied there per call)."""
    if device.type != "cpu":
        return tuple(t.to(device) for t in _tables(torch.device("cpu")))
    words = torch.arange(1 << 16, dtype=torch.int32)
    forward = torch.zeros_like(words)
    for r, positions in enumerate(STREAM_BITS):
        for bit, pos in enumerate(positions):
            forward |= ((words >> (4 * r + bit)) & 1) << pos
    inverse = torch.empty_like(words)
    inverse[forward.long()] = words
    return forward, inverse


def _remap(packed: torch.Tensor, direction: int, name: str) -> torch.Tensor:
    if packed.dtype != torch.uint8:
        raise TypeError(f"{name}: packed NVFP4 weights must be uint8, got {packed.dtype}")
    if packed.shape[-1] % 2:
        raise ValueError(f"{name}: the packed last dimension must be even (K a multiple of 4), "
                         f"got {tuple(packed.shape)}")
    b = packed.to(torch.int32)
    word = b[..., 0::2] | (b[..., 1::2] << 8)
    out = _tables(packed.device)[direction][word.long()]
    return torch.stack((out & 0xFF, out >> 8), -1).reshape(packed.shape).to(torch.uint8)


def to_kernel_layout(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint-packed NVFP4 ``[..., N, K/2]`` uint8 -> the kernel's layout (a new tensor)."""
    return _remap(packed, 0, "to_kernel_layout")


def from_kernel_layout(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``to_kernel_layout``: the checkpoint's bytes back."""
    return _remap(packed, 1, "from_kernel_layout")


def to_kernel_layout_(packed: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    """``to_kernel_layout`` in place, ``rows`` rows at a time (a model's stacked experts are
    hundreds of MB; the int32 temporaries stay small). Refuses to run inside a CUDA graph
    capture, where a replay would permute the weights again."""
    if packed.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("to_kernel_layout_: packed weights must be converted before CUDA "
                           "graph capture (a replay would convert them again)")
    flat = packed.view(-1, packed.shape[-1])
    for i in range(0, flat.shape[0], rows):
        flat[i:i + rows] = to_kernel_layout(flat[i:i + rows])
    return packed
