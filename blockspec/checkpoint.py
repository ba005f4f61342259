"""Reading a model folder: config.json, safetensors shards (memory-mapped), strict name and shape
checks with errors that name the tensor, and a progress bar for large checkpoints."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn
from safetensors import safe_open
from tqdm import tqdm

log = logging.getLogger("blockspec")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16}
PROGRESS_BYTES = 256 << 20


class CheckpointError(ValueError):
    """A model folder that cannot be loaded; the message names the file or tensor."""


def read_config(path: str | Path) -> dict:
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"model path {str(folder)!r} is not a directory")
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"no config.json in {str(folder)!r}")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg}: not valid JSON ({e})") from None


def resolve_dtype(name: str | torch.dtype, config: dict, device: torch.device) -> torch.dtype:
    """'auto' = the checkpoint's dtype on GPUs, float32 on CPU (bf16 matmuls are slow there)."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        cfg_dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
        return DTYPES.get(str(cfg_dtype), torch.bfloat16)
    if name not in DTYPES:
        raise CheckpointError(f"dtype {name!r} is not supported; choose auto, float32, bfloat16 or float16")
    return DTYPES[name]


def shard_files(path: str | Path) -> list[Path]:
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / f for f in weight_map.values()})
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index.name} names shard files that do not exist: {missing}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors weights in {str(folder)!r}")
    return files


class TensorSource:
    """Name -> tensor over all shards of a folder, opened memory-mapped, read on demand."""

    def __init__(self, path: str | Path) -> None:
        self._stack = ExitStack()
        self._where: dict[str, object] = {}
        for f in shard_files(path):
            handle = self._stack.enter_context(safe_open(str(f), framework="pt"))
            for name in handle.keys():
                self._where[name] = handle

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def shape(self, name: str) -> list[int]:
        return list(self._where[name].get_slice(name).get_shape())

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "TensorSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_state(model: nn.Module, source: TensorSource, *,
               rename: Callable[[str], str | None] = lambda n: n,
               what: str = "checkpoint") -> None:
    """Copy every tensor the model expects from ``source``.

    ``rename`` maps a checkpoint name to a model name, or None to skip it silently. Missing
    tensors are an error listing all of them; unexpected ones are logged; a shape mismatch names
    the tensor with expected and found shapes (packed modules can describe logical shapes).
    """
    expected = dict(model.state_dict(keep_vars=True))
    mapping: dict[str, str] = {}
    unexpected: list[str] = []
    for name in source.names():
        target = rename(name)
        if target is None:
            continue
        if target in expected:
            mapping[target] = name
        else:
            unexpected.append(name)
    missing = sorted(set(expected) - set(mapping))
    if missing:
        shown = ", ".join(missing[:50]) + (f" ... ({len(missing)} in all)" if len(missing) > 50 else "")
        raise CheckpointError(f"{what} is missing {len(missing)} tensor(s): {shown}")
    if unexpected:
        log.warning("%s: %d unexpected tensor(s) ignored: %s", what, len(unexpected),
                    ", ".join(sorted(unexpected)[:20]))
    modules = dict(model.named_modules())
    total = sum(t.numel() * t.element_size() for t in expected.values())
    with torch.no_grad():
        for target, name in tqdm(mapping.items(), desc=f"loading {what}", unit="tensor",
                                 disable=total < PROGRESS_BYTES):
            dest = expected[target]
            found = source.shape(name)
            if list(dest.shape) != found:
                raise CheckpointError(_shape_message(modules, target, list(dest.shape), found))
            dest.copy_(source.get(name).to(device=dest.device, dtype=dest.dtype))


def _shape_message(modules: dict[str, nn.Module], target: str, want: list[int], found: list[int]) -> str:
    owner, _, local = target.rpartition(".")
    module = modules.get(owner)
    hook = getattr(module, "logical_shape_message", None)
    detail = hook(local, tuple(found)) if hook is not None else None
    msg = f"tensor '{target}': expected shape {want}, found {found}"
    return f"{msg} ({detail})" if detail else msg


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder (CPU), names as stored: for whole-checkpoint tools such as
    ``blockspec quantize`` that need no model."""
    out: dict[str, torch.Tensor] = {}
    for f in shard_files(path):
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                if name in out:
                    raise CheckpointError(f"tensor {name!r} appears in more than one shard")
                out[name] = handle.get_tensor(name)
    return out


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path,
                 metadata: dict[str, str] | None = None) -> None:
    """save_file that tolerates tensors sharing storage (e.g. one fused global scale)."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    out = {}
    for k, v in tensors.items():
        v = v.contiguous()
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    save_file(out, str(path), metadata={"format": "pt", **(metadata or {})})
