"""The W4A16 NVFP4 kernel for calls of up to 16 bf16 rows, in CUDA (``_w4a16_cuda.cu``,
which says why): MoE pairs (each distinct expert of the call's tokens read once, straight into
mma.sync registers) and, in its dense mode, ``w4a16_linear`` calls.

Compiled at first use by NVRTC (the library torch's CUDA wheels ship) into a cubin per tile
shape, K and device, kept on disk between runs, and launched through the driver on torch's
current stream, so CUDA graphs capture it like any kernel. CPU tensors and the Triton
interpreter never come here (``w4a16.py`` sends them to its Triton kernel); the references
there are the oracle its GPU tests compare against, and CPU tests run the kernel's own source
through tests/cuda_emu.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from blockspec.kernels.triton_loader import interpreting, major_capability

SOURCE = Path(__file__).with_name("_w4a16_cuda.cu")
MAX_TOKENS = 16          # two n8 MMA tiles of tokens
UNIT_K = 64              # K per thread-quad step: one scale group per lane


# the measured tile per call shape (scripts/bench_w4a16_cuda.py --write-table): absent, every
# call of up to MAX_TOKENS rows takes the CUDA kernel at FALLBACK_TILE
TILES = Path(__file__).with_name("w4a16_cuda_tiles.json")
FALLBACK_TILE = (2, 4, 1)


def cuda_ok(x: torch.Tensor, weight: torch.Tensor, tokens: int, mode: str) -> bool:
    """Whether a W4A16 call (``mode`` "pairs" or "dense"; weight [..., N, K/2]) runs here: bf16
    CUDA activations (the MMA's type; fp16 stays with the Triton kernel) on sm_90 or later
    (the decode's bf16x2 multiplies), at most ``MAX_TOKENS`` tokens, K a multiple of
    ``UNIT_K``, and not a shape where the tile table measured the Triton kernel faster."""
    k = weight.shape[-1] * 2
    return (x.is_cuda and x.dtype == torch.bfloat16 and not interpreting()
            and 0 < tokens <= MAX_TOKENS and k % UNIT_K == 0
            and major_capability(x.device.index) >= 9
            and measured_tile(mode, tokens, weight.shape[-2], k) != "triton")


def default_tile(mode: str, tokens: int, n: int, k: int) -> tuple[int, int, int]:
    """(m_tiles, k_warps, prefetch) for ``tokens`` rows of an [N, K] weight: 16-row MMA tiles
    per warp, warps splitting K in a CTA, and 64-K units each warp keeps loading ahead of
    the one it decodes; the tile table's where it has the shape, else ``FALLBACK_TILE``."""
    tile = measured_tile(mode, tokens, n, k)
    return tile if isinstance(tile, tuple) else FALLBACK_TILE


def measured_tile(mode: str, tokens: int, n: int, k: int) -> tuple[int, int, int] | str | None:
    """The table's answer for a call: its best CUDA tile, "triton" where the Triton kernel
    was faster, None for a shape it does not have. Token counts between the measured ones
    take the next measured count up (the largest past them)."""
    rows = tile_table().get((mode, n, k))
    if not rows:
        return None
    return next((t for m, t in rows if m >= tokens), rows[-1][1])


@functools.lru_cache(maxsize=1)
def tile_table() -> dict[tuple[str, int, int], list[tuple[int, tuple[int, int, int] | str]]]:
    """``TILES`` as {(mode, N, K): [(tokens, tile or "triton"), ...] by tokens}."""
    if not TILES.is_file():
        return {}
    table: dict = {}
    for e in json.loads(TILES.read_text())["entries"]:
        tile = tuple(e["tile"]) if e["tile"] else "triton"
        table.setdefault((e["mode"], e["n"], e["k"]), []).append((e["tokens"], tile))
    return {key: sorted(rows) for key, rows in table.items()}


@functools.lru_cache(maxsize=None)
def _kernel(m_tiles: int, n_tiles: int, k_warps: int, prefetch: int, k: int, device: int):
    """NVRTC -> cubin -> driver function, cached per tile shape, K and device."""
    from torch.cuda import _utils as cuda_utils  # lazy: torch's NVRTC bindings, CUDA use only
    major, minor = torch.cuda.get_device_capability(device)
    cubin = cached_cubin(_nvrtc_library(cuda_utils), (m_tiles, n_tiles, k_warps, prefetch, k),
                         f"sm_{major}{minor}", cache_dir())
    with torch.cuda.device(device):
        return cuda_utils._cuda_load_module(cubin, ["w4a16_cuda"])["w4a16_cuda"]


def cache_dir() -> Path:
    """Where compiled kernels are kept between runs: ``$BLOCKSPEC_CACHE_DIR/cubin``, else
    ``~/.cache/blockspec/cubin``."""
    root = os.environ.get("BLOCKSPEC_CACHE_DIR") or Path.home() / ".cache" / "blockspec"
    return Path(root) / "cubin"


def cached_cubin(lib: ctypes.CDLL, shape: tuple[int, int, int, int, int], arch: str,
                 cache: Path) -> bytes:
    """``compile_cubin(lib, *shape, arch)`` through files in ``cache``, keyed by the source, the
    shape, the arch and NVRTC's version: a process start reuses them instead of compiling
    each tile shape again (a few hundred ms each). An unwritable cache only costs that."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    key = hashlib.sha256(f"{shape} {arch} nvrtc {major.value}.{minor.value}\n".encode()
                         + SOURCE.read_bytes()).hexdigest()[:24]
    path = cache / f"w4a16_cuda_{key}.cubin"
    if path.is_file():
        return path.read_bytes()
    cubin = compile_cubin(lib, *shape, arch)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        os.replace(tmp, path)
    except OSError:
        pass
    return cubin


def compile_cubin(lib: ctypes.CDLL, m_tiles: int, n_tiles: int, k_warps: int, prefetch: int,
                  k: int, arch: str) -> bytes:
    """The kernel for one tile shape and K, compiled by NVRTC (``lib``) for ``arch``."""
    return nvrtc_cubin(lib, f"#define MT {m_tiles}\n#define NT {n_tiles}\n#define KW {k_warps}\n"
                       f"#define PF {prefetch}\n#define KDIM {k}\n" + SOURCE.read_text(), arch)


def nvrtc_cubin(lib: ctypes.CDLL, src: str, arch: str) -> bytes:
    """CUDA source -> cubin for ``arch`` (e.g. "sm_90") by NVRTC (``lib``); the compile log
    in the error when it fails."""
    prog = ctypes.c_void_p()
    _nvrtc(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"w4a16_cuda.cu",
                                       0, None, None), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
        if lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)):
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"w4a16_cuda: NVRTC failed for {arch}:\n"
                               f"{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _nvrtc(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _nvrtc(lib, lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvrtc_library(cuda_utils) -> ctypes.CDLL:
    """torch's NVRTC loader, else the pip CUDA wheels' own library (``wheel_nvrtc``)."""
    try:
        return (getattr(cuda_utils, "_get_gpu_rtc_library", None)
                or cuda_utils._get_nvrtc_library)()
    except OSError:
        spec = importlib.util.find_spec("nvidia")
        path = wheel_nvrtc([Path(p) for p in (spec.submodule_search_locations or [])]
                           if spec else [])
        if path is None:
            raise RuntimeError("w4a16_cuda: no NVRTC library: torch's loader found none and "
                               "no nvidia/*/lib/libnvrtc.so.* is installed") from None
        return ctypes.CDLL(str(path))


def wheel_nvrtc(roots: list[Path]) -> Path | None:
    """The newest ``nvidia/<package>/lib/libnvrtc.so.<major>`` under the ``nvidia`` package's
    folders ``roots``: older torch asks only for an unversioned ``libnvrtc.so``, which the
    pip CUDA wheels do not ship."""
    found = [p for r in roots for p in r.glob("*/lib/libnvrtc.so.*")]
    return max(found, key=lambda p: [int(v) for v in p.name.split(".so.")[1].split(".")
                                      if v.isdigit()], default=None)


def _nvrtc(lib, status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"w4a16_cuda: {what} returned NVRTC status {status}")


@dataclass(frozen=True)
class LaunchPlan:
    """One launch of the kernel: its compile-time shape, grid, block and arguments (tensors
    as they are passed) and the bf16 output they fill. CPU tests run the same plan through
    the kernel's CPU emulation (tests/cuda_emu)."""
    m_tiles: int
    n_tiles: int
    k_warps: int
    prefetch: int
    k: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: list
    out: torch.Tensor


def plan_pairs(x: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor,
                weight_scale: torch.Tensor, ws2: torch.Tensor, *, x_per_pair: bool,
                relu2: bool, distinct: bool, shared_parts: int, rows: int,
                m_tiles: int | None = None, k_warps: int | None = None,
                prefetch: int | None = None) -> LaunchPlan:
    """``pair_w4a16`` with ``dedup`` (arguments checked there; ``ws2`` fp32 [E], ``rows`` the
    result's rows) as a launch of the kernel, its output allocated on x's device."""
    tokens, topk = ids.shape
    ids = ids.contiguous()
    return _plan(x, ids, 2 if ids.dtype == torch.int64 else 1, weight, weight_scale, ws2,
                 tokens=tokens, topk=topk, blocks=tokens * topk + shared_parts, rows=rows,
                 shared_parts=shared_parts, x_per_pair=x_per_pair, relu2=relu2,
                 distinct=distinct, ws2_rows=False, tile=(m_tiles, k_warps, prefetch),
                 mode="pairs")


def plan_dense(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               ws2: torch.Tensor, *, relu2: bool, m_tiles: int | None = None,
               k_warps: int | None = None, prefetch: int | None = None) -> LaunchPlan:
    """``w4a16_linear`` of ``x`` [M <= ``MAX_TOKENS``, K] as the kernel's dense mode: the
    weight [N, K/2] is its one expert and every row of x a token (no ids: ``ids_step`` 0, and
    ws2 stands in for the pointer, never read); ``ws2`` fp32, one global scale or one per
    output row (a fused stack of siblings)."""
    return _plan(x, ws2, 0, weight[None], weight_scale[None], ws2, tokens=x.shape[0], topk=1,
                 blocks=1, rows=x.shape[0], shared_parts=0, x_per_pair=False, relu2=relu2, distinct=True,
                 ws2_rows=ws2.numel() > 1, tile=(m_tiles, k_warps, prefetch), mode="dense")


def _plan(x: torch.Tensor, ids: torch.Tensor, ids_step: int, weight: torch.Tensor,
          weight_scale: torch.Tensor, ws2: torch.Tensor, *, tokens: int, topk: int, blocks: int,
          rows: int, shared_parts: int, x_per_pair: bool, relu2: bool, distinct: bool,
          ws2_rows: bool, tile: tuple[int | None, int | None, int | None],
          mode: str) -> LaunchPlan:
    e, n, half_k = weight.shape
    k = half_k * 2
    mt, kw, pf = (a or b for a, b in zip(tile, default_tile(mode, tokens, n, k)))
    if x.dtype != torch.bfloat16:
        raise ValueError(f"w4a16_cuda: x must be bf16, got {x.dtype}")
    x = x.contiguous()
    if x.data_ptr() % 16 or k % 8:
        x = x.clone()                      # 16-byte loads of x
    weight = weight.contiguous()
    if weight.data_ptr() % 8:
        weight = weight.clone()
    scale = weight_scale.view(torch.uint8).contiguous()
    ws2 = ws2.contiguous()
    out = torch.empty((rows, n), dtype=torch.bfloat16, device=x.device)
    args = [x, ids, ids_step, weight, scale, ws2, out, tokens, topk, n, shared_parts,
            e - shared_parts, int(x_per_pair), int(relu2), int(distinct), int(ws2_rows),
            x.stride(0), weight.stride(0), scale.stride(0), out.stride(0)]
    return LaunchPlan(mt, 1 if tokens <= 8 else 2, kw, pf, k, (blocks, -(-n // (16 * mt)), 1),
                      (32 * kw, 1, 1), args, out)


def pair_w4a16_cuda(x: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor,
                    weight_scale: torch.Tensor, ws2: torch.Tensor, **kwargs) -> torch.Tensor:
    """``plan_pairs``'s launch on x's CUDA device -> ``[rows, N]`` bf16."""
    plan = plan_pairs(x, ids, weight, weight_scale, ws2, **kwargs)
    launcher(plan, x.device)(grid=plan.grid, block=plan.block, args=plan.args)
    return plan.out


def dense_w4a16_cuda(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     ws2: torch.Tensor, **kwargs) -> torch.Tensor:
    """``plan_dense``'s launch on x's CUDA device -> ``[M, N]`` bf16."""
    plan = plan_dense(x, weight, weight_scale, ws2, **kwargs)
    launcher(plan, x.device)(grid=plan.grid, block=plan.block, args=plan.args)
    return plan.out


def launcher(plan: LaunchPlan, device: torch.device):
    """The compiled kernel for ``plan``'s shape on ``device`` (CPU tests put the emulator's
    launch here)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _kernel(plan.m_tiles, plan.n_tiles, plan.k_warps, plan.prefetch, plan.k, index)
