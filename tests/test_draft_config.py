"""Parsing rules of DFlash / DSpark draft configs: lookup orders, defaults, refused layouts, the
Nemotron 3.5 detector; the load-time checks against a target and the tensor-name mapping."""
from __future__ import annotations

import copy

import pytest

from blockspec.configs.draft import (
    DraftConfigError,
    build_target_layer_ids,
    is_nemotron_35_draft_config,
    parse_draft_config,
)
from blockspec.speculative.draft_loader import validate_against_target
from blockspec.speculative.draft_names import normalize_draft_tensor_names


def dflash_cfg(**over):
    d = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "vocab_size": 100,
        "rope_theta": 1000000.0,
        "dflash_config": {"mask_token_id": 99, "target_layer_ids": [1, 5]},
    }
    d.update(over)
    return d


def dspark_cfg(**over):
    d = dflash_cfg(architectures=["Qwen3DSparkModel"], markov_rank=8, markov_head_type="vanilla")
    d.update(over)
    return d


def nemotron_cfg(arch="DFlashDraftModel"):
    return dflash_cfg(
        architectures=[arch],
        has_embed_tokens=True,
        has_lm_head=False,
        quantization_config={"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4"},
        eagle_aux_hidden_state_layer_ids=[2, 6],
        markov_rank=16,
        dflash_config={"mask_token_id": 99, "target_layer_ids": [1, 5], "sample_from_anchor": False,
                       "causal": True, "attention_sink_bias": True, "use_swa": True,
                       "swa_window_size": 4},
    )


# ---- algorithm ----------------------------------------------------------------------------

def test_algorithm_from_architectures():
    assert parse_draft_config(dflash_cfg()).algorithm == "dflash"
    assert parse_draft_config(dspark_cfg()).algorithm == "dspark"
    assert parse_draft_config(dspark_cfg(architectures=["DSparkDraftModel"])).algorithm == "dspark"
    with pytest.raises(DraftConfigError, match="DFlashDraftModel.*Qwen3DSparkModel"):
        parse_draft_config(dflash_cfg(architectures=["LlamaForCausalLM"]))
    with pytest.raises(DraftConfigError, match="architectures"):
        parse_draft_config({k: v for k, v in dflash_cfg().items() if k != "architectures"})


# ---- block size / gamma -------------------------------------------------------------------

def test_dflash_block_size_precedence():
    assert parse_draft_config(dflash_cfg()).block_size == 16
    assert parse_draft_config(dflash_cfg(block_size=8)).block_size == 8
    d = dflash_cfg(block_size=8)
    d["dflash_config"]["block_size"] = 10
    cfg = parse_draft_config(d)
    assert cfg.block_size == 10
    assert cfg.gamma == 9 and cfg.query_len == 10 and cfg.drops_anchor_row


def test_dspark_gamma_lookup_order():
    # default
    assert parse_draft_config(dspark_cfg()).block_size == 7
    # each level wins over everything below it
    levels = [
        ("dspark_block_size", 3),
        ("dspark_config", {"block_size": 4}),
        ("text_config", {"block_size": 5}),
        ("block_size", 6),
        ("dflash_config", {"mask_token_id": 99, "target_layer_ids": [1, 5], "block_size": 9}),
    ]
    for i, (key, _) in enumerate(levels):
        d = dspark_cfg()
        for k, v in levels[i:]:
            d[k] = copy.deepcopy(v)
        expected = levels[i][1] if isinstance(levels[i][1], int) else levels[i][1]["block_size"]
        assert parse_draft_config(d).block_size == expected, key


def test_dspark_query_layout_follows_sample_from_anchor():
    cfg = parse_draft_config(dspark_cfg(block_size=5))
    assert cfg.sample_from_anchor is True
    assert (cfg.gamma, cfg.query_len, cfg.drops_anchor_row) == (5, 5, False)
    cfg = parse_draft_config(dspark_cfg(block_size=5, sample_from_anchor=False))
    assert (cfg.gamma, cfg.query_len, cfg.drops_anchor_row) == (5, 6, True)


