"""Structured output: a grammar's mask on the target's logits gives valid output from the
trained demo family (a math model that has never seen JSON), the same tokens with DFlash,
DSpark and no speculation, bad grammars refused before anything is queued, and unconstrained
requests in the same batch untouched."""
from __future__ import annotations

import json
import re

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from blockspec import Engine  # noqa: E402
from blockspec.demo_family import EXAMPLE_QUESTION  # noqa: E402
from blockspec.grammar import GrammarCompiler, bitmask_words, mask_logits  # noqa: E402
from blockspec.tiny_model import byte_level_tokenizer_json  # noqa: E402

SCHEMA = {"type": "object", "required": ["answer", "unit"], "properties": {
    "answer": {"type": "integer", "minimum": 0, "maximum": 100000},
    "unit": {"enum": ["pages", "days"]}}}
REGEX = "[0-9]{3}-[a-z]{2}"
EBNF = 'root ::= "Answer: " [0-9]+ " pages"'
ALGOS = ("NONE", "DFLASH", "DSPARK")


def _valid(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "ebnf":
        return re.fullmatch(r"Answer: [0-9]+ pages", text) is not None
    obj = json.loads(text)
    if kind == "json_object":
        return isinstance(obj, dict)
    return (set(obj) == {"answer", "unit"} and type(obj["answer"]) is int
            and 0 <= obj["answer"] <= 100000 and obj["unit"] in ("pages", "days"))


CONSTRAINTS = {"json_schema": {"json_schema": SCHEMA}, "regex": {"regex": REGEX},
               "ebnf": {"ebnf": EBNF}, "json_object": {"json_object": True}}


@pytest.fixture(scope="module")
def engines():
    out = {a: Engine(device="cpu", dtype="float32", speculative_algorithm=a) for a in ALGOS}
    yield out
    for e in out.values():
        e.shutdown()


@pytest.fixture(scope="module")
def prompt(engines):
    return engines["NONE"].tokenizer.apply_chat_template([{"role": "user", "content": EXAMPLE_QUESTION}])


def test_mask_logits_is_xgrammars_mask_and_leaves_allowed_bits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 70, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, bitmask_words(70)), dtype=torch.int32, generator=g)
    bitmask[0] = -1                                    # a row without a grammar
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, backend="torch_native")
    got = mask_logits(logits, bitmask)
    assert torch.equal(got, want)
    assert torch.equal(got[0], logits[0])              # all allowed: the very same values


def _byte_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_str(byte_level_tokenizer_json())


def test_block_masks_follow_the_drafts_and_roll_back():
    """Row j of a verify block's masks is the grammar state after drafts[:j]; after a draft the
    grammar rejects the rows allow everything; the matcher ends where it started."""
    tok = _byte_tokenizer()
    comp = GrammarCompiler(tok, 259, [2])
    drafts = tok.encode("12x4").ids                 # "12" fits, then "x" breaks [0-9]{3}
    m = comp.matcher("regex", REGEX)
    rows = torch.zeros(5, bitmask_words(259), dtype=torch.int32)
    m.fill(rows, drafts)
    for j in range(3):
        ref = comp.matcher("regex", REGEX)
        for t in drafts[:j]:
            ref.accept(t)
        want = torch.zeros(1, bitmask_words(259), dtype=torch.int32)
        ref.fill(want)
        assert torch.equal(rows[j], want[0]), j
    assert (rows[3:] == -1).all()
    again = torch.zeros_like(rows)
    m.fill(again, drafts)                           # rolled back: the same walk again
    assert torch.equal(again, rows)
    assert not m.accept(drafts[0])
    with pytest.raises(RuntimeError, match="violates the request's grammar"):
        m.accept(drafts[2])


def test_compile_cache_by_kind_and_text():
    comp = GrammarCompiler(_byte_tokenizer(), 259, [2])
    for _ in range(3):
        comp.compile("regex", REGEX)
        comp.compile("json_schema", json.dumps(SCHEMA))
        comp.compile("ebnf", EBNF)
    assert comp.compiles == 3
    comp.compile("regex", REGEX + "?")
    assert comp.compiles == 4


@pytest.mark.parametrize("params, message", [
    ({"json_schema": "{not json"}, r"json_schema: does not compile: .*JSON"),
    ({"json_schema": {"type": 3}}, r"json_schema: does not compile"),
    ({"regex": "[0-9"}, r"regex: does not compile: .*Unclosed"),
    ({"ebnf": "root ::= foo"}, r"ebnf: does not compile: .*foo"),
    ({"regex": "a", "ebnf": EBNF}, "at most one of json_schema, json_object, regex, ebnf; got regex, ebnf"),
    ({"regex": 5}, "regex must be a string, got int"),
    ({"json_schema": {"default": {1, 2}}}, "json_schema: not JSON-serialisable"),
    ({"json_object": "yes"}, "json_object must be a bool"),
])
def test_bad_grammar_is_a_value_error_naming_the_field(engines, params, message):
    e = engines["DFLASH"]
    with pytest.raises(ValueError, match=message):
        e.generate(input_ids=[[5, 6], [7, 8]], sampling_params=[{"max_new_tokens": 4}, params])
    assert e.stats().waiting == 0 and e.stats().running == 0     # nothing was queued


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_greedy_constrained_output_is_valid_and_identical_across_algorithms(engines, prompt, kind):
    sp = {"max_new_tokens": 48, "temperature": 0, **CONSTRAINTS[kind]}
    outs = {a: engines[a].generate(prompt=prompt, sampling_params=sp) for a in ALGOS}
    ref = outs["NONE"]
    assert ref["meta_info"]["finish_reason"]["type"] == "stop", ref
    assert _valid(kind, ref["text"]), ref["text"]
    for a in ("DFLASH", "DSPARK"):
        assert outs[a]["output_ids"] == ref["output_ids"], (a, outs[a]["text"], ref["text"])
        assert outs[a]["meta_info"]["spec_verify_ct"] > 0
    free = engines["NONE"].generate(prompt=prompt, sampling_params={"max_new_tokens": 48, "temperature": 0})
    assert not _valid_or_false(kind, free["text"])        # unconstrained, the model writes math


