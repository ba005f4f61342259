"""Tile counters of the W4A16 kernel's in-kernel split-K reduction (``w4a16.py``): the last
CTA of a tile resets its counter, so a buffer stays zero between launches; one buffer per
(device, stream). Allocate them (run once) before capturing a CUDA graph."""
from __future__ import annotations

import torch

_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}
# Outgrown buffers, never freed: a graph captured with one keeps its address (a batch grows past
# the sizes captured before, then shrinks back to them), and freed, its memory would go to the
# next capture's tensors while that graph still counts into it.
_OUTGROWN: list[torch.Tensor] = []


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``tiles`` counters for the current stream."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    buf = _COUNTERS.get((device, stream))
    if buf is None or buf.numel() < tiles:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[(device, stream)] = buf
    return buf


def zero_all() -> None:
    """Zero every buffer, the outgrown ones too (graphs still count into them): after a
    launch that failed midway, a counter may have been left raised."""
    for buf in (*_COUNTERS.values(), *_OUTGROWN):
        buf.zero_()