def test_sample_from_anchor_locations_and_default():
    assert parse_draft_config(dspark_cfg()).sample_from_anchor is True
    assert parse_draft_config(dspark_cfg(sample_from_anchor=False)).sample_from_anchor is False
    d = dspark_cfg()
    d["dflash_config"]["sample_from_anchor"] = False
    assert parse_draft_config(d).sample_from_anchor is False
    # the top-level key wins over dflash_config
    d["sample_from_anchor"] = True
    assert parse_draft_config(d).sample_from_anchor is True
    # DFlash parses it too (unused by its fixed layout)
    d = dflash_cfg()
    d["dflash_config"]["sample_from_anchor"] = False
    cfg = parse_draft_config(d)
    assert cfg.sample_from_anchor is False and cfg.drops_anchor_row and cfg.query_len == 16


# ---- DFlash query layouts blockspec does not run --------------------------------------------

def _dflash_with(key, value, nested):
    d = dflash_cfg()
    (d["dflash_config"] if nested else d)[key] = value
    return d


@pytest.mark.parametrize("nested", [True, False], ids=["dflash_config", "top_level"])
@pytest.mark.parametrize("key", ["sample_from_anchor", "query_zero_predicts_next"])
def test_dflash_anchor_first_layout_is_refused(key, nested):
    where = f"dflash_config.{key}" if nested else key
    with pytest.raises(DraftConfigError) as e:
        parse_draft_config(_dflash_with(key, True, nested))
    msg = str(e.value)
    assert f"{where}=true" in msg and "anchor-first" in msg
    assert "1+N query layout" in msg and "row 0 is the anchor" in msg     # the layout we run
    # the value that names blockspec's own layout, and absence, are fine
    for value in (False, None):
        cfg = parse_draft_config(_dflash_with(key, value, nested))
        assert cfg.sample_from_anchor is False and cfg.query_len == cfg.block_size == 16
    # a value that is not a bool is named, not guessed at
    with pytest.raises(DraftConfigError, match=rf"{where} must be true or false, got 'yes'"):
        parse_draft_config(_dflash_with(key, "yes", nested))


def test_dflash_false_at_one_level_does_not_hide_true_at_the_other():
    d = _dflash_with("sample_from_anchor", False, nested=False)
    d["dflash_config"]["sample_from_anchor"] = True
    with pytest.raises(DraftConfigError, match=r"dflash_config\.sample_from_anchor=true"):
        parse_draft_config(d)


@pytest.mark.parametrize("key, value, off", [
    ("projector_type", "domino", None),
    ("conv_kernel_size", 2, 0),
    ("conv_group_size", 64, 0),
    ("selector_rank", 256, 0),
    ("selector_top_k", 8, 0),
    ("output_multiplier", 0.5, 1.0),
    ("final_logit_softcapping", 30.0, 0.0),
    ("attention_value_scale", 0.7, 1.0),
])
def test_dflash_variants_not_implemented_are_refused(key, value, off):
    d = _dflash_with(key, value, nested=True)
    with pytest.raises(DraftConfigError, match=rf"dflash_config\.{key}={value!r} selects a DFlash "
                                               r"variant.*1\+N query layout"):
        parse_draft_config(d)
    assert parse_draft_config(_dflash_with(key, off, nested=True)).algorithm == "dflash"


def test_dspark_layout_rules_unchanged():
    # DSpark legitimately samples from the anchor, at either level, and ignores DFlash variants
    d = dspark_cfg()
    d["dflash_config"]["sample_from_anchor"] = True
    assert parse_draft_config(d).query_len == 7
    assert parse_draft_config(dspark_cfg(sample_from_anchor=True)).drops_anchor_row is False


# ---- target layers ------------------------------------------------------------------------

def test_build_target_layer_ids_defaults():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    assert build_target_layer_ids(36, 1) == [18]
    assert build_target_layer_ids(30, 4) == [1, 10, 18, 27]        # rounds, not truncates


