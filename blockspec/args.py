"""EngineArgs (field names = CLI flags, sglang spelling), validation, and attention-backend
resolution as one pure function of (device, capability, speculative mode, model)."""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

SPEC_ALGORITHMS = ("DFLASH", "DSPARK")
SPEC_OFF = "NONE"           # --speculative-algorithm NONE: speculation off (also "off", None)
DRAFT_LM_HEADS = ("auto", "target", "nvfp4")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


class ArgsError(ValueError):
    pass


@dataclass(frozen=True)
class BackendInfo:
    name: str
    devices: tuple[str, ...]          # "cpu", "cuda"
    min_capability: int = 0           # SM as 80, 90, ...; 0 = any
    noncausal_blocks: bool = True     # can run a draft block bidirectionally (DFlash)
    needs_available: str | None = None  # python module that must import (e.g. "triton")


# The backends this engine has. "torch_native": pool gather + SDPA with an explicit mask;
# runs everywhere and is the oracle every faster backend is tested against.
# "triton": paged kernel that reads K/V in place through the block table (decode, verify,
# prefill, draft blocks), graph-capturable; needs a CUDA GPU (sm80+) and triton.
BACKENDS: dict[str, BackendInfo] = {
    "torch_native": BackendInfo("torch_native", ("cpu", "cuda")),
    "triton": BackendInfo("triton", ("cuda",), min_capability=80, needs_available="triton"),
}
# Preference order for auto, best first.
AUTO_ORDER: tuple[str, ...] = ("triton", "torch_native")


@dataclass(frozen=True)
class DeviceInfo:
    kind: str                 # "cpu" | "cuda"
    capability: int = 0       # 80, 90, 100, 120 ...


@dataclass(frozen=True)
class ResolvedBackends:
    prefill: str
    decode: str
    draft: str | None


def _usable(info: BackendInfo, dev: DeviceInfo, available: frozenset[str]) -> bool:
    if dev.kind not in info.devices:
        return False
    if dev.kind == "cuda" and dev.capability < info.min_capability:
        return False
    return info.needs_available is None or info.needs_available in available


def resolve_attention_backends(dev: DeviceInfo, *, attention_backend: str | None,
                               prefill_attention_backend: str | None,
                               decode_attention_backend: str | None,
                               speculative_draft_attention_backend: str | None,
                               speculative_algorithm: str | None,
                               backends: dict[str, BackendInfo] = BACKENDS,
                               auto_order: tuple[str, ...] = AUTO_ORDER,
                               available: frozenset[str] = frozenset()) -> ResolvedBackends:
    """Pure resolution. Explicit choices are never overridden; 'auto'/None picks the first
    usable backend in ``auto_order``. The draft backend inherits the decode backend when that
    backend can run non-causal blocks (DFlash/DSpark drafts are bidirectional), otherwise the
    first usable one that can."""

    def check(flag: str, name: str) -> str:
        if name not in backends:
            raise ArgsError(f"--{flag.replace('_', '-')}: unknown attention backend {name!r}; "
                            f"choices: auto, {', '.join(sorted(backends))}")
        if not _usable(backends[name], dev, available):
            usable = [b for b in sorted(backends) if _usable(backends[b], dev, available)]
            raise ArgsError(f"--{flag.replace('_', '-')}: attention backend {name!r} is not available "
                            f"on {dev.kind}" + (f" sm{dev.capability}" if dev.kind == "cuda" else "")
                            + f"; choices here: auto, {', '.join(usable)}")
        return name

    def auto(need_noncausal: bool = False) -> str:
        for name in auto_order:
            info = backends[name]
            if _usable(info, dev, available) and (info.noncausal_blocks or not need_noncausal):
                return name
        raise ArgsError(f"no attention backend can run on {dev.kind}")

    base = None if attention_backend in (None, "auto") else check("attention_backend", attention_backend)
    prefill = (check("prefill_attention_backend", prefill_attention_backend)
               if prefill_attention_backend not in (None, "auto") else base or auto())
    decode = (check("decode_attention_backend", decode_attention_backend)
              if decode_attention_backend not in (None, "auto") else base or auto())
    draft = None
    if speculative_algorithm:
        if speculative_draft_attention_backend not in (None, "auto"):
            draft = check("speculative_draft_attention_backend", speculative_draft_attention_backend)
        else:
            draft = decode if backends[decode].noncausal_blocks else auto(need_noncausal=True)
    return ResolvedBackends(prefill=prefill, decode=decode, draft=draft)


def arg(default: Any, help: str, *,
        choices: Sequence[str] | Callable[[], Sequence[str]] | None = None,
        aliases: tuple[str, ...] = ()) -> Any:
    """An EngineArgs field whose CLI help sits next to it. ``choices`` may be a callable so a
    registry that grows at import time (attention backends) is read when the parser is built.
    The CLI appends the default and the choices to ``help`` itself; ``aliases`` are further
    spellings of the flag (vLLM's, where sglang's differs)."""
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases})


