"""The draft model a draft config names: DFlash's backbone alone, or with DSpark's Markov head."""
from __future__ import annotations

import torch

from blockspec.configs.draft import DraftConfig
from blockspec.layers.linear import QuantPlan
from blockspec.models.dflash import DFlashDraftModel
from blockspec.models.dspark import DSparkDraftModel


def build_draft_model(cfg: DraftConfig, quant: QuantPlan | None = None,
                      dtype: torch.dtype | None = torch.float32, attn_impl: str = "eager"
                      ) -> DFlashDraftModel:
    """``DFlashDraftModel`` or ``DSparkDraftModel`` according to ``cfg.algorithm``."""
    cls = DSparkDraftModel if cfg.algorithm == "dspark" else DFlashDraftModel
    return cls(cfg, quant, dtype, attn_impl)
