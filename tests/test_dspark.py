"""DSpark end to end: vanilla/gated/rnn heads x sample_from_anchor x generic and Nemotron 3.5
layouts decode token-identically to the target alone; sampling stays lossless."""
from __future__ import annotations

import pytest

from blockspec import Engine
from tests.spec_fixtures import (draft_config, make_spec_target, quantize_draft_w4a16,
                                 two_token_chi_square_pvalue, write_draft)
from tests.test_dflash import GREEDY, HIDDEN, LAYERS, PROMPTS, VOCAB


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    hf, folder = make_spec_target(root, offset=2.0, mix=0.3, pull=3.5)
    ref = Engine(model_path=str(folder), device="cpu").generate(input_ids=PROMPTS, sampling_params=GREEDY)
    return root, folder, [o["output_ids"] for o in ref], hf.model.embeddings.weight.detach()


def _draft(root, gamma, head, sfa, nemotron=False, embedding=None):
    cfg = draft_config("dspark", hidden=HIDDEN, vocab=VOCAB, target_layers=LAYERS, block_size=gamma,
                       head_type=head, sample_from_anchor=None if nemotron else sfa, nemotron=nemotron)
    if nemotron:
        cfg["markov_rank"] = 16          # packed markov_w2 needs in_features % 16 == 0
    folder = write_draft(root / f"ds_{gamma}_{head}_{sfa}_{nemotron}", cfg, std=0.05,
                         target_embedding=embedding)
    return quantize_draft_w4a16(folder) if nemotron else folder


def _engine(folder, draft, **kw):
    return Engine(model_path=str(folder), device="cpu", speculative_algorithm="DSPARK",
                  speculative_draft_model_path=str(draft), **kw)


def _hist(outs):
    return [sum(c) for c in zip(*[o["meta_info"]["spec_accept_histogram"] for o in outs])]


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("sfa", [True, False])
def test_generic_greedy_token_exact(target, head, sfa):
    root, folder, ref, _ = target
    outs = _engine(folder, _draft(root, 4, head, sfa)).generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == ref
    hist = _hist(outs)
    assert len(hist) == 5 and all(n > 0 for n in hist), hist    # every acceptance length 0..gamma


def test_nemotron_35_layout_quantized_greedy_token_exact(target):
    root, folder, ref, emb = target
    draft = _draft(root, 4, "vanilla", False, nemotron=True, embedding=emb)
    e = _engine(folder, draft)
    d = e.drafter.draft
    assert d.is_nemotron_35 and d.embed_tokens is not None
    assert d.markov_head.markov_w2.weight.dtype.is_floating_point is False   # packed uint8
    assert d.fc.weight.shape == (HIDDEN, 3 * HIDDEN // 2)
    outs = e.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == ref
    assert all(n > 0 for n in _hist(outs)), _hist(outs)


def test_num_draft_tokens_sets_gamma(target):
    root, folder, ref, _ = target
    e = _engine(folder, _draft(root, 7, "vanilla", True), speculative_num_draft_tokens=3)
    assert e.drafter.gamma == 2
    outs = e.generate(input_ids=PROMPTS[:4], sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == ref[:4]


def test_sampling_is_lossless_chi_square(target):
    root, folder, _, _ = target
    params = {"max_new_tokens": 2, "temperature": 0.7, "top_p": 0.9, "ignore_eos": True}
    prompt, n = [7, 5], 20000
    e = _engine(folder, _draft(root, 3, "gated", True), max_running_requests=2500,
                max_total_tokens=2500 * 10)
    outs = e.generate(input_ids=[prompt] * n, sampling_params=params)
    hist = _hist(outs)
    assert hist[0] > 0 and sum(hist[1:]) > 0, hist
    assert two_token_chi_square_pvalue(e, outs, prompt, params) > 0.01
