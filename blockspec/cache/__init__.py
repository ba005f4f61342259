"""Ground floor: every cache a step reads or writes (KV pages and pools, Mamba state and its
verify scratch) and the admission arithmetic over them. Imports only ``kernels/``."""
from __future__ import annotations

from blockspec.cache.allocator import BlockAllocator
from blockspec.cache.kv_pool import KVPool
from blockspec.cache.mamba_pool import MambaStatePool
from blockspec.cache.memory import STEPS_IN_FLIGHT, CacheLayout, MemoryManager, Reservation

__all__ = ["BlockAllocator", "KVPool", "MambaStatePool", "MemoryManager", "CacheLayout",
           "Reservation", "STEPS_IN_FLIGHT"]
