"""The head that scores draft blocks, when it should not be the target's lm_head as stored.

A draft's logits only choose proposals; the verify forward scores them with the target's own
head, so any head here is lossless and changes acceptance only. On a bf16 target the draft's
read of the 131k-row shared head is the largest single read of a draft step (0.17 ms of a
~1.2 ms DSpark step on lightning-mini); a W4A16 NVFP4 copy, quantized here once with the same
code as the checkpoint quantizer, reads ~3.6x fewer bytes. It is what a Lightning-quantized
target hands its draft anyway (its lm_head is W4A16 NVFP4).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from blockspec.layers.linear import Linear
from blockspec.quant.linear import NVFP4Linear, prepare_w4a16
from blockspec.quant.nvfp4 import GROUP_SIZE, quantize_nvfp4

log = logging.getLogger("blockspec")


def _source_weight(draft: nn.Module, target: nn.Module) -> torch.Tensor | None:
    """The dense [V, H] weight the draft scores with today, or None if it is not dense."""
    head = getattr(draft, "lm_head", None)
    if head is None:
        if getattr(target, "tied_head", False):
            return target.backbone.embeddings.weight
        head = target.lm_head
    return head.weight if type(head) is Linear else None


def make_draft_head(choice: str, draft: nn.Module, target: nn.Module) -> NVFP4Linear | None:
    """The worker's head for ``--speculative-draft-lm-head`` (None: score as stored). ``auto``
    makes the copy only where it pays and is what a GPU serves anyway: a dense bf16/fp16 head
    on CUDA (on the demo family it changed acceptance by -0.15 % for DSpark and 0 for DFlash,
    docs/benchmarks.md); CPU runs and fp32 models keep the head as stored."""
    if choice == "target":
        return None
    tp = getattr(getattr(target, "tp", None), "size", 1)
    if tp > 1 and getattr(draft, "lm_head", None) is None and not getattr(target, "tied_head", False):
        # a copy of this rank's rows would score only its part of the vocabulary
        log.info("draft lm_head: the target's head is split over %d tensor-parallel ranks; "
                 "drafts score with it (gathered), not with a copy", tp)
        return None
    if choice == "auto":
        w = _source_weight(draft, target)
        if w is None or not w.is_cuda or w.dtype not in (torch.bfloat16, torch.float16):
            return None
    return nvfp4_draft_head(draft, target)


def nvfp4_draft_head(draft: nn.Module, target: nn.Module) -> NVFP4Linear | None:
    """A W4A16 NVFP4 copy of the head the draft would use; None (with a log line) when that
    head is already quantized or its width is not a multiple of the NVFP4 group."""
    w = _source_weight(draft, target)
    if w is None:
        log.info("draft lm_head: the target's head is already quantized; drafts use it as is")
        return None
    v, h = w.shape
    if h % GROUP_SIZE:
        log.warning("draft lm_head: hidden size %d is not a multiple of %d; keeping the "
                    "dense head", h, GROUP_SIZE)
        return None
    with torch.no_grad():
        packed, scale, scale2 = quantize_nvfp4(w.detach())
        head = NVFP4Linear(h, v, bias=False, dtype=w.dtype, prefix="draft_lm_head").to(w.device)
        head.weight.copy_(packed)
        head.weight_scale.copy_(scale)
        head.weight_scale_2.copy_(scale2)
    prepare_w4a16(head)
    log.info("draft lm_head: W4A16 NVFP4 copy of the %s head (%d x %d)",
             "draft's" if getattr(draft, "lm_head", None) is not None else "target's", v, h)
    return head.eval()
