"""Load a DFlash / DSpark draft checkpoint against a loaded target, with load-time checks."""
from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch

from blockspec.checkpoint import TensorSource, load_state, read_config
from blockspec.configs.draft import DraftConfig, DraftConfigError, parse_draft_config
from blockspec.configs.nemotron_h import NemotronHConfig
from blockspec.models.dflash import DFlashDraftModel
from blockspec.models.draft import build_draft_model
from blockspec.models.loader import load_quant_plan, prepare_quantized
from blockspec.speculative.draft_names import normalize_draft_tensor_names

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


def validate_against_target(cfg: DraftConfig, target_hidden: int, target_vocab: int,
                            target_num_layers: int, fc_in_features_found: int | None) -> None:
    """Raise ``DraftConfigError`` when the draft cannot run with this target.

    ``fc_in_features_found`` is the *logical* in-features of the loaded ``fc.weight``
    (for packed Nemotron weights use ``DFlashDraftModel.fc_in_features_from_weight``);
    ``None`` skips that check.
    """
    problems: list[str] = []
    if cfg.hidden_size != target_hidden:
        problems.append(
            f"draft hidden_size {cfg.hidden_size} != target hidden size {target_hidden} "
            "(the draft reads the target's embeddings, LM head and hidden states)")
    k = cfg.num_context_features
    if fc_in_features_found is not None and fc_in_features_found != k * cfg.hidden_size:
        problems.append(
            f"K mismatch: fc.weight has {fc_in_features_found} in-features but "
            f"{k} target_layer_ids x hidden {cfg.hidden_size} = {k * cfg.hidden_size}")
    if cfg.mask_token_id >= target_vocab:
        problems.append(f"mask_token_id {cfg.mask_token_id} >= target vocab size {target_vocab} "
                        "(the target embedding is never resized)")
    if cfg.is_nemotron_35 and cfg.vocab_size is not None and cfg.mask_token_id >= cfg.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} >= draft embed_tokens rows "
                        f"{cfg.vocab_size}")
    bad = [i for i in cfg.target_layer_ids if i < 0 or i >= target_num_layers]
    if bad:
        problems.append(f"target_layer_ids {cfg.target_layer_ids} reach beyond the target's "
                        f"{target_num_layers} layers (ids must be < {target_num_layers}): {bad}")
    if cfg.num_target_layers is not None and cfg.num_target_layers != target_num_layers:
        if cfg.target_layer_ids_defaulted:
            problems.append(
                f"draft config num_target_layers={cfg.num_target_layers} != target depth "
                f"{target_num_layers}, and target_layer_ids were derived from it")
        else:
            warnings.warn(f"draft was trained for a {cfg.num_target_layers}-layer target; this "
                          f"target has {target_num_layers} layers", stacklevel=2)
    if cfg.algorithm == "dspark" and cfg.vocab_size is not None and cfg.vocab_size != target_vocab:
        problems.append(f"DSpark Markov head vocab {cfg.vocab_size} != target vocab "
                        f"{target_vocab} (its bias is added to the target-LM-head logits)")
    if problems:
        raise DraftConfigError("draft/target mismatch: " + "; ".join(problems))


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
