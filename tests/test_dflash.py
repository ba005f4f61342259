"""DFlash end to end: greedy output equals target-only decoding token for token, every
acceptance length occurs, stats are consistent, and bad drafts fail at load time."""
from __future__ import annotations

import logging

import pytest
import torch

from blockspec import Engine
from blockspec.configs.draft import DraftConfigError
from tests.ckpt_edit import edited_copy
from tests.spec_fixtures import (draft_config, make_spec_target, two_token_chi_square_pvalue,
                                 write_draft)

VOCAB, HIDDEN, LAYERS = 24, 32, 7
PROMPTS = [[(3 + 5 * i) % 23, (5 + 3 * i) % 23, 7 + i % 3, 11, 2 + i][: 2 + i % 4] for i in range(16)]
GREEDY = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    _, folder = make_spec_target(root, offset=2.0, mix=0.3, pull=3.5)
    ref = Engine(model_path=str(folder), device="cpu").generate(input_ids=PROMPTS, sampling_params=GREEDY)
    return root, folder, [o["output_ids"] for o in ref]


def _draft(root, block_size, **kw):
    cfg = draft_config("dflash", hidden=HIDDEN, vocab=VOCAB, target_layers=LAYERS, block_size=block_size, **kw)
    return write_draft(root / f"draft_b{block_size}_{len(kw)}", cfg, std=0.05)


def _spec_engine(folder, draft, **kw):
    return Engine(model_path=str(folder), device="cpu", speculative_algorithm="DFLASH",
                  speculative_draft_model_path=str(draft), **kw)


def _histogram(outs):
    return [sum(col) for col in zip(*[o["meta_info"]["spec_accept_histogram"] for o in outs])]


