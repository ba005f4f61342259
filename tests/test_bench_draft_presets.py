"""Published-size random draft presets of ``blockspec bench``: their parameter counts at
Lightning's shapes (meta device, nothing allocated), their format (Nemotron-3.5 layout, W4A16
NVFP4), and a scaled-down build that runs under the bench on the CPU."""
from __future__ import annotations


import pytest
import torch

from blockspec.bench import draft_presets, presets
from blockspec.bench.bench_args import RANDOM_DRAFTS
from blockspec.bench.engine_bench import run
from blockspec.configs.draft import parse_draft_config
from blockspec.layers.linear import Linear
from blockspec.quant.linear import NVFP4Linear, QuantEmbedding
from tests.bench_fixtures import bench_args as _args



def test_random_draft_choices_match_the_presets():
    assert set(RANDOM_DRAFTS) == {"dflash", "dspark", *draft_presets.DRAFT_PRESETS}


@pytest.mark.parametrize("kind, want, block", [("dflash-nemotron35", 0.7e9, 6),
                                               ("dspark-nemotron35", 0.8e9, 3)])
def test_published_size_presets_have_the_published_parameter_counts(kind, want, block):
    """0.7 B (DFlash) and 0.8 B (DSpark) within 10 %, the target's LM head not counted; the
    weights are stored at about 4.5 bits (NVFP4 codes + scales; the Markov W1 table bf16)."""
    sizes = draft_presets.draft_sizes(kind, presets.preset_config("nemotron-3.5-lightning"), block)
    assert sizes["draft_params"] == pytest.approx(want, rel=0.1)
    embed = 131072 * 2688                                  # the draft's own embed_tokens
    assert sizes["draft_params"] - sizes["draft_params_excl_embedding"] == embed
    assert sizes["draft_weight_bytes"] < 0.7 * sizes["draft_params"]     # bf16 would be 2x


@pytest.mark.parametrize("kind", sorted(draft_presets.DRAFT_PRESETS))
def test_preset_is_the_nemotron35_nvfp4_layout(kind):
    tiny = presets.preset_config("tiny")
    raw, _ = draft_presets.random_draft_config(kind, tiny, 4)
    cfg = parse_draft_config(raw, target_num_layers=4)
    assert cfg.is_nemotron_35 and cfg.num_hidden_layers == 5 and cfg.algorithm == kind[:6]
    assert cfg.intermediate_size == 2 * tiny["hidden_size"]
    model = draft_presets.build_random_draft(kind, tiny, 4, torch.device("cpu"), torch.float32)
    assert isinstance(model.embed_tokens, QuantEmbedding)
    linears = [m for m in model.modules() if isinstance(m, (Linear, torch.nn.Linear, NVFP4Linear))]
    assert linears and all(isinstance(m, NVFP4Linear) for m in linears)
    if kind.startswith("dspark"):
        assert model.markov_head.rank == 32                # the scaled-down rank
    wide = draft_presets.preset_config(kind, presets.preset_config("nemotron-3.5-lightning"), 4)
    assert (wide["num_attention_heads"], wide["num_key_value_heads"], wide["head_dim"]) == (32, 8, 128)
    assert len(wide["dflash_config"]["target_layer_ids"]) == 5


@pytest.mark.parametrize("kind", sorted(draft_presets.DRAFT_PRESETS))
def test_preset_draft_runs_under_the_bench(kind):
    rows = run(_args(device="cpu", dtype="float32", input_len=6, output_len=24, batch_size=[2],
                     repeats=1, random_draft=kind, speculative_num_draft_tokens=4,
                     simulate_accept_length=2.5))
    r = rows[0]
    want = draft_presets.draft_sizes(kind, presets.preset_config("tiny"), 4 if "dflash" in kind else 3)
    assert r["random_draft"] == kind and r["verify_width"] == 4
    assert r["draft_params"] == want["draft_params"] > r["draft_params_excl_embedding"]
    assert r["speculative"] == ("DFlashDraftModel" if kind.startswith("dflash") else "DSparkDraftModel")
    assert r["mean_output_len"] == 24 and r["step_ms"] > 0
    assert 1.0 < r["accept_length"] <= 4.0
