"""What one forward knows about its batch, as device tensors: the only batch description a
model, a layer or an attention backend ever reads (no Python list, no request object).

``runtime/metadata.py`` builds it (from static step buffers inside a captured graph, or from
host lists for prefill chunks); the fields' shapes are documented beside them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from blockspec.cache import KVPool, MambaStatePool

if TYPE_CHECKING:
    # annotation only (the one upward name on the ground floor): the batch carries its backend
    from blockspec.attention.base import AttentionBackend


class Mode(Enum):
    EXTEND = "extend"   # prefill (or a prefill chunk): writes KV and commits Mamba state
    DECODE = "decode"   # one token per request: writes KV and commits Mamba state
    VERIFY = "verify"   # T tokens per request: writes KV, keeps Mamba state per position
    DRAFT = "draft"     # a draft block: writes the block's K/V into the draft pool


@dataclass(frozen=True)
class ExtendGroup:
    """The requests of a prefill forward whose chunks have one length ``q``, for one batched
    Mamba scan: their rows are either one contiguous block ``[start, start + n * q)``
    (consecutive requests: a view, no gather) or the index ``rows`` [n, q]."""

    q: int
    n: int
    slots: torch.Tensor                  # [n] request slots (a view of req_slots when contiguous)
    start: int = -1
    rows: torch.Tensor | None = None


@dataclass
class ForwardMetadata:
    mode: Mode
    batch_size: int
    input_ids: torch.Tensor          # [N] long (N = rows of all requests, flattened)
    positions: torch.Tensor          # [N] long, absolute positions
    row_req: torch.Tensor            # [N] long, batch index of every row
    req_slots: torch.Tensor          # [B] long, request slot (block-table row, Mamba state row)
    seq_lens: torch.Tensor           # [B] long, cached length once this step's rows are written
    q_start: torch.Tensor            # [B+1] long, first row of each request
    out_slots: torch.Tensor          # [N] long, flat cache slot every row writes
    block_table: torch.Tensor        # [R+1, max_pages] int32 (shared by every paged pool)
    page_size: int
    attn: AttentionBackend
    kv: KVPool | None = None
    mamba: MambaStatePool | None = None
    q_len: int | None = None         # rows per request when uniform (decode 1, verify T)
    max_q_len: int = 1               # host upper bound on rows per request
    max_seq_len: int = 0             # host upper bound on seq_lens (eager paths only)
    q_lens_host: list[int] | None = None   # extend: rows per request (Mamba groups equal lengths)
    logits_rows: torch.Tensor | None = None   # rows whose logits are wanted (None = all)
    capture_layers: tuple[int, ...] = ()      # residual-stream taps (layer index to tap before)
    real_rows: torch.Tensor | None = None     # [N] bool: a padded chunk's real rows (None: all)
    attn_state: dict[str, Any] = field(default_factory=dict)   # per-forward backend data
    _extend_groups: list[ExtendGroup] | None = field(default=None, repr=False)

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def extend_groups(self) -> list[ExtendGroup]:
        """An extend's requests grouped by chunk length, built once per forward (the first
        Mamba layer asks; the others reuse it), so no layer copies indices to the device: a
        host-to-device copy waits for the stream, and one per layer would idle the GPU."""
        if self._extend_groups is None:
            starts, acc = [], 0
            for q in self.q_lens_host:
                starts.append(acc)
                acc += q
            by_len: dict[int, list[int]] = {}
            for b, q in enumerate(self.q_lens_host):
                by_len.setdefault(q, []).append(b)
            groups = []
            dev = self.req_slots.device
            for q, members in by_len.items():
                b0, n = members[0], len(members)
                if members == list(range(b0, b0 + n)):
                    groups.append(ExtendGroup(q, n, self.req_slots[b0:b0 + n], start=starts[b0]))
                else:
                    index = torch.tensor([[starts[b] + i for i in range(q)] for b in members],
                                         device=dev)
                    groups.append(ExtendGroup(q, n, self.req_slots[torch.tensor(members, device=dev)],
                                              rows=index))
            self._extend_groups = groups
        return self._extend_groups


def flat_slots(block_table: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
               page_size: int) -> torch.Tensor:
    """Flat cache slot of (request slot, position) pairs through the block table."""
    pages = block_table[slots, positions // page_size].long()
    return pages * page_size + positions % page_size
