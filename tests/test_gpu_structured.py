"""Structured output on a GPU (skipped without CUDA or xgrammar): a Lightning-shaped random
target (lightning-mini: Lightning's layer shapes and 131,072-token vocabulary) with random
DFlash / DSpark drafts and a synthetic byte-level vocabulary of that size. Greedy constrained
output is token-identical across NONE / DFLASH / DSPARK, and every sampled completion is a
valid instance of the schema.

(The name is bounded by a pattern, not maxLength: xgrammar 0.2.9 compiles a maxLength string to
a character class that lets control characters through, which JSON forbids.)"""
from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("xgrammar")

from blockspec import Engine  # noqa: E402
from blockspec.bench.draft_presets import build_random_draft  # noqa: E402
from blockspec.bench.presets import build_target, preset_config  # noqa: E402
from blockspec.bench.synthetic_tokenizer import synthetic_tokenizer  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "ok", "tag"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}, "tag": {"enum": ["a", "b", "c"]}}}
PROMPTS = [[3, 5, 7, 11, 2], [8, 1], [13, 4, 9, 100, 2000], [6, 6, 6, 1, 2, 3, 4]]


def _valid(text: str) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return (isinstance(doc, dict) and set(doc) == {"name", "age", "ok", "tag"}
            and isinstance(doc["name"], str) and re.fullmatch("[a-z]{1,8}", doc["name"]) is not None
            and isinstance(doc["age"], int) and not isinstance(doc["age"], bool)
            and 0 <= doc["age"] <= 120 and isinstance(doc["ok"], bool)
            and doc["tag"] in ("a", "b", "c"))


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """fp32 (so target-only and verify agree on every argmax), graphs on, and an eager DFlash.
    Each engine builds its own target and draft (the same seeded weights): engines share no
    module, since an engine prepares its model and draft for its own graphs."""
    dev, dtype = torch.device("cuda"), torch.float32
    cfg = preset_config("lightning-mini")
    tok = synthetic_tokenizer(cfg["vocab_size"], tmp_path_factory.mktemp("vocab"))
    kw = dict(tokenizer=tok, max_running_requests=64, max_total_tokens=64 * 128)
    out = {}
    for name, kind, eager in (("none", None, False), ("dflash", "dflash", False),
                              ("dflash_eager", "dflash", True),
                              ("dspark", "dspark", False)):
        draft = (build_random_draft(kind, cfg, 4 if kind == "dflash" else 3, dev, dtype)
                 if kind else None)
        out[name] = Engine.from_model(build_target("lightning-mini", dev, dtype), draft=draft,
                                      disable_cuda_graph=eager, **kw)
    yield out
    for e in out.values():
        e.shutdown()


def test_greedy_constrained_output_is_identical_across_algorithms(engines):
    sp = {"max_new_tokens": 64, "temperature": 0, "json_schema": SCHEMA}
    runs = {k: e.generate(input_ids=PROMPTS, sampling_params=sp) for k, e in engines.items()}
    want = [o["output_ids"] for o in runs["none"]]
    for kind in runs:           # graphs (the phases replayed) and eager alike
        assert [o["output_ids"] for o in runs[kind]] == want, kind
    tok = engines["none"].tokenizer
    assert all(_valid(tok.decode(ids)) for ids in want)
    phased = [k for k in engines["none"].runner.graphs._graphs if len(k) == 4]
    assert phased and all(k[0] == "decode" for k in phased)   # (kind, phase, key, size)


@pytest.mark.parametrize("kind", ["none", "dflash", "dspark"])
def test_every_sampled_completion_honours_the_schema(engines, kind):
    """300 sampled completions (batches of 64 through captured steps) all parse and validate;
    a seeded request gives the same tokens alone and inside the batch."""
    e = engines[kind]
    sp = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 0.95, "json_schema": SCHEMA}
    outs = e.generate(input_ids=[PROMPTS[i % 4] for i in range(300)],
                      sampling_params=[{**sp, "seed": i} for i in range(300)])
    texts = [e.tokenizer.decode(o["output_ids"]) for o in outs]
    bad = [t for t in texts if not _valid(t)]
    assert not bad, bad[:3]
    assert len(set(texts)) > 50                      # sampled, not one greedy answer
    alone = e.generate(input_ids=PROMPTS[7 % 4], sampling_params={**sp, "seed": 7})
    assert alone["output_ids"] == outs[7]["output_ids"]
