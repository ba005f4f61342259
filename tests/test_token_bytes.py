"""``Tokenizer.token_bytes``: the bytes each token stands for, also for tokens that hold part
of a UTF-8 character, so the tokens' bytes rebuild the exact text (chat logprob ``bytes``)."""
from __future__ import annotations

from pathlib import Path

import pytest

from blockspec.tokenizer import Tokenizer

DEMO = Path(__file__).parent.parent / "blockspec" / "demo_family" / "target"
TEXT = "Héllo wörld — 3 × 4 = 12 ✓ 日本"


@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_token_bytes_rebuild_the_text(tiny_folder, which):
    tok = Tokenizer(tiny_folder if which == "tiny" else DEMO)
    ids = tok.encode(TEXT)
    assert bytes(b for t in ids for b in tok.token_bytes(t)) == TEXT.encode()
    partial = [t for t in ids if "\ufffd" in tok.decode([t])]
    assert partial, "the text should split a character across tokens"
    for t in partial:                      # part of a character: raw bytes >= 0x80
        assert tok.token_bytes(t) and all(b >= 0x80 for b in tok.token_bytes(t))


def test_special_and_unknown_ids(tiny_folder):
    tok = Tokenizer(tiny_folder)
    assert tok.token_bytes(tok.eos_token_id) == []
    assert tok.token_bytes(10**9) is None


def test_byte_fallback_pieces(tmp_path):
    """SentencePiece-style vocabularies: <0xNN> pieces are that byte, '▁' is a space."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "\u2581hi": 1, "<0xC3>": 2, "<0xA9>": 3}
    hf = HF(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse()])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path)
    assert tok.token_bytes(1) == list(b" hi") and tok.token_bytes(2) == [0xC3]
    assert bytes(tok.token_bytes(2) + tok.token_bytes(3)).decode() == "é"
