"""The target against transformers' NemotronH (an oracle that is not ours)."""
from __future__ import annotations

import pytest

from blockspec import Engine
from tests.hf_oracle import CONFIGS, hf_greedy, hf_logits, make_checkpoint

PROMPTS = [[5, 17, 33, 8, 60, 21, 9], [44, 3], [12, 70, 71, 72, 15, 16, 90, 4, 7, 30, 31, 50, 11],
           [88, 10, 23, 54]]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    hf, folder = make_checkpoint(request.param, tmp_path_factory.mktemp("hf"))
    engine = Engine(model_path=str(folder), dtype="float32", device="cpu")
    yield request.param, hf, engine
    engine.shutdown()


def test_prompt_logits_match(pair):
    _, hf, engine = pair
    ours = engine.runner.score(PROMPTS)
    for prompt, got in zip(PROMPTS, ours):
        ref = hf_logits(hf, prompt)
        rel = (got - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, f"relative logit error {rel:.2e}"


def test_greedy_tokens_match_single_and_batched(pair):
    name, hf, engine = pair
    sp = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    refs = [hf_greedy(hf, p, 32) for p in PROMPTS]
    single = engine.generate(input_ids=PROMPTS[0], sampling_params=sp)
    assert single["output_ids"] == refs[0]
    batched = engine.generate(input_ids=PROMPTS, sampling_params=sp)
    for ref, out in zip(refs, batched):
        assert out["output_ids"] == ref
        assert out["meta_info"]["completion_tokens"] == 32
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 32}


def test_configs_cover_every_feature():
    patterns = "".join(c["pattern"] for c in CONFIGS.values())
    assert set("M*-E") <= set(patterns)
    assert any(c.get("moe_latent_size") for c in CONFIGS.values())
    assert any(c.get("n_group", 1) > 1 for c in CONFIGS.values())
    assert {c.get("tie_word_embeddings", False) for c in CONFIGS.values()} == {True, False}
    assert {c["spelling"] for c in CONFIGS.values()} == {"new", "legacy"}
