"""Every cache the engine holds, sized up front, and the admission arithmetic over them.

``MemoryManager`` owns the page allocator (``allocator.py``), the device block table, the KV
pools (``kv_pool.py``: the target's and the draft context's, on the same pages) and the Mamba
state pool (``mamba_pool.py``), and the request slots. Capacity is reserved at admission for
every position a request may use, so a running request never runs out. A verify appends rows;
discarding rejected rows is just a shorter length: nothing is copied.

The last request slot and the first pages are a *dummy* request: CUDA-graph batches are
padded to a captured size with rows that read and write only the dummy's cache.

With the prefix cache on (``prefix_cache.py``) a reservation may start with pages it shares
with the cache and other requests; admission counts them as held, asks the cache to evict
unused pages before it refuses, and a release drops the request's references.

Under tensor parallelism only rank 0 keeps the books; every rank holds its own device caches
(its heads). The few device writes the bookkeeping itself makes (a block-table row at
admission, a Mamba slot reset, snapshot copies) are recorded in a journal
(``record_device_ops``) that rank 0 ships to the other ranks ahead of its next forward, where
``replay_device_op`` repeats them in order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blockspec.cache.allocator import BlockAllocator
from blockspec.cache.kv_pool import KVPool
from blockspec.cache.mamba_pool import MambaStatePool
from blockspec.cache.prefix_cache import Hit, PrefixCache
from blockspec.cache.radix_cache import Node

# steps the scheduler keeps launched ahead of the one it reads back (engine/scheduler.py)
STEPS_IN_FLIGHT = 2


@dataclass
class CacheLayout:
    """What the target model needs cached (from its config)."""

    num_attention_layers: int
    num_kv_heads: int
    head_dim: int
    num_mamba_layers: int
    conv_dim: int = 0
    conv_kernel: int = 4
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    ssm_state_size: int = 0
    mamba_groups: int = 1

    @classmethod
    def for_model(cls, cfg) -> CacheLayout:
        """From a target config (under tensor parallelism the rank's ``rank_cfg``: its heads)."""
        return cls(num_attention_layers=len(cfg.layer_ids("attention")),
                   num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                   num_mamba_layers=len(cfg.layer_ids("mamba")), conv_dim=cfg.conv_dim,
                   conv_kernel=cfg.conv_kernel, mamba_heads=cfg.mamba_num_heads,
                   mamba_head_dim=cfg.mamba_head_dim, ssm_state_size=cfg.ssm_state_size,
                   mamba_groups=cfg.n_groups)


@dataclass
class Reservation:
    """A request's hold on the caches: its slot (block-table row and Mamba state row) and pages."""

    slot: int = -1
    pages: list[int] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)     # prefix cache path it uses (page order)
    cached: int = 0                                     # tokens resumed from the prefix cache


MIN_SNAPSHOTS = 32      # default floor of the prefix cache's Mamba snapshot slots


