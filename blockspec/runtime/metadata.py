"""Batch metadata: what one forward needs to know about its batch, as device tensors.

Two ways in:

* ``StepInputs``: static per-request buffers (slot, committed length, last token, sampling
  parameters, seeds and counters) sized for the largest batch, filled from one pinned host
  buffer with one non-blocking copy per step. Decode, draft and verify forwards derive
  everything else on the device (``uniform_metadata``), so a step is a pure function of these
  buffers and the caches: it can be captured once and replayed as a CUDA graph.
* ``extend_metadata``: prefill chunks of any lengths, built from host lists (an eager
  prefill forward; its shapes change every call).
* ``chunk_metadata``: one request's prefill chunk padded to a fixed length, derived on the
  device from a few static values, so the forward can be captured once per length and
  replayed (``runtime/prefill_graphs.py``).

No Python list and no request object reaches a model: the model reads ``ForwardMetadata``
(``blockspec/forward_metadata.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from blockspec.attention.base import AttentionBackend
from blockspec.cache import KVPool, MambaStatePool
from blockspec.forward_metadata import ForwardMetadata, Mode, flat_slots
from blockspec.grammar import Matcher
from blockspec.penalties import PenaltyState

# (buffer field, StepBatch attribute); the order is the buffer's row order
_INT_FIELDS = (("slot", "slots"), ("prefix", "prefix_lens"), ("token", "tokens"), ("top_k", "top_k"),
               ("seed", "seeds"), ("sample_ctr", "sample_counters"), ("verify_ctr", "verify_counters"))
_FLOAT_FIELDS = (("temperature", "temperature"), ("top_p", "top_p"), ("min_p", "min_p"))


@dataclass
class StepBatch:
    """One decode or speculative step, described on the host (built by the scheduler)."""

    slots: list[int]
    prefix_lens: list[int]            # committed tokens per request (the anchor's position)
    tokens: list[int]                 # last sampled token per request (the step's input)
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    seeds: list[int]
    sample_counters: list[int]        # output tokens so far (AR sampling stream)
    verify_counters: list[int]        # verify steps so far (speculative streams)
    want_logprobs: bool = False
    grammars: list[Matcher | None] | None = None    # per row; None when no row is constrained
    penalized: bool = False           # some row has a penalty, logit_bias or min_new_tokens
    top_logprobs: bool = False        # some row wants its top alternatives' logprobs

    @property
    def size(self) -> int:
        return len(self.slots)

    @property
    def greedy_only(self) -> bool:
        return all(t <= 0 for t in self.temperature)

    @property
    def filters(self) -> bool:
        """Some sampled row has a top-k / top-p / min-p filter on (the sort is needed)."""
        return any(t > 0 and (k > 0 or p < 1 or m > 0)
                   for t, k, p, m in zip(self.temperature, self.top_k, self.top_p, self.min_p))

    @property
    def constrained(self) -> bool:
        """Some row has a grammar: its logits are masked by host-computed bitmasks."""
        return self.grammars is not None and any(g is not None for g in self.grammars)

    def sampling_key(self) -> tuple[bool, bool, bool, bool, bool, bool]:
        """What decides which sampling code a step runs (one captured graph each); a batch
        with no penalty and no top logprobs runs exactly the code it ran before they existed."""
        return (self.greedy_only, self.filters, self.want_logprobs, self.constrained,
                self.penalized, self.top_logprobs)


class StepInputs:
    """Static per-request input buffers for decode / speculative steps.

    One byte buffer holds every field; the host copy is pinned (on CUDA) and reaches the
    device with one non-blocking copy per step. Rows past the real batch are padding that
    points at the memory manager's dummy slot.
    """

    def __init__(self, max_bs: int, device: torch.device, dummy_slot: int) -> None:
        self.max_bs = max_bs
        self.device = device
        self.dummy_slot = dummy_slot
        n_int, n_float = len(_INT_FIELDS), len(_FLOAT_FIELDS)
        nbytes = (8 * n_int + 4 * n_float) * max_bs
        pin = device.type == "cuda"
        self._host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
        self._dev = torch.zeros(nbytes, dtype=torch.uint8, device=device) if pin else self._host
        self._ints, self._floats = self._blocks(self._host)
        self.host = self._views(self._host)
        self.dev = self._views(self._dev)
        self.fill_dummy(0, max_bs)
        self.upload()
        # grammar bitmasks [max_bs, width, words], made by the first constrained batch
        self.mask_host: torch.Tensor | None = None
        self.mask_dev: torch.Tensor | None = None
        self._mask_sent: torch.cuda.Event | None = None    # behind the last mask upload
        self.penalties: PenaltyState | None = None      # made by the first penalised request

    def reserve_penalties(self, vocab: int) -> PenaltyState:
        """The penalty buffers (one row per cache slot, the dummy slot's included), once."""
        if self.penalties is None:
            self.penalties = PenaltyState(self.dummy_slot + 1, vocab, self.device)
        return self.penalties

    def reserve_masks(self, width: int, words: int) -> None:
        """Allocate the bitmask buffers once (a captured graph keeps reading the same device
        buffer): ``width`` rows per request, the widest step's verify positions."""
        if self.mask_host is None:
            pin = self.device.type == "cuda"
            self.mask_host = torch.full((self.max_bs, width, words), -1, dtype=torch.int32,
                                        pin_memory=pin)
            self.mask_dev = (torch.full_like(self.mask_host, -1, device=self.device) if pin
                             else self.mask_host)

    def fill_masks(self, grammars: list[Matcher | None], drafts: list[list[int]] | None = None,
                   rows: int = 1, padded: int = 0) -> None:
        """Bitmask rows of every request from its matcher (all allowed without one): the next
        token's mask, or with ``drafts`` one row per verify position; dummy rows up to
        ``padded`` allow everything. Uploaded with one non-blocking copy."""
        host = self.mask_host
        if self._mask_sent is not None:      # the last upload may still read the pinned rows
            self._mask_sent.synchronize()
        for b, g in enumerate(grammars):
            if g is None:
                host[b, :rows] = -1
            else:
                g.fill(host[b, :rows], drafts[b] if drafts is not None else ())
        n = max(len(grammars), padded)
        host[len(grammars):n, :rows] = -1
        self._upload_masks(n, rows)

    def put_masks(self, masks: torch.Tensor) -> None:
        """Mask rows [n, rows, words] computed elsewhere (rank 0's matchers, for a
        tensor-parallel worker), written and uploaded as ``fill_masks`` does."""
        if self._mask_sent is not None:
            self._mask_sent.synchronize()
        n, rows = masks.shape[:2]
        self.mask_host[:n, :rows] = masks
        self._upload_masks(n, rows)

    def _upload_masks(self, n: int, rows: int) -> None:
        if self.mask_dev is not self.mask_host:
            self.mask_dev[:n, :rows].copy_(self.mask_host[:n, :rows], non_blocking=True)
            self._mask_sent = torch.cuda.Event()
            self._mask_sent.record()

    def _blocks(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffer as an int64 [fields, max_bs] block followed by a float32 one."""
        n_int, mb = len(_INT_FIELDS), self.max_bs
        return (buf[: 8 * n_int * mb].view(torch.int64).view(n_int, mb),
                buf[8 * n_int * mb:].view(torch.float32).view(len(_FLOAT_FIELDS), mb))

    def _views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        ints, floats = self._blocks(buf)
        out = {name: ints[i] for i, (name, _) in enumerate(_INT_FIELDS)}
        out.update({name: floats[i] for i, (name, _) in enumerate(_FLOAT_FIELDS)})
        return out

    def fill_dummy(self, start: int, end: int) -> None:
        h = self.host
        self._ints[:, start:end] = 0
        h["slot"][start:end] = self.dummy_slot
        h["top_k"][start:end] = -1
        h["temperature"][start:end] = 0.0
        h["top_p"][start:end] = 1.0
        h["min_p"][start:end] = 0.0

    def fill_timing_rows(self, tokens: torch.Tensor) -> None:
        """Rows [0, len(tokens)) as dummy rows (the dummy slot's cache only) with ``tokens``
        as their anchors and distinct seeds, so a step timed on them routes its tokens over
        the MoE experts as a real batch's do; upload. (The adaptive cost table's rows.)"""
        n = tokens.shape[0]
        self.fill_dummy(0, n)
        self.host["token"][:n] = tokens
        self.host["seed"][:n] = torch.arange(1, n + 1)
        self.upload()

    def fill(self, batch: StepBatch, padded: int, masks: bool = True) -> None:
        """Write the batch into rows [0, size) and dummy rows up to ``padded``; upload. With
        ``masks`` a constrained batch's next-token masks too (a phased step fills its own)."""
        n = batch.size
        if padded > self.max_bs or n > padded:
            raise ValueError(f"batch of {n} padded to {padded} exceeds the {self.max_bs} rows")
        # two host tensors for the whole batch (this runs every step: keep it cheap)
        self._ints[:, :n] = torch.tensor([getattr(batch, a) for _, a in _INT_FIELDS], dtype=torch.int64)
        self._floats[:, :n] = torch.tensor([getattr(batch, a) for _, a in _FLOAT_FIELDS],
                                           dtype=torch.float32)
        if padded > n:
            self.fill_dummy(n, padded)
        self.upload()
        if masks and batch.constrained:
            self.fill_masks(batch.grammars, padded=padded)

    def upload(self) -> None:
        if self._dev is not self._host:
            self._dev.copy_(self._host, non_blocking=True)

    def view(self, bs: int) -> dict[str, torch.Tensor]:
        """Device views of the first ``bs`` rows (what a captured step reads)."""
        out = {name: t[:bs] for name, t in self.dev.items()}
        if self.mask_dev is not None:
            out["bitmask"] = self.mask_dev[:bs]
        if self.penalties is not None:
            out.update(self.penalties.views())
        return out


def uniform_metadata(inp: dict[str, torch.Tensor], q_len: int, mode: Mode, input_ids: torch.Tensor,
                     block_table: torch.Tensor, page_size: int, attn: AttentionBackend,
                     kv: KVPool | None, mamba: MambaStatePool | None = None,
                     capture_layers: tuple[int, ...] = (), max_seq_len: int = 0,
                     ) -> ForwardMetadata:
    """``q_len`` rows per request at positions prefix .. prefix + q_len - 1, everything
    derived on the device from the step inputs (graph-safe: fixed shapes, no host reads)."""
    slots, prefix = inp["slot"], inp["prefix"]
    bs = slots.shape[0]
    dev = slots.device
    t = torch.arange(q_len, device=dev)
    positions = (prefix[:, None] + t[None]).reshape(-1)
    row_req = torch.arange(bs, device=dev)[:, None].expand(bs, q_len).reshape(-1)
    return ForwardMetadata(
        mode=mode, batch_size=bs, input_ids=input_ids.reshape(-1), positions=positions,
        row_req=row_req, req_slots=slots, seq_lens=prefix + q_len,
        q_start=torch.arange(bs + 1, device=dev) * q_len,
        out_slots=flat_slots(block_table, slots[row_req], positions, page_size),
        block_table=block_table, page_size=page_size, attn=attn, kv=kv, mamba=mamba,
        q_len=q_len, max_q_len=q_len, max_seq_len=max_seq_len, capture_layers=capture_layers)


def same_rows(meta: ForwardMetadata, mode: Mode, input_ids: torch.Tensor, attn: AttentionBackend,
              kv: KVPool | None, mamba: MambaStatePool | None = None,
              capture_layers: tuple[int, ...] = ()) -> ForwardMetadata:
    """Metadata for another forward over exactly ``meta``'s rows (positions, slots, lengths):
    a speculative verify over the draft block's positions reuses them instead of deriving
    them again (~10 small kernels per step)."""
    return replace(meta, mode=mode, input_ids=input_ids.reshape(-1), attn=attn, kv=kv,
                   mamba=mamba, capture_layers=capture_layers, attn_state={})


def extend_metadata(slots: list[int], starts: list[int], ids: list[list[int]], *,
                    device: torch.device, block_table: torch.Tensor, page_size: int,
                    attn: AttentionBackend, kv: KVPool | None, mamba: MambaStatePool | None,
                    logits_all: bool, capture_layers: tuple[int, ...] = (),
                    rows: list[int] | None = None) -> ForwardMetadata:
    """Prefill chunks: request b writes ids[b] at positions starts[b].. (one upload). Logits
    rows: each chunk's last, every row (``logits_all``) or the flat ``rows`` given."""
    q_lens = [len(x) for x in ids]
    positions = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, q_lens)])
    row_req = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    q_start = torch.zeros(len(q_lens) + 1, dtype=torch.long)
    q_start[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    if rows is not None:
        rows = torch.tensor(rows, dtype=torch.long)
    else:
        rows = torch.arange(int(q_start[-1])) if logits_all else q_start[1:] - 1
    host = [torch.tensor([t for x in ids for t in x], dtype=torch.long), positions, row_req,
            torch.tensor(slots, dtype=torch.long), torch.tensor(starts, dtype=torch.long) + torch.tensor(q_lens),
            q_start, rows]
    flat = torch.cat([t.reshape(-1) for t in host]).to(device, non_blocking=True)
    input_ids, positions, row_req, req_slots, seq_lens, q_start, rows = (
        part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in host]), host))
    return ForwardMetadata(
        mode=Mode.EXTEND, batch_size=len(q_lens), input_ids=input_ids, positions=positions,
        row_req=row_req, req_slots=req_slots, seq_lens=seq_lens, q_start=q_start,
        out_slots=flat_slots(block_table, req_slots[row_req], positions, page_size),
        block_table=block_table, page_size=page_size, attn=attn, kv=kv, mamba=mamba,
        max_q_len=max(q_lens), max_seq_len=max(s + q for s, q in zip(starts, q_lens)),
        q_lens_host=q_lens, logits_rows=rows, capture_layers=capture_layers)


