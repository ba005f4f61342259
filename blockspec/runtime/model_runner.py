"""ModelRunner: executes forwards for the scheduler and never decides what runs.

* ``extend``: prefill chunks: one request's chunk up to ``prefill_graph_max_tokens`` replays
  a captured forward of its padded length (``runtime/prefill_graphs.py``); other chunks
  (several requests, every row's logits) run eagerly.
* ``launch_step`` / ``collect``: a decode or speculative step described by a ``StepBatch``,
  launched without waiting for it, and its outputs read back (one copy per step, into a pinned
  buffer). The step itself is a pure function of the static step inputs and the caches
  (``decode_step`` here, ``SpecWorker.step_fn`` for speculation), replayed from a CUDA graph
  when one is captured for the padded batch size, else run eagerly. Every step function ends
  by advancing the inputs on the device (``advance_inputs``: last token, lengths, counters),
  so the next step of the same requests can be launched before this one is read back
  (``launch_step(None, ...)``): the host's work on a step's outputs overlaps the next step.

The runner reads the memory manager's pools; allocation and admission live in the scheduler.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from blockspec.args import ResolvedBackends
from blockspec.attention import create_backend
from blockspec.cache import MemoryManager
from blockspec.forward_metadata import Mode
from blockspec.grammar import bitmask_words, mask_logits
from blockspec.layers.moe import MoE
from blockspec.models.nemotron_h import ModelOutput, NemotronHForCausalLM
from blockspec.penalties import count_tokens, penalize
from blockspec.runtime.graph_runner import GraphRunner
from blockspec.runtime.launched import Launched, Plan, StepFn
from blockspec.runtime.logprobs import chosen_and_top, pack_top, top_width, unpack_top
from blockspec.runtime.metadata import StepBatch, StepInputs, extend_metadata, uniform_metadata
from blockspec.runtime.phases import Pending, PhasedSteps
from blockspec.runtime.prefill_graphs import PrefillGraphs
from blockspec.sampling import Stream, logprobs_of, sample, uniforms
from blockspec.simulated_text import simulated_text

__all__ = ["Launched", "ModelRunner", "Pending", "RunnerOptions", "StepFn"]
log = logging.getLogger("blockspec")


@dataclass
class RunnerOptions:
    max_batch_size: int
    use_cuda_graph: bool = True
    cuda_graph_max_bs: int = 32
    prefill_graph_max_tokens: int = 2048


class ModelRunner:
    def __init__(self, model: NemotronHForCausalLM, memory: MemoryManager,
                 backends: ResolvedBackends, options: RunnerOptions) -> None:
        self.model, self.cfg, self.memory = model, model.cfg, memory
        self.device = memory.device
        self.prefill_attn = create_backend(backends.prefill)
        self.decode_attn = create_backend(backends.decode)
        self.inputs = StepInputs(options.max_batch_size, self.device, memory.dummy_slot)
        graphs_ok = (options.use_cuda_graph and self.device.type == "cuda"
                     and self.decode_attn.supports_cuda_graph)
        self.graphs = (GraphRunner(self.device, min(options.cuda_graph_max_bs, options.max_batch_size))
                       if graphs_ok else None)
        self.prefill_graphs = (
            PrefillGraphs(model, memory, self.prefill_attn, options.prefill_graph_max_tokens,
                          capture=True)
            if graphs_ok and options.prefill_graph_max_tokens > 0
            and self.prefill_attn.supports_cuda_graph else None)
        for m in model.modules():
            if isinstance(m, MoE) and not m.graph_safe(model.backbone.norm_f.weight.dtype, self.device):
                self.disable_graphs("an MoE layer's experts have no sync-free path for this "
                                    "dtype/device (the reference expert loop reads counts back)")
                break
        self.capture_layers: tuple[int, ...] = ()
        self.host_max_seq_len = 0   # eager steps' longest context (the torch backend needs it)
        self.time_steps = False     # time each launched step (the adaptive width's cost table)
        self.simulate_text = False  # benchmarks only: decode commits simulated_text.py's
        self._readback: dict[int, list[torch.Tensor]] = {}   # pinned output buffers per width
        self._turn = 0
        self.phased = PhasedSteps(self)      # grammar-constrained steps
        self._decode_plan = Plan((self.decode_forward, self.decode_finish), rows=1)
        self.top_n = top_width(self.cfg.vocab_size)    # alternatives a step computes

    # ---- prefill -------------------------------------------------------------------------------
    @torch.inference_mode()
    def extend(self, slots: list[int], starts: list[int], ids: list[list[int]],
               logits_all: bool = False, capture_layers: tuple[int, ...] | None = None,
               rows: list[int] | None = None) -> tuple[ModelOutput, torch.Tensor]:
        """Prefill ``ids[b]`` at positions ``starts[b]..`` of request slot ``slots[b]``.
        Returns the output (logits of each chunk's last row, of every row, or of the flat
        ``rows`` given) and the metadata's positions and cache slots of the rows (for a
        drafter's context)."""
        taps = self.capture_layers if capture_layers is None else tuple(capture_layers)
        pg = self.prefill_graphs
        if (pg is not None and len(ids) == 1 and pg.fits(len(ids[0])) and not logits_all
                and (rows is None or list(rows) == [len(ids[0]) - 1])):
            return pg.extend(slots[0], starts[0], ids[0], taps)
        m = self.memory
        meta = extend_metadata(slots, starts, ids, device=self.device, block_table=m.block_table,
                               page_size=m.page_size, attn=self.prefill_attn, kv=m.kv, mamba=m.mamba,
                               logits_all=logits_all, rows=rows, capture_layers=taps)
        return self.model(meta), torch.stack([meta.positions, meta.out_slots])

    @torch.inference_mode()
    def sample_rows(self, logits: torch.Tensor, batch: StepBatch,
                    rows: list[int] | None = None) -> torch.Tensor:
        """Sample one token per row of ``logits`` (prefill's first tokens; ``rows``: of those
        rows of it), through the same inputs and sampler as a decode step. Returns [B, 2]
        float64 (token, logprob)."""
        if rows is not None:
            logits = logits[torch.tensor(rows, device=logits.device)]
        self.reserve_buffers(batch)
        self.inputs.fill(batch, batch.size)
        inp, key = self.inputs.view(batch.size), batch.sampling_key()
        out = self._pick(logits, inp, key)
        if batch.penalized:
            count_tokens(inp["pen_counts"], inp["slot"], out[:, 0].long())
        return out

    def reserve_buffers(self, batch: StepBatch) -> None:
        """The grammar bitmask buffers, the first time a batch has a constrained row, and the
        penalty state, the first time one has a penalised row."""
        if batch.constrained:
            self.inputs.reserve_masks(self.memory.step_width, bitmask_words(self.cfg.vocab_size))
        if batch.penalized:
            self.inputs.reserve_penalties(self.cfg.vocab_size)

    def fill_penalties(self, slot: int, prompt_ids: list[int], output_ids: list[int],
                       params: object, banned: list[int]) -> None:
        """A request's penalty row, once its prefill is done (its committed tokens are
        ``prompt_ids`` + ``output_ids``). Nothing until the first penalised request; after
        that every request's row is written, so no request inherits its slot's last owner."""
        if getattr(params, "penalized", False) or self.inputs.penalties is not None:
            self.inputs.reserve_penalties(self.cfg.vocab_size).fill(
                slot, prompt_ids, output_ids, params, banned)

    @staticmethod
    def _pick(logits: torch.Tensor, inp: dict[str, torch.Tensor], key: tuple) -> torch.Tensor:
        """Next token per row and its raw logprob, [B, 2] float64 (the one AR sampling path),
        then with top logprobs 2 * TOP_LOGPROBS_MAX columns (values, ids). Penalised and
        constrained batches sample from the penalised, masked logits; the logprobs stay the
        model's own."""
        greedy_only, filters, want_lp, constrained, penalized, want_top = key
        scored = penalize(logits, inp) if penalized else logits
        scored = mask_logits(scored, inp["bitmask"][:, 0]) if constrained else scored
        u = None if greedy_only else uniforms(inp["seed"], inp["sample_ctr"], Stream.SAMPLE, 1)[:, 0]
        tok = sample(scored, inp["temperature"], inp["top_k"], inp["top_p"], inp["min_p"], u,
                     greedy_only=greedy_only, filters=filters)
        if want_top:
            lp, vals, ids = chosen_and_top(logits, tok, top_width(logits.shape[-1]))
            return torch.cat([torch.stack([tok.double(), lp.double()], 1), pack_top(vals, ids)], 1)
        lp = logprobs_of(logits, tok) if want_lp else torch.zeros_like(logits[:, 0])
        return torch.stack([tok.double(), lp.double()], 1)

    def picked(self, rows: list[list[float]], key: tuple) -> list[tuple]:
        """``_pick``'s rows on the host: (0 drafts, [token], [logprob], top per token or None)."""
        k = self.top_n
        return [(0, [int(r[0])], [r[1]], unpack_top(r[2:], k) if key[5] else None) for r in rows]

    # ---- steps ---------------------------------------------------------------------------------
    def decode_step(self, inp: dict[str, torch.Tensor], key: tuple) -> torch.Tensor:
        """One token per request from its last token: forward, sample. [B, 2] (token, logprob)."""
        return self.decode_finish(inp, key, self.decode_forward(inp, key, None))

    def decode_forward(self, inp: dict[str, torch.Tensor], key: tuple, _: object) -> torch.Tensor:
        """The decode forward's logits [B, V] (a constrained step's first phase)."""
        m = self.memory
        meta = uniform_metadata(inp, 1, Mode.DECODE, inp["token"], m.block_table, m.page_size,
                                self.decode_attn, m.kv, m.mamba, max_seq_len=self.host_max_seq_len)
        return self.model(meta).logits

    def decode_finish(self, inp: dict[str, torch.Tensor], key: tuple,
                      logits: torch.Tensor) -> torch.Tensor:
        """Sample from the forward's logits and advance the inputs (the last phase)."""
        out = self._pick(logits, inp, key)
        if self.simulate_text:
            out[:, 0] = simulated_text(inp["seed"], inp["sample_ctr"], 1, self.cfg.vocab_size)[:, 0]
        if key[4]:
            count_tokens(inp["pen_counts"], inp["slot"], out[:, 0].long())
        self.advance_inputs(inp, out[:, 0].long(), torch.ones_like(inp["prefix"]), verified=False)
        return out

    def launch_decode(self, batch: StepBatch | None, prev: Launched | None = None) -> Launched:
        """A decode step for ``batch`` (or the one after ``prev``); a constrained batch runs
        its phases back to back, since its masks are known now."""
        if batch is not None and batch.constrained:
            return self.phased.complete(self.begin_decode(batch), batch.grammars)
        return self.launch_step(batch, self.decode_step, "decode", 1, prev)

    def begin_decode(self, batch: StepBatch | None, prev: Launched | None = None) -> Pending:
        """A constrained decode step's forward (``runtime/phases.py``)."""
        return self.phased.begin(batch, self._decode_plan, "decode", 1, prev)

    def by_kind(self, kind: str) -> tuple[StepFn, Plan]:
        """The step function and phased plan a step of ``kind`` runs (a tensor-parallel
        worker names the step rank 0 launched this way); "decode" here, "spec<w>" the
        drafter's."""
        if kind != "decode":
            raise KeyError(f"step kind {kind!r} is the drafter's")
        return self.decode_step, self._decode_plan

    def advance_inputs(self, inp: dict[str, torch.Tensor], token: torch.Tensor,
                       committed: torch.Tensor, verified: bool) -> None:
        """The inputs of the same requests' next step, written in place on the device: the last
        committed ``token``, lengths and sample counters up by ``committed``, the verify counter
        by one after a speculative step, exactly what the scheduler would fill from its
        requests. Padding rows (the dummy slot) stay as they are."""
        live = inp["slot"] != self.memory.dummy_slot
        n = torch.where(live, committed, torch.zeros_like(committed))
        inp["token"].copy_(torch.where(live, token, inp["token"]))
        inp["prefix"].add_(n)
        inp["sample_ctr"].add_(n)
        if verified:
            inp["verify_ctr"].add_(live.long())

    def disable_graphs(self, why: str) -> None:
        """Run every step eagerly: something a step runs cannot be captured (logged once)."""
        if self.graphs is not None:
            log.info("CUDA graphs off: %s", why)
        self.graphs = self.prefill_graphs = None

    @torch.inference_mode()
    def ensure_graph(self, kind: str, key: tuple, padded: int, fn: StepFn) -> tuple:
        """The graph of (kind, sampling mode, padded size), captured now if it is new, together
        with every smaller captured size it lacks: a batch shrinks into those as its requests
        finish at different steps, and a capture then would stall the running requests.
        Largest first (smaller graphs reuse the shared pool). The step inputs are dummy rows
        while a graph warms up and records, so no real cache is touched. Under inference mode
        whoever calls: with autograd on, the layers take their torch references (the kernels
        have no backward) and the graph would replay those."""
        for size in sorted((s for s in self.graphs.sizes if s <= padded), reverse=True):
            gkey = (kind, key, size)
            if not self.graphs.has(gkey):
                self.inputs.fill_dummy(0, size)
                self.inputs.upload()
                self.graphs.capture(gkey, lambda size=size: fn(self.inputs.view(size), key))
        return (kind, key, padded)

    @torch.inference_mode()
    def launch_step(self, batch: StepBatch | None, fn: StepFn, kind: str, width: int,
                    prev: Launched | None = None) -> Launched:
        """Launch one step without waiting for it. With ``batch``: fill the static inputs from
        it (one upload; nothing may be in flight, so ``collect`` every earlier step first).
        With None: the step after ``prev`` for the same requests, from the inputs ``prev``
        advanced on the device (``fn`` / ``kind`` / ``width`` may differ from ``prev``'s: an
        adaptive verify width; that graph must have been captured with ``prev``'s). Replays
        the captured graph of (kind, sampling mode, padded size), else runs ``fn`` eagerly;
        the outputs are copied to a host buffer behind it.
        ``width`` = positions the step writes past the committed length. A constrained
        batch's masks come from its matchers' host state: it runs in phases
        (``runtime/phases.py``)."""
        if batch is not None:
            bs, key = batch.size, batch.sampling_key()
            if batch.constrained:
                raise RuntimeError("a constrained batch runs in phases (PhasedSteps)")
            self.reserve_buffers(batch)
        else:
            bs, key = prev.bs, prev.key
        padded = self.graphs.padded_size(bs) if self.graphs is not None else None
        cpu_seconds = None
        if padded is None:
            if batch is not None:
                self.host_max_seq_len = max(batch.prefix_lens) + width
                self.inputs.fill(batch, bs)
            else:   # an upper bound: every length grew by at most ``width``
                self.host_max_seq_len += width
            started, t0 = self._start_timer()
            out = fn(self.inputs.view(bs), key)
            if t0 is not None:          # the CPU: the step is computed already
                cpu_seconds = time.perf_counter() - t0
        else:
            gkey = (kind, key, padded)
            if batch is not None:
                gkey = self.ensure_graph(kind, key, padded, fn)
                self.inputs.fill(batch, padded)
            started, _ = self._start_timer()
            out = self.graphs.replay(gkey)
        step = Launched(kind, fn, key, width, bs, out, started=started, cpu_seconds=cpu_seconds)
        return self.read_later(step, out[:bs])

    def _start_timer(self) -> tuple[torch.cuda.Event | None, float | None]:
        """With ``time_steps``, where a step starts: on CUDA an event recorded on the stream
        now (no sync), on the CPU the host clock; (None, None) otherwise."""
        if not self.time_steps:
            return None, None
        if self.device.type == "cuda":
            started = torch.cuda.Event(enable_timing=True)
            started.record()
            return started, None
        return None, time.perf_counter()

    def read_later(self, step: Launched, out: torch.Tensor) -> Launched:
        """Copy ``out`` into the next of two pinned buffers behind the step (CUDA), so the next
        replay may overwrite the graph's output before the host reads this one."""
        if out.device.type != "cuda":     # computed already: nothing to overlap
            step.out = out
            return step
        ring = self._readback.get(out.shape[1])
        if ring is None or ring[0].shape[0] < out.shape[0]:
            rows = max(out.shape[0], self.inputs.max_bs)
            ring = [torch.empty(rows, out.shape[1], dtype=out.dtype, pin_memory=True)
                    for _ in range(2)]
            self._readback[out.shape[1]] = ring
        self._turn ^= 1
        host = ring[self._turn][: out.shape[0]]
        host.copy_(out, non_blocking=True)
        step.out, step.event = host, torch.cuda.Event(enable_timing=step.started is not None)
        step.event.record()
        return step

    @staticmethod
    def collect(step: Launched) -> list[list[float]]:
        """The outputs of a launched step, as rows of floats (waits for it)."""
        if step.event is not None:
            step.event.synchronize()
        return step.out.tolist()

    # ---- whole prompts (evaluation, parity checks, draft training) -----------------------------
    def _borrow(self, prompts: list[list[int]]):
        m = self.memory
        held = []
        for p in prompts:
            if not m.can_admit(len(p)):
                for r in held:
                    m.release(r)
                raise RuntimeError("prompts do not fit the cache")
            held.append(m.admit(len(p)))
        return held

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Logits at every prompt position ([L, V] fp32 each) in one prefill; caches are
        borrowed and given back."""
        held = self._borrow(prompts)
        try:
            out, _ = self.extend([r.slot for r in held], [0] * len(prompts), prompts,
                                 logits_all=True, capture_layers=())
        finally:
            for r in held:
                self.memory.release(r)
        return list(out.logits.split([len(p) for p in prompts]))

    @torch.inference_mode()
    def hidden_states(self, prompts: list[list[int]], layers: tuple[int, ...]) -> list[torch.Tensor]:
        """Residual stream before each layer in ``layers`` (index ``num_layers`` = after the
        last layer), concatenated per row: [L, len(layers) * H] per prompt. The same capture
        that feeds a drafter while serving; used to train drafts. Caches are borrowed."""
        held = self._borrow(prompts)
        try:
            out, _ = self.extend([r.slot for r in held], [0] * len(prompts), prompts,
                                 capture_layers=tuple(layers))
        finally:
            for r in held:
                self.memory.release(r)
        return list(out.aux_hidden.split([len(p) for p in prompts]))
