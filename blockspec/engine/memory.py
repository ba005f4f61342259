"""Every cache the engine holds, sized up front, and the admission arithmetic over them.

* ``BlockAllocator`` hands out fixed-size KV pages. A request's pages are written once, at
  admission, into its row of the device ``block_table`` [max_requests + 1, max_pages]; position
  p of request r lives at flat slot ``block_table[r, p // page] * page + p % page`` in every
  paged pool, so the target KV pool and the draft context pool share one table. A verify
  appends rows; discarding rejected rows is just a shorter length: nothing is copied.
* ``KVPool`` holds K and V of one model's attention layers, flat over slots.
* ``MambaStatePool`` holds each Mamba layer's conv window and fp32 SSM state per request slot,
  plus the verify scratch (the state after every block position) that a speculative commit
  picks from with one index copy.
* ``MemoryManager`` owns all of them and the request slots. Capacity is reserved at
  admission for every position a request may use, so a running request never runs out.

The last request slot and the first pages are a *dummy* request: CUDA-graph batches are
padded to a captured size with rows that read and write only the dummy's cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blockspec.kernels.mamba_step import commit_verify
from blockspec.kernels.triton_loader import use_triton


class BlockAllocator:
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


class KVPool:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)


class MambaStatePool:
    """Conv windows [L, slots, C, K-1] (model dtype) and SSM states [L, slots, H, P, N] (fp32).

    ``ensure_verify(T)`` adds the verify scratch: the pre-conv inputs [L, slots, T, C] and the
    recurrence inputs of each of T block positions [L, slots, T, H + H*P + G*N] (fp32: the
    decay exp(dt * A) per head, dt * x per channel, B per group). A verify forward writes them
    and leaves the committed state alone; ``commit_verify`` replays positions 0..a per row.
    Keeping a position's inputs rather than the state after it costs 1/N of the bytes (the
    verify writes no state at all), and the replay is the verify's own arithmetic.
    """

    def __init__(self, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int,
                 num_heads: int, head_dim: int, state_size: int, dtype: torch.dtype,
                 device: torch.device, *, groups: int) -> None:
        if num_heads % groups or conv_dim < num_heads * head_dim + 2 * groups * state_size:
            raise ValueError(f"MambaStatePool: groups={groups} must divide num_heads={num_heads} "
                             f"and conv_dim={conv_dim} hold H*P + 2*G*N channels")
        self.groups = groups
        self.conv = torch.zeros(num_layers, num_slots, conv_dim, conv_kernel - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(num_layers, num_slots, num_heads, head_dim, state_size,
                               dtype=torch.float32, device=device)
        self.xbc_scratch: torch.Tensor | None = None
        self.step_scratch: torch.Tensor | None = None

    @property
    def inputs_per_position(self) -> int:
        """Floats of one position's recurrence inputs: H + H*P + G*N."""
        _, _, H, P, N = self.ssm.shape
        return H + H * P + self.groups * N

    def ensure_verify(self, width: int) -> None:
        if self.step_scratch is not None and self.step_scratch.shape[2] >= width:
            return
        L, S, C, _ = self.conv.shape
        self.xbc_scratch = torch.zeros(L, S, width, C, dtype=self.conv.dtype, device=self.conv.device)
        self.step_scratch = torch.zeros(L, S, width, self.inputs_per_position, dtype=torch.float32,
                                        device=self.ssm.device)

    def reset(self, slot: int) -> None:
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()

    def commit_verify(self, slots: torch.Tensor, index: torch.Tensor) -> None:
        """Every layer adopts the state after block position ``index[b]`` (0-based) for slot
        ``slots[b]``: the SSM state replays positions 0..index from the scratch's inputs; the
        conv window after position i is the last K-1 columns of [window | xbc[:i+1]]. Device
        ops only (graph-safe): one kernel for all layers on CUDA
        (``kernels/mamba_step.commit_verify``), else ``commit_verify_reference``."""
        if use_triton(self.ssm):
            commit_verify(self.conv, self.ssm, self.xbc_scratch, self.step_scratch, slots, index,
                          self.groups)
        else:
            self.commit_verify_reference(slots, index)

    def commit_verify_reference(self, slots: torch.Tensor, index: torch.Tensor) -> None:
        keep = self.conv.shape[-1]
        L, _, H, P, N = self.ssm.shape
        steps = self.step_scratch[:, slots]                                 # [L, B, W, F]
        B, W = steps.shape[1], steps.shape[2]
        decay = steps[..., :H]
        dx = steps[..., H:H + H * P].reshape(L, B, W, H, P)
        bm = steps[..., H + H * P:].reshape(L, B, W, self.groups, N)
        bm = bm.repeat_interleave(H // self.groups, dim=3)                  # [L, B, W, H, N]
        state = self.ssm[:, slots]
        for t in range(W):          # the update of ssm_recurrent_steps, op for op
            new = (state * decay[:, :, t, :, None, None]
                   + dx[:, :, t, :, :, None] * bm[:, :, t, :, None, :])
            state = torch.where((t <= index).view(1, B, 1, 1, 1), new, state)
        self.ssm[:, slots] = state
        full = torch.cat([self.conv[:, slots], self.xbc_scratch[:, slots].transpose(-1, -2)], dim=-1)
        cols = index[:, None] + 1 + torch.arange(keep, device=index.device)[None]      # [B, K-1]
        C = full.shape[2]
        window = full.gather(-1, cols[None, :, None, :].expand(L, B, C, keep))
        self.conv[:, slots] = window


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


@dataclass
class Reservation:
    """A request's hold on the caches: its slot (block-table row and Mamba state row) and pages."""

    slot: int = -1
    pages: list[int] = field(default_factory=list)


class MemoryManager:
    """Owns the caches and answers admission; the runner reads the pools, never allocates."""

    def __init__(self, layout: CacheLayout, *, max_total_tokens: int, max_requests: int,
                 page_size: int, dtype: torch.dtype, device: torch.device,
                 dummy_tokens: int = 64) -> None:
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

    # ---- capacity ----------------------------------------------------------------------------
    @property
    def total_tokens(self) -> int:
        return self.allocator.num_blocks * self.page_size

    def needed_tokens(self, prompt_len: int, max_new_tokens: int) -> int:
        return prompt_len + max_new_tokens + self.lookahead

    def can_admit(self, num_tokens: int) -> bool:
        return bool(self._free_slots) and self.allocator.blocks_for(num_tokens) <= self.allocator.num_free

    def admit(self, num_tokens: int) -> Reservation:
        """Reserve a slot and pages for ``num_tokens`` positions and publish the pages in the
        device block table (one small copy per admission, never per step)."""
        if not self.can_admit(num_tokens):
            raise RuntimeError("admit called without capacity")
        res = Reservation(slot=self._free_slots.pop())
        self.allocator.grow(res.pages, num_tokens)
        row = torch.tensor(res.pages, dtype=torch.int32)
        self.block_table[res.slot, : len(res.pages)].copy_(row, non_blocking=False)
        if self.mamba is not None:
            self.mamba.reset(res.slot)
        return res

    def release(self, res: Reservation) -> None:
        self.allocator.release(res.pages)
        if res.slot >= 0:
            self._free_slots.append(res.slot)
            res.slot = -1
