"""Load a DFlash / DSpark draft checkpoint against a loaded target, with load-time checks."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from blockspec.checkpoint import TensorSource, load_state, read_config
from blockspec.models.dflash import DFlashDraftModel, build_draft_model
from blockspec.configs.draft import (DraftConfig, DraftConfigError,
                                           normalize_draft_tensor_names, parse_draft_config,
                                           validate_against_target)
from blockspec.models.loader import load_quant_plan, prepare_quantized
from blockspec.configs.nemotron_h import NemotronHConfig

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


def _check_own_head(cfg: DraftConfig, names: dict[str, str], src: TensorSource,
                    target: NemotronHConfig, folder: Path) -> bool:
    """Whether the draft scores with its own head: the target's rule (a folder's own
    ``lm_head.weight`` is used, the shared head only when there is none). Logs which."""
    ckpt = names.get("lm_head.weight")
    if ckpt is None:
        if cfg.has_lm_head:
            raise DraftConfigError(f"draft checkpoint {folder.name}: config.json says "
                                   "has_lm_head=true but the folder has no lm_head.weight")
        log.info("draft %s: output head is the target's (no lm_head.weight in the draft)",
                 folder.name)
        return False
    rows = src.shape(ckpt)[0]
    if rows != target.vocab_size:
        raise DraftConfigError(
            f"draft checkpoint {folder.name}: {ckpt} has {rows} rows but the target vocabulary "
            f"has {target.vocab_size}; a draft head must score the target's vocabulary "
            "(draft-vocabulary mappings such as d2t are not supported)")
    log.info("draft %s: output head is the draft's own %s", folder.name, ckpt)
    return True


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
        names = normalize_draft_tensor_names(src.names(), cfg, keep_lm_head=True)  # param -> ckpt
        quant = load_quant_plan(folder, raw, list(names))     # module names in draft space
        own_head = _check_own_head(cfg, names, src, target, folder)
        with torch.device(device):
            model = build_draft_model(cfg, quant, dtype)
            if own_head:
                model.add_own_head(target.vocab_size, quant, dtype)
        # config-level mismatches first: they explain a wrong fc shape better than the shape does
        validate_against_target(cfg, target.hidden_size, target.vocab_size, target.num_layers, None)
        if "fc.weight" in names:
            model.fc_in_features_from_weight(src.shape(names["fc.weight"]))
        back = {ckpt: param for param, ckpt in names.items()}
        load_state(model, src, rename=back.get, what=f"draft checkpoint {folder.name}")
    prepare_quantized(model)
    model.eval()
    return model
