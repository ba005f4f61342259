"""DFlash's fields of a draft config: block size, mask token and target layers as DFlash
checkpoints spell them (``dflash_config`` first, then the top level), and the refusal of DFlash
query layouts and variants blockspec does not run."""
from __future__ import annotations

from typing import Any, Mapping

from blockspec.configs.draft_fields import MISSING, DraftConfigError, first, positive_int, sub

DFLASH_ARCHITECTURES = ("DFlashDraftModel",)
DEFAULT_DFLASH_BLOCK_SIZE = 16

# Fields that ask for a query layout other than the 1+N one blockspec runs (vLLM and sglang
# refuse both at load); each is accepted only when absent, null or false.
DFLASH_ANCHOR_FIRST_FIELDS = ("sample_from_anchor", "query_zero_predicts_next")
DFLASH_LAYOUT = ("the 1+N query layout (row 0 is the anchor and its output is discarded; rows "
                 "1..B-1 predict positions p+1..p+B-1)")
# dflash_config fields of DFlash variants blockspec does not implement, with the values that
# mean "variant off"; any other value would be ignored and run wrongly, so it is refused.
DFLASH_VARIANT_FIELDS = {
    "projector_type": (),                      # Domino: anchor-first with a GRU projector
    "conv_kernel_size": (0,),                  # DFlash2 grouped conv
    "conv_group_size": (0,),
    "selector_rank": (0,),                     # DFlash2 candidate selector
    "selector_top_k": (0,),
    "output_multiplier": (1,),
    "final_logit_softcapping": (0,),
    "attention_value_scale": (1,),
}


def reject_unsupported_dflash_layout(d: Mapping[str, Any]) -> None:
    """A DFlash draft trained for another query layout would run here with every draft row
    shifted by one and acceptance collapsed, without any error: refuse it at load."""
    dfc = sub(d, "dflash_config")
    for key in DFLASH_ANCHOR_FIRST_FIELDS:
        for where, m in ((f"dflash_config.{key}", dfc), (key, d)):
            value = m.get(key)
            if value is None or value is False:
                continue
            if value is not True:
                raise DraftConfigError(f"DFlash draft config: {where} must be true or false, "
                                       f"got {value!r}")
            raise DraftConfigError(
                f"DFlash draft config: {where}=true asks for the anchor-first query layout "
                f"(row 0 predicts the next token); blockspec runs DFlash only in {DFLASH_LAYOUT}")
    for key, off in DFLASH_VARIANT_FIELDS.items():
        value = dfc.get(key)
        if value is None or (not isinstance(value, bool) and value in off):
            continue
        raise DraftConfigError(
            f"DFlash draft config: dflash_config.{key}={value!r} selects a DFlash variant that "
            f"blockspec does not implement; blockspec runs plain DFlash in {DFLASH_LAYOUT}")


def dflash_block_size(d: Mapping[str, Any]) -> int:
    """B: the anchor plus B-1 mask rows (so at least 2)."""
    bs = first((sub(d, "dflash_config"), "block_size"), (d, "block_size"))
    block_size = DEFAULT_DFLASH_BLOCK_SIZE if bs is MISSING else positive_int(bs, "block_size")
    if block_size < 2:
        raise DraftConfigError(f"draft config: DFlash block_size must be >= 2, got {block_size}")
    return block_size


def dflash_mask_token(d: Mapping[str, Any]) -> Any:
    return first((sub(d, "dflash_config"), "mask_token_id"), (d, "mask_token_id"))


def dflash_target_layers(d: Mapping[str, Any]) -> tuple[Any, Any]:
    """(num_target_layers, target_layer_ids) as given, each possibly MISSING."""
    dfc = sub(d, "dflash_config")
    return (first((dfc, "num_target_layers"), (d, "num_target_layers")),
            first((dfc, "target_layer_ids"), (d, "target_layer_ids")))
