"""Constrained sampling stays lossless under speculation: with a grammar, DFlash and DSpark
(and plain decoding) sample the target's distribution masked by the grammar, checked by a
chi-square test against the exact masked joint of two tokens that come from verify steps."""
from __future__ import annotations

import pytest

pytest.importorskip("xgrammar")

from blockspec import Engine  # noqa: E402
from tests.spec_fixtures import (CHARS, draft_config, make_spec_target,  # noqa: E402
                                 two_token_chi_square_pvalue, write_char_tokenizer, write_draft)
from tests.test_dflash import HIDDEN, LAYERS, VOCAB  # noqa: E402

# the first token is forced ('s'), the next two are sampled by the first verify's rows 0 and 1
# (or a second verify), each under its own mask; the target's favourite 'f' is allowed by both
REGEX = "s[d-h][e-j]"
ALLOWED = ([CHARS.index(c) for c in "defgh"], [CHARS.index(c) for c in "efghij"])
PARAMS = {"max_new_tokens": 3, "temperature": 1.0, "top_p": 0.95, "ignore_eos": True, "regex": REGEX}
PROMPT, N = [7, 5], 8000


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured_lossless")
    _, folder = make_spec_target(root, offset=2.0, mix=0.3, pull=3.5)
    write_char_tokenizer(folder, VOCAB)
    return root, folder


def _draft(root, kind: str):
    extra = {"head_type": "gated"} if kind == "dspark" else {}
    cfg = draft_config(kind, hidden=HIDDEN, vocab=VOCAB, target_layers=LAYERS,
                       block_size=4 if kind == "dflash" else 3, **extra)
    return write_draft(root / f"draft_{kind}", cfg, std=0.05)


@pytest.mark.parametrize("algo", ["NONE", "DFLASH", "DSPARK"])
def test_constrained_sampling_is_the_masked_target_distribution(target, algo):
    root, folder = target
    kw = {} if algo == "NONE" else {"speculative_algorithm": algo,
                                    "speculative_draft_model_path": str(_draft(root, algo.lower()))}
    e = Engine(model_path=str(folder), device="cpu", max_running_requests=2000,
               max_total_tokens=2000 * 16, **kw)
    try:
        outs = e.generate(input_ids=[PROMPT] * N, sampling_params=PARAMS)
        assert all(o["text"][0] == "s" and len(o["output_ids"]) == 3 for o in outs)
        if algo != "NONE":
            hist = [sum(c) for c in zip(*[o["meta_info"]["spec_accept_histogram"] for o in outs])]
            assert hist[0] > 0 and sum(hist[1:]) > 0, hist        # drafts rejected and accepted
        tail = [{"output_ids": o["output_ids"][1:]} for o in outs]
        forced = PROMPT + [CHARS.index("s")]
        assert two_token_chi_square_pvalue(e, tail, forced, PARAMS, ALLOWED) > 0.01
    finally:
        e.shutdown()


def test_constrained_sampling_at_random_adaptive_widths(target):
    """The phased (grammar) steps at verify widths chosen per step: same masked law."""
    import random

    root, folder = target
    e = Engine(model_path=str(folder), device="cpu", max_running_requests=2000,
               max_total_tokens=2000 * 16, speculative_algorithm="DFLASH",
               speculative_draft_model_path=str(_draft(root, "dflash")), speculative_adaptive=True)
    try:
        rng = random.Random(2)
        e.drafter.chooser.force = iter(lambda: rng.randint(1, e.drafter.width), None)
        outs = e.generate(input_ids=[PROMPT] * N, sampling_params=PARAMS)
        assert all(o["text"][0] == "s" and len(o["output_ids"]) == 3 for o in outs)
        widths = [sum(c) for c in zip(*[o["meta_info"]["spec_width_histogram"] for o in outs])]
        assert all(n > 0 for n in widths), widths
        tail = [{"output_ids": o["output_ids"][1:]} for o in outs]
        forced = PROMPT + [CHARS.index("s")]
        assert two_token_chi_square_pvalue(e, tail, forced, PARAMS, ALLOWED) > 0.01
    finally:
        e.shutdown()
