"""Prefix caching for the hybrid target: shared KV pages plus Mamba state checkpoints.

A finished or prefilled prefix stays in the radix tree (``radix_cache.py``): its KV pages
(target and draft context alike, since both pools are addressed through the same pages) and,
at checkpoints, a snapshot of every Mamba layer's state (``mamba_snapshots.py``). A request
whose context starts with a cached path resumes at the deepest snapshot on it: it shares the
path's pages (one more reference each), gets the snapshot copied into its Mamba slot and
prefills only the rest.

Checkpoints are page boundaries: the multiple of ``track_interval`` a prefill chunk ends at
(the scheduler ends a chunk at the last one inside it, ``chunk_end``; a chunk longer than the
interval skips the ones before) and the last page boundary before the context's last token.
Pages are evicted least recently used first, leaves only, never while a request uses them.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from blockspec.cache.allocator import BlockAllocator
from blockspec.cache.mamba_pool import MambaStatePool
from blockspec.cache.mamba_snapshots import MambaSnapshots
from blockspec.cache.radix_cache import Node, RadixTree


@dataclass
class Hit:
    """A cached prefix a request resumes from: its nodes (one per page), ``length`` tokens,
    and the snapshot of the state after them (None on a model without Mamba layers or for
    an empty hit)."""

    nodes: list[Node] = field(default_factory=list)
    length: int = 0
    snapshot: int | None = None

    @property
    def pages(self) -> list[int]:
        return [n.page for n in self.nodes]


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, mamba: MambaStatePool | None, *,
                 track_interval: int, snapshot_slots: int) -> None:
        page = allocator.block_size
        if track_interval < page or track_interval % page:
            raise ValueError(f"mamba_track_interval ({track_interval}) must be a positive "
                             f"multiple of page_size ({page})")
        self.allocator = allocator
        self.page_size = page
        self.interval = track_interval
        self.tree = RadixTree(page)
        self.snapshots = MambaSnapshots(mamba, snapshot_slots) if mamba is not None else None
        self._snapped: set[Node] = set()             # nodes carrying a snapshot
        self.queried_tokens = 0          # context tokens looked up at admission
        self.hit_tokens = 0              # of those, resumed from the cache

    # ---- lookup ------------------------------------------------------------------------------
    def lookup(self, tokens: list[int], limit: int) -> Hit:
        """The deepest resumable cached prefix of ``tokens`` of at most ``limit`` tokens."""
        path = self.tree.match(tokens, limit)
        if self.snapshots is not None:
            while path and path[-1].snapshot is None:
                path.pop()
        return Hit(path, len(path) * self.page_size, path[-1].snapshot if path else None)

    def count(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    # ---- checkpoints -------------------------------------------------------------------------
    def last_checkpoint(self, total: int) -> int:
        """The end-of-context checkpoint of a context of ``total`` tokens: the last page
        boundary before its last token, the deepest point the same context sent again can
        resume from (a lookup leaves at least one token to prefill)."""
        return (total - 1) // self.page_size * self.page_size

    def chunk_end(self, start: int, end: int, total: int) -> int:
        """Where a prefill chunk [start, end) of a context of ``total`` tokens should end: at
        the last checkpoint inside it (a multiple of the interval, or ``last_checkpoint``), so
        the slot's Mamba state is exactly there after the chunk."""
        last = self.last_checkpoint(total)
        if start < last <= end:
            return last
        mult = end // self.interval * self.interval
        return mult if mult > start else end

    def is_checkpoint(self, pos: int, total: int) -> bool:
        return pos > 0 and pos % self.page_size == 0 and (
            pos % self.interval == 0 or pos == self.last_checkpoint(total))

    def insert(self, tokens: list[int], pages: list[int], nodes: list[Node], slot: int) -> None:
        """Cache ``tokens`` (page aligned, held in ``pages``) with request slot ``slot``'s
        Mamba state, which is the state after them. The request's ``nodes`` (a path prefix)
        grow by the new part of the path, which it then uses (locks). Without a free snapshot
        slot (all in use) nothing is cached."""
        n = len(tokens) // self.page_size
        if n == 0:
            return
        sid = None
        if self.snapshots is not None:
            known = self.tree.match(tokens, len(tokens))
            if len(known) < n or known[-1].snapshot is None:
                sid = self.snapshots.save(slot)
                while sid is None and self._evict_snapshot():
                    sid = self.snapshots.save(slot)
                if sid is None:
                    return
        path, adopted = self.tree.insert(tokens, pages)
        self.allocator.adopt([pages[i] for i in adopted])
        if path[:len(nodes)] != nodes[:len(path)]:
            raise RuntimeError("a request's cached path is not a prefix of its tokens' path")
        new = path[len(nodes):]
        self.tree.lock(new)
        nodes.extend(new)
        if sid is not None:
            path[-1].snapshot = sid
            self._snapped.add(path[-1])

    def release(self, nodes: list[Node]) -> None:
        """A request stops using ``nodes`` (emptied)."""
        self.tree.unlock(nodes)
        if nodes:
            self._prune(nodes[-1])
        nodes.clear()

    # ---- eviction ----------------------------------------------------------------------------
    def evict_pages(self, want: int) -> None:
        """Free up to ``want`` pages by dropping unused leaves, least recently used first (a
        parent left a leaf joins the candidates)."""
        goal = self.allocator.num_free + want
        heap = [(n.last_use, id(n), n) for n in self.tree.unused_leaves()]
        heapq.heapify(heap)
        while heap and self.allocator.num_free < goal:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            self._drop(leaf)
            if parent.parent is not None and parent.is_leaf and parent.refs == 0:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))

    @property
    def evictable_pages(self) -> int:
        """Pages only the cache holds: every one can be evicted (a node no request uses has
        no used node below it)."""
        return self.allocator.num_idle_cached

    def _drop(self, node: Node) -> None:
        self.tree.remove(node)
        self._unsnap(node)
        self.allocator.release([node.page])

    def _unsnap(self, node: Node) -> None:
        if node.snapshot is not None:
            self.snapshots.free(node.snapshot)
            node.snapshot = None
            self._snapped.discard(node)

    def _evict_snapshot(self) -> bool:
        """Free the least recently used snapshot no request needs: first those of unused
        nodes, then those inside a running request's path (only the deepest one on it may be
        resumed from; losing it costs that request's finish-time checkpoint, nothing else)."""
        unused = [n for n in self._snapped if n.refs == 0]
        pool = unused or [n for n in self._snapped if n.children]
        if not pool:
            return False
        node = min(pool, key=lambda n: n.last_use)
        self._unsnap(node)
        self._prune(node)
        return True

    def _prune(self, node: Node) -> None:
        """With Mamba layers a path past its last snapshot cannot be resumed: drop unused
        leaves without a snapshot, upwards."""
        if self.snapshots is None:
            return
        while node.parent is not None and node.is_leaf and node.refs == 0 and node.snapshot is None:
            parent = node.parent
            self._drop(node)
            node = parent

    # ---- accounting --------------------------------------------------------------------------
    @property
    def cached_pages(self) -> int:
        return len(self.tree)

    def audit(self, tables: list[list[int]]) -> None:
        """Raise AssertionError unless every page's holders are the tree (once) plus the
        request ``tables`` listing it, free + held pages = capacity, and every snapshot is
        free or named by exactly one node."""
        a = self.allocator
        holders: dict[int, int] = {}
        for n in self.tree.nodes():
            assert n.refs >= 0, f"node of page {n.page} has refs {n.refs}"
            holders[n.page] = holders.get(n.page, 0) + 1
            assert holders[n.page] == 1, f"page {n.page} is in the tree twice"
        for t in tables:
            for p in t:
                holders[p] = holders.get(p, 0) + 1
        for p in range(a.first, a.first + a.num_blocks):
            assert a.refs(p) == holders.get(p, 0), f"page {p}: {a.refs(p)} refs, {holders.get(p, 0)} holders"
        assert a.num_free + len(holders) == a.num_blocks, "free + held pages != capacity"
        idle = sum(1 for n in self.tree.nodes() if a.refs(n.page) == 1)
        assert a.num_idle_cached == idle, f"{a.num_idle_cached} idle cached pages counted, {idle} found"
        if self.snapshots is not None:
            named = [n.snapshot for n in self.tree.nodes() if n.snapshot is not None]
            assert len(set(named)) == len(named), "a snapshot is named by two nodes"
            assert len(named) + self.snapshots.num_free == self.snapshots.capacity, \
                "free + cached snapshots != capacity"
