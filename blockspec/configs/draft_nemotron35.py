"""The Nemotron 3.5 Lightning draft layout (DFlash or DSpark): its detection and the rules only
it carries. The detector is deliberately narrow, exactly the five conditions the published
checkpoints meet, so a generic draft that happens to carry one of these fields is unaffected."""
from __future__ import annotations

from typing import Any, Mapping

from blockspec.configs.draft_fields import MISSING, DraftConfigError, dflash_then_top

# only these two architectures name the layout (a third DSpark name exists for generic drafts)
NEMOTRON_35_ARCHITECTURES = ("DFlashDraftModel", "Qwen3DSparkModel")
NEMOTRON_35_QUANT_ALGO = "W4A16_NVFP4"


def is_nemotron_35_draft_config(config: Mapping[str, Any]) -> bool:
    """True only for the published Nemotron 3.5 Lightning DFlash/DSpark draft family.

    All five must hold: (1) ``architectures`` names ``DFlashDraftModel`` or
    ``Qwen3DSparkModel``; (2) ``has_embed_tokens`` truthy and ``has_lm_head`` falsy;
    (3) ``quantization_config.quant_algo == "W4A16_NVFP4"``; (4) ``target_layer_ids``
    (``dflash_config`` first, then top level) and ``eagle_aux_hidden_state_layer_ids`` are
    non-empty, equally long and ``aux[i] == target[i] + 1``; (5) ``sample_from_anchor``
    (``dflash_config`` first, then top level, default True) is exactly ``False``.
    """
    if not isinstance(config, Mapping):
        return False
    archs = config.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not any(a in NEMOTRON_35_ARCHITECTURES for a in archs):
        return False
    if not config.get("has_embed_tokens") or config.get("has_lm_head"):
        return False
    qc = config.get("quantization_config")
    if not isinstance(qc, Mapping) or qc.get("quant_algo") != NEMOTRON_35_QUANT_ALGO:
        return False
    tgt = dflash_then_top(config, "target_layer_ids")
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if tgt is MISSING or not isinstance(tgt, (list, tuple)) or not isinstance(aux, (list, tuple)):
        return False
    if len(tgt) == 0 or len(tgt) != len(aux):
        return False
    try:
        if any(int(a) != int(t) + 1 for a, t in zip(aux, tgt)):
            return False
    except (TypeError, ValueError):
        return False
    sfa = dflash_then_top(config, "sample_from_anchor")
    if sfa is MISSING:
        sfa = True
    return sfa is False


def check_nemotron_35(vocab: int | None, markov_head_type: str | None) -> None:
    """The layout's own requirements: its draft embeds tokens itself (so it needs a vocabulary)
    and its DSpark head is the vanilla Markov head."""
    if markov_head_type is not None and markov_head_type != "vanilla":
        raise DraftConfigError(
            f"Nemotron 3.5 DSpark draft: only the 'vanilla' Markov head is supported, "
            f"got {markov_head_type!r}")
    if vocab is None:
        raise DraftConfigError("Nemotron 3.5 draft config: vocab_size is required for embed_tokens")