def _valid_or_false(kind: str, text: str) -> bool:
    try:
        return _valid(kind, text)
    except ValueError:
        return False


def test_seeded_sampling_is_always_valid_and_reproducible(engines, prompt):
    """Sixteen seeds per constraint and algorithm (32 samples each): every output valid; a
    seeded request gives the same tokens alone or in a batch; the first token (sampled at
    prefill from the masked distribution, before any verify) is the same under every
    algorithm."""
    n = 16
    firsts = {}
    for a in ALGOS:
        for kind in ("json_schema", "regex"):
            sps = [{"max_new_tokens": 48, "temperature": 1.0, "seed": 100 + i, **CONSTRAINTS[kind]}
                   for i in range(n)]
            outs = engines[a].generate(prompt=[prompt] * n, sampling_params=sps)
            bad = [o["text"] for o in outs if not _valid_or_false(kind, o["text"])]
            assert not bad, (a, kind, bad)
            assert len({o["text"] for o in outs}) > 3, (a, kind)          # really sampled
            if kind == "json_schema":
                alone = engines[a].generate(prompt=prompt, sampling_params=sps[5])
                assert alone["output_ids"] == outs[5]["output_ids"], a
            firsts[a, kind] = [o["output_ids"][0] for o in outs]
    for kind in ("json_schema", "regex"):
        assert firsts["NONE", kind] == firsts["DFLASH", kind] == firsts["DSPARK", kind]


def test_unconstrained_rows_are_untouched_by_a_constrained_neighbour(engines, prompt):
    other = engines["NONE"].tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tom has 12 apples and eats 5. How many are left?"}])
    greedy = {"max_new_tokens": 40, "temperature": 0}
    sampled = {"max_new_tokens": 40, "temperature": 0.8, "top_p": 0.95, "seed": 11}
    constrained = {"max_new_tokens": 40, "temperature": 0, "json_schema": SCHEMA}
    for a in ("NONE", "DFLASH"):
        e = engines[a]
        solo = [e.generate(prompt=p, sampling_params=s)["output_ids"]
                for p, s in ((other, greedy), (prompt, sampled), (prompt, constrained))]
        mixed = e.generate(prompt=[other, prompt, prompt], sampling_params=[greedy, sampled, constrained])
        assert [o["output_ids"] for o in mixed] == solo, a


def test_constrained_steps_begin_ahead_and_complete_after_the_readback(engines, prompt,
                                                                      monkeypatch):
    """The step after a constrained one has its forwards launched before the current step is
    read back, and its masks filled only after: the order begin(ahead) -> collect ->
    complete, every time. A mask that missed a committed token would let a forbidden token
    through, which the matcher refuses (RuntimeError), so valid output proves the order."""
    from blockspec.runtime.model_runner import ModelRunner
    from blockspec.runtime.phases import PhasedSteps

    events = []

    def spy(name, orig, ahead_arg=None):
        def call(self, *a, **kw):
            events.append(name if ahead_arg is None else (name, a[ahead_arg] is None))
            return orig(self, *a, **kw)
        return call

    monkeypatch.setattr(PhasedSteps, "begin", spy("begin", PhasedSteps.begin, ahead_arg=0))
    monkeypatch.setattr(PhasedSteps, "complete", spy("complete", PhasedSteps.complete))
    monkeypatch.setattr(ModelRunner, "collect", staticmethod(
        lambda step, orig=ModelRunner.collect: events.append("collect") or orig(step)))
    for a in ("NONE", "DFLASH"):
        events.clear()
        out = engines[a].generate(prompt=[prompt] * 2, sampling_params=[
            {"max_new_tokens": 24, "temperature": 0, "regex": "[0-9]{20}"},
            {"max_new_tokens": 12, "temperature": 0}])      # ends first: a constrained row runs throughout
        assert re.fullmatch("[0-9]{20}", out[0]["text"])
        ahead = [i for i, e in enumerate(events) if e == ("begin", True)]
        assert len(ahead) >= 3, (a, events)
        for i in ahead:
            assert events[i + 1:i + 3] == ["collect", "complete"], (a, events[i:i + 3])


def test_grammar_end_finishes_even_with_ignore_eos_and_stop_ids_end_it(engines, prompt):
    e = engines["DFLASH"]
    eos = e.tokenizer.eos_token_id
    out = e.generate(prompt=prompt, sampling_params={"max_new_tokens": 40, "temperature": 0,
                                                     "regex": REGEX, "ignore_eos": True})
    assert re.fullmatch(REGEX, out["text"]) and out["output_ids"][-1] == eos
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    dot = e.tokenizer.encode(".")[0]
    out = e.generate(prompt=prompt, sampling_params={"max_new_tokens": 40, "temperature": 0,
                                                     "regex": REGEX, "stop_token_ids": [dot]})
    assert out["meta_info"]["finish_reason"]["matched"] in (dot, eos)
    assert re.fullmatch(REGEX, e.tokenizer.decode(out["output_ids"][:-1]))
