"""Engine in sglang's shape: ``Engine(model_path=...).generate(prompt=..., ...)``, a client of
the engine loop (engine/loop.py) like the HTTP server; ``submit``/``abort``/``stats`` are what
servers build on."""
from __future__ import annotations

import logging
import queue
import uuid
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from blockspec.args import ArgsError, DeviceInfo, EngineArgs, resolve_attention_backends
from blockspec.cache import CacheLayout, MemoryManager
from blockspec.checkpoint import read_config, resolve_dtype
from blockspec.configs.nemotron_h import NemotronHConfig
from blockspec.demo_family import demo_engine_kwargs
from blockspec.engine.loop import EngineClosedError, EngineLoop, LoopStats, StreamOutput
from blockspec.engine.request import Request
from blockspec.engine.scheduler import Scheduler
from blockspec.engine.tp_launch import TPWorkers, stop_engine
from blockspec.grammar import GrammarCompiler, Matcher
from blockspec.kernels.triton_loader import triton_importable
from blockspec.models.loader import load_target
from blockspec.models.nemotron_h import NemotronHForCausalLM
from blockspec.parallel import SINGLE
from blockspec.penalties import bias_token
from blockspec.runtime.logprobs import TOP_LOGPROBS_MAX
from blockspec.runtime.model_runner import ModelRunner, RunnerOptions
from blockspec.sampling import SamplingParams, not_utf8
from blockspec.speculative.worker import SpecWorker, build_spec_worker
from blockspec.tokenizer import Tokenizer

log = logging.getLogger("blockspec")
DEFAULT_MAX_TOTAL_TOKENS = 32768


