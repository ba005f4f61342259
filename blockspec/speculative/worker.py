"""Speculative step for DFlash and DSpark: draft a block, verify it with the target in one
forward, accept losslessly, commit target state and the draft context.

The whole step is one pure function of the static step inputs and the caches
(``step_fn``), so the runner replays it as a single CUDA graph per batch size and reads back
only the accept lengths, tokens and logprobs; it ends by advancing those inputs (bonus token,
lengths, counters), so the next step can start before this one is read back. The draft
context (per draft layer K/V of every committed token, projected from the target's captured
hidden states) lives in a paged pool on the target's block tables: the draft block writes its
own K/V at the block positions, and the verify's captured rows overwrite them with the real
context; rows past a request's committed length are never read, so rejected rows need no
clean-up.

The verify width w (1..W, W = gamma + 1) is chosen per step for the whole batch
(``speculative/adaptive.py``): a step at width w verifies the first w - 1 drafts, so the
verify forward, acceptance, Mamba commit and draft-context write run over w rows; w = 1 is a
plain AR step (no draft forward: the target decodes the anchor and its hidden states become
draft context). Fixed-width speculation is the same path with the choice pinned to W. One
graph per (width, sampling mode, padded batch); each step also returns its requests' updated
acceptance EWMA, which the host's chooser reads with the step's other outputs.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from blockspec.args import EngineArgs
from blockspec.attention import create_backend
from blockspec.forward_metadata import Mode
from blockspec.grammar import mask_logits
from blockspec.kernels.spec_commit import spec_commit_fused
from blockspec.kernels.triton_loader import use_triton
from blockspec.models.dflash import DFlashDraftModel
from blockspec.penalties import count_tokens, penalize
from blockspec.runtime.launched import Plan
from blockspec.runtime.logprobs import chosen_and_top, pack_top, unpack_top
from blockspec.runtime.metadata import StepBatch, same_rows, uniform_metadata
from blockspec.runtime.model_runner import Launched, ModelRunner, Pending
from blockspec.sampling import Stream, logprobs_of, uniforms
from blockspec.simulated_text import simulated_text
from blockspec.speculative.accept import verify_block
from blockspec.speculative.adaptive import (EAGER_REPS, GRAPH_REPS, AcceptanceEWMA, CostTable,
                                             WidthChooser, candidate_widths, eager_size,
                                             eager_timed_widths)
from blockspec.speculative.draft_head import make_draft_head
from blockspec.speculative.draft_loader import load_draft
from blockspec.speculative.simulated_accept import SimulatedAcceptance


class SpecWorker:
    def __init__(self, draft: DFlashDraftModel, runner: ModelRunner, draft_backend: str,
                 dtype: torch.dtype, draft_lm_head: str = "auto", adaptive: bool = False,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        self.draft, self.runner, self.target = draft, runner, runner.model
        draft.fuse()
        # None: the draft scores with its own head, else the target's (DFlashDraftModel)
        self.head = make_draft_head(draft_lm_head, draft, self.target)
        self.memory = runner.memory
        cfg = draft.config
        self.gamma = cfg.gamma
        self.width = cfg.gamma + 1                  # the widest verify: positions p .. p + gamma
        self.is_dspark = cfg.algorithm == "dspark"
        self.pool = self.memory.add_draft_pool(cfg.num_hidden_layers, draft.num_kv_heads,
                                               draft.head_dim, dtype)
        self.memory.set_step_width(self.width)
        runner.capture_layers = tuple(i + 1 for i in cfg.target_layer_ids)
        self.attn = create_backend(draft_backend)
        if not self.attn.supports_cuda_graph:   # a step is one graph: every backend in it must capture
            runner.disable_graphs(f"the draft's attention backend {self.attn.name!r} is eager-only")
        self.simulate: SimulatedAcceptance | None = None   # benchmarks only (see _propose)
        self.adaptive = adaptive
        self.widths = candidate_widths(self.width, adaptive)
        self.cost = CostTable()
        self.chooser = WidthChooser(self.widths, self.cost)
        runner.time_steps = len(self.widths) > 1      # each step's time refines the cost table
        # a fixed width has nothing to choose: its steps skip the EWMA (28 small kernels
        # a step) and report zeros in its columns
        # a step that commits one of the end-of-sequence ids the scheduler stops on (default:
        # the model config's) is its request's last: the EWMA does not fold it in
        eos = runner.cfg.eos_token_id if eos_token_ids is None else eos_token_ids
        self.ewma = (AcceptanceEWMA(self.memory.dummy_slot + 1, self.gamma, self.memory.device,
                                    stop=eos) if len(self.widths) > 1 else None)
        self._fns = {w: self._step_at(w) for w in self.widths}
        # grammar-constrained steps: propose -> verify forward -> masked finish, eagerly: the
        # three phases replayed as graphs made an illegal memory access on the GPU under a
        # sampled batch of 64 with admissions (not yet understood), so they do not capture
        self._plans = {w: self._plan_at(w) for w in self.widths}

    def _step_at(self, w: int):
        return lambda inp, key: self.step_fn(inp, key, w)

    def _plan_at(self, w: int) -> Plan:
        return Plan((lambda inp, key, _: self._propose(inp, key, w),
                     lambda inp, key, proposal: (proposal, self._verify_forward(inp, proposal, w)),
                     lambda inp, key, pv: self._finish(inp, key, w, *pv, inp["bitmask"][:, :w])),
                    rows=w, drafts_of=(lambda proposal: proposal[0]) if w > 1 else None,
                    graphs=False)

    def by_kind(self, kind: str) -> tuple:
        """The step function and phased plan of a step named ``kind`` ("spec<w>")."""
        w = int(kind.removeprefix("spec"))
        return self._fns[w], self._plans[w]

    @property
    def lookahead(self) -> int:
        return self.width

    # ---- prefill ---------------------------------------------------------------------------
    @torch.inference_mode()
    def on_prefill(self, aux: torch.Tensor, rows: torch.Tensor) -> None:
        """Context of prompt rows: ``rows`` = [positions; cache slots] of the prefill chunk."""
        self.draft.write_context(aux, rows[0], rows[1], self.pool)

    # ---- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, batch: StepBatch | None, prev: Launched | None = None) -> Launched:
        """Launch a speculative step for ``batch``, or (None) the next one of ``prev``'s
        requests from the inputs it advanced on the device (``ModelRunner.launch_step``).
        A constrained batch runs its phases back to back (its masks are known now)."""
        if batch is not None and batch.constrained:
            return self.runner.phased.complete(self.begin(batch), batch.grammars)
        if batch is not None:
            self._ensure_steps(batch)
        w = self.chooser.choose(batch.size if batch is not None else prev.bs)
        return self.runner.launch_step(batch, self._fns[w], f"spec{w}", w, prev)

    def _ensure_steps(self, batch: StepBatch) -> None:
        """Every candidate width's graphs for the batch's sampling mode and padded size (and
        the smaller sizes), captured together so the width can change on a step launched
        ahead; then each (size, width) new to the cost table is timed on dummy rows: graph
        replays at the captured sizes, eager steps at ``eager_size`` for a batch that runs
        eagerly, of three widths with the rest interpolated (``eager_timed_widths``; not under
        tensor parallelism: rank 0's dummy step would wait on the workers' collectives, so the
        analytic shape stays there)."""
        runner, graphs, key = self.runner, self.runner.graphs, batch.sampling_key()
        padded = graphs.padded_size(batch.size) if graphs is not None else None
        if padded is not None:
            for w in self.widths:
                runner.ensure_graph(f"spec{w}", key, padded, self._fns[w])
            sizes, reps, warm = [s for s in graphs.sizes if s <= padded], GRAPH_REPS, True
            timed = self.widths

            def run(size: int, w: int) -> object:
                return graphs.replay((f"spec{w}", key, size))
        elif self.target.tp.size == 1:
            runner.reserve_buffers(batch)
            sizes, reps, warm = [eager_size(batch.size, runner.inputs.max_bs)], EAGER_REPS, False
            timed = eager_timed_widths(self.widths)

            def run(size: int, w: int) -> object:
                runner.host_max_seq_len = w      # the dummy rows' context: their verify block
                return self._fns[w](runner.inputs.view(size), key)
        else:
            return
        todo = [(s, w) for s in sizes for w in timed if (s, w) not in self.cost.measured]
        if len(self.widths) == 1 or not todo:
            return
        g = torch.Generator().manual_seed(0)
        runner.inputs.fill_timing_rows(torch.randint(0, runner.cfg.vocab_size, (max(sizes),),
                                                     generator=g))
        if not warm and not self.cost.measured:   # the process's first eager steps: one
            run(sizes[0], self.widths[-1])         # untimed, so no entry pays for first use
        for size, w in todo:
            self.cost.measure(size, w, lambda size=size, w=w: run(size, w), self.memory.device,
                              reps, warm)
        for size in sizes:
            self.cost.interpolate(size, self.widths)

    def begin(self, batch: StepBatch | None, prev: Launched | None = None) -> Pending:
        """A constrained step's draft and verify forwards (``runtime/phases.py``); its verify
        masks follow the drafts through each request's grammar on the host, one bitmask row
        per verify position, so a draft the grammar forbids is rejected and the bonus obeys
        the grammar."""
        if batch is not None:     # every width's phases: a step launched ahead may change it
            for v in self.widths:
                self.runner.phased.prepare(batch, self._plans[v], f"spec{v}")
        w = self.chooser.choose(batch.size if batch is not None else prev.bs)
        return self.runner.phased.begin(batch, self._plans[w], f"spec{w}", w, prev)

    def results(self, step: Launched) -> list[tuple]:
        """(accepted drafts a, the a + 1 committed tokens, their logprobs, their top
        alternatives or None) per request; the rows' acceptance EWMA and the engine row go
        to the chooser, the step's time (when timed) to the cost table."""
        T, G, k = step.width, self.gamma, self.runner.top_n
        res, ewma, engine = [], [], None
        for row in self.runner.collect(step):    # one conversion of the step's output
            a = int(row[0])
            tops = unpack_top(row[1 + 2 * T + 2 * G:], k, T)[:a + 1] if step.key[5] else None
            res.append((a, [int(t) for t in row[1:a + 2]], row[1 + T:T + a + 2], tops))
            ewma.append(row[1 + 2 * T:1 + 2 * T + G])
            engine = row[1 + 2 * T + G:1 + 2 * T + 2 * G]
        if self.ewma is not None:
            self.chooser.observe(ewma, engine)
        seconds = step.seconds()
        if seconds is not None:
            self.cost.observe(step.bs, step.width, seconds)
        return res

    def step_fn(self, inp: dict[str, torch.Tensor], key: tuple, width: int | None = None,
                ) -> torch.Tensor:
        """Draft -> verify the first ``width`` - 1 drafts (default all) -> accept -> commit for
        every row, device ops only. Returns [B, 1 + 2T + 2γ] float64 (T = width): accepted
        drafts, committed tokens (padded), logprobs, the rows' acceptance EWMA and the engine
        row (the same in every row; zeros at a fixed width), then, with top logprobs,
        T * TOP_LOGPROBS_MAX values and as many ids."""
        w = self.width if width is None else width
        proposal = self._propose(inp, key, w)
        return self._finish(inp, key, w, proposal, self._verify_forward(inp, proposal, w))

    def _propose(self, inp: dict[str, torch.Tensor], key: tuple, width: int) -> tuple:
        """The draft block's first ``width`` - 1 drafts: (drafts [B, w-1], their distributions
        or None, the draft metadata, the simulation coins or None). Width 1 runs no draft."""
        greedy_only = key[0]
        if width == 1:
            return inp["token"][:, None][:, :0], None, None, None
        draft, target, m = self.draft, self.target, self.memory
        # a width-w step drafts with a block of w - 1 drafts, exactly as a fixed width w does
        n = width - 1
        B, Q = inp["slot"].shape[0], draft.query_rows(n)
        anchor = inp["token"]
        ids, _ = draft.block_inputs(anchor, inp["prefix"], n)                        # [B, Q]
        x = draft.embed_block(ids, target.backbone.embeddings).reshape(B * Q, -1)
        dmeta = uniform_metadata(inp, Q, Mode.DRAFT, ids, m.block_table, m.page_size, self.attn,
                                 self.pool, max_seq_len=self.runner.host_max_seq_len)
        h = draft.select_draft_hidden(draft.forward_paged(x, dmeta).view(B, Q, -1), n)
        base = self.draft_logits(h)                                                  # [B, n, V]
        if self.is_dspark:
            u_draft = None if greedy_only else uniforms(
                inp["seed"], inp["verify_ctr"], Stream.DRAFT, self.gamma)[:, :n]
            drafts, q = draft.markov_walk(base, h, anchor, inp["temperature"], u_draft,
                                          greedy_only=greedy_only, with_probs=not greedy_only)
        else:
            drafts, q = base.argmax(-1), None        # argmax drafting: q is a point mass
        u_sim = None
        if self.simulate is not None:   # benchmark mode: the simulated text's next tokens are
            # proposed (random tokens: a random draft's argmax repeats tokens and would route
            # the verify to fewer experts than a trained draft's), the profile's coins judge them
            drafts = simulated_text(inp["seed"], inp["sample_ctr"], n, target.cfg.vocab_size)
            u_sim = uniforms(inp["seed"], inp["verify_ctr"], Stream.SIMULATE, n)
        return drafts[:, :n], None if q is None else q[:, :n], dmeta, u_sim

    def _verify_forward(self, inp: dict[str, torch.Tensor], proposal: tuple, width: int):
        """The target forward over [anchor, drafts] (``width`` rows per request); width 1 is
        the target's decode forward (its Mamba state advances in place)."""
        drafts, _, dmeta, _ = proposal
        m, T = self.memory, width
        cand = torch.cat([inp["token"][:, None], drafts], dim=1)
        if T == 1:
            meta = uniform_metadata(inp, 1, Mode.DECODE, cand, m.block_table, m.page_size,
                                    self.runner.decode_attn, m.kv, m.mamba,
                                    capture_layers=self.runner.capture_layers,
                                    max_seq_len=self.runner.host_max_seq_len)
            return self.target(meta), meta
        if dmeta.q_len == T:         # the verify reads the draft block's own positions
            vmeta = same_rows(dmeta, Mode.VERIFY, cand, self.runner.decode_attn, m.kv, m.mamba,
                              self.runner.capture_layers)
        else:
            vmeta = uniform_metadata(inp, T, Mode.VERIFY, cand, m.block_table, m.page_size,
                                     self.runner.decode_attn, m.kv, m.mamba,
                                     capture_layers=self.runner.capture_layers,
                                     max_seq_len=self.runner.host_max_seq_len)
        return self.target(vmeta), vmeta

    def _finish(self, inp: dict[str, torch.Tensor], key: tuple, width: int, proposal: tuple,
                verified: tuple, bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """Accept (on the penalised logits, then those ``bitmask`` allows, when given) ->
        commit -> EWMA -> advance; the logprobs stay the target's own."""
        greedy_only, filters, want_lp, _, penalized, want_top = key
        drafts, q, _, u_sim = proposal
        out, vmeta = verified
        m, T = self.memory, width
        B = drafts.shape[0]
        logits = out.logits.view(B, T, -1)
        scored = penalize(logits, inp, drafts) if penalized else logits
        scored = scored if bitmask is None else mask_logits(scored, bitmask)
        if self.simulate is not None:   # benchmark mode: the profile's coins decide how many
            # of the w - 1 verified drafts are accepted; the bonus is the text's next token, so
            # every width commits the text plain decoding does (runner.simulate_text)
            acc = (self.simulate.accepted(u_sim, inp["verify_ctr"]) if u_sim is not None
                   else torch.zeros_like(inp["prefix"]))
            bonus = simulated_text(inp["seed"], inp["sample_ctr"] + acc, 1,
                                   self.target.cfg.vocab_size)[:, 0]
        else:
            u = None
            if not greedy_only:   # coin j is the same at every width (COIN column j)
                bonus_u = uniforms(inp["seed"], inp["verify_ctr"], Stream.BONUS, 1)
                u = bonus_u if T == 1 else torch.cat(
                    [uniforms(inp["seed"], inp["verify_ctr"], Stream.COIN, self.gamma)[:, :T - 1],
                     bonus_u], dim=1)
            acc, bonus = verify_block(drafts, scored, q, inp["temperature"], inp["top_k"],
                                      inp["top_p"], inp["min_p"], u, greedy_only=greedy_only,
                                      filters=filters)

        if m.mamba is not None and T > 1:     # width 1 decoded: its state is committed
            m.mamba.commit_verify(inp["slot"], acc)
        self.draft.write_context(out.aux_hidden, vmeta.positions, vmeta.out_slots, self.pool)
        commit = self.commit_fused if use_triton(acc) else self.commit_reference
        toks, row = commit(inp, acc, bonus, drafts, T)
        if penalized:
            kept = torch.arange(T, device=toks.device)[None] <= acc[:, None]
            count_tokens(inp["pen_counts"], inp["slot"], toks, kept)
        if want_top:
            lp, vals, ids = chosen_and_top(logits.reshape(B * T, -1), toks.reshape(-1),
                                           self.runner.top_n)
            row[:, 1 + T:1 + 2 * T] = lp.view(B, T)
            return torch.cat([row, pack_top(vals.view(B, -1), ids.view(B, -1))], dim=1)
        if want_lp:
            row[:, 1 + T:1 + 2 * T] = logprobs_of(logits.reshape(B * T, -1),
                                                  toks.reshape(-1)).view(B, T)
        return row

    def commit_reference(self, inp: dict[str, torch.Tensor], acc: torch.Tensor,
                         bonus: torch.Tensor, drafts: torch.Tensor, width: int,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's bookkeeping after acceptance: the committed tokens [B, width] (the drafts
        with the bonus at the accept length), the output's first 1 + 2 width + 2γ columns
        (accepted drafts, tokens, zero logprobs, the EWMA rows and the engine row), the EWMA
        folded in and the inputs advanced. ``commit_fused`` is the same in one launch."""
        B, T = drafts.shape[0], width
        toks = torch.cat([drafts, bonus[:, None]], dim=1).scatter(1, acc[:, None], bonus[:, None])
        ewma = (self.ewma.update(inp["slot"], inp["verify_ctr"], acc, T, toks)
                if self.ewma is not None else acc.new_zeros(B, 2 * self.gamma, dtype=torch.float64))
        self.runner.advance_inputs(inp, bonus, acc + 1, verified=True)
        zero_lps = acc.new_zeros(B, T, dtype=torch.float64)
        return toks, torch.cat([acc[:, None].double(), toks.double(), zero_lps, ewma], dim=1)

    def commit_fused(self, inp: dict[str, torch.Tensor], acc: torch.Tensor, bonus: torch.Tensor,
                     drafts: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``commit_reference`` as one Triton launch (``kernels/spec_commit.py``)."""
        return spec_commit_fused(acc, bonus, drafts, inp, width=width, gamma=self.gamma,
                                 dummy=self.memory.dummy_slot,
                                 **(self.ewma.kernel_args() if self.ewma is not None else {}))

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the draft rows: the worker's NVFP4 head copy if it made one, else
        the draft's own head or the target's."""
        if self.head is not None:
            return self.head(h).float()
        return self.draft.compute_logits(h, self.target)


def build_spec_worker(args: EngineArgs, runner: ModelRunner, draft_backend: str,
                      dtype: torch.dtype, device: torch.device,
                      eos_token_ids: Sequence[int] | None = None) -> SpecWorker:
    draft = load_draft(args.speculative_draft_model_path, runner.cfg, dtype, device,
                       args.speculative_num_draft_tokens, expect=args.speculative_algorithm)
    return SpecWorker(draft, runner, draft_backend, dtype, args.speculative_draft_lm_head,
                      adaptive=args.speculative_adaptive, eos_token_ids=eos_token_ids)
