"""Loading Triton kernel files once per mode.

Triton decides at decoration time whether a kernel is compiled or interpreted
(``TRITON_INTERPRET=1``), and resolves helper functions through module globals. So every
kernel file is a plain module of ``@triton.jit`` functions, loaded here as a separate module
object per mode; launchers ask for the mode the current process is in. Kernel files avoid the
standard library's jitted helpers (``tl.sum``, ``tl.max``, ``tl.zeros``, ``tl.cdiv``,
``tl.sigmoid``), which break in the interpreter when triton was imported before the variable
was set, and use ``tl.reduce`` with their own combine functions instead. Sums, running sums
(``tl.associative_scan``) and maxima pass ``tl.standard._sum_combine`` / ``_elementwise_max``:
the same code as a local combine when compiled, and the interpreter recognises them and uses
numpy rather than one Python call per element (seconds a launch on the tests' shapes).
"""
from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from types import ModuleType

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _load(path: str, interpret: bool) -> ModuleType:
    name = f"blockspec.kernels._loaded_{Path(path).stem}_{int(interpret)}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_kernels(path: str | Path) -> ModuleType:
    """The kernel module at ``path`` for the current mode."""
    return _load(str(path), interpreting())


@functools.lru_cache(maxsize=None)
def major_capability(index: int | None) -> int:
    """CUDA device ``index``'s major compute capability, asked once (launchers that pick a
    kernel or a launch feature by architecture call it per launch)."""
    return torch.cuda.get_device_capability(index)[0]


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    """Whether ``import triton`` works (the compiler, or the interpreter on CPU): the one place
    that tries it. The engine asks this to offer the Triton attention backend."""
    try:
        # lazy: triton is optional (CPU-only installs may lack it); imported to test for it
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def triton_available() -> bool:
    """Triton kernels may run: triton imports, unless BLOCKSPEC_DISABLE_TRITON=1 asks for the
    torch references everywhere (to compare the two paths). Callers that also check the device
    and dtype themselves use this; ``use_triton`` adds the common checks."""
    if os.environ.get("BLOCKSPEC_DISABLE_TRITON", "0") not in ("", "0"):
        return False
    return triton_importable()


def use_triton(x: torch.Tensor) -> bool:
    """Fast paths run on CUDA tensors when ``triton_available()`` and no gradient is wanted
    (the kernels have no backward; training runs the references)."""
    if not x.is_cuda or torch.is_grad_enabled():
        return False
    return triton_available()


def next_pow2(n: int, at_least: int = 1) -> int:
    """The smallest power of two >= max(n, at_least): Triton block shapes are powers of two."""
    return max(at_least, 1 << max(0, n - 1).bit_length())


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device, cpu: int) -> int:
    """Streaming multiprocessors of a CUDA device (work splits aim at a few waves of them);
    ``cpu`` stands in under the interpreter, where it only shapes the tests' launches."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return cpu
