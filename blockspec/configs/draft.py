"""Draft-model configuration for DFlash and DSpark checkpoints.

``parse_draft_config`` turns a draft ``config.json`` dict into a validated ``DraftConfig``.
Every rule lives here so the engine and the model never re-read the raw dict:

* algorithm kind from ``architectures``;
* block size (DFlash) / gamma (DSpark) with the lookup orders of the specs;
* target layer ids, with the sglang default spread when absent;
* mask token, attention layout (layer types, sliding window, causality), RoPE parameters;
* DSpark Markov head (rank, type) and the query-row layout (``sample_from_anchor``);
* DFlash query layouts and variants blockspec does not run, refused by name;
* Nemotron 3.5 detection (``is_nemotron_35_draft_config``), exactly the five published conditions.

``validate_against_target`` checks a parsed draft against the target it will run with, and
``normalize_draft_tensor_names`` maps checkpoint tensor names onto the module's parameter names.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

DFLASH_ARCHITECTURES = ("DFlashDraftModel",)
DSPARK_ARCHITECTURES = ("Qwen3DSparkModel", "DSparkDraftModel")
# The Nemotron 3.5 detector deliberately names only these two (dflash.md §4.1 condition 1).
NEMOTRON_35_ARCHITECTURES = ("DFlashDraftModel", "Qwen3DSparkModel")

DEFAULT_DFLASH_BLOCK_SIZE = 16
DEFAULT_DSPARK_GAMMA = 7
SUPPORTED_MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
NEMOTRON_35_QUANT_ALGO = "W4A16_NVFP4"

_MISSING = object()


class DraftConfigError(ValueError):
    """A draft checkpoint's config (or its pairing with a target) cannot be served."""


# --------------------------------------------------------------------------------------------
# small lookup helpers
# --------------------------------------------------------------------------------------------