def test_target_layer_ids_sources():
    d = dflash_cfg(target_layer_ids=[0, 3])
    assert parse_draft_config(d).target_layer_ids == [1, 5]          # dflash_config wins
    del d["dflash_config"]["target_layer_ids"]
    cfg = parse_draft_config(d)
    assert cfg.target_layer_ids == [0, 3] and not cfg.target_layer_ids_defaulted
    # default from num_target_layers (config) or the caller's target depth
    d = dflash_cfg(num_hidden_layers=5, num_target_layers=36)
    del d["dflash_config"]["target_layer_ids"]
    cfg = parse_draft_config(d)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] and cfg.target_layer_ids_defaulted
    del d["num_target_layers"]
    assert parse_draft_config(d, target_num_layers=40).target_layer_ids == [1, 10, 19, 28, 37]
    with pytest.raises(DraftConfigError, match="target_layer_ids"):
        parse_draft_config(d)
    # dspark: prefixed key first
    d = dspark_cfg(dspark_target_layer_ids=[2, 4], target_layer_ids=[0, 1])
    assert parse_draft_config(d).target_layer_ids == [2, 4]
    d = dspark_cfg(target_layer_ids=[0, 1])
    assert parse_draft_config(d).target_layer_ids == [0, 1]           # top > dflash_config
    with pytest.raises(DraftConfigError, match="exceed"):
        parse_draft_config(dflash_cfg(num_target_layers=5))            # id 5 >= 5


# ---- mask token ---------------------------------------------------------------------------

def test_mask_token_required_and_sources():
    d = dflash_cfg()
    del d["dflash_config"]["mask_token_id"]
    with pytest.raises(DraftConfigError, match="mask_token_id is required"):
        parse_draft_config(d)
    d["dflash_config"]["mask_token"] = "<|MASK|>"
    with pytest.raises(DraftConfigError, match="MASK"):
        parse_draft_config(d)
    d["mask_token_id"] = 7
    assert parse_draft_config(d).mask_token_id == 7
    d = dspark_cfg(dspark_noise_token_id=42)
    assert parse_draft_config(d).mask_token_id == 42


# ---- attention layout ---------------------------------------------------------------------

def test_layer_types_window_causality():
    cfg = parse_draft_config(dflash_cfg())
    assert cfg.layer_types == ["full_attention"] * 2
    assert [cfg.layer_is_causal(i) for i in range(2)] == [False, False]
    cfg = parse_draft_config(dflash_cfg(layer_types=["full_attention", "sliding_attention"],
                                        sliding_window=4))
    assert [cfg.layer_is_causal(i) for i in range(2)] == [False, True]
    assert [cfg.layer_window(i) for i in range(2)] == [None, 4]
    cfg = parse_draft_config(dflash_cfg(layer_types=["sliding_attention"] * 2, sliding_window=4,
                                        is_causal=False))
    assert [cfg.layer_is_causal(i) for i in range(2)] == [False, False]
    cfg = parse_draft_config(dflash_cfg(is_causal=True))
    assert [cfg.layer_is_causal(i) for i in range(2)] == [True, True]
    with pytest.raises(DraftConfigError, match="sliding_window"):
        parse_draft_config(dflash_cfg(layer_types=["sliding_attention"] * 2))
    with pytest.raises(DraftConfigError, match="unsupported layer type"):
        parse_draft_config(dflash_cfg(layer_types=["linear_attention"] * 2))
    with pytest.raises(DraftConfigError, match="one type per draft layer"):
        parse_draft_config(dflash_cfg(layer_types=["full_attention"]))
    # Nemotron-style: window from dflash_config.swa_window_size, causal from dflash_config.causal
    cfg = parse_draft_config(nemotron_cfg())
    assert cfg.layer_types == ["sliding_attention"] * 2 and cfg.sliding_window == 4
    assert cfg.is_causal is True and cfg.attention_sink_bias is True


