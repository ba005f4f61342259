"""EngineArgs (field names = CLI flags, sglang spelling), validation, and attention-backend
resolution as one pure function of (device, capability, speculative mode, model)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

SPEC_ALGORITHMS = ("DFLASH", "DSPARK")


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


@dataclass
class EngineArgs:
    model_path: str | None = None
    tokenizer_path: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    random_seed: int = 0
    max_running_requests: int = 16
    max_total_tokens: int | None = None
    chunked_prefill_size: int = 2048
    page_size: int = 16
    attention_backend: str | None = None
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_draft_attention_backend: str | None = None
    cuda_graph_max_bs: int = 32
    disable_cuda_graph: bool = False
    log_level: str = "warning"
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
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half"):
            raise ArgsError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.speculative_algorithm is not None:
            algo = self.speculative_algorithm.upper()
            if algo not in SPEC_ALGORITHMS:
                raise ArgsError(f"speculative_algorithm must be one of {', '.join(SPEC_ALGORITHMS)}, "
                                f"got {self.speculative_algorithm!r}")
            self.speculative_algorithm = algo
            if not self.speculative_draft_model_path:
                raise ArgsError(f"speculative_algorithm={algo} needs speculative_draft_model_path")
        if self.speculative_num_draft_tokens is not None and self.speculative_num_draft_tokens < 2:
            raise ArgsError("speculative_num_draft_tokens must be >= 2, "
                            f"got {self.speculative_num_draft_tokens}")
        for name in ("max_running_requests", "chunked_prefill_size", "page_size", "cuda_graph_max_bs"):
            if getattr(self, name) < 1:
                raise ArgsError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ArgsError(f"max_total_tokens must be >= 1, got {self.max_total_tokens}")
