"""The attention interface every backend implements, for the target and the draft alike.

Semantics (the contract the reference and every fast backend are tested against): query row i
of request b, at absolute position ``qpos = meta.positions[i]``, attends to the keys at
positions ``kp`` in ``[0, meta.seq_lens[b])`` of its request's pages (through
``meta.block_table``), keeping ``kp <= qpos`` when ``causal`` and ``qpos - kp < window`` when a
window is given; ``sink`` [Hq] is an extra per-head logit that joins the softmax denominator
and carries no value. Query head h reads KV head ``h // (Hq / Hkv)``. ``forward`` first writes
the step's new K/V rows at ``meta.out_slots``, so a block sees itself.

Life cycle, after mini-sglang's backend interface: ``prepare(meta)`` derives whatever the
backend needs per forward (tile tables, context slot tables) from the metadata once, before
the layers run; ``attend`` runs per layer. Everything a graph-capable backend derives comes
from device tensors in static buffers, so ``prepare`` runs *inside* a captured forward and
replay needs no host-side hook; backends that need host-side sizes (the torch reference)
say ``supports_cuda_graph = False`` and run eagerly.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from blockspec.forward_metadata import ForwardMetadata


class AttentionBackend(ABC):
    name: str = ""
    supports_cuda_graph: bool = False

    def prepare(self, meta: ForwardMetadata) -> None:
        """Per-forward setup shared by every layer (default: nothing)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: ForwardMetadata, *,
                scale: float, causal: bool = True, window: int | None = None,
                sink: torch.Tensor | None = None) -> torch.Tensor:
        """q [N, Hq, D], new k/v [N, Hkv, D]; caches [slots, Hkv, D]. Returns [N, Hq, D]."""
        k_cache[meta.out_slots] = k.to(k_cache.dtype)
        v_cache[meta.out_slots] = v.to(v_cache.dtype)
        out = self.attend(q, k_cache, v_cache, meta, scale=scale, causal=causal,
                          window=window, sink=sink)
        if meta.real_rows is not None:    # a padded chunk: its padded rows were never written
            out = torch.where(meta.real_rows[:, None, None], out, 0.0)
        return out

    @abstractmethod
    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: ForwardMetadata, *, scale: float, causal: bool, window: int | None,
               sink: torch.Tensor | None) -> torch.Tensor:
        ...

