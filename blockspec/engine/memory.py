"""Caches with capacity known up front.

* ``BlockAllocator`` hands out fixed-size KV blocks; a request's block table maps position p to
  slot ``table[p // block_size] * block_size + p % block_size`` in every paged pool, so the
  target KV pool and the draft context pool share one table. A verify appends rows, and
  discarding rejected rows is just a shorter length: nothing is copied.
* ``KVPool`` holds K and V for the attention layers of one model, flat over slots.
* ``MambaStatePool`` holds the conv window and the fp32 SSM state of each Mamba layer per
  request slot.
"""
from __future__ import annotations

import torch


class CapacityError(RuntimeError):
    """Raised when a request can never fit the configured cache."""


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend ``table`` to cover ``num_tokens`` positions; False (and unchanged) if full."""
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        table.extend(self._free.pop() for _ in range(need))
        return True

    def shrink(self, table: list[int], num_tokens: int) -> None:
        """Give back blocks beyond ``num_tokens`` positions."""
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._free.append(table.pop())

    def release(self, table: list[int]) -> None:
        self._free.extend(reversed(table))
        table.clear()

    def slots(self, table: list[int], start: int, end: int, device: torch.device) -> torch.Tensor:
        """Flat slot ids of positions [start, end) of a request."""
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[pos // self.block_size]
        return (blocks * self.block_size + pos % self.block_size).to(device)


class KVPool:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)


class MambaStatePool:
    def __init__(self, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int,
                 num_heads: int, head_dim: int, state_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.conv = torch.zeros(num_layers, num_slots, conv_dim, conv_kernel - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(num_layers, num_slots, num_heads, head_dim, state_size,
                               dtype=torch.float32, device=device)
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)