class GenerateError(ValueError):
    """Bad arguments to ``Engine.generate`` / ``Engine.submit``; ``param`` names the argument
    (None when it is about the engine itself), so a server can point its client at it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _is_token(t: Any, vocab: int) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab


def check_token_ids(ids: Any, vocab: int, param: str, *, allow_empty: bool = False) -> None:
    """``ids`` is a list of ints in [0, vocab) (non-empty unless ``allow_empty``): an id past
    the vocabulary would index past the embedding table inside a step."""
    if not isinstance(ids, (list, tuple)):
        raise GenerateError(f"{param} must be a list of token ids, got {type(ids).__name__}", param)
    if not ids and not allow_empty:
        raise GenerateError(f"{param} is empty: give at least one token", param)
    bad = [t for t in ids if not _is_token(t, vocab)]
    if bad:
        shown = ", ".join(_short(t) for t in bad[:5])
        raise GenerateError(f"{param}: token ids must be ints in [0, {vocab}) (the vocabulary), "
                            f"found [{shown}]", param)


def _short(x: Any) -> str:
    if isinstance(x, int) and x.bit_length() > 128:
        return f"an int of {x.bit_length()} bits"
    return repr(x)


def check_text(text: str, param: str) -> None:
    """``text`` encodes as UTF-8 (no lone surrogate), else GenerateError naming ``param``."""
    at = not_utf8(text)
    if at is not None:
        raise GenerateError(f"{param} is not UTF-8 text: character {at} is {text[at]!r} (a lone "
                            "surrogate, e.g. JSON's \\ud800 or an undecodable byte)", param)


def check_context(prompt_len: int, max_new_tokens: int, context: int, *, prompt_param: str,
                  tokens_param: str, source: str = "") -> None:
    """prompt + max_new_tokens fit ``context`` tokens, else GenerateError naming both numbers
    and the one to change (``source`` says where the context comes from)."""
    if prompt_len + max_new_tokens <= context:
        return
    if prompt_len >= context:
        raise GenerateError(f"the prompt has {prompt_len} tokens but the context holds {context}"
                            f"{source} (prompt + output); shorten the prompt", prompt_param)
    raise GenerateError(f"the prompt has {prompt_len} tokens and {tokens_param} is "
                        f"{_short(max_new_tokens)}, together more than the context of {context} "
                        f"tokens{source}; lower {tokens_param} to at most {context - prompt_len}",
                        tokens_param)


def check_logprob_args(top_logprobs_num: Any, logprob_start_len: Any) -> None:
    """``top_logprobs_num`` in [0, TOP_LOGPROBS_MAX] and ``logprob_start_len`` an int >= -1."""
    if not _is_int_arg(top_logprobs_num) or not 0 <= top_logprobs_num <= TOP_LOGPROBS_MAX:
        raise GenerateError(f"top_logprobs_num must be an int in [0, {TOP_LOGPROBS_MAX}], got "
                            f"{_short(top_logprobs_num)}", "top_logprobs_num")
    if not _is_int_arg(logprob_start_len) or logprob_start_len < -1:
        raise GenerateError("logprob_start_len must be an int >= -1 (-1: no prompt logprobs, "
                            f"0: every prompt token), got {_short(logprob_start_len)}",
                            "logprob_start_len")


def _is_int_arg(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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
    return frozenset({"triton"}) if triton_importable() else frozenset()


def engine_backends(args: EngineArgs, device: torch.device, speculative: str | None):
    """The attention backends ``args`` resolve to on ``device``."""
    return resolve_attention_backends(
        device_info(device), attention_backend=args.attention_backend,
        prefill_attention_backend=args.prefill_attention_backend,
        decode_attention_backend=args.decode_attention_backend,
        speculative_draft_attention_backend=args.speculative_draft_attention_backend,
        speculative_algorithm=speculative, available=available_modules())


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        # no model_path: the shipped demo family, DFlash on unless kwargs say otherwise
        model_path, kwargs = demo_engine_kwargs(model_path, kwargs)
        self.args = args = EngineArgs.from_kwargs(model_path=model_path, **kwargs)
        if args.node_rank > 0:
            raise ArgsError("node_rank > 0 runs only that node's tensor-parallel ranks, no "
                            "engine: use `blockspec serve --node-rank N` (run_worker_node)")
        logging.basicConfig(level=args.log_level.upper(), format="[blockspec] %(message)s")
        self.device = resolve_device(args.device)
        self._resolve_backends(args.speculative_algorithm)      # bad flags fail before any load
        tok_dir = self._tokenizer_dir(args.tokenizer_path, args.model_path)
        raw = read_config(args.model_path)
        self.dtype = resolve_dtype(args.dtype, raw, self.device)
        # tp_size > 1: the workers start (and load their shards) while this process loads its own
        self._tp = (TPWorkers.start(args, self.device, self.dtype, self.backends)
                    if args.tp_size > 1 else None)
        try:
            model, config = load_target(args.model_path, self.dtype, self.device,
                                        tp=self._tp.group if self._tp is not None else SINGLE)
            tokenizer = Tokenizer(tok_dir) if Tokenizer.exists(tok_dir) else None
            self._assemble(model, config, tokenizer, draft=None)
        except BaseException:
            if self._tp is not None:
                self._tp.close()
            raise

    @classmethod
    def from_model(cls, model: NemotronHForCausalLM, *, draft: Any = None,
                   tokenizer: Tokenizer | None = None, **kwargs: Any) -> "Engine":
        """An Engine around a target (and draft) already in memory, on its device and dtype.
        Benchmarks build random full-size models directly on the GPU this way, without
        writing a checkpoint. ``kwargs`` are EngineArgs fields (no paths)."""
        self = cls.__new__(cls)
        self.args = args = EngineArgs.from_kwargs(**kwargs)
        if args.tp_size > 1:
            raise GenerateError("Engine.from_model runs one process; tp_size > 1 needs "
                                "Engine(model_path=...) (each rank loads its shard)", "tp_size")
        self._tp = None
        logging.basicConfig(level=args.log_level.upper(), format="[blockspec] %(message)s")
        param = next(model.parameters())
        self.device, self.dtype = param.device, model.backbone.norm_f.weight.dtype
        self._resolve_backends(args.speculative_algorithm or (draft.config.algorithm.upper() if draft else None))
        self._assemble(model, model.cfg, tokenizer, draft=draft)
        return self

    @staticmethod
    def _tokenizer_dir(tokenizer_path: str | None, model_path: str) -> Path:
        """The tokenizer folder; an explicit tokenizer_path that is missing or holds no
        tokenizer.json is an error about that path (not a silent 'no tokenizer')."""
        if tokenizer_path is None:
            return Path(model_path)
        path = Path(tokenizer_path)
        if not path.exists():
            raise GenerateError(f"tokenizer_path {tokenizer_path} does not exist", "tokenizer_path")
        if path.is_file() and path.name == "tokenizer.json":
            path = path.parent
        if not Tokenizer.exists(path):
            raise GenerateError(f"tokenizer_path {tokenizer_path} has no tokenizer.json",
                                "tokenizer_path")
        return path

    def _resolve_backends(self, speculative: str | None) -> None:
        self.backends = engine_backends(self.args, self.device, speculative)

    def _assemble(self, model: NemotronHForCausalLM, config: NemotronHConfig,
                  tokenizer: Tokenizer | None, draft: Any) -> None:
        """Caches, runner, drafter, scheduler and the engine loop around a loaded target."""
        args = self.args
        self.model, self.config, self.tokenizer = model, config, tokenizer
        sizes = {"max_total_tokens": args.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS,
                 "max_requests": args.max_running_requests, "page_size": args.page_size,
                 "prefix_cache": args.enable_radix_cache and not args.disable_radix_cache,
                 "mamba_track_interval": args.mamba_track_interval,
                 "mamba_cache_slots": args.mamba_cache_slots}
        options = RunnerOptions(max_batch_size=args.max_running_requests,
                                use_cuda_graph=not args.disable_cuda_graph,
                                cuda_graph_max_bs=args.cuda_graph_max_bs,
                                prefill_graph_max_tokens=args.cuda_graph_max_prefill_tokens)
        if self._tp is not None:     # every rank sizes its caches (its heads) as rank 0 does
            self._tp.build(sizes, options)
        self.memory = MemoryManager(CacheLayout.for_model(model.rank_cfg), dtype=self.dtype,
                                    device=self.device, **sizes)
        runner_args = (model, self.memory, self.backends, options)
        self.runner = (self._tp.mirrored_runner(*runner_args) if self._tp is not None
                       else ModelRunner(*runner_args))
        eos = list(config.eos_token_id)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.drafter = None
        if draft is not None:
            self.drafter = SpecWorker(draft, self.runner, self.backends.draft, self.dtype,
                                      args.speculative_draft_lm_head,
                                      adaptive=args.speculative_adaptive, eos_token_ids=eos)
        elif args.speculative_algorithm:
            self.drafter = build_spec_worker(args, self.runner, self.backends.draft, self.dtype,
                                             self.device, eos_token_ids=eos)
        if self._tp is not None:
            self.drafter = self._tp.ready(self.drafter)
        # structured output; xgrammar is loaded by the first constrained request
        self._grammars = (GrammarCompiler(tokenizer.backend, config.vocab_size, eos)
                          if tokenizer is not None else None)
        detok = tokenizer.decode if tokenizer else None
        self.scheduler = Scheduler(
            self.runner, self.memory, eos_token_ids=eos, chunked_prefill_size=args.chunked_prefill_size,
            decoding_prefill_chunk_size=args.decoding_prefill_chunk_size,
            detokenize=detok, drafter=self.drafter, seed=args.random_seed)
        # The loop thread never refers back to the Engine, so an Engine dropped without
        # shutdown() is collected and its finalizer stops the thread.
        self._loop: EngineLoop | None = EngineLoop(self.scheduler, detokenize=detok,
                                                   speculative=self.drafter is not None)
        weakref.finalize(self, stop_engine, self._loop, self._tp)
        # Called as on_step(tokens done, tokens total) while a generate call waits (the CLI's
        # progress bar); prompt tokens count as done once the request's first output arrives.
        self.on_step: Callable[[int, int], None] | None = None

    # ---- public API ----------------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 return_logprob: bool = False,
                 stream: bool = False, *, top_logprobs_num: int = 0,
                 logprob_start_len: int = -1) -> dict | list[dict] | Iterator[dict]:
        """One prompt gives a dict ``{"text", "output_ids", "meta_info"}``, a list gives a list.

        With ``stream=True``: an iterator of deltas, one per step that changed a request,
        ``{"text": new text, "output_ids": new ids, "meta_info": {...}}`` (plus ``"index"`` into
        the prompt list when a list was given); the deltas concatenate to the non-streamed
        result and each request's last delta carries its full ``meta_info``. Closing the
        iterator early aborts what is still running.

        ``top_logprobs_num`` (0..20) adds each output token's top alternatives
        (``meta_info["output_top_logprobs"]``), ``logprob_start_len`` >= 0 the prompt's
        logprobs from that position (``input_token_logprobs``, ``input_top_logprobs``); either
        implies ``return_logprob``."""
        check_logprob_args(top_logprobs_num, logprob_start_len)
        lp_args = (top_logprobs_num, logprob_start_len)
        single, id_lists, param = self._normalize_prompts(prompt, input_ids)
        params = self._normalize_params(sampling_params, len(id_lists))
        for i, (ids, p) in enumerate(zip(id_lists, params)):   # all or nothing: nothing is
            self.check_request(ids, p, param if single else f"{param}[{i}]")   # queued on an error
        outputs: queue.SimpleQueue[StreamOutput] = queue.SimpleQueue()
        per_step = stream or self.on_step is not None     # the progress hook wants every step
        group = uuid.uuid4().hex        # one call's prompts share the engine with other callers
        with self._require_loop().grouped():
            rids = [self._enqueue(ids, p, outputs.put, return_logprob, per_step, None, group, lp_args)
                    for ids, p in zip(id_lists, params)]
        if stream:
            return self._stream(rids, outputs, single)
        results = {rid: {"text": "", "output_ids": [], "meta_info": None} for rid in rids}
        sizes = {rid: (len(ids), p.max_new_tokens) for rid, ids, p in zip(rids, id_lists, params)}
        total = sum(a + b for a, b in sizes.values())
        done: dict[str, int] = {}
        for out in self._drain(rids, outputs):
            r = results[out.rid]
            r["text"] += out.text
            r["output_ids"] += out.token_ids
            if out.finished:
                r["meta_info"] = out.meta_info
            if self.on_step is not None:
                prompt, most = sizes[out.rid]
                done[out.rid] = prompt + (most if out.finished else len(r["output_ids"]))
                self.on_step(sum(done.values()), total)
        ordered = [results[rid] for rid in rids]
        return ordered[0] if single else ordered

    def submit(self, input_ids: list[int], params: SamplingParams,
               sink: Callable[[StreamOutput], None], *, return_logprob: bool = False,
               stream: bool = True, rid: str | None = None, group: object = None,
               top_logprobs_num: int = 0, logprob_start_len: int = -1) -> str:
        """Queue one request on the engine loop and return its id; its ``StreamOutput``s go to
        ``sink`` from the loop thread (which must not block). Raises GenerateError (or
        SamplingParamsError) naming the argument when the request is malformed or can never
        fit (``check_request``). Requests submitted with the same ``group`` (one client
        request's prompts) are admitted round-robin with other groups; ``top_logprobs_num`` and
        ``logprob_start_len`` as for ``generate``. This is the entry point for servers."""
        self._require_loop()
        check_logprob_args(top_logprobs_num, logprob_start_len)
        if rid is not None:
            if not isinstance(rid, str):
                raise GenerateError(f"rid must be a string, got {type(rid).__name__}", "rid")
            check_text(rid, "rid")
        self.check_request(input_ids, params)
        return self._enqueue(input_ids, params, sink, return_logprob, stream, rid, group,
                             (top_logprobs_num, logprob_start_len))

    def check_request(self, input_ids: list[int], params: SamplingParams,
                      param: str = "input_ids") -> None:
        """The one check every way in (``generate``, ``submit``, so the CLI and the server)
        runs before anything is queued: token ids and stop_token_ids inside the vocabulary,
        sampling parameters in the ranges the step buffers hold, prompt + max_new_tokens
        within the model's context, and the whole request within the cache. Raises
        GenerateError / SamplingParamsError naming the argument (``param``: the prompt's)."""
        vocab = self.config.vocab_size
        check_token_ids(input_ids, vocab, param)
        if not isinstance(params, SamplingParams):
            raise GenerateError(f"params must be SamplingParams, got {type(params).__name__}",
                                "sampling_params")
        params.validate()
        if params.stop_token_ids:
            check_token_ids(list(params.stop_token_ids), vocab, "stop_token_ids")
        if params.logit_bias:
            check_token_ids([bias_token(k) for k in params.logit_bias], vocab, "logit_bias")
        check_context(len(input_ids), params.max_new_tokens, self.config.max_position_embeddings,
                      prompt_param=param, tokens_param="max_new_tokens",
                      source=" (the model's max_position_embeddings)")
        try:
            self.scheduler.check(Request(rid="", prompt_ids=list(input_ids), params=params))
        except ValueError as e:
            raise GenerateError(str(e), "max_new_tokens") from None
        self.compile_grammar(params)

    def _enqueue(self, input_ids: list[int], params: SamplingParams, sink: Callable[[StreamOutput], None],
                 return_logprob: bool, stream: bool, rid: str | None, group: object = None,
                 lp_args: tuple[int, int] = (0, -1)) -> str:
        """Hand an already checked request to the loop."""
        top, start = lp_args
        req = Request(rid=rid if rid is not None else uuid.uuid4().hex, prompt_ids=list(input_ids),
                      params=params, return_logprob=return_logprob or top > 0 or start >= 0,
                      group=group, grammar=self._matcher(params), top_logprobs_num=top,
                      logprob_start_len=start)
        try:
            self._require_loop().submit(req, sink, stream=stream)
        except EngineClosedError as e:
            raise GenerateError(f"{e}; create a new Engine") from None
        return req.rid

    def abort(self, rid: str, wait: float | None = None) -> bool:
        """Abort a queued or running request; its cache is freed before the next step (with
        ``wait`` seconds: by the time this returns). False when no such request is live."""
        return self._loop.abort(rid, wait=wait) if self._loop is not None else False

    def stats(self) -> LoopStats:
        """Queue depth, running requests, cache usage and step count, as of the last step."""
        return self._loop.stats if self._loop is not None else LoopStats(alive=False)

    @property
    def context_length(self) -> int:
        """Most tokens (prompt + output) one request may span: the model's position limit or
        what the cache can reserve for a single request, whichever is smaller."""
        return min(self.config.max_position_embeddings,
                   self.memory.total_tokens - self.memory.lookahead)

    @property
    def verify_width(self) -> int:
        """Positions one speculative verify covers (anchor + drafts: the most tokens it can
        commit); 0 without speculation."""
        return self.drafter.width if self.drafter is not None else 0

    def shutdown(self) -> None:
        """Stop the engine loop (running requests end with an error) and drop the model."""
        if self._loop is not None or self._tp is not None:
            stop_engine(self._loop, self._tp)
        self._loop = self._tp = None
        self.scheduler = None
        self.runner = None
        self.memory = None
        self.model = None
        self.drafter = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- loop clients --------------------------------------------------------------------------
    def _require_loop(self) -> EngineLoop:
        if self._loop is None:
            raise GenerateError("this Engine was shut down; create a new one")
        return self._loop

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile (or find cached) the request's structured-output grammar; ValueError naming
        the field when it does not compile. The server calls it while validating a request."""
        constraint = params.constraint()
        if constraint is None:
            return
        if self._grammars is None:
            raise GenerateError(f"{constraint[0]}: structured output needs the model's tokenizer "
                                f"(tokenizer.json), and this model has none")
        self._grammars.compile(*constraint)

    def _matcher(self, params: SamplingParams) -> Matcher | None:
        """A fresh grammar matcher for a request that was checked by ``check_request``."""
        constraint = params.constraint()
        if constraint is None:
            return None
        self.compile_grammar(params)
        return self._grammars.matcher(*constraint, extra_stop_ids=params.stop_token_ids)

    def _drain(self, rids: list[str], outputs: queue.SimpleQueue) -> Iterator[StreamOutput]:
        """Outputs of ``rids`` until each has finished; an engine failure raises here. Leaving
        early (an exception, ^C, a closed stream) aborts what is still running."""
        pending = set(rids)
        try:
            while pending:
                try:
                    out = outputs.get(timeout=1.0)
                except queue.Empty:
                    if self._loop is not None and self._loop.alive:
                        continue
                    raise RuntimeError("the engine loop stopped before the request finished") from None
                if out.finished:
                    pending.discard(out.rid)
                    if out.finish_reason.get("type") == "error":
                        raise RuntimeError(f"request {out.rid} failed: {out.finish_reason['message']}")
                yield out
        finally:
            for rid in pending:
                self.abort(rid)

    def _stream(self, rids: list[str], outputs: queue.SimpleQueue, single: bool) -> Iterator[dict]:
        index = {rid: i for i, rid in enumerate(rids)}
        for out in self._drain(rids, outputs):
            chunk = {"text": out.text, "output_ids": out.token_ids, "meta_info": out.meta_info}
            if not single:
                chunk["index"] = index[out.rid]
            yield chunk

    # ---- input normalisation -----------------------------------------------------------------
    def _normalize_prompts(self, prompt: Any, input_ids: Any) -> tuple[bool, list[list[int]], str]:
        """(one prompt?, token id lists, the argument they came from)."""
        if self._loop is None:
            raise GenerateError("this Engine was shut down; create a new one")
        if (prompt is None) == (input_ids is None):
            raise GenerateError("give exactly one of prompt or input_ids", "prompt")
        vocab = self.config.vocab_size
        if input_ids is not None:
            if not isinstance(input_ids, list) or not input_ids:
                raise GenerateError("input_ids must be a non-empty list of ints or of lists of "
                                    "ints", "input_ids")
            single = not any(isinstance(x, list) for x in input_ids)
            lists = [input_ids] if single else input_ids
            for i, x in enumerate(lists):
                check_token_ids(x, vocab, "input_ids" if single else f"input_ids[{i}]")
            return single, [list(x) for x in lists], "input_ids"
        single = isinstance(prompt, str)
        texts = [prompt] if single else prompt
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise GenerateError("prompt must be a string or a non-empty list of strings", "prompt")
        for i, t in enumerate(texts):
            check_text(t, "prompt" if single else f"prompt[{i}]")
        if self.tokenizer is None:
            raise GenerateError("a text prompt needs a tokenizer, but the model folder has no "
                                "tokenizer.json; pass input_ids instead", "prompt")
        return single, [self.tokenizer.encode(t) for t in texts], "prompt"

    @staticmethod
    def _normalize_params(sp: Any, n: int) -> list[SamplingParams]:
        if isinstance(sp, list):
            if len(sp) != n:
                raise GenerateError(f"sampling_params has {len(sp)} entries for {n} prompts",
                                    "sampling_params")
            items = sp
        else:
            items = [sp] * n
        return [SamplingParams.from_dict(d) for d in items]      # from_dict validates
