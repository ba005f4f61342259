"""A byte-level tokenizer of any vocabulary size, for benchmarking grammar masks on random
presets (which have no tokenizer, and no published tokenizer can be downloaded here).

The cost of a grammar's token mask depends on the vocabulary: how many pieces a grammar state
must check one by one (xgrammar precomputes the rest per state). The pieces here are built to
resemble a BPE vocabulary's: three specials (ids 0-2, where Nemotron-H configs put pad, bos and
eos), the 256 byte symbols, then words of 2-10 characters drawn from
English letter frequencies, about half with a leading space, with digits, punctuation and JSON
delimiters (quotes, braces, brackets, commas, colons) mixed in at roughly the rate a real
tokenizer has them. The pieces are deterministic for a size, so two runs mask the same
vocabulary.
"""
from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from blockspec.tokenizer import Tokenizer

_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
_LETTER_WEIGHTS = [12.7, 9.1, 8.2, 7.5, 7.0, 6.7, 6.3, 6.1, 6.0, 4.3, 4.0, 2.8, 2.8, 2.4, 2.4,
                   2.2, 2.0, 2.0, 1.9, 1.5, 1.0, 0.8, 0.2, 0.2, 0.1, 0.1]
_OTHER = '0123456789.,:;!?\'"()[]{}-_/\\@#$%&*+=<>|`~'
SPECIALS = ("<unk>", "<s>", "</s>")     # ids 0, 1, 2: pad/unk, bos, eos


def _pieces(n: int, seed: int) -> list[str]:
    """``n`` distinct multi-character pieces (ByteLevel's printable alphabet: a leading space
    is written 'Ġ')."""
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        length = rng.randint(2, 10)
        if rng.random() < 0.06:          # punctuation / digit runs: '",', '":', '123', '}]'
            word = "".join(rng.choice(_OTHER) for _ in range(min(length, 4)))
        else:
            word = "".join(rng.choices(_LETTERS, _LETTER_WEIGHTS, k=length))
            if rng.random() < 0.1:
                word = word.capitalize()
            if rng.random() < 0.03:
                word += rng.choice(_OTHER)
        piece = ("Ġ" if rng.random() < 0.5 else "") + word
        if piece not in seen:
            seen.add(piece)
            out.append(piece)
    return out


def synthetic_tokenizer(vocab_size: int, folder: str | Path | None = None,
                        seed: int = 0) -> Tokenizer:
    """A tokenizer whose vocabulary has exactly ``vocab_size`` pieces: specials, bytes, words
    (eos is id 2, as in the presets' configs). Written to ``folder`` (a temporary one if None)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    least = len(SPECIALS) + len(alphabet)
    if vocab_size < least:
        raise ValueError(f"a synthetic tokenizer needs vocab_size >= {least}, got {vocab_size}")
    pieces = list(SPECIALS) + alphabet + _pieces(vocab_size - least, seed)
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    folder = Path(folder or tempfile.mkdtemp(prefix="blockspec-vocab-"))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": SPECIALS[1],
                                                                 "eos_token": SPECIALS[2]}))
    return Tokenizer(folder)