def chunk_metadata(ids: torch.Tensor, slot: torch.Tensor, start: torch.Tensor, real: torch.Tensor,
                   dummy_slot: int, block_table: torch.Tensor, page_size: int,
                   attn: AttentionBackend, kv: KVPool | None, mamba: MambaStatePool | None,
                   capture_layers: tuple[int, ...] = (), max_seq_len: int = 0,
                   ) -> ForwardMetadata:
    """One request's prefill chunk padded to ``C = len(ids)`` rows: its ``real`` first rows
    are the tokens at positions ``start ..`` of request ``slot`` (device scalars, [1] each).
    Graph-safe: fixed shapes, no host reads. The attention sees ``real`` queries (so padded
    rows attend to nothing and output nothing); padded rows sit at the last real position
    (every table lookup stays in range) and write their K/V into the dummy slot; the Mamba
    mixers leave the state untouched over them (``real_rows``); the logits are the last
    real row's. ``max_seq_len``: a host bound for backends that need one (not in graphs)."""
    c = ids.shape[0]
    dev = ids.device
    t = torch.arange(c, device=dev)
    real_rows = t < real
    positions = start + torch.minimum(t, real - 1)
    zeros = torch.zeros(c, dtype=torch.long, device=dev)
    own = flat_slots(block_table, slot.expand(c), positions, page_size)
    dummy = flat_slots(block_table, torch.full_like(zeros, dummy_slot), zeros, page_size)
    return ForwardMetadata(
        mode=Mode.EXTEND, batch_size=1, input_ids=ids, positions=positions, row_req=zeros,
        req_slots=slot, seq_lens=start + real, q_start=torch.cat([real * 0, real]),
        out_slots=torch.where(real_rows, own, dummy), block_table=block_table,
        page_size=page_size, attn=attn, kv=kv, mamba=mamba, q_len=c, max_q_len=c,
        max_seq_len=max_seq_len, q_lens_host=[c], logits_rows=real - 1,
        capture_layers=capture_layers, real_rows=real_rows)