def _sub(d: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    v = d.get(key)
    return v if isinstance(v, Mapping) else {}


def _first(*candidates: tuple[Mapping[str, Any], str]) -> Any:
    """Value of the first (mapping, key) pair whose key is present and not None."""
    for m, k in candidates:
        if k in m and m[k] is not None:
            return m[k]
    return _MISSING


def _dflash_then_top(d: Mapping[str, Any], key: str) -> Any:
    return _first((_sub(d, "dflash_config"), key), (d, key))


def _dspark_lookup(d: Mapping[str, Any], key: str, prefixed: str | None = None) -> Any:
    """dspark.md §2.6 order: ``dspark_<key>`` > ``dspark_config.<key>`` > ``text_config.<key>``
    > top level > ``dflash_config.<key>``."""
    return _first((d, prefixed or f"dspark_{key}"), (_sub(d, "dspark_config"), key),
                  (_sub(d, "text_config"), key), (d, key), (_sub(d, "dflash_config"), key))


def _as_int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise DraftConfigError(f"draft config: {what} must be a list of integers, got {value!r}")
    return [int(v) for v in value]


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """sglang's default capture layers (dflash.md §1.3): ``[L//2]`` for a one-layer draft,
    else ``round(1 + i*(L-4)/(n-1))`` for i in 0..n-1 (HF "output of layer j" indexing)."""
    if num_target_layers <= 0 or num_draft_layers <= 0:
        raise DraftConfigError(
            f"cannot build default target_layer_ids from num_target_layers={num_target_layers}, "
            f"num_draft_layers={num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


# --------------------------------------------------------------------------------------------
# Nemotron 3.5 detection
# --------------------------------------------------------------------------------------------

def is_nemotron_35_draft_config(config: Mapping[str, Any]) -> bool:
    """True only for the published Nemotron 3.5 Lightning DFlash/DSpark draft family.

    All five must hold (dflash.md §4.1): (1) ``architectures`` names ``DFlashDraftModel`` or
    ``Qwen3DSparkModel``; (2) ``has_embed_tokens`` truthy and ``has_lm_head`` falsy;
    (3) ``quantization_config.quant_algo == "W4A16_NVFP4"``; (4) ``target_layer_ids``
    (``dflash_config`` first, then top level) and ``eagle_aux_hidden_state_layer_ids`` are
    non-empty, equally long and ``aux[i] == target[i] + 1``; (5) ``sample_from_anchor``
    (``dflash_config`` first, then top level, default True) is exactly ``False``.
    A generic draft that carries one of these fields is not affected.
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
    tgt = _dflash_then_top(config, "target_layer_ids")
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if tgt is _MISSING or not isinstance(tgt, (list, tuple)) or not isinstance(aux, (list, tuple)):
        return False
    if len(tgt) == 0 or len(tgt) != len(aux):
        return False
    try:
        if any(int(a) != int(t) + 1 for a, t in zip(aux, tgt)):
            return False
    except (TypeError, ValueError):
        return False
    sfa = _dflash_then_top(config, "sample_from_anchor")
    if sfa is _MISSING:
        sfa = True
    return sfa is False


# --------------------------------------------------------------------------------------------
# the parsed config
# --------------------------------------------------------------------------------------------

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
    sample_from_anchor: bool            # DSpark's layout switch (dspark.md §2.2); DFlash: False
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


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value \
            or int(value) <= 0:
        raise DraftConfigError(f"draft config: {what} must be a positive integer, got {value!r}")
    return int(value)


def _speculators_gamma(d: Mapping[str, Any]) -> Any:
    sc = _sub(d, "speculators_config")
    methods = sc.get("proposal_methods")
    if isinstance(methods, list):
        for m in methods:
            if isinstance(m, Mapping) and m.get("speculative_tokens") is not None:
                return m["speculative_tokens"]
    return _MISSING


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


# DFlash fields that ask for a query layout other than the 1+N one blockspec runs (vLLM and
# sglang refuse both at load); each is accepted only when absent, null or false.
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


def _reject_unsupported_dflash_layout(d: Mapping[str, Any], dfc: Mapping[str, Any]) -> None:
    """A DFlash draft trained for another query layout would run here with every draft row
    shifted by one and acceptance collapsed, without any error: refuse it at load."""
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


def parse_draft_config(d: Mapping[str, Any], *, target_num_layers: int | None = None) -> DraftConfig:
    """Parse and validate a DFlash / DSpark draft ``config.json`` dict.

    ``target_num_layers`` is used for the default ``target_layer_ids`` when the config gives
    neither the ids nor ``num_target_layers``.
    """
    if not isinstance(d, Mapping):
        raise DraftConfigError(f"draft config must be a dict, got {type(d).__name__}")
    algorithm, arch = _parse_algorithm(d)
    is_dspark = algorithm == "dspark"
    dfc = _sub(d, "dflash_config")

    # ---- backbone ----------------------------------------------------------------------------
    def req(key: str) -> int:
        if d.get(key) is None:
            raise DraftConfigError(f"draft config: missing required field {key!r}")
        return _positive_int(d[key], key)

    hidden = req("hidden_size")
    n_layers = req("num_hidden_layers")
    n_heads = req("num_attention_heads")
    n_kv = _positive_int(d["num_key_value_heads"], "num_key_value_heads") \
        if d.get("num_key_value_heads") is not None else n_heads
    if n_heads % n_kv:
        raise DraftConfigError(
            f"draft config: num_attention_heads={n_heads} is not a multiple of "
            f"num_key_value_heads={n_kv}")
    if d.get("head_dim") is not None:
        head_dim = _positive_int(d["head_dim"], "head_dim")
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
    vocab = _positive_int(d["vocab_size"], "vocab_size") if d.get("vocab_size") is not None else None
    max_pos = d.get("max_position_embeddings")

    # ---- block size / gamma -----------------------------------------------------------------
    if is_dspark:
        bs = _first((d, "dspark_block_size"), (_sub(d, "dspark_config"), "block_size"),
                    (_sub(d, "text_config"), "block_size"), (d, "block_size"),
                    (dfc, "block_size"))
        if bs is _MISSING:
            bs = _speculators_gamma(d)
        block_size = DEFAULT_DSPARK_GAMMA if bs is _MISSING else _positive_int(bs, "DSpark block_size (gamma)")
    else:
        bs = _first((dfc, "block_size"), (d, "block_size"))
        block_size = DEFAULT_DFLASH_BLOCK_SIZE if bs is _MISSING else _positive_int(bs, "block_size")
        if block_size < 2:
            raise DraftConfigError(f"draft config: DFlash block_size must be >= 2, got {block_size}")

    # ---- sample_from_anchor -----------------------------------------------------------------
    if is_dspark:
        sfa = _dspark_lookup(d, "sample_from_anchor")
        sample_from_anchor = True if sfa is _MISSING else bool(sfa)
    else:
        _reject_unsupported_dflash_layout(d, dfc)
        sample_from_anchor = False

    # ---- mask token ---------------------------------------------------------------------------
    if is_dspark:
        mask = _first((d, "dspark_noise_token_id"), (d, "dspark_mask_token_id"),
                      (_sub(d, "dspark_config"), "mask_token_id"),
                      (_sub(d, "dspark_config"), "noise_token_id"),
                      (_sub(d, "text_config"), "mask_token_id"), (d, "mask_token_id"),
                      (dfc, "mask_token_id"))
    else:
        mask = _first((dfc, "mask_token_id"), (d, "mask_token_id"))
    if mask is _MISSING:
        hint = ""
        tok = _first((dfc, "mask_token"), (d, "mask_token"))
        if tok is not _MISSING:
            hint = (f" (only the string mask_token={tok!r} is given; resolve it with the "
                    "tokenizer and set dflash_config.mask_token_id)")
        raise DraftConfigError("draft config: mask_token_id is required "
                               "(dflash_config.mask_token_id, mask_token_id"
                               + (" or dspark_noise_token_id" if is_dspark else "") + ")" + hint)
    if isinstance(mask, bool) or not isinstance(mask, int) or mask < 0:
        raise DraftConfigError(f"draft config: mask_token_id must be a non-negative int, got {mask!r}")

    # ---- target layers ------------------------------------------------------------------------
    if is_dspark:
        ntl = _dspark_lookup(d, "num_target_layers")
        ids = _dspark_lookup(d, "target_layer_ids")
    else:
        ntl = _first((dfc, "num_target_layers"), (d, "num_target_layers"))
        ids = _first((dfc, "target_layer_ids"), (d, "target_layer_ids"))
    num_target_layers = None if ntl is _MISSING else _positive_int(ntl, "num_target_layers")
    defaulted = ids is _MISSING
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
        target_layer_ids = _as_int_list(ids, "target_layer_ids")
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
    sw = _first((d, "sliding_window"), (dfc, "swa_window_size"))
    sliding_window = None if sw is _MISSING else _positive_int(sw, "sliding_window")
    if "sliding_attention" in layer_types and sliding_window is None:
        raise DraftConfigError("draft config: sliding_attention layers need sliding_window "
                               "(or dflash_config.swa_window_size)")
    ic = _first((d, "is_causal"), (dfc, "causal"))
    is_causal = None if ic is _MISSING else bool(ic)
    rope_thetas = _parse_rope(d, layer_types)

    sink = _first((dfc, "attention_sink_bias"), (d, "attention_sink_bias"))
    if is_dspark and sink is _MISSING:
        sink = _dspark_lookup(d, "attention_sink_bias")
    attention_sink_bias = False if sink is _MISSING else bool(sink)

    # ---- checkpoint family ----------------------------------------------------------------------
    aux = d.get("eagle_aux_hidden_state_layer_ids")
    aux = _as_int_list(aux, "eagle_aux_hidden_state_layer_ids") if aux is not None else None
    qc = d.get("quantization_config")
    qc = dict(qc) if isinstance(qc, Mapping) else None
    nemotron = is_nemotron_35_draft_config(d)
    ies = _first((dfc, "input_embedding_scale"), (d, "input_embedding_scale"))
    input_embedding_scale = None if ies is _MISSING else float(ies)

    # ---- DSpark Markov head ---------------------------------------------------------------------
    markov_rank = markov_head_type = None
    if is_dspark:
        r = _dspark_lookup(d, "markov_rank")
        if r is _MISSING:
            raise DraftConfigError("DSpark draft config: markov_rank is required (DSpark needs its "
                                   "Markov head; set markov_rank > 0)")
        if isinstance(r, bool) or not isinstance(r, (int, float)) or int(r) != r or int(r) <= 0:
            raise DraftConfigError(f"DSpark draft config: markov_rank must be > 0, got {r!r}")
        markov_rank = int(r)
        ht = _dspark_lookup(d, "markov_head_type")
        markov_head_type = "vanilla" if ht is _MISSING else ht
        if markov_head_type not in SUPPORTED_MARKOV_HEAD_TYPES:
            raise DraftConfigError(
                f"DSpark draft config: unsupported markov_head_type {markov_head_type!r}; "
                f"supported: {', '.join(SUPPORTED_MARKOV_HEAD_TYPES)}")
        if nemotron and markov_head_type != "vanilla":
            raise DraftConfigError(
                f"Nemotron 3.5 DSpark draft: only the 'vanilla' Markov head is supported, "
                f"got {markov_head_type!r}")
        if vocab is None:
            raise DraftConfigError("DSpark draft config: vocab_size is required for the Markov head")
    if nemotron and vocab is None:
        raise DraftConfigError("Nemotron 3.5 draft config: vocab_size is required for embed_tokens")

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


# --------------------------------------------------------------------------------------------
# load-time checks against the target
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# checkpoint tensor names
# --------------------------------------------------------------------------------------------

_ALIASES = (("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm."))
_ALWAYS_IGNORED = ("lm_head.", "rotary_emb.")


def _normalize_one(name: str, cfg: DraftConfig, keep_confidence_head: bool,
                   keep_lm_head: bool) -> str | None:
    n = name[len("model."):] if name.startswith("model.") else name
    for old, new in _ALIASES:
        if n.startswith(old):
            n = new + n[len(old):]
            break
    if n.startswith("lm_head.") and keep_lm_head:
        return n
    if n.startswith(_ALWAYS_IGNORED) or ".rotary_emb." in n:
        return None
    if n.startswith("embed_tokens.") and not cfg.is_nemotron_35:
        return None
    if n.startswith("confidence_head.") and not keep_confidence_head:
        return None
    if n.startswith("markov_head.") and cfg.algorithm != "dspark":
        return None
    return n


def normalize_draft_tensor_names(names_or_dict: Mapping[str, Any] | Iterable[str],
                                 cfg: DraftConfig, *, keep_confidence_head: bool = False,
                                 keep_lm_head: bool = False) -> dict[str, Any]:
    """Map checkpoint tensor names onto the draft module's parameter names.

    Strips a leading ``model.``, aliases ``encoder.fc.*`` → ``fc.*`` and
    ``encoder.output_norm_enc.*`` → ``hidden_norm.*``, drops ``lm_head.*`` unless asked (the
    loader asks: a draft's own head is used when it has one) and ``rotary_emb``
    caches, drops ``embed_tokens.*`` unless the draft is Nemotron 3.5, drops the DSpark
    ``confidence_head.*`` (not built) unless asked, and ``markov_head.*`` for DFlash drafts.

    Given a dict ``{name: tensor}`` it returns ``{param_name: tensor}``; given an iterable of
    names it returns ``{param_name: checkpoint_name}``.  Two checkpoint names landing on one
    parameter is an error.
    """
    is_dict = isinstance(names_or_dict, Mapping)
    items = names_or_dict.items() if is_dict else ((n, n) for n in names_or_dict)
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name, value in items:
        new = _normalize_one(name, cfg, keep_confidence_head, keep_lm_head)
        if new is None:
            continue
        if new in out:
            raise DraftConfigError(f"draft checkpoint: tensors {origin[new]!r} and {name!r} both "
                                   f"map to {new!r}")
        out[new] = value
        origin[new] = name
    return out
