"""ModelRunner: owns the target model and its caches and runs one forward for a batch.

It turns requests into a ``ForwardBatch`` (slots, positions, taps), calls the model, and hands
back logits (and aux hidden rows when a drafter is attached). It samples nothing and never
decides which requests run; that is the scheduler's job.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.engine.memory import BlockAllocator, KVPool, MambaStatePool
from blockspec.runtime.metadata import ForwardBatch, Mode
from blockspec.models.nemotron_h import ModelOutput, NemotronHForCausalLM
from blockspec.engine.request import Request


@dataclass
class CacheSpec:
    max_total_tokens: int
    max_running_requests: int
    page_size: int


class ModelRunner:
    def __init__(self, model: NemotronHForCausalLM, spec: CacheSpec, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model, self.cfg, self.device = model, model.cfg, device
        cfg = self.cfg
        num_blocks = -(-spec.max_total_tokens // spec.page_size)
        self.allocator = BlockAllocator(num_blocks, spec.page_size)
        n_attn, n_mamba = len(cfg.layer_ids("attention")), len(cfg.layer_ids("mamba"))
        self.kv = KVPool(n_attn, num_blocks * spec.page_size, cfg.num_key_value_heads,
                         cfg.head_dim, dtype, device) if n_attn else None
        self.mamba = MambaStatePool(n_mamba, spec.max_running_requests, cfg.conv_dim,
                                    cfg.conv_kernel, cfg.mamba_num_heads, cfg.mamba_head_dim,
                                    cfg.ssm_state_size, dtype, device) if n_mamba else None
        self.max_running_requests = spec.max_running_requests
        self.capture_layers: tuple[int, ...] = ()

    # ---- capacity ----------------------------------------------------------------------------
    def can_admit(self, num_tokens: int) -> bool:
        slots_ok = self.mamba is None or self.mamba.num_free > 0
        return slots_ok and self.allocator.blocks_for(num_tokens) <= self.allocator.num_free

    def admit(self, req: Request, num_tokens: int) -> None:
        """Reserve cache for every position the request may occupy, so decode never runs out."""
        if not self.allocator.grow(req.block_table, num_tokens):
            raise RuntimeError("admit called without capacity")
        if self.mamba is not None:
            req.mamba_slot = self.mamba.alloc()

    def release(self, req: Request) -> None:
        self.allocator.release(req.block_table)
        if self.mamba is not None and req.mamba_slot >= 0:
            self.mamba.release(req.mamba_slot)
            req.mamba_slot = -1

    @property
    def total_tokens(self) -> int:
        return self.allocator.num_blocks * self.allocator.block_size

    # ---- batches -----------------------------------------------------------------------------
    def _to_device(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Move CPU int64 index tensors to the device in one copy (one H2D transfer per batch
        instead of one per request and per field)."""
        flat = torch.cat([t.reshape(-1) for t in tensors]).to(self.device)
        return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]

    def _context_slots_cpu(self, reqs: list[Request], lens: list[int]) -> torch.Tensor:
        ctx = torch.zeros(len(reqs), max(max(lens), 1), dtype=torch.long)
        for b, (r, n) in enumerate(zip(reqs, lens)):
            ctx[b, :n] = self.allocator.slots(r.block_table, 0, n, torch.device("cpu"))
        return ctx

    def _batch(self, mode: Mode, reqs: list[Request], new_ids: list[list[int]] | torch.Tensor,
               starts: list[int], logits_all: bool) -> ForwardBatch:
        """``new_ids``: per-request id lists, or a [B, T] device tensor (verify blocks)."""
        cpu = torch.device("cpu")
        q_lens = [len(x) for x in new_ids] if isinstance(new_ids, list) else [new_ids.shape[1]] * len(reqs)
        positions = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, q_lens)])
        kv_slots = torch.cat([self.allocator.slots(r.block_table, s, s + q, cpu)
                              for r, s, q in zip(reqs, starts, q_lens)])
        ctx = self._context_slots_cpu(reqs, [s + q for s, q in zip(starts, q_lens)])
        ends = torch.cumsum(torch.tensor(q_lens), 0)
        rows = torch.arange(int(ends[-1])) if logits_all else ends - 1
        mamba_slots = torch.tensor([r.mamba_slot for r in reqs])
        host = [positions, kv_slots, ctx, mamba_slots, rows]
        if isinstance(new_ids, list):
            host.append(torch.tensor([t for x in new_ids for t in x], dtype=torch.long))
        positions, kv_slots, ctx, mamba_slots, rows, *ids = self._to_device(*host)
        ids = ids[0] if ids else new_ids.reshape(-1)
        return ForwardBatch(mode=mode, input_ids=ids, positions=positions, q_lens=q_lens,
                            prefix_lens=list(starts), kv_slots=kv_slots, ctx_slots=ctx,
                            mamba_slots=mamba_slots, logits_rows=rows,
                            capture_layers=self.capture_layers)

    def context_slots(self, reqs: list[Request], lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots of positions [0, lens[b]) per request, padded to [B, max(lens)] (pad slot 0),
        and the validity mask. Any paged pool indexed by the shared block tables reads them."""
        ctx = self._context_slots_cpu(reqs, lens)
        valid = torch.arange(ctx.shape[1])[None] < torch.tensor(lens)[:, None]
        ctx, valid = self._to_device(ctx, valid.long())
        return ctx, valid.bool()

    @torch.inference_mode()
    def extend(self, chunks: list[tuple[Request, int, int]]) -> ModelOutput:
        """Prefill prompt positions [start, end) of each request; logits of each last row."""
        reqs = [c[0] for c in chunks]
        fb = self._batch(Mode.EXTEND, reqs, [r.prompt_ids[s:e] for r, s, e in chunks],
                         [s for _, s, _ in chunks], logits_all=False)
        out = self.model(fb, self.kv, self.mamba)
        for r, _, e in chunks:
            r.num_cached = e
        return out

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Logits at every prompt position ([L, V] fp32 each) in one prefill; caches are
        borrowed and given back (for evaluation and parity checks)."""
        reqs = [Request(rid=-1 - i, prompt_ids=list(p), params=None) for i, p in enumerate(prompts)]
        for r in reqs:
            if not self.can_admit(len(r.prompt_ids)):
                raise RuntimeError("score: prompts do not fit the cache")
            self.admit(r, len(r.prompt_ids))
        try:
            fb = self._batch(Mode.EXTEND, reqs, [r.prompt_ids for r in reqs], [0] * len(reqs),
                             logits_all=True)
            logits = self.model(fb, self.kv, self.mamba).logits
        finally:
            for r in reqs:
                self.release(r)
        return list(logits.split([len(p) for p in prompts]))

    @torch.inference_mode()
    def hidden_states(self, prompts: list[list[int]], layers: tuple[int, ...]) -> list[torch.Tensor]:
        """Residual stream before each layer in ``layers`` (index ``num_layers`` = after the
        last layer), concatenated per row: [L, len(layers) * H] per prompt. The same capture
        that feeds a drafter while serving; used to train drafts. Caches are borrowed."""
        reqs = [Request(rid=-1 - i, prompt_ids=list(p), params=None) for i, p in enumerate(prompts)]
        for r in reqs:
            if not self.can_admit(len(r.prompt_ids)):
                raise RuntimeError("hidden_states: prompts do not fit the cache")
            self.admit(r, len(r.prompt_ids))
        saved, self.capture_layers = self.capture_layers, tuple(layers)
        try:
            fb = self._batch(Mode.EXTEND, reqs, [r.prompt_ids for r in reqs], [0] * len(reqs),
                             logits_all=False)
            aux = self.model(fb, self.kv, self.mamba).aux_hidden
        finally:
            self.capture_layers = saved
            for r in reqs:
                self.release(r)
        return list(aux.split([len(p) for p in prompts]))

    @torch.inference_mode()
    def decode(self, reqs: list[Request]) -> ModelOutput:
        """One token per request: the last sampled token goes in at position num_cached."""
        fb = self._batch(Mode.DECODE, reqs, [[r.last_token] for r in reqs],
                         [r.num_cached for r in reqs], logits_all=False)
        out = self.model(fb, self.kv, self.mamba)
        for r in reqs:
            r.num_cached += 1
        return out

    @torch.inference_mode()
    def verify(self, reqs: list[Request], cand: torch.Tensor) -> tuple[ModelOutput, ForwardBatch]:
        """Target forward over cand [B, T] at positions num_cached.. (committed state untouched)."""
        fb = self._batch(Mode.VERIFY, reqs, cand, [r.num_cached for r in reqs], logits_all=True)
        return self.model(fb, self.kv, self.mamba), fb

    @torch.inference_mode()
    def commit_verify(self, reqs: list[Request], fb: ForwardBatch, accept_len: torch.Tensor,
                      accepted: list[int]) -> None:
        """Keep a+1 block rows: Mamba adopts the state at index a; KV rows past it are simply
        beyond the new length (overwritten by the next step). ``accepted`` is
        ``accept_len.tolist()``, read once by the caller."""
        if self.mamba is not None:
            self.model.commit_verify(fb, self.mamba, accept_len.to(self.device))
        for r, a in zip(reqs, accepted):
            r.num_cached += a + 1
