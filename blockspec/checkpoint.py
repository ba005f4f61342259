"""Reading a model folder: config.json, safetensors shards (memory-mapped), strict name and shape
checks with errors that name the tensor, and a progress bar for large checkpoints; the logical
shape of a packed linear weight as stored."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from blockspec.parallel import Shard

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
        raw = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg}: expected a JSON object, got {type(raw).__name__}")
    return raw


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


INDEX_NAME = "model.safetensors.index.json"


def read_index(path: str | Path) -> dict[str, str] | None:
    """The index's weight_map (tensor name -> shard file name), or None without an index."""
    index = Path(path) / INDEX_NAME
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no weight_map (tensor name -> shard file) in it")
    return weight_map


def shard_files(path: str | Path) -> list[Path]:
    folder = Path(path)
    weight_map = read_index(folder)
    if weight_map is not None:
        files = sorted({folder / f for f in weight_map.values()})
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{folder / INDEX_NAME} names shard files that do not exist: "
                                  f"{missing}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors weights in {str(folder)!r}")
    return files


def _open_shard(path: Path):
    """``safe_open`` that turns a broken file into a one-line ``CheckpointError`` naming it."""
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as e:
        raise CheckpointError(f"{path}: {_shard_problem(path, e)}") from None


def _shard_problem(path: Path, error: Exception) -> str:
    """What is wrong with a safetensors file safetensors refused, in words: empty, cut short
    (against the sizes its own header declares), or a header that does not parse."""
    size = path.stat().st_size
    if size == 0:
        return "empty file (0 bytes), not a safetensors shard"
    what = f"not a readable safetensors file ({size} bytes): {error}"
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"only {size} bytes, too short for a safetensors header; cut short?"
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            return (f"cut short: its header alone declares {8 + n} bytes but the file has {size} "
                    "(an interrupted download or copy?)")
        try:
            header = json.loads(fh.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items()
                       if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return what
    if 8 + n + end > size:
        return (f"cut short: its header declares {8 + n + end} bytes but the file has {size} "
                "(an interrupted download or copy?)")
    return what


class TensorSource:
    """Name -> tensor over all shards of a folder, opened memory-mapped, read on demand.
    With an index, every tensor it lists must be in the shard it names."""

    def __init__(self, path: str | Path) -> None:
        self._stack = ExitStack()
        self._where: dict[str, object] = {}
        self._file: dict[str, Path] = {}
        try:
            for f in shard_files(path):
                handle = self._stack.enter_context(_open_shard(f))
                for name in handle.keys():
                    if name in self._where:
                        raise CheckpointError(f"tensor {name!r} is in both {self._file[name]} "
                                              f"and {f}")
                    self._where[name] = handle
                    self._file[name] = f
            _check_index(Path(path), self._file)
        except BaseException:
            self._stack.close()
            raise

    def names(self) -> list[str]:
        return list(self._where)

    def file_of(self, name: str) -> Path:
        return self._file[name]

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def shape(self, name: str) -> list[int]:
        return list(self._where[name].get_slice(name).get_shape())

    def get_shard(self, name: str, shard: Shard) -> torch.Tensor:
        """Only ``shard``'s part of a tensor (tensor parallelism): the file is sliced, never
        read whole."""
        part = self._where[name].get_slice(name)
        return shard.read(part, list(part.get_shape()))

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "TensorSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_index(folder: Path, found: dict[str, Path]) -> None:
    weight_map = read_index(folder)
    if weight_map is None:
        return
    wrong = [(name, shard) for name, shard in weight_map.items()
             if found.get(name) != folder / shard]
    if wrong:
        shown = ", ".join(f"{n!r} -> {s}" for n, s in wrong[:10])
        more = f" ... ({len(wrong)} in all)" if len(wrong) > 10 else ""
        raise CheckpointError(f"{folder / INDEX_NAME} lists tensor(s) that their shard does not "
                              f"hold: {shown}{more}")


def load_state(model: nn.Module, source: TensorSource, *,
               rename: Callable[[str], str | None] = lambda n: n,
               what: str = "checkpoint",
               shard: Callable[[str], Shard | None] = lambda n: None) -> None:
    """Copy every tensor the model expects from ``source``.

    ``rename`` maps a checkpoint name to a model name, or None to skip it silently. Missing
    tensors are an error listing all of them; unexpected ones are logged; a shape mismatch names
    the tensor with expected and found shapes (packed modules can describe logical shapes).
    ``shard`` maps a model name to the part of the tensor this tensor-parallel rank holds
    (None: all of it); only that part is read.
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
            part = shard(target) if found else None
            if part is not None:
                found = part.local_shape(found)
            if list(dest.shape) != found:
                raise CheckpointError(_shape_message(modules, target, list(dest.shape), found))
            if part is not None and part.zero:
                dest.zero_()
                continue
            tensor = source.get(name) if part is None else source.get_shard(name, part)
            problem = _dtype_problem(dest.dtype, tensor.dtype)
            if problem:
                raise CheckpointError(f"{source.file_of(name)}: tensor {name!r} {problem}")
            dest.copy_(tensor.to(device=dest.device, dtype=dest.dtype))


PLAIN_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _dtype_problem(want: torch.dtype, found: torch.dtype) -> str | None:
    """Casts among plain floats only change precision (a bf16 file run in fp32) and are fine.
    Anything else must match exactly: cast, packed or integer data would turn into numbers it
    never meant, and an FP8 weight would lose the scale that gives it its value."""
    if found == want or (found in PLAIN_FLOATS and want in PLAIN_FLOATS):
        return None
    if want in PLAIN_FLOATS:
        return (f"has dtype {found}, but the config makes it a plain {want} weight (only a "
                "quantization config, hf_quant_config.json or quantization_config, that covers "
                "it can make it anything else)")
    if found in PLAIN_FLOATS:
        return (f"has dtype {found}, but the quantization config makes it a {want} tensor "
                "(packed or FP8): the file holds it unquantized")
    return f"has dtype {found}, but the config makes it {want}"


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
    with TensorSource(path) as src:
        return {name: src.get(name) for name in src.names()}


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path,
                 metadata: dict[str, str] | None = None) -> None:
    """save_file that tolerates tensors sharing storage (e.g. one fused global scale)."""
    seen: set[int] = set()
    out = {}
    for k, v in tensors.items():
        v = v.contiguous()
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    save_file(out, str(path), metadata={"format": "pt", **(metadata or {})})


def _pack_factor(module: nn.Module) -> int | None:
    """Values per stored element of a (possibly packed) linear weight, None when unpacked."""
    pf = getattr(module, "pack_factor", None)
    w = getattr(module, "weight", None)
    if pf is None and w is not None:
        pf = getattr(w, "pack_factor", None)
    if pf is None and isinstance(w, torch.Tensor) and w.dtype == torch.uint8:
        pf = 2                      # NVFP4: two E2M1 codes per byte
    return int(pf) if pf is not None else None


def logical_linear_weight_shape(module: nn.Module, loaded: torch.Tensor | Sequence[int],
                                output_features: int) -> tuple[int, ...]:
    """Logical [out, in] shape of a loaded (possibly packed) linear weight (NVFP4 packs two codes per byte).

    If the module's weight is not packed, or the loaded tensor's shape differs from the
    module's storage shape, the loaded shape is returned unchanged.  Otherwise the loaded
    numel times the pack factor is reshaped to ``(output_features, numel // output_features)``
    (``(numel,)`` if that does not divide).
    """
    shape = tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(int(s) for s in loaded)
    w = getattr(module, "weight", None)
    pf = _pack_factor(module)
    if pf is None or not isinstance(w, torch.Tensor) or tuple(w.shape) != shape:
        return shape
    numel = 1
    for s in shape:
        numel *= s
    logical = numel * pf
    if output_features > 0 and logical % output_features == 0:
        return (output_features, logical // output_features)
    return (logical,)
