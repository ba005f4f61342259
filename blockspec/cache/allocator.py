"""Fixed-size KV pages handed out and taken back (a free list; no fragmentation by design).

A request's pages are written once, at admission, into its row of the device block table;
position p of request r lives at flat slot ``block_table[r, p // page] * page + p % page`` in
every paged pool, so the target KV pool and the draft context pool share one table.

Pages are reference counted: the prefix cache (``prefix_cache.py``) holds one reference on a
page it has cached and every request whose block table lists the page holds one more, so a
cached page is shared (never copied) and goes back to the free list only when the last holder
lets it go.
"""
from __future__ import annotations


class BlockAllocator:
    """Pages ``first .. first + num_blocks - 1``, lowest handed out first."""

    def __init__(self, num_blocks: int, block_size: int, first: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.first = first
        self._free = list(range(first + num_blocks - 1, first - 1, -1))
        self._refs = [0] * (first + num_blocks)
        self._cached = [False] * (first + num_blocks)   # one of the holders is the prefix cache
        self.num_idle_cached = 0                        # cached pages no request holds

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def refs(self, page: int) -> int:
        """Holders of ``page`` (0: free)."""
        return self._refs[page]

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend ``table`` to cover ``num_tokens`` positions; False (and unchanged) if full."""
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for _ in range(need):
            page = self._free.pop()
            self._refs[page] = 1
            table.append(page)
        return True

    def share(self, pages: list[int]) -> None:
        """One more holder of each of ``pages`` (each already held)."""
        for page in pages:
            if self._refs[page] <= 0:
                raise RuntimeError(f"page {page} is free: it cannot be shared")
            if self._cached[page] and self._refs[page] == 1:
                self.num_idle_cached -= 1
            self._refs[page] += 1

    def adopt(self, pages: list[int]) -> None:
        """The prefix cache becomes a holder of each of ``pages`` (held by a request)."""
        self.share(pages)
        for page in pages:
            self._cached[page] = True

    def release(self, table: list[int]) -> None:
        """Drop one hold on each page of ``table`` (emptied); a page nobody holds is free."""
        for page in reversed(table):
            if self._refs[page] <= 0:
                raise RuntimeError(f"page {page} released more often than it was held")
            self._refs[page] -= 1
            if self._cached[page] and self._refs[page] == 1:
                self.num_idle_cached += 1
            elif self._refs[page] == 0:
                if self._cached[page]:
                    self._cached[page] = False
                    self.num_idle_cached -= 1
                self._free.append(page)
        table.clear()
