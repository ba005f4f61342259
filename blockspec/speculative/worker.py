"""Speculative step for DFlash and DSpark: draft a block, verify it with the target in one
forward, accept losslessly, commit target state and the draft context for accepted rows only.

The draft context (per draft layer K/V of every committed token, projected from the target's
captured hidden states) lives in a paged pool indexed by the target's block tables, so it is
written once per committed row and never copied.
"""
from __future__ import annotations

import torch
from torch.profiler import record_function

from blockspec.args import EngineArgs
from blockspec.engine.memory import KVPool
from blockspec.models.dflash import DFlashDraftModel
from blockspec.engine.request import Request
from blockspec.runtime.model_runner import ModelRunner
from blockspec.sampling import logprobs_of, params_to_tensors
from blockspec.speculative.draft_loader import load_draft
from blockspec.speculative.accept import verify_block


class SpecWorker:
    def __init__(self, draft: DFlashDraftModel, runner: ModelRunner, dtype: torch.dtype,
                 fallback: torch.Generator) -> None:
        self.draft, self.runner, self.target = draft, runner, runner.model
        cfg = draft.config
        self.gamma = cfg.gamma
        self.lookahead = cfg.gamma + 1           # verify writes positions p .. p + gamma
        self.is_dspark = cfg.algorithm == "dspark"
        self.pool = KVPool(cfg.num_hidden_layers, runner.total_tokens, draft.num_kv_heads,
                           draft.head_dim, dtype, runner.device)
        runner.capture_layers = tuple(i + 1 for i in cfg.target_layer_ids)
        self.fallback = fallback

    # ---- draft context -------------------------------------------------------------------------
    def _write_context(self, aux: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        for n, (k, v) in enumerate(self.draft.project_context(aux, positions)):
            self.pool.k[n][slots] = k.to(self.pool.k.dtype)
            self.pool.v[n][slots] = v.to(self.pool.v.dtype)

    @torch.inference_mode()
    def on_prefill(self, chunks: list[tuple[Request, int, int]], aux: torch.Tensor) -> None:
        alloc, dev = self.runner.allocator, self.runner.device
        positions = torch.cat([torch.arange(s, e) for _, s, e in chunks]).to(dev)
        slots = torch.cat([alloc.slots(r.block_table, s, e, dev) for r, s, e in chunks])
        self._write_context(aux, positions, slots)

    def release(self, req: Request) -> None:
        """Nothing to free: the pool shares the target's block tables."""

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, reqs: list[Request]) -> list[tuple[list[int], list[float] | None]]:
        dev, B, T = self.runner.device, len(reqs), self.gamma + 1
        params = [r.params for r in reqs]
        gens = [r.generator for r in reqs]
        anchor = torch.tensor([r.last_token for r in reqs], device=dev)
        committed = [r.num_cached for r in reqs]
        with record_function("spec.propose"):
            drafts, q = self._propose(reqs, anchor, committed, params, gens)
        with record_function("spec.verify_forward"):
            cand = torch.cat([anchor[:, None], drafts], dim=1)
            out, fb = self.runner.verify(reqs, cand)
        with record_function("spec.accept"):
            logits = out.logits.view(B, T, -1)
            acc, bonus = verify_block(drafts, logits, q, params, gens, self.fallback)
        accepted = acc.tolist()                    # the step's one read-back of the outcome
        with record_function("spec.commit"):
            self.runner.commit_verify(reqs, fb, acc, accepted)
            keep = torch.arange(T, device=dev)[None] <= acc[:, None]                 # [B, T]
            rows = keep.reshape(-1)
            self._write_context(out.aux_hidden[rows], fb.positions[rows], fb.kv_slots[rows])
        toks = torch.cat([drafts, drafts[:, :1]], dim=1).scatter(1, acc[:, None], bonus[:, None])
        want_lp = any(r.return_logprob for r in reqs)
        lps = logprobs_of(logits.reshape(B * T, -1), toks.reshape(-1)).view(B, T) if want_lp else None
        results = []
        for b, (r, a) in enumerate(zip(reqs, accepted)):
            r.spec_verify_ct += 1
            if not r.spec_accept_histogram:
                r.spec_accept_histogram = [0] * T
            r.spec_accept_histogram[a] += 1
            results.append((toks[b, : a + 1].tolist(), lps[b, : a + 1].tolist() if lps is not None else None))
        return results

    def _propose(self, reqs, anchor, committed, params, gens):
        draft, runner = self.draft, self.runner
        ids, pos = draft.block_inputs(anchor, torch.tensor(committed, device=anchor.device))
        x = draft.embed_block(ids, self.target.backbone.embeddings)
        ctx, valid = runner.context_slots(reqs, committed)
        ks = [self.pool.k[n][ctx] for n in range(len(draft.layers))]
        vs = [self.pool.v[n][ctx] for n in range(len(draft.layers))]
        h = draft.select_draft_hidden(draft.forward_block(x, pos, ks, vs, valid))   # [B, gamma, H]
        base = draft.compute_logits(h, self.target)                                 # [B, gamma, V]
        if not self.is_dspark:
            return base.argmax(-1), None            # argmax drafting: q is a point mass
        temperature, _, _, _ = params_to_tensors(params, anchor.device)
        greedy = temperature == 0
        return draft.markov_walk(base, h, anchor, greedy, temperature, gens, self.fallback)


def build_spec_worker(args: EngineArgs, runner: ModelRunner, dtype: torch.dtype,
                      device: torch.device) -> SpecWorker:
    draft = load_draft(args.speculative_draft_model_path, runner.cfg, dtype, device,
                       args.speculative_num_draft_tokens, expect=args.speculative_algorithm)
    fallback = torch.Generator(device=device).manual_seed(args.random_seed + 1)
    return SpecWorker(draft, runner, dtype, fallback)