def test_rope_parsing():
    assert parse_draft_config(dflash_cfg()).rope_theta == 1e6
    d = dflash_cfg(rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert parse_draft_config(d).rope_thetas == [5e5, 5e5]
    d = dflash_cfg(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(DraftConfigError, match="yarn"):
        parse_draft_config(d)
    d = dflash_cfg(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5})
    with pytest.raises(DraftConfigError, match="llama3"):
        parse_draft_config(d)
    d = dflash_cfg(layer_types=["full_attention", "sliding_attention"], sliding_window=8,
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert parse_draft_config(d).rope_thetas == [1e6, 1e4]
    d = dflash_cfg()
    del d["rope_theta"]
    assert parse_draft_config(d).rope_theta == 10000.0


def test_backbone_errors():
    with pytest.raises(DraftConfigError, match="hidden_act"):
        parse_draft_config(dflash_cfg(hidden_act="gelu"))
    with pytest.raises(DraftConfigError, match="multiple"):
        parse_draft_config(dflash_cfg(num_key_value_heads=3))
    with pytest.raises(DraftConfigError, match="hidden_size"):
        parse_draft_config({k: v for k, v in dflash_cfg().items() if k != "hidden_size"})


# ---- DSpark Markov head -------------------------------------------------------------------

def test_markov_rank_and_head_type():
    cfg = parse_draft_config(dspark_cfg(markov_head_type="rnn", markov_rank=4))
    assert (cfg.markov_rank, cfg.markov_head_type) == (4, "rnn")
    cfg = parse_draft_config(dspark_cfg(dspark_markov_rank=12, dspark_markov_head_type="gated"))
    assert (cfg.markov_rank, cfg.markov_head_type) == (12, "gated")
    for bad in (0, -3):
        with pytest.raises(DraftConfigError, match="markov_rank must be > 0"):
            parse_draft_config(dspark_cfg(markov_rank=bad))
    d = dspark_cfg()
    del d["markov_rank"]
    with pytest.raises(DraftConfigError, match="markov_rank"):
        parse_draft_config(d)
    with pytest.raises(DraftConfigError, match="unsupported markov_head_type 'cond'"):
        parse_draft_config(dspark_cfg(markov_head_type="cond"))
    d = dspark_cfg()
    del d["markov_head_type"]
    assert parse_draft_config(d).markov_head_type == "vanilla"
    # DFlash configs carry no head
    assert parse_draft_config(dflash_cfg(markov_rank=8)).markov_rank is None


def test_nemotron_dspark_only_vanilla():
    d = nemotron_cfg("Qwen3DSparkModel")
    d["markov_head_type"] = "gated"
    with pytest.raises(DraftConfigError, match="vanilla"):
        parse_draft_config(d)
    d["markov_head_type"] = "vanilla"
    cfg = parse_draft_config(d)
    assert cfg.is_nemotron_35 and cfg.algorithm == "dspark"
    assert (cfg.gamma, cfg.query_len) == (7, 8)      # anchor row dropped


# ---- Nemotron 3.5 detection ---------------------------------------------------------------

def _breakers():
    """Each function flips exactly one of the five §4.1 conditions."""
    def arch(d): d["architectures"] = ["DSparkDraftModel"]        # not in the detector's list
    def embed(d): d["has_embed_tokens"] = False
    def lm_head(d): d["has_lm_head"] = True
    def quant(d): d["quantization_config"]["quant_algo"] = "NVFP4"
    def aux_off(d): d["eagle_aux_hidden_state_layer_ids"] = [1, 5]   # aux == target, not +1
    def aux_len(d): d["eagle_aux_hidden_state_layer_ids"] = [2]
    def aux_missing(d): del d["eagle_aux_hidden_state_layer_ids"]
    def sfa_default(d): del d["dflash_config"]["sample_from_anchor"]
    def sfa_true(d): d["dflash_config"]["sample_from_anchor"] = True
    def sfa_not_bool(d): d["dflash_config"]["sample_from_anchor"] = 0
    return [arch, embed, lm_head, quant, aux_off, aux_len, aux_missing, sfa_default, sfa_true,
            sfa_not_bool]


def test_is_nemotron_35_all_five_conditions():
    for arch in ("DFlashDraftModel", "Qwen3DSparkModel"):
        assert is_nemotron_35_draft_config(nemotron_cfg(arch))
    for brk in _breakers():
        d = nemotron_cfg()
        brk(d)
        assert not is_nemotron_35_draft_config(d), brk.__name__
    # target ids from the top level count too; sample_from_anchor at top level counts too
    d = nemotron_cfg()
    d["target_layer_ids"] = d["dflash_config"].pop("target_layer_ids")
    d["sample_from_anchor"] = d["dflash_config"].pop("sample_from_anchor")
    assert is_nemotron_35_draft_config(d)


def test_generic_draft_with_one_nemotron_field_is_generic():
    for extra in ({"has_embed_tokens": True},
                  {"quantization_config": {"quant_algo": "W4A16_NVFP4"}},
                  {"eagle_aux_hidden_state_layer_ids": [2, 6]},
                  {"sample_from_anchor": False}):
        d = dflash_cfg(**extra)
        assert not is_nemotron_35_draft_config(d)
        assert not parse_draft_config(d).is_nemotron_35
    assert parse_draft_config(nemotron_cfg()).is_nemotron_35


# ---- validation against the target --------------------------------------------------------

def test_validate_against_target():
    cfg = parse_draft_config(dflash_cfg())
    validate_against_target(cfg, 32, 100, 6, 64)                       # fine
    validate_against_target(cfg, 32, 100, 6, None)
    with pytest.raises(DraftConfigError, match="hidden"):
        validate_against_target(cfg, 48, 100, 6, 64)
    with pytest.raises(DraftConfigError, match="K mismatch"):
        validate_against_target(cfg, 32, 100, 6, 96)
    with pytest.raises(DraftConfigError, match="mask_token_id 99 >= target vocab"):
        validate_against_target(cfg, 32, 99, 6, 64)
    with pytest.raises(DraftConfigError, match="must be < 5"):
        validate_against_target(cfg, 32, 100, 5, 64)                   # id 5 on a 5-layer target
    # defaulted ids derived from a different depth are an error
    d = dflash_cfg(num_target_layers=36)
    del d["dflash_config"]["target_layer_ids"]
    cfg = parse_draft_config(d)
    with pytest.raises(DraftConfigError, match="num_target_layers=36"):
        validate_against_target(cfg, 32, 100, 40, 64)
    # DSpark Markov vocab must match the target vocab
    cfg = parse_draft_config(dspark_cfg())
    with pytest.raises(DraftConfigError, match="Markov"):
        validate_against_target(cfg, 32, 128, 6, 64)


# ---- tensor names -------------------------------------------------------------------------

def test_normalize_draft_tensor_names():
    names = ["model.fc.weight", "encoder.output_norm_enc.weight", "model.norm.weight",
             "layers.0.self_attn.q_proj.weight", "lm_head.weight", "embed_tokens.weight",
             "layers.0.self_attn.rotary_emb.inv_freq", "rotary_emb.inv_freq",
             "markov_head.markov_w1.weight", "confidence_head.proj.weight"]
    cfg = parse_draft_config(dflash_cfg())
    m = normalize_draft_tensor_names(names, cfg)
    assert m == {"fc.weight": "model.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight",
                 "norm.weight": "model.norm.weight",
                 "layers.0.self_attn.q_proj.weight": "layers.0.self_attn.q_proj.weight"}
    # dict input keeps values; dspark keeps the Markov head; nemotron keeps embed_tokens
    cfg = parse_draft_config(dspark_cfg())
    m = normalize_draft_tensor_names({n: i for i, n in enumerate(names)}, cfg)
    assert m["markov_head.markov_w1.weight"] == 8 and "embed_tokens.weight" not in m
    assert "confidence_head.proj.weight" not in m
    cfg = parse_draft_config(nemotron_cfg())
    m = normalize_draft_tensor_names(["model.embed_tokens.weight", "encoder.fc.weight",
                                      "encoder.fc.weight_scale"], cfg)
    assert set(m) == {"embed_tokens.weight", "fc.weight", "fc.weight_scale"}
    with pytest.raises(DraftConfigError, match="both map"):
        normalize_draft_tensor_names(["fc.weight", "model.fc.weight"], cfg)