class MemoryManager:
    """Owns the caches and answers admission; the runner reads the pools, never allocates."""

    def __init__(self, layout: CacheLayout, *, max_total_tokens: int, max_requests: int,
                 page_size: int, dtype: torch.dtype, device: torch.device,
                 dummy_tokens: int = 64, prefix_cache: bool = False,
                 mamba_track_interval: int = 256, mamba_cache_slots: int = 0) -> None:
        self.page_size = page_size
        self.max_requests = max_requests
        self.device = device
        self.dtype = dtype
        self.dummy_slot = max_requests
        dummy_pages = -(-dummy_tokens // page_size)
        num_pages = -(-max_total_tokens // page_size)
        self.allocator = BlockAllocator(num_pages, page_size, first=dummy_pages)
        self.total_pages = num_pages + dummy_pages
        self.max_pages = max(num_pages, dummy_pages)
        self.block_table = torch.zeros(max_requests + 1, self.max_pages, dtype=torch.int32, device=device)
        self.block_table[self.dummy_slot, :dummy_pages] = torch.arange(dummy_pages, dtype=torch.int32)
        self._free_slots = list(range(max_requests - 1, -1, -1))
        num_slots = self.total_pages * page_size
        self.kv = (KVPool(layout.num_attention_layers, num_slots, layout.num_kv_heads,
                          layout.head_dim, dtype, device)
                   if layout.num_attention_layers else None)
        self.mamba = (MambaStatePool(layout.num_mamba_layers, max_requests + 1, layout.conv_dim,
                                     layout.conv_kernel, layout.mamba_heads, layout.mamba_head_dim,
                                     layout.ssm_state_size, dtype, device,
                                     groups=layout.mamba_groups)
                      if layout.num_mamba_layers else None)
        self.draft_kv: KVPool | None = None
        self.journal: list[tuple] | None = None
        # snapshot slots default to twice the running requests' Mamba state, at least
        # MIN_SNAPSHOTS: one prompt saves a checkpoint every interval and at its end, and its
        # answer another when it finishes, so a pool of two would evict a shared prefix's
        # checkpoint with the same request's later ones before anyone could resume from it
        slots = mamba_cache_slots or max(MIN_SNAPSHOTS, 2 * max_requests)
        self.prefix = (PrefixCache(self.allocator, self.mamba, track_interval=mamba_track_interval,
                                   snapshot_slots=slots)
                       if prefix_cache else None)
        self.set_step_width(1)

    # ---- pools a drafter adds ----------------------------------------------------------------
    def add_draft_pool(self, num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> KVPool:
        """The draft context pool: per draft layer K/V on the same pages as the target."""
        self.draft_kv = KVPool(num_layers, self.total_pages * self.page_size, num_kv_heads,
                               head_dim, dtype, self.device)
        return self.draft_kv

    def set_step_width(self, width: int) -> None:
        """Positions one step may write past the committed length (1 for AR, the verify width
        for speculation). ``STEPS_IN_FLIGHT`` such steps are reserved at admission: the
        scheduler launches the next step before it has read the current one back, so a request
        that finishes may still be written by the step after (whose rows are then dropped).
        A width above 1 is a verify's: the Mamba pool gets its verify scratch."""
        self.step_width = width
        self.lookahead = STEPS_IN_FLIGHT * width
        if width > 1 and self.mamba is not None:
            self.mamba.ensure_verify(width)

    # ---- tensor parallelism: the device writes of the bookkeeping -----------------------------
    def record_device_ops(self, journal: list[tuple]) -> None:
        """From now on append every device write the bookkeeping makes to ``journal``."""
        self.journal = journal
        if self.mamba is not None:
            self.mamba.journal = journal
        if self.prefix is not None and self.prefix.snapshots is not None:
            self.prefix.snapshots.journal = journal

    def replay_device_op(self, op: tuple) -> None:
        """Repeat one journaled write on this rank's caches (whose books are never used)."""
        kind, *a = op
        if kind == "table":
            slot, pages = a
            self.block_table[slot, :len(pages)].copy_(torch.tensor(pages, dtype=torch.int32))
        elif kind == "reset":
            self.mamba.reset(a[0])
        elif kind == "save":
            self.prefix.snapshots.copy_in(*a)
        elif kind == "restore":
            self.prefix.snapshots.restore(*a)
        else:
            raise ValueError(f"unknown cache device op {kind!r}")

    # ---- capacity ----------------------------------------------------------------------------
    @property
    def total_tokens(self) -> int:
        return self.allocator.num_blocks * self.page_size

    def needed_tokens(self, prompt_len: int, max_new_tokens: int) -> int:
        return prompt_len + max_new_tokens + self.lookahead

    def lookup(self, tokens: list[int]) -> Hit | None:
        """The cached prefix a request with context ``tokens`` resumes from: at most
        len - 1 tokens, so its prefill computes the last position (None: cache off)."""
        return self.prefix.lookup(tokens, len(tokens) - 1) if self.prefix is not None else None

    def can_admit(self, num_tokens: int, hit: Hit | None = None) -> bool:
        """Room for a slot and ``num_tokens`` positions, ``hit``'s pages counted as held; the
        prefix cache evicts unused pages (never ``hit``'s) before the answer is no."""
        if not self._free_slots:
            return False
        shared = len(hit.nodes) if hit is not None else 0
        need = max(self.allocator.blocks_for(num_tokens) - shared, 0)
        if need > self.allocator.num_free and self.prefix is not None:
            keep = hit.nodes if hit is not None else []
            pinned = sum(1 for n in keep if self.allocator.refs(n.page) == 1)
            if need > self.allocator.num_free + self.prefix.evictable_pages - pinned:
                return False                    # evicting could not make room: keep the cache
            self.prefix.tree.lock(keep)
            try:
                self.prefix.evict_pages(need - self.allocator.num_free)
            finally:
                self.prefix.tree.unlock(keep)
        return need <= self.allocator.num_free

    def admit(self, num_tokens: int, hit: Hit | None = None) -> Reservation:
        """Reserve a slot and pages for ``num_tokens`` positions (the first ones ``hit``'s,
        shared, its snapshot copied into the slot's Mamba state) and publish the pages in the
        device block table (one small copy per admission, never per step)."""
        if not self.can_admit(num_tokens, hit):
            raise RuntimeError("admit called without capacity")
        res = Reservation(slot=self._free_slots.pop())
        if hit is not None and hit.nodes:
            res.pages = hit.pages
            self.allocator.share(res.pages)
            res.nodes = list(hit.nodes)
            self.prefix.tree.lock(res.nodes)
            res.cached = hit.length
        self.allocator.grow(res.pages, num_tokens)
        row = torch.tensor(res.pages, dtype=torch.int32)
        self.block_table[res.slot, : len(res.pages)].copy_(row, non_blocking=False)
        if self.journal is not None:
            self.journal.append(("table", res.slot, list(res.pages)))
        if self.mamba is not None:
            if hit is not None and hit.snapshot is not None:
                self.prefix.snapshots.restore(hit.snapshot, res.slot)
            else:
                self.mamba.reset(res.slot)
        return res

    def checkpoint(self, res: Reservation, tokens: list[int]) -> None:
        """``tokens`` (page aligned) are committed in ``res`` and its slot's Mamba state is
        the state after them: cache them (a no-op with the cache off)."""
        if self.prefix is not None:
            self.prefix.insert(tokens, res.pages, res.nodes, res.slot)

    def release(self, res: Reservation) -> None:
        if self.prefix is not None:
            self.prefix.release(res.nodes)
        self.allocator.release(res.pages)
        res.cached = 0
        if res.slot >= 0:
            self._free_slots.append(res.slot)
            res.slot = -1
