"""The demo data generator: GSM8K format, correct calculator annotations, the learnability
rules, disjoint splits, seeded determinism, the shipped test split, and the tokenizer."""
from __future__ import annotations

import re

import pytest

from blockspec.gsm8k_data.generator import (generate_split, is_test_question, iter_split,
                                           read_jsonl)
from blockspec.gsm8k_data.templates import MAX_LARGE_FACTOR, MAX_RESULT, MAX_SMALL_FACTOR, TEMPLATES
from blockspec.eval.gsm8k import DEFAULT_DATA

ANNOT = re.compile(r"<<(\d+)([-+*/])(\d+)(?:\+(\d+))?=(\d+)>>(\d+)")


@pytest.fixture(scope="module")
def train():
    return generate_split("train", 3000, seed=0)


def test_gsm8k_format_and_annotations(train):
    for p in train:
        lines = p.answer.split("\n")
        assert lines[-1] == f"#### {p.value}"
        assert 2 <= len(lines) - 1 <= 4                      # 2-4 reasoning steps
        assert p.question.endswith("?") and "\n" not in p.question
        results = []
        for line in lines[:-1]:
            found = ANNOT.findall(line)
            assert len(found) == 1, line
            a, op, b, c3, res, after = found[0]
            a, b, res = int(a), int(b), int(res)
            want = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else -1}[op]
            if c3:
                want += int(c3)
            assert op != "/" or a % b == 0, line
            assert res == want and after == str(res), line
            assert 0 <= res <= MAX_RESULT, line
            if op in "*/":
                assert min(a, b) <= MAX_SMALL_FACTOR, line
                assert (max(a, b) if op == "*" else res) <= MAX_LARGE_FACTOR, line
            assert f"{a}{op}{b}" in line.split("<<")[0], line   # plain expression before it
            results.append(res)
        assert results[-1] == p.value


def test_every_template_is_used(train):
    assert {p.template for p in train} == {t.__name__ for t in TEMPLATES}


def test_splits_are_disjoint_by_construction(train):
    test = generate_split("test", 300, seed=0)
    assert not {p.question for p in train} & {p.question for p in test}
    assert all(is_test_question(p.question) for p in test)
    assert not any(is_test_question(p.question) for p in train)
    assert len({p.question for p in test}) == len(test)


def test_seeded_determinism():
    assert generate_split("train", 50, seed=3) == generate_split("train", 50, seed=3)
    assert generate_split("train", 50, seed=3) != generate_split("train", 50, seed=4)
    with pytest.raises(ValueError, match="split"):
        next(iter_split("dev", 0))


def test_shipped_test_split_is_reproducible():
    rows = read_jsonl(DEFAULT_DATA)
    assert len(rows) == 500
    assert rows == [p.to_json() for p in generate_split("test", 500, seed=0)]


def test_read_jsonl_names_bad_rows(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_jsonl(f)


def test_tokenizer_splits_digits_and_has_chat_template(tmp_path, train):
    from blockspec.gsm8k_data.tokenizer import SPECIALS, save_tokenizer, train_tokenizer, training_texts
    from blockspec.tokenizer import Tokenizer

    tok = train_tokenizer(training_texts(p.to_json() for p in train[:500]))
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2, 3]
    assert tok.get_vocab_size() <= 1536
    text = train[0].question + "\n" + train[0].answer
    enc = tok.encode(text)
    assert tok.decode(enc.ids) == text
    assert all(len(piece.strip(" Ġ")) == 1 for piece in enc.tokens if any(ch.isdigit() for ch in piece))
    t = Tokenizer(save_tokenizer(tok, tmp_path))
    q = train[1].question
    assert t.apply_chat_template([{"role": "user", "content": q}]) == q + "\n"
    assert t.eos_token_id == 2
    # the raw question is a prefix of the templated prompt, token for token
    assert t.encode(q + "\n")[: len(t.encode(q))] == t.encode(q)
