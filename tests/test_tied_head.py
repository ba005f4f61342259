"""Which output head a target folder gets: its own ``lm_head.weight`` when it has one, the tied
embedding only when it has none. transformers' NemotronH never ties, so the folders it saves
carry a head of their own even when config.json says ``tie_word_embeddings: true``."""
from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from blockspec import Engine
from blockspec.checkpoint import CheckpointError
from tests.ckpt_edit import edited_copy
from tests.hf_oracle import build_hf, hf_greedy, hf_greedy_logprobs, save_hf

SPEC = dict(pattern="M*ME-", spelling="new", tie_word_embeddings=True)
PROMPTS = [[5, 17, 33, 8, 60, 21, 9], [44, 3], [12, 70, 71, 72, 15, 16, 90, 4, 7, 30, 31, 50, 11],
           [88, 10, 23, 54]]
N = 32
SP = {"max_new_tokens": N, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def own_head(tmp_path_factory):
    """A tied config saved by transformers with a head that differs from the embedding."""
    hf = build_hf(SPEC, seed=3)
    with torch.no_grad():
        g = torch.Generator().manual_seed(11)
        hf.lm_head.weight.copy_(torch.randn(hf.lm_head.weight.shape, generator=g) * 0.25)
    folder = save_hf(hf, tmp_path_factory.mktemp("tied") / "own_head", "new", drop_tied_head=False)
    return hf, folder


def test_fixture_is_a_tied_config_with_a_different_head(own_head):
    hf, folder = own_head
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True
    tensors = load_file(str(folder / "model.safetensors"))
    assert not torch.equal(tensors["lm_head.weight"], tensors["backbone.embeddings.weight"])
    # and the difference decides tokens: scoring with the embedding would decode otherwise
    tied = copy.deepcopy(hf)
    with torch.no_grad():
        tied.lm_head.weight.copy_(tied.model.embeddings.weight)
    assert any(hf_greedy(tied, p, N) != hf_greedy(hf, p, N) for p in PROMPTS)


def test_own_head_of_tied_config_matches_transformers(own_head, caplog):
    hf, folder = own_head
    with caplog.at_level(logging.INFO, logger="blockspec"):
        engine = Engine(model_path=str(folder), dtype="float32", device="cpu")
    notes = [r.getMessage() for r in caplog.records if "output head" in r.getMessage()]
    assert len(notes) == 1 and "own lm_head.weight" in notes[0], notes
    assert not engine.model.tied_head
    try:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=SP, return_logprob=True)
    finally:
        engine.shutdown()
    for prompt, out in zip(PROMPTS, outs):
        ref_ids, ref_lps = hf_greedy_logprobs(hf, prompt, N)
        assert out["output_ids"] == ref_ids
        got = out["meta_info"]["output_token_logprobs"]
        assert [t for _, t in got] == ref_ids
        assert torch.allclose(torch.tensor([lp for lp, _ in got]), torch.tensor(ref_lps),
                              atol=1e-4, rtol=0), (got, ref_lps)


def test_folder_without_head_still_ties(tmp_path, caplog):
    hf = build_hf(SPEC, seed=3)                 # lm_head is a copy of the embedding here
    folder = save_hf(hf, tmp_path / "tied", "new")
    assert "lm_head.weight" not in load_file(str(folder / "model.safetensors"))
    with caplog.at_level(logging.INFO, logger="blockspec"):
        engine = Engine(model_path=str(folder), dtype="float32", device="cpu")
    notes = [r.getMessage() for r in caplog.records if "output head" in r.getMessage()]
    assert len(notes) == 1 and "tied to backbone.embeddings.weight" in notes[0], notes
    assert engine.model.tied_head and not hasattr(engine.model, "lm_head")
    try:
        out = engine.generate(input_ids=PROMPTS[0], sampling_params=SP)
    finally:
        engine.shutdown()
    assert out["output_ids"] == hf_greedy(hf, PROMPTS[0], N)


def test_untied_config_without_head_is_still_an_error(own_head, tmp_path):
    _, folder = own_head
    d = edited_copy(folder, tmp_path / "untied", lambda c: c.update(tie_word_embeddings=False),
                    lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): lm_head.weight"):
        Engine(model_path=str(d), dtype="float32", device="cpu")
