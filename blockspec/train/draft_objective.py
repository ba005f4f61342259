"""The DFlash / DSpark training objective (the papers' block loss, with DSpark's Markov head).

Per sequence, random distinct anchors are drawn among the generated positions (the answer,
from its leading newline on: every token that can be an anchor at serving time).  Each anchor
``a`` makes one block ``[tok[a], MASK, ...]`` at positions ``a, a+1, ...`` that attends to the
target features of the context strictly before ``a`` (the anchor's own features do not exist
at serving time) and to its own block, non-causally.  Draft k (k = 0..gamma-1, whatever the
row layout) predicts ``tok[a+k+1]`` through the frozen target LM head; the cross-entropy is
weighted by ``exp(-k / decay)`` and normalised by the weight sum.

DSpark adds its Markov head, trained left to right with the true previous token:
``logits_k = base_k + bias(tok[a+k], h_k)`` -- the walk ``run_markov_block`` does at serving
time, with teacher forcing.

The backbone runs through the dense ``forward_block`` API: each block gets its sequence's
context K/V (one projection per sequence, gathered per block) and a validity mask that cuts
the context at its anchor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from blockspec.models.dflash import DFlashDraftModel


def sample_anchors(lengths: torch.Tensor, starts: torch.Tensor, num_anchors: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``num_anchors`` distinct anchors per sequence in ``[start, length-2]``, sorted.

    Returns (anchors [B, A] long, valid [B, A] bool); invalid slots hold a valid position.
    """
    b = lengths.shape[0]
    t = int(lengths.max())
    pos = torch.arange(t)[None]
    ok = (pos >= starts[:, None]) & (pos <= lengths[:, None] - 2)
    score = torch.rand(b, t, generator=generator).masked_fill(~ok, -1.0)
    a = min(num_anchors, t)
    top, idx = score.topk(a, dim=1)
    valid = top >= 0
    idx = torch.where(valid, idx, starts[:, None].expand(-1, a))
    order = torch.argsort(torch.where(valid, idx, t + idx), dim=1)
    return idx.gather(1, order), valid.gather(1, order)


def draft_loss(draft: DFlashDraftModel, target, feats: torch.Tensor, ids: torch.Tensor,
               lengths: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
               decay: float) -> tuple[torch.Tensor, dict]:
    """Weighted block cross-entropy for one batch.

    ``target`` is blockspec's ``NemotronHForCausalLM`` (frozen: embedding and LM head are
    used); feats ``[B, S, K*H]`` target features per position; ids ``[B, S]``; lengths ``[B]``;
    anchors/valid ``[B, A]``.  All tensors on the draft's device.
    """
    cfg = draft.config
    dev = ids.device
    b, s = ids.shape
    gamma, q = cfg.gamma, cfg.query_len
    seq = torch.arange(b, device=dev)[:, None].expand_as(anchors)[valid]        # [n]
    a = anchors[valid]                                                           # [n]
    n = a.shape[0]

    # context K/V: one projection per sequence, gathered per block, cut at the anchor
    pos_ctx = torch.arange(s, device=dev)[None].expand(b, s)
    ctx = draft.project_context(feats, pos_ctx)
    ks = [k[seq] for k, _ in ctx]
    vs = [v[seq] for _, v in ctx]
    ctx_valid = torch.arange(s, device=dev)[None] < a[:, None]                  # [n, S]

    # the block: [anchor, mask, ...] at positions a .. a+q-1
    block = torch.full((n, q), cfg.mask_token_id, dtype=torch.long, device=dev)
    block[:, 0] = ids[seq, a]
    positions = a[:, None] + torch.arange(q, device=dev)[None]
    x = draft.embed_block(block, target.backbone.embeddings)
    h = draft.select_draft_hidden(draft.forward_block(x, positions, ks, vs, ctx_valid))
    logits = target.compute_logits(h)                                           # [n, gamma, V]

    # labels: draft k predicts tok[a+k+1]; the previous token (Markov) is tok[a+k]
    k = torch.arange(gamma, device=dev)[None]
    label_pos = a[:, None] + 1 + k                                              # [n, gamma]
    in_seq = label_pos < lengths[seq][:, None]
    labels = ids[seq[:, None], label_pos.clamp(max=s - 1)]
    if cfg.algorithm == "dspark":
        prev = ids[seq[:, None], (label_pos - 1).clamp(max=s - 1)]
        head = draft.markov_head
        state = head.init_state(n, dev, h.dtype)
        steps = []
        for j in range(gamma):
            bias, state = head.step(prev[:, j], h[:, j], state)
            steps.append(logits[:, j] + bias.float())
        logits = torch.stack(steps, dim=1)
    weights = torch.exp(-k.float() / decay).expand(n, gamma) * in_seq
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                         reduction="none").view(n, gamma)
    loss = (ce * weights).sum() / weights.sum().clamp_min(1e-9)
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels) & in_seq
        # accepted prefix length of greedy drafts against the true continuation
        prefix = torch.cumprod(hit.long(), dim=1).sum(1).float()
        stats = {"blocks": n, "acc0": float(hit[:, 0].float().mean()),
                 "prefix": float(prefix.mean())}
    return loss, stats
