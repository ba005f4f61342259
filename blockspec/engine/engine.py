"""Offline Engine in sglang's shape: ``Engine(model_path=...).generate(prompt=..., ...)``."""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from blockspec.args import DeviceInfo, EngineArgs, resolve_attention_backends
from blockspec.checkpoint import read_config, resolve_dtype
from blockspec.engine.memory import CacheLayout, MemoryManager
from blockspec.engine.request import Request
from blockspec.engine.scheduler import Scheduler
from blockspec.models.loader import load_target
from blockspec.models.nemotron_h_config import NemotronHConfig
from blockspec.runtime.model_runner import ModelRunner, RunnerOptions
from blockspec.sampling import SamplingParams
from blockspec.tokenizer import Tokenizer

log = logging.getLogger("blockspec")
DEFAULT_MAX_TOTAL_TOKENS = 32768


class GenerateError(ValueError):
    """Bad arguments to ``Engine.generate``."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GenerateError(f"device {name!r} requested but CUDA is not available")
    return dev


def device_info(dev: torch.device) -> DeviceInfo:
    if dev.type != "cuda":
        return DeviceInfo("cpu")
    major, minor = torch.cuda.get_device_capability(dev)
    return DeviceInfo("cuda", major * 10 + minor)


def available_modules() -> frozenset[str]:
    """Optional modules backends need (``BackendInfo.needs_available``)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return frozenset()
    return frozenset({"triton"})


def cache_layout(cfg: NemotronHConfig) -> CacheLayout:
    return CacheLayout(
        num_attention_layers=len(cfg.layer_ids("attention")), num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, num_mamba_layers=len(cfg.layer_ids("mamba")), conv_dim=cfg.conv_dim,
        conv_kernel=cfg.conv_kernel, mamba_heads=cfg.mamba_num_heads,
        mamba_head_dim=cfg.mamba_head_dim, ssm_state_size=cfg.ssm_state_size)


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.args = args = EngineArgs.from_kwargs(model_path=model_path, **kwargs)
        logging.basicConfig(level=args.log_level.upper(), format="[blockspec] %(message)s")
        if args.model_path is None:
            from blockspec.demo import ensure_demo_model

            args.model_path = str(ensure_demo_model())
        self.device = resolve_device(args.device)
        self.backends = resolve_attention_backends(
            device_info(self.device), attention_backend=args.attention_backend,
            prefill_attention_backend=args.prefill_attention_backend,
            decode_attention_backend=args.decode_attention_backend,
            speculative_draft_attention_backend=args.speculative_draft_attention_backend,
            speculative_algorithm=args.speculative_algorithm, available=available_modules())
        raw = read_config(args.model_path)
        self.dtype = resolve_dtype(args.dtype, raw, self.device)
        self.model, self.config = load_target(args.model_path, self.dtype, self.device)
        tok_dir = Path(args.tokenizer_path or args.model_path)
        self.tokenizer = Tokenizer(tok_dir) if Tokenizer.exists(tok_dir) else None
        self.memory = MemoryManager(
            cache_layout(self.config), max_total_tokens=args.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS,
            max_requests=args.max_running_requests, page_size=args.page_size, dtype=self.dtype,
            device=self.device)
        self.runner = ModelRunner(self.model, self.memory, self.backends, RunnerOptions(
            max_batch_size=args.max_running_requests, use_cuda_graph=not args.disable_cuda_graph,
            cuda_graph_max_bs=args.cuda_graph_max_bs))
        self.drafter = None
        if args.speculative_algorithm:
            from blockspec.speculative.worker import build_spec_worker

            self.drafter = build_spec_worker(args, self.runner, self.backends.draft, self.dtype,
                                             self.device)
        eos = list(self.config.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.scheduler = Scheduler(
            self.runner, self.memory, eos_token_ids=eos, chunked_prefill_size=args.chunked_prefill_size,
            detokenize=self.tokenizer.decode if self.tokenizer else None,
            drafter=self.drafter, seed=args.random_seed)
        self._next_rid = 0
        # Called with a generate call's requests after every step (the CLI's progress bar).
        self.on_step: Callable[[list[Request]], None] | None = None

    # ---- public API ----------------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 return_logprob: bool = False) -> dict | list[dict]:
        if self.scheduler is None:
            raise GenerateError("this Engine was shut down; create a new one")
        single, id_lists = self._normalize_prompts(prompt, input_ids)
        params = self._normalize_params(sampling_params, len(id_lists))
        reqs = []
        for ids, p in zip(id_lists, params):
            req = Request(rid=self._next_rid, prompt_ids=ids, params=p, return_logprob=return_logprob)
            self._next_rid += 1
            reqs.append(req)
        for req in reqs:
            self.scheduler.add(req)
        pending = {r.rid for r in reqs}
        while pending:
            for done in self.scheduler.step():
                pending.discard(done.rid)
            if self.on_step is not None:
                self.on_step(reqs)
        spec = self.drafter is not None
        results = [{"text": r.text, "output_ids": list(r.output_ids), "meta_info": r.meta_info(spec)}
                   for r in reqs]
        return results[0] if single else results

    def shutdown(self) -> None:
        self.scheduler = None
        self.runner = None
        self.memory = None
        self.model = None
        self.drafter = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- input normalisation -----------------------------------------------------------------
    def _normalize_prompts(self, prompt, input_ids) -> tuple[bool, list[list[int]]]:
        if (prompt is None) == (input_ids is None):
            raise GenerateError("give exactly one of prompt or input_ids")
        vocab = self.config.vocab_size
        if input_ids is not None:
            single = bool(input_ids) and all(isinstance(t, int) for t in input_ids)
            lists = [input_ids] if single else input_ids
            if not isinstance(lists, list) or not all(isinstance(x, list) for x in lists):
                raise GenerateError("input_ids must be a list of ints or a list of lists of ints")
            for x in lists:
                bad = [t for t in x if not isinstance(t, int) or not 0 <= t < vocab]
                if bad:
                    raise GenerateError(f"input_ids: token ids must be ints in [0, {vocab}), found {bad[:5]}")
            return single, [list(x) for x in lists]
        if self.tokenizer is None:
            raise GenerateError("a text prompt needs a tokenizer, but the model folder has no "
                                "tokenizer.json; pass input_ids instead")
        single = isinstance(prompt, str)
        texts = [prompt] if single else prompt
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise GenerateError("prompt must be a string or a list of strings")
        return single, [self.tokenizer.encode(t) for t in texts]

    @staticmethod
    def _normalize_params(sp, n: int) -> list[SamplingParams]:
        if isinstance(sp, list):
            if len(sp) != n:
                raise GenerateError(f"sampling_params has {len(sp)} entries for {n} prompts")
            items = sp
        else:
            items = [sp] * n
        return [SamplingParams.from_dict(d) for d in items]      # from_dict validates
