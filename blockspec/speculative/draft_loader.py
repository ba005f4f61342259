"""Load a DFlash / DSpark draft checkpoint against a loaded target, with load-time checks."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from blockspec.checkpoint import TensorSource, load_state, read_config
from blockspec.models.dflash import DFlashDraftModel, build_draft_model
from blockspec.models.draft_config import (DraftConfig, normalize_draft_tensor_names,
                                           parse_draft_config, validate_against_target)
from blockspec.models.loader import load_quant_plan
from blockspec.models.nemotron_h_config import NemotronHConfig

log = logging.getLogger("blockspec")


def apply_num_draft_tokens(cfg: DraftConfig, num_draft_tokens: int | None) -> None:
    """``speculative_num_draft_tokens`` is the verify width: B for DFlash, gamma + 1 for DSpark.
    It overrides the checkpoint's block size with a warning (sglang behaviour)."""
    if num_draft_tokens is None:
        return
    block = num_draft_tokens if cfg.algorithm == "dflash" else num_draft_tokens - 1
    if block != cfg.block_size:
        log.warning("speculative_num_draft_tokens=%d overrides the draft checkpoint's block size "
                    "(%s %d -> %d)", num_draft_tokens,
                    "block_size" if cfg.algorithm == "dflash" else "gamma", cfg.block_size, block)
        cfg.block_size = block


def load_draft(path: str | Path, target: NemotronHConfig, dtype: torch.dtype, device: torch.device,
               num_draft_tokens: int | None = None, expect: str | None = None) -> DFlashDraftModel:
    folder = Path(path)
    raw = read_config(folder)
    cfg = parse_draft_config(raw, target_num_layers=target.num_layers)
    if expect is not None and cfg.algorithm != expect.lower():
        raise ValueError(f"speculative_algorithm={expect} but the draft at {folder} is a "
                         f"{cfg.algorithm.upper()} checkpoint ({cfg.architecture})")
    apply_num_draft_tokens(cfg, num_draft_tokens)
    with TensorSource(folder) as src:
        names = normalize_draft_tensor_names(src.names(), cfg)     # param name -> checkpoint name
        quant = load_quant_plan(folder, raw, list(names))     # module names in draft space
        with torch.device(device):
            model = build_draft_model(cfg, quant, dtype)
        # config-level mismatches first: they explain a wrong fc shape better than the shape does
        validate_against_target(cfg, target.hidden_size, target.vocab_size, target.num_layers, None)
        if "fc.weight" in names:
            model.fc_in_features_from_weight(src.shape(names["fc.weight"]))
        back = {ckpt: param for param, ckpt in names.items()}
        load_state(model, src, rename=back.get, what=f"draft checkpoint {folder.name}")
    model.eval()
    return model
