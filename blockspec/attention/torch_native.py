"""The reference backend: gather each request's context through its block table into a padded
batch and run SDPA (or, with a sink, an explicit fp32 softmax) under an explicit mask.

It runs anywhere and is the oracle the paged kernels are tested against. Its shapes depend on
the longest context of the batch (a host-side number), so it does not run in CUDA graphs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from blockspec.attention.base import AttentionBackend
from blockspec.forward_metadata import flat_slots

if TYPE_CHECKING:
    from blockspec.forward_metadata import ForwardMetadata


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                     scale: float, sink: torch.Tensor | None = None, impl: str = "sdpa") -> torch.Tensor:
    """q [B, Q, Hq, D], k/v [B, L, Hkv, D], allowed [B, Q, L] -> [B, Q, Hq, D] in q's dtype.

    ``impl="sdpa"`` without a sink: SDPA with GQA (no per-head copies of K/V). Otherwise (a sink
    [Hq], or ``impl="eager"``): scores and softmax in fp32, the sink as one extra logit per head
    that carries no value."""
    b, nq, nh, d = q.shape
    nkv = k.shape[2]
    rep = nh // nkv
    if sink is None and impl == "sdpa":
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
            attn_mask=allowed[:, None], scale=scale, enable_gqa=rep > 1)
        return out.transpose(1, 2)
    qf = q.float().reshape(b, nq, nkv, rep, d).permute(0, 2, 3, 1, 4)       # [B,kv,rep,Q,d]
    kf = k.float().permute(0, 2, 1, 3).unsqueeze(2)                           # [B,kv,1,L,d]
    vf = v.float().permute(0, 2, 1, 3).unsqueeze(2)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale                   # [B,kv,rep,Q,L]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    if sink is not None:
        s = sink.float().reshape(1, nkv, rep, 1, 1).expand(b, nkv, rep, nq, 1)
        probs = torch.softmax(torch.cat((scores, s), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vf)                                              # [B,kv,rep,Q,d]
    return out.permute(0, 3, 1, 2, 4).reshape(b, nq, nh, d).to(q.dtype)


class TorchNativeAttention(AttentionBackend):
    name = "torch_native"
    supports_cuda_graph = False

    def prepare(self, meta: ForwardMetadata) -> None:
        """Context slot table [B, L] (L = longest context), the padded query layout, and each
        padded query's position; shared by every layer of the forward."""
        dev = meta.req_slots.device
        B, L, qmax = meta.batch_size, max(meta.max_seq_len, 1), meta.max_q_len
        kpos = torch.arange(L, device=dev)
        ctx = flat_slots(meta.block_table, meta.req_slots[:, None].expand(B, L),
                         kpos[None].expand(B, L), meta.page_size)
        valid = kpos[None] < meta.seq_lens[:, None]
        row_off = torch.arange(meta.num_rows, device=dev) - meta.q_start[meta.row_req]
        qpos = torch.zeros(B, qmax, dtype=torch.long, device=dev)
        qpos[meta.row_req, row_off] = meta.positions
        meta.attn_state[self.name] = (ctx, valid, row_off, qpos, kpos)

    def attend(self, q, k_cache, v_cache, meta, *, scale, causal, window, sink):
        if self.name not in meta.attn_state:
            self.prepare(meta)
        ctx, valid, row_off, qpos, kpos = meta.attn_state[self.name]
        B, qmax = meta.batch_size, meta.max_q_len
        qp = q.new_zeros(B, qmax, *q.shape[1:])
        qp[meta.row_req, row_off] = q
        allowed = valid[:, None, :].expand(B, qmax, -1)
        if causal:
            allowed = allowed & (kpos[None, None] <= qpos[:, :, None])
        if window is not None:
            allowed = allowed & ((qpos[:, :, None] - kpos[None, None]) < window)
        # padding query rows may have nothing allowed; their (NaN) outputs are never read
        out = masked_attention(qp, k_cache[ctx], v_cache[ctx], allowed, scale, sink)
        return out[meta.row_req, row_off]
