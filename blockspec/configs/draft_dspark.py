"""DSpark's fields of a draft config: gamma, the query-row layout (``sample_from_anchor``), the
noise/mask token, target layers and the Markov head, each looked up in DSpark's order
(``dspark_<key>`` > ``dspark_config`` > ``text_config`` > top level > ``dflash_config``)."""
from __future__ import annotations

from typing import Any, Mapping

from blockspec.configs.draft_fields import (MISSING, DraftConfigError, dspark_lookup, first,
                                            positive_int, sub)

DSPARK_ARCHITECTURES = ("Qwen3DSparkModel", "DSparkDraftModel")
DEFAULT_DSPARK_GAMMA = 7
SUPPORTED_MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


def _speculators_gamma(d: Mapping[str, Any]) -> Any:
    """A speculators-format config keeps gamma as a proposal method's ``speculative_tokens``."""
    methods = sub(d, "speculators_config").get("proposal_methods")
    if isinstance(methods, list):
        for m in methods:
            if isinstance(m, Mapping) and m.get("speculative_tokens") is not None:
                return m["speculative_tokens"]
    return MISSING


def dspark_gamma(d: Mapping[str, Any]) -> int:
    bs = first((d, "dspark_block_size"), (sub(d, "dspark_config"), "block_size"),
               (sub(d, "text_config"), "block_size"), (d, "block_size"),
               (sub(d, "dflash_config"), "block_size"))
    if bs is MISSING:
        bs = _speculators_gamma(d)
    return DEFAULT_DSPARK_GAMMA if bs is MISSING else positive_int(bs, "DSpark block_size (gamma)")


def dspark_sample_from_anchor(d: Mapping[str, Any]) -> bool:
    sfa = dspark_lookup(d, "sample_from_anchor")
    return True if sfa is MISSING else bool(sfa)


def dspark_mask_token(d: Mapping[str, Any]) -> Any:
    dsc, dfc = sub(d, "dspark_config"), sub(d, "dflash_config")
    return first((d, "dspark_noise_token_id"), (d, "dspark_mask_token_id"),
                 (dsc, "mask_token_id"), (dsc, "noise_token_id"),
                 (sub(d, "text_config"), "mask_token_id"), (d, "mask_token_id"),
                 (dfc, "mask_token_id"))


def dspark_target_layers(d: Mapping[str, Any]) -> tuple[Any, Any]:
    """(num_target_layers, target_layer_ids) as given, each possibly MISSING."""
    return dspark_lookup(d, "num_target_layers"), dspark_lookup(d, "target_layer_ids")


def dspark_markov_head(d: Mapping[str, Any], vocab: int | None) -> tuple[int, str]:
    """(rank, head type): DSpark needs its Markov head, and the head's bias spans the vocabulary."""
    r = dspark_lookup(d, "markov_rank")
    if r is MISSING:
        raise DraftConfigError("DSpark draft config: markov_rank is required (DSpark needs its "
                               "Markov head; set markov_rank > 0)")
    if isinstance(r, bool) or not isinstance(r, (int, float)) or int(r) != r or int(r) <= 0:
        raise DraftConfigError(f"DSpark draft config: markov_rank must be > 0, got {r!r}")
    ht = dspark_lookup(d, "markov_head_type")
    head_type = "vanilla" if ht is MISSING else ht
    if head_type not in SUPPORTED_MARKOV_HEAD_TYPES:
        raise DraftConfigError(
            f"DSpark draft config: unsupported markov_head_type {head_type!r}; "
            f"supported: {', '.join(SUPPORTED_MARKOV_HEAD_TYPES)}")
    if vocab is None:
        raise DraftConfigError("DSpark draft config: vocab_size is required for the Markov head")
    return int(r), head_type
