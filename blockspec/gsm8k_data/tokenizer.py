"""Train the demo family's tokenizer (HF ``tokenizers`` BPE) and write it with a chat template.

Digits are split into single tokens so the target learns column arithmetic over a ten-symbol
alphabet instead of memorising one token per number; the byte-level alphabet keeps any user
prompt encodable.  The vocabulary stays small (about 1k), so embeddings and the LM head are a
small share of a ~10M-parameter model.

Prompt format: the user turn is the question followed by one newline, and the assistant turn is
the GSM8K answer followed by ``</s>``.  A raw question typed at ``blockspec generate`` (which
does not apply a template) is the same prompt minus that newline, which the target has also
learnt to produce, so both paths answer.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS, MASK = "<pad>", "<s>", "</s>", "<|mask|>"
SPECIALS = (PAD, BOS, EOS, MASK)          # ids 0, 1, 2, 3
DEFAULT_VOCAB_SIZE = 1024

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ m['content'] }}{{ '\\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
    """A byte-level BPE whose pre-tokenizer isolates every digit."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIALS):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s!r} got id {tok.token_to_id(s)}, expected {i}")
    return tok


def save_tokenizer(tok, folder: str | Path) -> Path:
    """tokenizer.json + tokenizer_config.json (special tokens and the chat template)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "mask_token": MASK,
           "model_max_length": 1024, "chat_template": CHAT_TEMPLATE,
           "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return folder


def training_texts(rows: Iterable[dict]) -> Iterator[str]:
    for r in rows:
        yield r["question"] + "\n" + r["answer"]