@pytest.mark.parametrize("block", [2, 3, 4, 6, 8, 12, 16])
def test_greedy_token_exact(target, block):
    root, folder, ref = target
    e = _spec_engine(folder, _draft(root, block))
    outs = e.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == ref
    # two verify widths reserved (the step in flight), a verify scratch of one width
    assert e.memory.lookahead == 2 * block and e.memory.mamba.step_scratch.shape[2] == block
    hist = _histogram(outs)
    assert len(hist) == block
    if block <= 6:   # short blocks: every acceptance length 0..B-1 must actually occur
        assert all(n > 0 for n in hist), hist
    else:            # long blocks: long acceptances still occur
        assert sum(hist[block // 2:]) > 0, hist


def test_meta_info_statistics(target):
    root, folder, ref = target
    out = _spec_engine(folder, _draft(root, 4)).generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    m = out["meta_info"]
    assert m["completion_tokens"] == 64 and out["output_ids"] == ref[0]
    assert sum(m["spec_accept_histogram"]) == m["spec_verify_ct"] > 0
    committed = sum((a + 1) * n for a, n in enumerate(m["spec_accept_histogram"]))
    assert committed >= 64 - 1   # the first token comes from prefill; the last step may overshoot
    assert m["spec_accept_length"] == pytest.approx(committed / m["spec_verify_ct"])
    assert 1.0 <= m["spec_accept_length"] <= 4.0


def test_chunked_prefill_and_logprobs_with_spec(target):
    root, folder, ref = target
    e = _spec_engine(folder, _draft(root, 6), chunked_prefill_size=2)
    outs = e.generate(input_ids=PROMPTS[:4], sampling_params=GREEDY, return_logprob=True)
    assert [o["output_ids"] for o in outs] == ref[:4]
    plain = Engine(model_path=str(folder), device="cpu").generate(
        input_ids=PROMPTS[:4], sampling_params=GREEDY, return_logprob=True)
    for o, p in zip(outs, plain):
        got = [lp for lp, _ in o["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, _ in p["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-4)


def test_num_draft_tokens_overrides_block_size(target, caplog):
    root, folder, ref = target
    with caplog.at_level(logging.WARNING, logger="blockspec"):
        e = _spec_engine(folder, _draft(root, 8), speculative_num_draft_tokens=3)
    assert "overrides the draft checkpoint's block size" in caplog.text
    out = e.generate(input_ids=PROMPTS[:3], sampling_params=GREEDY)
    assert [o["output_ids"] for o in out] == ref[:3]
    assert len(out[0]["meta_info"]["spec_accept_histogram"]) == 3


def test_mixed_greedy_and_sampled_batch(target):
    root, folder, ref = target
    e = _spec_engine(folder, _draft(root, 4))
    sampled = {"max_new_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 3, "ignore_eos": True}
    outs = e.generate(input_ids=PROMPTS[:4], sampling_params=[GREEDY, sampled, GREEDY, sampled])
    assert outs[0]["output_ids"] == ref[0] and outs[2]["output_ids"] == ref[2]
    again = e.generate(input_ids=PROMPTS[1], sampling_params=sampled)
    assert again["output_ids"] == outs[1]["output_ids"]   # seeded: same alone or batched


def _edit_draft(root, name, cfg_edit=None, tensor_edit=None):
    return edited_copy(_draft(root, 4), root / name, cfg_edit, tensor_edit)


@pytest.mark.parametrize("name, cfg_edit, tensor_edit, message", [
    ("hidden", lambda c: c.update(hidden_size=48), None, "draft hidden_size 48 != target hidden size 32"),
    ("fc", None, lambda t: t.update({"fc.weight": torch.zeros(32, 64)}), "K mismatch"),
    ("mask", lambda c: c["dflash_config"].update(mask_token_id=24), None, "mask_token_id 24 >= target vocab size 24"),
    ("depth", lambda c: (c.pop("num_target_layers"), c["dflash_config"].update(target_layer_ids=[0, 3, 7])),
     None, "beyond the target's 7 layers"),
    ("depth_cfg", lambda c: c["dflash_config"].update(target_layer_ids=[0, 3, 7]), None,
     r"target_layer_ids \[0, 3, 7\] exceed num_target_layers=7"),
])
def test_load_time_errors(target, name, cfg_edit, tensor_edit, message):
    root, folder, _ = target
    bad = _edit_draft(root, name, cfg_edit, tensor_edit)
    with pytest.raises(DraftConfigError, match=message):
        _spec_engine(folder, bad)


def test_algorithm_must_match_checkpoint(target):
    root, folder, _ = target
    with pytest.raises(ValueError, match="DFLASH checkpoint"):
        Engine(model_path=str(folder), device="cpu", speculative_algorithm="DSPARK",
               speculative_draft_model_path=str(_draft(root, 4)))


def test_sampling_is_lossless_chi_square(target):
    root, folder, _ = target
    params = {"max_new_tokens": 2, "temperature": 0.7, "top_p": 0.9, "ignore_eos": True}
    prompt, n = [7, 5], 20000
    e = _spec_engine(folder, _draft(root, 4), max_running_requests=2500, max_total_tokens=2500 * 10)
    outs = e.generate(input_ids=[prompt] * n, sampling_params=params)
    assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) == n   # the 2nd token came from a verify
    hist = _histogram(outs)
    assert hist[0] > 0 and sum(hist[1:]) > 0, hist                  # drafts both rejected and accepted
    assert two_token_chi_square_pvalue(e, outs, prompt, params) > 0.01


def test_nemotron_35_layout_w4a16_greedy_token_exact(target):
    from tests.spec_fixtures import quantize_draft_w4a16

    root, folder, ref = target
    from safetensors.torch import load_file as _load
    emb = _load(str(folder / "model.safetensors"))["backbone.embeddings.weight"]
    cfg = draft_config("dflash", hidden=HIDDEN, vocab=VOCAB, target_layers=LAYERS, block_size=4, nemotron=True)
    draft = quantize_draft_w4a16(write_draft(root / "nemotron_dflash", cfg, std=0.05, target_embedding=emb))
    e = _spec_engine(folder, draft)
    d = e.drafter.draft
    assert d.is_nemotron_35 and d.embed_tokens.weight.dtype == torch.uint8   # own packed embedding
    assert d.layers[0].self_attn.q_proj.weight.dtype == torch.uint8
    outs = e.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == ref
    assert all(n > 0 for n in _histogram(outs)), _histogram(outs)


def test_generic_draft_with_a_nemotron_field_takes_generic_path(target):
    root, folder, ref = target
    cfg = draft_config("dflash", hidden=HIDDEN, vocab=VOCAB, target_layers=LAYERS, block_size=4)
    cfg["has_embed_tokens"] = True           # one Nemotron field alone changes nothing
    e = _spec_engine(folder, write_draft(root / "generic_one_field", cfg, std=0.05))
    assert not e.drafter.draft.is_nemotron_35 and e.drafter.draft.embed_tokens is None
    assert e.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"] == ref[0]
