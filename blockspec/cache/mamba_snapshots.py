"""Saved Mamba states: copies of one request slot's conv windows and SSM states (every layer),
taken at a prefix's page boundary so a later request with that prefix resumes from it. The
recurrence cannot be rebuilt from KV, so a prefix cache hit on a hybrid model needs one."""
from __future__ import annotations

import torch

from blockspec.cache.mamba_pool import MambaStatePool


class MambaSnapshots:
    """``capacity`` snapshot slots beside the request slots of ``pool``; save/restore are
    device copies (no host sync)."""

    def __init__(self, pool: MambaStatePool, capacity: int) -> None:
        L, _, C, K1 = pool.conv.shape
        _, _, H, P, N = pool.ssm.shape
        self.pool = pool
        self.capacity = capacity
        self.conv = torch.zeros(L, capacity, C, K1, dtype=pool.conv.dtype, device=pool.conv.device)
        self.ssm = torch.zeros(L, capacity, H, P, N, dtype=pool.ssm.dtype, device=pool.ssm.device)
        self._free = list(range(capacity - 1, -1, -1))
        self.journal: list[tuple] | None = None     # see MemoryManager.record_device_ops

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes_per_snapshot(self) -> int:
        c, s = self.pool.conv[:, 0], self.pool.ssm[:, 0]
        return c.numel() * c.element_size() + s.numel() * s.element_size()

    def save(self, slot: int) -> int | None:
        """Copy request slot ``slot``'s state into a free snapshot; None when none is free."""
        if not self._free:
            return None
        sid = self._free.pop()
        self.copy_in(slot, sid)
        return sid

    def copy_in(self, slot: int, sid: int) -> None:
        """Snapshot ``sid`` := request slot ``slot``'s state (the device half of ``save``)."""
        if self.journal is not None:
            self.journal.append(("save", slot, sid))
        self.conv[:, sid].copy_(self.pool.conv[:, slot])
        self.ssm[:, sid].copy_(self.pool.ssm[:, slot])

    def restore(self, sid: int, slot: int) -> None:
        if self.journal is not None:
            self.journal.append(("restore", sid, slot))
        self.pool.conv[:, slot].copy_(self.conv[:, sid])
        self.pool.ssm[:, slot].copy_(self.ssm[:, sid])

    def free(self, sid: int) -> None:
        if sid in self._free or not 0 <= sid < self.capacity:
            raise RuntimeError(f"snapshot {sid} is not held")
        self._free.append(sid)
