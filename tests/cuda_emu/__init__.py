"""Runs a hand-written CUDA kernel's own source on the CPU (``cuda_emu.h`` says how), so its
indexing, fragment plan, barriers and memory accesses are tested without a GPU.

The kernel file and a small C entry are compiled together by the host C++ compiler (``$CXX``,
else g++) into a shared library, cached by the hash of everything that goes into it.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from blockspec.kernels import w4a16_cuda

HERE = Path(__file__).parent
FLAGS = ["-std=c++17", "-O1", "-shared", "-fPIC", "-DCUDA_EMU"]


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _library(kernel: Path, entry: Path, defines: dict[str, int]) -> ctypes.CDLL:
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("cuda_emu: no C++ compiler (set CXX or install g++)")
    flags = FLAGS + [f"-D{k}={v}" for k, v in sorted(defines.items())]
    key = hashlib.sha256("\0".join(
        [cxx, *flags] + [p.read_text() for p in (HERE / "cuda_emu.h", kernel, entry)]).encode())
    cache = Path(tempfile.gettempdir()) / "blockspec_cuda_emu"
    cache.mkdir(exist_ok=True)
    lib = cache / f"{kernel.stem}_{key.hexdigest()[:16]}.so"
    if not lib.exists():
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run([cxx, *flags, "-I", str(HERE), "-include", "cuda_emu.h",
                               "-x", "c++", str(kernel), "-x", "c++", str(entry), "-o", str(tmp)],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"cuda_emu: {cxx} failed on {kernel.name}:\n{done.stderr[-4000:]}")
        os.replace(tmp, lib)
    return ctypes.CDLL(str(lib))


def _extent(t: torch.Tensor) -> int:
    """Bytes from t's first element to just past its last."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def run_w4a16_cuda(plan: w4a16_cuda.LaunchPlan, reverse: bool = False,
                    source: Path = w4a16_cuda.SOURCE) -> torch.Tensor:
    """Runs ``plan`` (``w4a16_cuda.plan_pairs`` on CPU tensors) on the CPU, threads in
    order or in ``reverse``; raises with the emulator's message when an access or a barrier
    failed. ``source``: the kernel file (a mutated copy, to show a test can fail)."""
    plan.out.fill_(float("nan"))            # rows the kernel should write and does not show
    emulated_launcher(plan, reverse, source)(grid=plan.grid, block=plan.block, args=plan.args)
    return plan.out


def emulated_launcher(plan: w4a16_cuda.LaunchPlan, reverse: bool = False,
                      source: Path = w4a16_cuda.SOURCE):
    """A stand-in for ``w4a16_cuda.launcher(plan, device)``'s kernel: the same call
    (grid, block, args), run by the emulator."""
    lib = _library(source, HERE / "w4a16_cuda_launch.cpp",
                   {"MT": plan.m_tiles, "NT": plan.n_tiles, "KW": plan.k_warps,
                    "PF": plan.prefetch, "KDIM": plan.k})
    fn = lib.emu_w4a16_cuda
    fn.restype = ctypes.c_char_p

    def launch(grid: tuple[int, int, int], block: tuple[int, int, int], args: list) -> None:
        if grid[2] != 1 or block[1:] != (1, 1):
            raise ValueError(f"cuda_emu: grid {grid} / block {block}: only x and y are used")
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        extents = (ctypes.c_longlong * len(tensors))(*[_extent(t) for t in tensors])
        c_args = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor)
                  else ctypes.c_int(a) for a in args]
        err = fn(ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]), ctypes.c_uint(block[0]),
                 ctypes.c_int(int(reverse)), extents, *c_args)
        if err is not None:
            raise RuntimeError(f"cuda_emu: {err.decode()}")

    return launch
