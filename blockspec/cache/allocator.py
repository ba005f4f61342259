"""Fixed-size KV pages handed out and taken back (a free list; no fragmentation by design).

A request's pages are written once, at admission, into its row of the device block table;
position p of request r lives at flat slot ``block_table[r, p // page] * page + p % page`` in
every paged pool, so the target KV pool and the draft context pool share one table.
"""
from __future__ import annotations


class BlockAllocator:
    """Pages ``first .. first + num_blocks - 1``, lowest handed out first."""

    def __init__(self, num_blocks: int, block_size: int, first: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(first + num_blocks - 1, first - 1, -1))

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

    def release(self, table: list[int]) -> None:
        self._free.extend(reversed(table))
        table.clear()
