"""Draft-model configuration for DFlash and DSpark checkpoints.

``parse_draft_config`` turns a draft ``config.json`` dict into a validated ``DraftConfig``, so
the engine and the model never re-read the raw dict. The backbone (Qwen3-style layers), the
target-layer defaulting, the attention layout and RoPE are read here; what a family spells its
own way is read by its module: ``draft_dflash.py`` (block size, mask token, refused query
layouts and variants), ``draft_dspark.py`` (gamma, ``sample_from_anchor``, noise token, Markov
head) and ``draft_nemotron35.py`` (the Nemotron 3.5 layout's detection and rules).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from blockspec.configs.draft_dflash import (DFLASH_ARCHITECTURES, dflash_block_size,
                                            dflash_mask_token, dflash_target_layers,
                                            reject_unsupported_dflash_layout)
from blockspec.configs.draft_dspark import (DSPARK_ARCHITECTURES, SUPPORTED_MARKOV_HEAD_TYPES,
                                            dspark_gamma, dspark_markov_head, dspark_mask_token,
                                            dspark_sample_from_anchor, dspark_target_layers)
from blockspec.configs.draft_fields import (MISSING, DraftConfigError, as_int_list,
                                            dspark_lookup, first, positive_int, sub)
from blockspec.configs.draft_nemotron35 import check_nemotron_35, is_nemotron_35_draft_config

__all__ = ["DraftConfig", "DraftConfigError", "SUPPORTED_MARKOV_HEAD_TYPES", "SUPPORTED_LAYER_TYPES",
           "build_target_layer_ids", "is_nemotron_35_draft_config", "parse_draft_config"]

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """sglang's default capture layers: ``[L//2]`` for a one-layer draft,
    else ``round(1 + i*(L-4)/(n-1))`` for i in 0..n-1 (HF "output of layer j" indexing)."""
    if num_target_layers <= 0 or num_draft_layers <= 0:
        raise DraftConfigError(
            f"cannot build default target_layer_ids from num_target_layers={num_target_layers}, "
            f"num_draft_layers={num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DraftConfig:
    """Everything the draft model and the engine need from a draft ``config.json``."""

    algorithm: str                      # "dflash" | "dspark"
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    attention_bias: bool
    vocab_size: int | None
    max_position_embeddings: int | None
    # block layout
    block_size: int                     # DFlash: B (anchor + B-1 masks); DSpark: gamma
    sample_from_anchor: bool            # DSpark's query-row layout switch; DFlash: False
    mask_token_id: int
    # target conditioning
    target_layer_ids: list[int]
    target_layer_ids_defaulted: bool
    num_target_layers: int | None
    # attention layout
    layer_types: list[str]
    sliding_window: int | None          # HF convention: the window includes the current token
    is_causal: bool | None              # config-level override of every layer's causality
    rope_thetas: list[float]            # one per draft layer (default rope only)
    attention_sink_bias: bool
    # checkpoint family
    has_embed_tokens: bool
    has_lm_head: bool
    eagle_aux_hidden_state_layer_ids: list[int] | None
    quantization_config: dict | None
    is_nemotron_35: bool
    input_embedding_scale: float | None
    # DSpark
    markov_rank: int | None = None
    markov_head_type: str | None = None
    raw: dict = field(default_factory=dict, repr=False)

    # ---- derived ----------------------------------------------------------------------------
    @property
    def num_context_features(self) -> int:
        """K: number of captured target layers (fc in-features = K * hidden_size)."""
        return len(self.target_layer_ids)

    @property
    def fc_in_features(self) -> int:
        return self.num_context_features * self.hidden_size

    @property
    def rope_theta(self) -> float:
        return self.rope_thetas[0]

    @property
    def gamma(self) -> int:
        """Number of draft tokens one block proposes."""
        return self.block_size - 1 if self.algorithm == "dflash" else self.block_size

    @property
    def drops_anchor_row(self) -> bool:
        """Whether query row 0 (the anchor) is discarded from the draft hidden.

        DFlash: always (row k predicts position p+k).  DSpark: when ``sample_from_anchor`` is
        False (row j of gamma+1 predicts p+j); with True, all gamma rows are drafts (row k
        predicts p+k+1).
        """
        return self.algorithm == "dflash" or not self.sample_from_anchor

    @property
    def query_len(self) -> int:
        """Rows of the block fed to the draft forward: ``[anchor, mask * (query_len-1)]``."""
        return self.gamma + 1 if self.drops_anchor_row else self.gamma

    def layer_is_causal(self, i: int) -> bool:
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None


def _parse_algorithm(d: Mapping[str, Any]) -> tuple[str, str]:
    archs = d.get("architectures")
    if isinstance(archs, str):
        archs = [archs]
    if not archs:
        raise DraftConfigError(
            "draft config has no 'architectures'; supported: "
            f"{', '.join(DFLASH_ARCHITECTURES + DSPARK_ARCHITECTURES)}")
    for a in archs:
        if a in DFLASH_ARCHITECTURES:
            return "dflash", a
        if a in DSPARK_ARCHITECTURES:
            return "dspark", a
    raise DraftConfigError(
        f"unsupported draft architecture {list(archs)!r}; supported: "
        f"{', '.join(DFLASH_ARCHITECTURES)} (DFlash), {', '.join(DSPARK_ARCHITECTURES)} (DSpark)")


def _parse_rope(d: Mapping[str, Any], layer_types: list[str]) -> list[float]:
    """Plain (default) RoPE only.  Accepts ``rope_theta`` + ``rope_scaling`` (legacy) or
    ``rope_parameters`` (flat, or keyed by layer type)."""
    top_theta = d.get("rope_theta")

    def one(params: Any, where: str) -> float:
        theta = top_theta
        if params is not None:
            if not isinstance(params, Mapping):
                raise DraftConfigError(f"draft config: {where} must be a dict, got {params!r}")
            rtype = params.get("rope_type", params.get("type", "default"))
            if rtype not in (None, "default"):
                raise DraftConfigError(
                    f"draft config: unsupported RoPE scaling type {rtype!r} in {where}; "
                    "only plain (default) rotary embeddings are supported")
            prf = params.get("partial_rotary_factor", 1.0)
            if prf is not None and float(prf) != 1.0:
                raise DraftConfigError(
                    f"draft config: partial_rotary_factor={prf} in {where} is not supported "
                    "(draft RoPE rotates the full head_dim)")
            if params.get("rope_theta") is not None:
                theta = params["rope_theta"]
        if theta is None:
            theta = 10000.0
        theta = float(theta)
        if not math.isfinite(theta) or theta <= 0:
            raise DraftConfigError(f"draft config: rope_theta must be positive, got {theta}")
        return theta

    prf = d.get("partial_rotary_factor")
    if prf is not None and float(prf) != 1.0:
        raise DraftConfigError(
            f"draft config: partial_rotary_factor={prf} is not supported "
            "(draft RoPE rotates the full head_dim)")
    scaling = d.get("rope_scaling")
    params = d.get("rope_parameters")
    if scaling is not None and params is not None:
        one(scaling, "rope_scaling")      # validate both; rope_parameters wins
    if params is None:
        params = scaling
        where = "rope_scaling"
    else:
        where = "rope_parameters"
    if isinstance(params, Mapping) and params and all(k in SUPPORTED_LAYER_TYPES or k == "linear_attention"
                                                       for k in params):
        # per-layer-type parameters (transformers 5 style)
        out = []
        for lt in layer_types:
            if lt not in params:
                raise DraftConfigError(f"draft config: {where} has no entry for layer type {lt!r}")
            out.append(one(params[lt], f"{where}.{lt}"))
        return out
    theta = one(params, where)
    return [theta] * len(layer_types)


def parse_draft_config(d: Mapping[str, Any], *, target_num_layers: int | None = None) -> DraftConfig:
    """Parse and validate a DFlash / DSpark draft ``config.json`` dict.

    ``target_num_layers`` is used for the default ``target_layer_ids`` when the config gives
    neither the ids nor ``num_target_layers``.
    """
    if not isinstance(d, Mapping):
        raise DraftConfigError(f"draft config must be a dict, got {type(d).__name__}")
    algorithm, arch = _parse_algorithm(d)
    is_dspark = algorithm == "dspark"
    dfc = sub(d, "dflash_config")

    # ---- backbone ----------------------------------------------------------------------------
    def req(key: str) -> int:
        if d.get(key) is None:
            raise DraftConfigError(f"draft config: missing required field {key!r}")
        return positive_int(d[key], key)

    hidden = req("hidden_size")
    n_layers = req("num_hidden_layers")
    n_heads = req("num_attention_heads")
    n_kv = positive_int(d["num_key_value_heads"], "num_key_value_heads") \
        if d.get("num_key_value_heads") is not None else n_heads
    if n_heads % n_kv:
        raise DraftConfigError(
            f"draft config: num_attention_heads={n_heads} is not a multiple of "
            f"num_key_value_heads={n_kv}")
    if d.get("head_dim") is not None:
        head_dim = positive_int(d["head_dim"], "head_dim")
    else:
        if hidden % n_heads:
            raise DraftConfigError("draft config: no head_dim and hidden_size is not divisible "
                                   "by num_attention_heads")
        head_dim = hidden // n_heads
    if head_dim % 2:
        raise DraftConfigError(f"draft config: head_dim={head_dim} must be even for RoPE")
    inter = req("intermediate_size")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise DraftConfigError(f"draft config: hidden_act={act!r} is not supported (only 'silu')")
    eps = float(d.get("rms_norm_eps", 1e-6))
    vocab = positive_int(d["vocab_size"], "vocab_size") if d.get("vocab_size") is not None else None
    max_pos = d.get("max_position_embeddings")

    # ---- the family's block layout: gamma / block size, query rows, mask token ----------------
    if is_dspark:
        block_size = dspark_gamma(d)
        sample_from_anchor = dspark_sample_from_anchor(d)
        mask = dspark_mask_token(d)
    else:
        block_size = dflash_block_size(d)
        reject_unsupported_dflash_layout(d)
        sample_from_anchor = False
        mask = dflash_mask_token(d)
    if mask is MISSING:
        hint = ""
        tok = first((dfc, "mask_token"), (d, "mask_token"))
        if tok is not MISSING:
            hint = (f" (only the string mask_token={tok!r} is given; resolve it with the "
                    "tokenizer and set dflash_config.mask_token_id)")
        raise DraftConfigError("draft config: mask_token_id is required "
                               "(dflash_config.mask_token_id, mask_token_id"
                               + (" or dspark_noise_token_id" if is_dspark else "") + ")" + hint)
    if isinstance(mask, bool) or not isinstance(mask, int) or mask < 0:
        raise DraftConfigError(f"draft config: mask_token_id must be a non-negative int, got {mask!r}")

    # ---- target layers ------------------------------------------------------------------------
    ntl, ids = dspark_target_layers(d) if is_dspark else dflash_target_layers(d)
    num_target_layers = None if ntl is MISSING else positive_int(ntl, "num_target_layers")
    defaulted = ids is MISSING
    if defaulted:
        depth = num_target_layers if num_target_layers is not None else target_num_layers
        if depth is None:
            raise DraftConfigError(
                "draft config: no target_layer_ids and no num_target_layers; cannot pick the "
                "target layers to capture (pass target_num_layers=...)")
        target_layer_ids = build_target_layer_ids(int(depth), n_layers)
        if num_target_layers is None:
            num_target_layers = int(depth)
    else:
        target_layer_ids = as_int_list(ids, "target_layer_ids")
        if not target_layer_ids:
            raise DraftConfigError("draft config: target_layer_ids is empty")
        if any(i < 0 for i in target_layer_ids):
            raise DraftConfigError(f"draft config: negative target layer id in {target_layer_ids}")
        if num_target_layers is not None and max(target_layer_ids) >= num_target_layers:
            raise DraftConfigError(
                f"draft config: target_layer_ids {target_layer_ids} exceed num_target_layers="
                f"{num_target_layers}")

    # ---- attention layout ---------------------------------------------------------------------
    lts = d.get("layer_types")
    if lts is not None:
        if not isinstance(lts, (list, tuple)) or len(lts) != n_layers:
            raise DraftConfigError(
                f"draft config: layer_types must list one type per draft layer ({n_layers}), "
                f"got {lts!r}")
        for lt in lts:
            if lt not in SUPPORTED_LAYER_TYPES:
                raise DraftConfigError(
                    f"draft config: unsupported layer type {lt!r}; supported: "
                    f"{', '.join(SUPPORTED_LAYER_TYPES)}")
        layer_types = list(lts)
    elif dfc.get("use_swa"):
        # Nemotron 3.5 style: SWA switched on in dflash_config, window from swa_window_size.
        layer_types = ["sliding_attention"] * n_layers
    elif d.get("use_sliding_window") and d.get("sliding_window") is not None:
        # transformers' Qwen3 derivation when layer_types is absent.
        mwl = int(d.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if i >= mwl else "full_attention"
                       for i in range(n_layers)]
    else:
        layer_types = ["full_attention"] * n_layers
    sw = first((d, "sliding_window"), (dfc, "swa_window_size"))
    sliding_window = None if sw is MISSING else positive_int(sw, "sliding_window")
    if "sliding_attention" in layer_types and sliding_window is None:
        raise DraftConfigError("draft config: sliding_attention layers need sliding_window "
                               "(or dflash_config.swa_window_size)")
    ic = first((d, "is_causal"), (dfc, "causal"))
    is_causal = None if ic is MISSING else bool(ic)
    rope_thetas = _parse_rope(d, layer_types)

    sink = first((dfc, "attention_sink_bias"), (d, "attention_sink_bias"))
    if is_dspark and sink is MISSING:
        sink = dspark_lookup(d, "attention_sink_bias")
    attention_sink_bias = False if sink is MISSING else bool(sink)

    # ---- checkpoint family ----------------------------------------------------------------------
    aux = d.get("eagle_aux_hidden_state_layer_ids")
    aux = as_int_list(aux, "eagle_aux_hidden_state_layer_ids") if aux is not None else None
    qc = d.get("quantization_config")
    qc = dict(qc) if isinstance(qc, Mapping) else None
    nemotron = is_nemotron_35_draft_config(d)
    ies = first((dfc, "input_embedding_scale"), (d, "input_embedding_scale"))
    input_embedding_scale = None if ies is MISSING else float(ies)

    # ---- DSpark Markov head, Nemotron 3.5 requirements -----------------------------------------
    markov_rank = markov_head_type = None
    if is_dspark:
        markov_rank, markov_head_type = dspark_markov_head(d, vocab)
    if nemotron:
        check_nemotron_35(vocab, markov_head_type)

    return DraftConfig(
        algorithm=algorithm, architecture=arch, hidden_size=hidden, num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=head_dim,
        intermediate_size=inter, rms_norm_eps=eps, attention_bias=bool(d.get("attention_bias", False)),
        vocab_size=vocab, max_position_embeddings=max_pos, block_size=block_size,
        sample_from_anchor=sample_from_anchor, mask_token_id=int(mask),
        target_layer_ids=target_layer_ids, target_layer_ids_defaulted=defaulted,
        num_target_layers=num_target_layers, layer_types=layer_types,
        sliding_window=sliding_window, is_causal=is_causal, rope_thetas=rope_thetas,
        attention_sink_bias=attention_sink_bias, has_embed_tokens=bool(d.get("has_embed_tokens")),
        has_lm_head=bool(d.get("has_lm_head")), eagle_aux_hidden_state_layer_ids=aux,
        quantization_config=qc, is_nemotron_35=nemotron,
        input_embedding_scale=input_embedding_scale, markov_rank=markov_rank,
        markov_head_type=markov_head_type, raw=dict(d))