def attention_backend_choices() -> tuple[str, ...]:
    return ("auto", *sorted(BACKENDS))


def choices_of(f: Any) -> tuple[str, ...] | None:
    """The choices of an EngineArgs field (see ``arg``), or None when it takes any value."""
    c = f.metadata.get("choices")
    return tuple(c() if callable(c) else c) if c is not None else None


@dataclass
class EngineArgs:
    """Engine configuration; each field is a CLI flag (``--model-path``, ...). To add one:
    ``name: type = arg(default, "one line of help")``; tests check every field has help."""

    model_path: str | None = arg(
        None, "model folder (config.json, *.safetensors, tokenizer.json); default: the trained demo "
              "family shipped in the package (blockspec/demo_family: its target, with DFLASH on "
              "unless --speculative-algorithm says otherwise)")
    tokenizer_path: str | None = arg(None, "folder with tokenizer.json; default: the model folder")
    dtype: str = arg("auto", "compute dtype; auto: float32 on CPU, the checkpoint's dtype on GPU",
                     choices=(*DTYPES, *DTYPE_ALIASES))
    device: str = arg("auto", "auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    random_seed: int = arg(0, "seeds sampling for requests without their own seed")
    tp_size: int = arg(
        1, "tensor-parallel ranks: the target's heads, channels and vocabulary split over this "
           "many processes (this one and tp_size - 1 workers it starts; NCCL on cuda:i, gloo on "
           "the CPU); drafts are replicated", aliases=("--tensor-parallel-size",))
    ep_size: int = arg(
        1, "expert-parallel ranks: 1 splits each MoE expert's channels over the tp_size ranks; "
           "tp_size gives each rank n_routed_experts / tp_size whole experts (the shared expert "
           "stays split by channels)", aliases=("--expert-parallel-size",))
    nnodes: int = arg(1, "machines the tp_size ranks span (tp_size / nnodes ranks each); node "
                         "0 schedules and serves, the others only run their ranks")
    node_rank: int = arg(0, "this machine's index among the nnodes (0 schedules and serves)")
    dist_init_addr: str | None = arg(None, "HOST:PORT of node 0's rendezvous for the ranks of "
                                           "every node (needed with nnodes > 1; default: a free "
                                           "port on 127.0.0.1)")
    max_running_requests: int = arg(16, "most requests decoded together")
    max_total_tokens: int | None = arg(None, "cache capacity in tokens over all running requests "
                                             "(prompt + max_new_tokens each); default: 32768")
    chunked_prefill_size: int = arg(32768, "most prompt tokens per prefill forward")
    decoding_prefill_chunk_size: int = arg(
        64, "most prompt tokens per prefill forward while other requests decode: such a "
            "forward runs between two of their steps and delays each stream by its time "
            "(capped by --chunked-prefill-size; on one H200, 64 keeps 16 streams within 3x "
            "their steady inter-token latency while a 32k prompt prefills, 128 halves that "
            "prompt's time to first token at 3.1x)")
    page_size: int = arg(16, "tokens per KV cache block")
    enable_radix_cache: bool = arg(False, "turn the prefix cache on: shared KV pages and Mamba "
                                          "state checkpoints of earlier prompts and answers")
    disable_radix_cache: bool = arg(False, "keep the prefix cache off (sglang's flag; wins over "
                                           "--enable-radix-cache)")
    mamba_track_interval: int = arg(256, "prefix cache: tokens between Mamba state checkpoints "
                                         "in a prefill (a multiple of --page-size)")
    mamba_cache_slots: int = arg(0, "prefix cache: Mamba state snapshots kept (each the size of "
                                    "one request's Mamba state); 0: twice --max-running-requests, at "
                                    "least 32")
    attention_backend: str | None = arg(None, "attention kernels for every phase; default: auto "
                                              "(the best usable on the device)",
                                        choices=attention_backend_choices)
    prefill_attention_backend: str | None = arg(None, "prefill attention; default: --attention-backend",
                                                choices=attention_backend_choices)
    decode_attention_backend: str | None = arg(None, "decode attention; default: --attention-backend",
                                               choices=attention_backend_choices)
    speculative_algorithm: str | None = arg(
        None, "block speculative decoding (needs --speculative-draft-model-path, except with the "
              "demo family); NONE turns it off; default: off with --model-path, DFLASH with the "
              "demo family", choices=(*SPEC_ALGORITHMS, SPEC_OFF))
    speculative_draft_model_path: str | None = arg(None, "DFlash/DSpark draft checkpoint folder")
    speculative_num_draft_tokens: int | None = arg(None, "verify block width (>= 2, anchor "
                                                         "included); default: the draft's block_size")
    speculative_adaptive: bool = arg(
        False, "choose each step's verify width (1 .. --speculative-num-draft-tokens, 1 = plain "
               "decoding) from a measured step-time table and live per-position acceptance")
    speculative_draft_attention_backend: str | None = arg(
        None, "draft attention; default: the decode backend when it runs non-causal blocks",
        choices=attention_backend_choices)
    speculative_draft_lm_head: str = arg(
        "auto", "head that scores draft blocks: target = the head as stored; nvfp4 = a W4A16 "
                "NVFP4 copy of it made at load (about 3.6x fewer bytes per draft step; only the "
                "proposals change, verification stays exact); auto = nvfp4 on CUDA when that head "
                "is a dense bf16/fp16 matrix, else target", choices=DRAFT_LM_HEADS)
    cuda_graph_max_bs: int = arg(32, "largest batch replayed from a CUDA graph (graphs are "
                                     "captured at 1, 2, 4, 8, 16, 24, 32, ... up to it); "
                                     "larger batches run eagerly")
    cuda_graph_max_prefill_tokens: int = arg(
        2048, "longest prefill chunk of one request replayed from a CUDA graph (captured at "
              "16, 32, ... up to it, padded to the next; cheap small chunks for prefix-cache "
              "hits and chunks between decode steps); 0: every prefill forward runs eagerly")
    disable_cuda_graph: bool = arg(False, "run every step eagerly (no CUDA graphs)")
    log_level: str = arg("warning", "logging level", choices=LOG_LEVELS)
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        known = {f.name for f in fields(cls)} - {"extra"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ArgsError(f"unknown engine argument(s): {', '.join(unknown)}")
        args = cls(**kwargs)
        args.validate()
        return args

    def validate(self) -> None:
        if self.dtype not in DTYPES and self.dtype not in DTYPE_ALIASES:
            raise ArgsError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ArgsError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ArgsError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.speculative_algorithm is not None and \
                str(self.speculative_algorithm).upper() in (SPEC_OFF, "OFF"):
            self.speculative_algorithm = None
        if self.speculative_algorithm is not None:
            algo = self.speculative_algorithm.upper()
            if algo not in SPEC_ALGORITHMS:
                raise ArgsError(f"speculative_algorithm must be one of {', '.join(SPEC_ALGORITHMS)} "
                                f"or {SPEC_OFF} (off), got {self.speculative_algorithm!r}")
            self.speculative_algorithm = algo
            if not self.speculative_draft_model_path:
                raise ArgsError(f"speculative_algorithm={algo} needs speculative_draft_model_path")
        if self.speculative_num_draft_tokens is not None and self.speculative_num_draft_tokens < 2:
            raise ArgsError("speculative_num_draft_tokens must be >= 2, "
                            f"got {self.speculative_num_draft_tokens}")
        if self.speculative_draft_lm_head not in DRAFT_LM_HEADS:
            raise ArgsError(f"speculative_draft_lm_head must be one of {', '.join(DRAFT_LM_HEADS)}, "
                            f"got {self.speculative_draft_lm_head!r}")
        for name in ("max_running_requests", "chunked_prefill_size", "decoding_prefill_chunk_size",
                     "page_size", "cuda_graph_max_bs", "tp_size"):
            if getattr(self, name) < 1:
                raise ArgsError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cuda_graph_max_prefill_tokens < 0:
            raise ArgsError("cuda_graph_max_prefill_tokens must be >= 0 (0: eager prefill), "
                            f"got {self.cuda_graph_max_prefill_tokens}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ArgsError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1:
            if self.tp_size % self.nnodes:
                raise ArgsError(f"tp_size ({self.tp_size}) must be a multiple of nnodes "
                                f"({self.nnodes}): each node runs tp_size / nnodes ranks")
            host, _, port = (self.dist_init_addr or "").rpartition(":")
            if not host or not port.isdigit():
                raise ArgsError("nnodes > 1 needs dist_init_addr HOST:PORT (node 0's "
                                f"rendezvous), got {self.dist_init_addr!r}")
        if self.ep_size not in (1, self.tp_size):
            raise ArgsError(f"ep_size must be 1 or tp_size ({self.tp_size}): experts split over "
                            f"the tensor-parallel ranks, got {self.ep_size}")
        prefix_cache = self.enable_radix_cache and not self.disable_radix_cache
        if prefix_cache and (self.mamba_track_interval < 1
                             or self.mamba_track_interval % self.page_size):
            raise ArgsError(f"mamba_track_interval must be a positive multiple of page_size "
                            f"({self.page_size}), got {self.mamba_track_interval}")
        if self.mamba_cache_slots < 0:
            raise ArgsError(f"mamba_cache_slots must be >= 0, got {self.mamba_cache_slots}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ArgsError(f"max_total_tokens must be >= 1, got {self.max_total_tokens}")
