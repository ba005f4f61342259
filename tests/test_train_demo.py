"""CPU smoke of the demo training: a few steps of train-target and of every train-draft
flavour; the checkpoints load where serving loads them (transformers agrees on the target,
speculation stays lossless with each draft); resume; the training objective's context cut."""
from __future__ import annotations

import json

import pytest
import torch

from blockspec import Engine
from blockspec.cli import main as cli
from tests.demo_fixtures import DRAFTS, tiny_family, train_target

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPTS = ["Tom has 3 apples. How many?", "Mia buys 4 packs of pens. How many pens?"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return tiny_family(tmp_path_factory.mktemp("demo_family"))


@pytest.fixture(scope="module")
def reference(family):
    e = Engine(model_path=str(family["target"]), device="cpu")
    return [o["output_ids"] for o in e.generate(prompt=PROMPTS, sampling_params=GREEDY)]


def test_target_checkpoint_is_transformers_layout(family):
    from transformers import NemotronHForCausalLM

    from blockspec.train.target_model import forward_hidden

    folder = family["target"]
    cfg = json.loads((folder / "config.json").read_text())
    assert {"linear_attention", "full_attention", "mlp", "moe"} <= set(cfg["layers_block_type"])
    ids = [5, 9, 17, 30, 41, 8, 7]
    engine = Engine(model_path=str(folder), device="cpu")
    ours = engine.runner.score([ids])[0]
    with torch.no_grad():
        train_fwd = engine.model.compute_logits(forward_hidden(engine.model, torch.tensor([ids])))[0]
        hf = NemotronHForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        theirs = hf(torch.tensor([ids])).logits[0].float()
    assert torch.allclose(train_fwd, ours, atol=1e-4)       # training forward = serving forward
    assert torch.allclose(theirs, ours, atol=1e-4)          # transformers reads the same model
    summary = json.loads((folder / "train_summary.json").read_text())
    assert summary["steps"] == 3


def test_long_chunk_gradients_are_finite():
    """A 128-token SSD chunk with fast decay overflows exp() above the diagonal unless it is
    masked before the exp; that inf must not reach the gradients (0 * inf = NaN)."""
    from blockspec.train.target_model import build_target, forward_hidden, hf_config

    cfg = hf_config("M*", 64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8,
                    n_groups=2, chunk_size=128, time_step_min=0.1, time_step_max=0.1)
    model = build_target(cfg, torch.device("cpu"), 0)
    h = forward_hidden(model, torch.randint(0, 64, (2, 140)))
    model.compute_logits(h).logsumexp(-1).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_target_resume_continues(tmp_path):
    folder = train_target(tmp_path / "t", 2)
    assert cli(["train-target", "--output", str(folder), "--resume", "--max-steps", "3",
                "--size", "tiny", "--num-samples", "300", "--batch-size", "8", "--device", "cpu"]) == 0
    assert json.loads((folder / "train_summary.json").read_text())["steps"] == 3


@pytest.mark.parametrize("name", list(DRAFTS))
def test_trained_draft_loads_and_is_lossless(family, reference, name):
    algo = DRAFTS[name][0].upper()
    e = Engine(model_path=str(family["target"]), device="cpu", speculative_algorithm=algo,
               speculative_draft_model_path=str(family[name]))
    outs = e.generate(prompt=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
    d = e.drafter.draft
    cfg = json.loads((family[name] / "config.json").read_text())
    if name.endswith("nvfp4"):
        assert d.is_nemotron_35 and d.embed_tokens.weight.dtype == torch.uint8
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]]
        assert cfg["dflash_config"]["sample_from_anchor"] is False and not cfg["has_lm_head"]
        if algo == "DSPARK":
            assert d.markov_head.markov_w2.weight.dtype == torch.uint8   # markov_w2 packed
    else:
        assert not d.is_nemotron_35 and d.embed_tokens is None


def test_draft_resume_continues(family, tmp_path):
    from tests.demo_fixtures import train_draft

    folder = train_draft(family["target"], tmp_path / "d", "dspark", 1)
    train_draft(family["target"], folder, "dspark", 2, "--resume")
    assert json.loads((folder / "train_summary.json").read_text())["steps"] == 2


def test_nemotron_layout_needs_w4a16(family, tmp_path, capsys):
    rc = cli(["train-draft", "--target-model-path", str(family["target"]), "--algorithm", "dflash",
              "--layout", "nemotron35", "--output", str(tmp_path / "d"), "--size", "tiny",
              "--max-steps", "1", "--num-samples", "50", "--device", "cpu"])
    assert rc == 2 and "W4A16_NVFP4" in capsys.readouterr().err


def test_anchors_are_distinct_sorted_generated_positions():
    from blockspec.train.draft_objective import sample_anchors

    lengths, starts = torch.tensor([20, 9, 30]), torch.tensor([10, 6, 3])
    a, valid = sample_anchors(lengths, starts, 5, torch.Generator().manual_seed(0))
    assert valid.tolist()[1] == [True, True, False, False, False]   # only 6 and 7 qualify
    for row, ok, s, n in zip(a.tolist(), valid.tolist(), starts.tolist(), lengths.tolist()):
        got = [x for x, v in zip(row, ok) if v]
        assert got == sorted(set(got)) and all(s <= x <= n - 2 for x in got)


@pytest.mark.parametrize("name", ["dflash", "dspark_nvfp4"])
def test_block_sees_only_context_before_its_anchor(family, name):
    """Features at or after the anchor must not change a block's loss; earlier ones must."""
    from blockspec.models.draft import build_draft_model
    from blockspec.configs.draft import parse_draft_config
    from blockspec.train.draft_objective import draft_loss

    engine = Engine(model_path=str(family["target"]), device="cpu")
    cfg = json.loads((family[name] / "config.json").read_text())
    draft = build_draft_model(parse_draft_config(cfg), None, torch.float32)
    draft.init_random_(std=0.2, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(4, 200, (1, 24))
    taps = tuple(i + 1 for i in draft.config.target_layer_ids)
    feats = torch.stack(engine.runner.hidden_states(ids.tolist(), taps))
    anchors, valid = torch.tensor([[12]]), torch.tensor([[True]])

    def loss(f):
        return float(draft_loss(draft, engine.model, f, ids, torch.tensor([24]), anchors, valid, 4.0)[0])

    base = loss(feats)
    later = feats.clone()
    later[:, 12:] += torch.randn_like(later[:, 12:])
    earlier = feats.clone()
    earlier[:, :12] += torch.randn_like(earlier[:, :12])
    assert loss(later) == pytest.approx(base, abs=1e-6)
    assert abs(loss(earlier) - base) > 1e-4
