"""ForwardBatch: everything one model forward needs to know about the batch, as tensors.

The runner builds it from requests; the model only reads it. Rows of all requests are
flattened ([T_total]); per-request metadata is indexed by batch position.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch


class Mode(Enum):
    EXTEND = "extend"   # prefill (or a prefill chunk): writes KV and commits Mamba state
    DECODE = "decode"   # one token per request: writes KV and commits Mamba state
    VERIFY = "verify"   # T tokens per request: writes KV, keeps Mamba state per position


@dataclass
class ForwardBatch:
    mode: Mode
    input_ids: torch.Tensor          # [T_total] long
    positions: torch.Tensor          # [T_total] long, absolute positions
    q_lens: list[int]                # new tokens per request
    prefix_lens: list[int]           # tokens already in the cache per request
    kv_slots: torch.Tensor           # [T_total] flat KV-pool slot of every new token
    ctx_slots: torch.Tensor          # [B, L_max] KV slots of positions 0..prefix+q-1 (padded with 0)
    mamba_slots: torch.Tensor        # [B] state-pool slot per request
    logits_rows: torch.Tensor        # rows of the flattened batch whose logits are wanted
    capture_layers: tuple[int, ...] = ()   # residual-stream taps (layer index before which to tap)
    verify_states: dict[int, object] = field(default_factory=dict)  # filled by Mamba layers in VERIFY
    row_batch: torch.Tensor = field(init=False)    # [T_total] request index of every row
    row_offset: torch.Tensor = field(init=False)   # [T_total] offset of the row within its request

    def __post_init__(self) -> None:
        dev = self.input_ids.device
        q = torch.tensor(self.q_lens, device=dev)
        self.row_batch = torch.repeat_interleave(torch.arange(len(self.q_lens), device=dev), q)
        starts = torch.cumsum(q, 0) - q
        self.row_offset = torch.arange(self.input_ids.shape[0], device=dev) - starts[self.row_batch]

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def seq_lens(self) -> list[int]:
        return [p + q for p, q in zip(self.prefix_lens, self.q_lens)]

    def row_starts(self) -> list[int]:
        out, acc = [], 0
        for q in self.q_lens:
            out.append(acc)
            acc += q
        return out
