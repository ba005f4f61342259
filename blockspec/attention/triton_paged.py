"""The Triton paged attention backend: the tile tables are built once per forward (by its
first layer, kept in the metadata's ``attn_state``), then each layer is one launch of
``kernels/paged_attention.py``, which describes the layout of the work (``base`` has the
contract)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from blockspec.attention.base import AttentionBackend
from blockspec.kernels import paged_attention as pa

if TYPE_CHECKING:
    from blockspec.forward_metadata import ForwardMetadata


class TritonPagedAttention(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True

    def _tiles(self, meta: ForwardMetadata, group: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict, int]:
        key = (self.name, group, dtype)   # the prefill tiles depend on the dtype
        if key not in meta.attn_state:
            dev = meta.req_slots.device
            if meta.q_len is not None:
                cfg = pa.launch_config(meta.q_len * group, dtype)
                tr, t0 = pa.uniform_tiles(meta.batch_size, meta.q_len, group, cfg["block_m"], dev)
            else:       # eager prefill chunks: prefill tiles whatever the lengths
                cfg = pa.launch_config(max(meta.max_q_len * group, pa.PREFILL_ROWS), dtype)
                tr, t0 = pa.ragged_tiles(meta.q_lens_host, group, cfg["block_m"], dev)
            meta.attn_state[key] = (tr, t0, cfg, tr.shape[0])
        return meta.attn_state[key]

    def attend(self, q, k_cache, v_cache, meta, *, scale, causal, window, sink):
        group = q.shape[1] // k_cache.shape[1]
        tile_req, tile_row0, cfg, tiles = self._tiles(meta, group, q.dtype)
        splits = pa.pick_splits(tiles * k_cache.shape[1], q.device) if meta.q_len is not None else 1
        return pa.paged_attention(q, k_cache, v_cache, meta.block_table, meta.req_slots,
                                  meta.seq_lens, meta.q_start, tile_req, tile_row0,
                                  page_size=meta.page_size, scale=scale, causal=causal,
                                  window=window, sink=sink, splits=splits, **cfg)
