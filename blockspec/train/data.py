"""Training sequences from GSM8K-format rows: token ids in the chat format of the tokenizer, the
index where the answer starts, and a length-bucketed, resumable batch order.

Sequence layout (see ``blockspec.gsm8k_data.tokenizer``): ``question "\\n" answer </s>``.  The
loss covers the newline, the answer and ``</s>``: the newline too, so that a raw question
typed without the template is also answered.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sequences:
    """Token ids of all sequences in one flat int32 tensor (cheap for 10^5-10^6 rows)."""

    flat: torch.Tensor           # [sum of lengths] int32
    offsets: torch.Tensor        # [N] start of each sequence in ``flat``
    lengths: torch.Tensor        # [N]
    answer_start: torch.Tensor   # [N] index of the first supervised token (the newline)

    def __len__(self) -> int:
        return self.lengths.shape[0]

    def ids(self, i: int) -> list[int]:
        o = int(self.offsets[i])
        return self.flat[o:o + int(self.lengths[i])].tolist()


def encode_rows(tokenizer, rows: list[dict], eos_id: int, max_len: int) -> Sequences:
    """``tokenizer`` is a ``tokenizers.Tokenizer``; rows longer than ``max_len`` are dropped."""
    questions = tokenizer.encode_batch([r["question"] for r in rows], add_special_tokens=False)
    answers = tokenizer.encode_batch(["\n" + r["answer"] for r in rows], add_special_tokens=False)
    flat: list[int] = []
    lengths, starts = [], []
    for q, a in zip(questions, answers):
        n = len(q.ids) + len(a.ids) + 1
        if n <= max_len and q.ids:
            flat += q.ids
            flat += a.ids
            flat.append(eos_id)
            lengths.append(n)
            starts.append(len(q.ids))
    if not lengths:
        raise ValueError(f"no training sequence fits max_len={max_len}")
    lengths_t = torch.tensor(lengths)
    offsets = torch.cumsum(lengths_t, 0) - lengths_t
    return Sequences(torch.tensor(flat, dtype=torch.int32), offsets, lengths_t,
                     torch.tensor(starts))


class BatchOrder:
    """Shuffled epochs; inside each window of ``bucket`` batches, sequences of similar length
    are batched together (less padding), and the batches are then shuffled.  The position
    (epoch, cursor) is part of the training state, so a resumed run continues the same order."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int, bucket: int = 32) -> None:
        self.lengths = torch.tensor(lengths)
        self.batch_size, self.seed, self.bucket = batch_size, seed, bucket
        self.epoch, self.cursor = 0, 0
        self._batches = self._plan(0)

    def _plan(self, epoch: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        perm = torch.randperm(len(self.lengths), generator=g)
        window = self.batch_size * self.bucket
        batches = []
        for w0 in range(0, len(perm), window):
            chunk = perm[w0:w0 + window]
            chunk = chunk[torch.argsort(self.lengths[chunk], stable=True)]
            batches += list(chunk.split(self.batch_size))
        order = torch.randperm(len(batches), generator=g).tolist()
        return [batches[i] for i in order]

    def next(self) -> torch.Tensor:
        if self.cursor >= len(self._batches):
            self.epoch += 1
            self.cursor = 0
            self._batches = self._plan(self.epoch)
        b = self._batches[self.cursor]
        self.cursor += 1
        return b

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def restore(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._batches = self._plan(self.epoch)


def pad_batch(seqs: Sequences, index: torch.Tensor, pad_id: int, multiple: int = 8
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, T] long, lengths [B], answer_start [B]); T rounded up to ``multiple``."""
    lengths = seqs.lengths[index]
    t = -(-int(lengths.max()) // multiple) * multiple
    col = torch.arange(t)[None]
    inside = col < lengths[:, None]
    gather = (seqs.offsets[index][:, None] + col).clamp(max=seqs.flat.shape[0] - 1)
    ids = torch.where(inside, seqs.flat[gather].long(), torch.full_like(gather, pad_id))
    return ids, lengths, seqs.answer_start[index]
