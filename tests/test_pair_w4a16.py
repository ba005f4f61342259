"""``pair_w4a16`` (the W4A16 kernel's per-pair mode, plain and deduplicating) against the
per-pair torch reference.

CPU: the Triton interpreter (exact fp32 decode, so indexing, dedup leaders, splits and the
relu^2 epilogue are what is checked). GPU (``-m gpu``): the compiled kernels at Lightning's
expert shapes, verify-sized token counts, random and shared routing, inside a CUDA graph; the
CUDA kernel (``w4a16_cuda``, up to 16 tokens) at each tile shape, on odd shapes and ids.
"""
import ctypes
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from blockspec.kernels import w4a16 as tw
from blockspec.kernels import w4a16_cuda as tc
from blockspec.kernels.triton_loader import triton_available
from blockspec.quant.nvfp4 import quantize_nvfp4
from blockspec.kernels.w4a16_layout import to_kernel_layout

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not importable")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
gpu = pytest.mark.gpu


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _script(name):
    """A module of scripts/ (they are not a package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _experts(e, n, k, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    packed = [quantize_nvfp4((torch.randn(n, k, generator=g) * 0.05 * (1 + i % 3)).bfloat16())
              for i in range(e)]
    w, s, s2 = (torch.stack([p[j] for p in packed]).to(device) for j in range(3))
    return to_kernel_layout(w), s, s2       # the kernels' layout


def _ids(tokens, topk, e, seed, device="cpu", shared=0):
    """Top-k ids (distinct per token); ``shared`` experts are chosen by every token."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(tokens):
        rest = torch.randperm(e - shared, generator=g)[:topk - shared] + shared
        rows.append(torch.cat([torch.arange(shared), rest])[torch.randperm(topk, generator=g)])
    return torch.stack(rows).to(device)


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@needs_triton
@pytest.mark.parametrize("dedup", [False, True])
@pytest.mark.parametrize("tokens, shared, split", [(1, 0, 1), (3, 2, 1), (5, 1, 2), (4, 3, 1)])
def test_pair_kernel_interpreter(interpreter, dedup, tokens, shared, split):
    e, topk, n, k = 6, 3, 48, 128
    w, s, s2 = _experts(e, n, k, seed=tokens)
    ids = _ids(tokens, topk, e, seed=7 + tokens, shared=shared)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    kw = dict(block_n=16, block_k=64, split_k=split)
    up = tw.pair_w4a16(x, ids, w, s, s2, dedup=dedup, relu2=True, **kw)
    ref_up = tw.pair_w4a16_reference(x, ids, w, s, s2, relu2=True)
    assert up.shape == (tokens * topk, n) and up.dtype == torch.bfloat16
    assert _rel(up, ref_up) <= 1e-2
    assert bool((up >= 0).all())
    # the down projection's form: one x row per pair
    xp = torch.randn(tokens * topk, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    y = tw.pair_w4a16(xp, ids, w, s, s2, x_per_pair=True, dedup=dedup, **kw)
    assert _rel(y, tw.pair_w4a16_reference(xp, ids, w, s, s2, x_per_pair=True)) <= 1e-2


@needs_triton
@pytest.mark.parametrize("dedup, distinct", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("tokens", [1, 3])
def test_shared_parts_ride_in_the_launch_interpreter(interpreter, dedup, distinct, tokens):
    """The stack's last S experts (the shared expert's slices) give every token S more rows,
    for the up form (x per token) and the down form (x per output row)."""
    e, shared, topk, n, k = 7, 2, 2, 32, 64
    w, s, s2 = _experts(e, n, k, seed=3)
    ids = _ids(tokens, topk, e - shared, seed=tokens + 20)     # routed ids only
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(8)).bfloat16()
    kw = dict(block_n=16, block_k=64, dedup=dedup, distinct=distinct, shared_parts=shared)
    up = tw.pair_w4a16(x, ids, w, s, s2, relu2=True, **kw)
    ref = tw.pair_w4a16_reference(x, ids, w, s, s2, relu2=True, shared_parts=shared)
    assert up.shape == (tokens * (topk + shared), n) and _rel(up, ref) <= 1e-2
    # shared rows are the pseudo-experts' own: token t's part s is row T*k + t*S + s
    last = tw.pair_w4a16_reference(x[-1:], torch.full((1, 1), e - 1), w, s, s2, relu2=True)
    assert _rel(up[-1:], last) <= 1e-2
    xp = torch.randn(up.shape[0], k, generator=torch.Generator().manual_seed(9)).bfloat16()
    y = tw.pair_w4a16(xp, ids, w, s, s2, x_per_pair=True, **kw)
    ref = tw.pair_w4a16_reference(xp, ids, w, s, s2, x_per_pair=True, shared_parts=shared)
    assert _rel(y, ref) <= 1e-2


@needs_triton
def test_dedup_keys_repeated_ids_within_a_token(interpreter):
    # not top-k routing, but the key (expert, earlier occurrences in the token) keeps every
    # pair's row: token 0 names expert 2 twice.
    e, n, k = 4, 32, 64
    w, s, s2 = _experts(e, n, k, seed=1)
    ids = torch.tensor([[2, 2, 1], [1, 2, 0]])
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = tw.pair_w4a16(x, ids, w, s, s2, x_per_pair=True, dedup=True, block_n=16, block_k=64)
    assert _rel(y, tw.pair_w4a16_reference(x, ids, w, s, s2, x_per_pair=True)) <= 1e-2


def test_pair_input_checks():
    w, s, s2 = _experts(2, 16, 64, seed=0)
    ids = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="x has 3 rows, expected 2"):
        tw.pair_w4a16(torch.zeros(3, 64, dtype=torch.bfloat16), ids, w, s, s2)
    with pytest.raises(ValueError, match="one per output row"):
        tw.pair_w4a16(torch.zeros(2, 64, dtype=torch.bfloat16), ids, w, s, s2, x_per_pair=True)
    with pytest.raises(ValueError, match="dedup takes at most"):
        tw.pair_w4a16(torch.zeros(17, 64, dtype=torch.bfloat16),
                      torch.zeros(17, 1, dtype=torch.int64), w, s, s2, dedup=True)
    with pytest.raises(ValueError, match="stacked"):
        tw.pair_w4a16(torch.zeros(2, 64, dtype=torch.bfloat16), ids, w[0], s[0], s2[0])


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("n, k", [(1856, 2688), (2688, 1856)])
@pytest.mark.parametrize("tokens, shared", [(1, 0), (4, 0), (6, 0), (6, 4), (10, 6)])
def test_pair_kernel_gpu(n, k, tokens, shared):
    e, topk = 128, 6
    w, s, s2 = _experts(e, n, k, seed=n, device="cuda")
    ids = _ids(tokens, topk, e, seed=tokens, device="cuda", shared=shared)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    xp = torch.randn(tokens * topk, k, device="cuda", dtype=torch.bfloat16)
    ref_up = tw.pair_w4a16_reference(x, ids, w, s, s2, relu2=True)
    ref_dn = tw.pair_w4a16_reference(xp, ids, w, s, s2, x_per_pair=True)
    for dedup in (False, True):
        up = tw.pair_w4a16(x, ids, w, s, s2, relu2=True, dedup=dedup)
        dn = tw.pair_w4a16(xp, ids, w, s, s2, x_per_pair=True, dedup=dedup)
        assert _rel(up, ref_up) <= 1e-2 and _rel(dn, ref_dn) <= 1e-2
    # the MoE's form: top-k ids (distinct) and the last 2 experts as the shared expert's slices
    ids2 = _ids(tokens, topk, e - 2, seed=tokens + 5, device="cuda")
    xs = torch.randn(tokens * (topk + 2), k, device="cuda", dtype=torch.bfloat16)
    for dedup in (False, True):
        kw = dict(dedup=dedup, distinct=True, shared_parts=2)
        up = tw.pair_w4a16(x, ids2, w, s, s2, relu2=True, **kw)
        dn = tw.pair_w4a16(xs, ids2, w, s, s2, x_per_pair=True, **kw)
        assert _rel(up, tw.pair_w4a16_reference(x, ids2, w, s, s2, relu2=True,
                                                 shared_parts=2)) <= 1e-2
        assert _rel(dn, tw.pair_w4a16_reference(xs, ids2, w, s, s2, x_per_pair=True,
                                                 shared_parts=2)) <= 1e-2
    # split-K counters and the dedup leaders replay in a graph with new ids
    graph, static_ids = torch.cuda.CUDAGraph(), ids.clone()
    tw.pair_w4a16(xp, static_ids, w, s, s2, x_per_pair=True, dedup=True)
    with torch.cuda.graph(graph):
        out = tw.pair_w4a16(xp, static_ids, w, s, s2, x_per_pair=True, dedup=True)
    for seed in (11, 12):
        static_ids.copy_(_ids(tokens, topk, e, seed=seed, device="cuda", shared=shared))
        graph.replay()
        ref = tw.pair_w4a16_reference(xp, static_ids, w, s, s2, x_per_pair=True)
        assert _rel(out, ref) <= 1e-2


@needs_triton
@pytest.mark.parametrize("split", [1, 2])
def test_dense_relu2_epilogue_interpreter(interpreter, split):
    w, s, s2 = (t[0] for t in _experts(1, 40, 128, seed=4))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(6)).bfloat16()
    y = tw.w4a16_linear(x, w, s, s2, relu2=True, block_n=16, block_k=64, split_k=split)
    ref = torch.square(torch.relu(tw.w4a16_linear_reference(x, w, s, s2)))
    assert _rel(y, ref) <= 1e-2 and bool((y >= 0).all())
    with pytest.raises(ValueError, match="relu2"):
        tw.w4a16_linear(x, w, s, s2, torch.zeros(40), relu2=True)


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("m", [1, 6])
def test_dense_relu2_epilogue_gpu(m):
    w, s, s2 = (t[0] for t in _experts(1, 3712, 2688, seed=5, device="cuda"))
    x = torch.randn(m, 2688, device="cuda", dtype=torch.bfloat16)
    ref = torch.square(torch.relu(tw.w4a16_linear(x, w, s, s2)))
    assert torch.equal(tw.w4a16_linear(x, w, s, s2, relu2=True), ref)  # same kernel, + epilogue


def test_tile_table_picks_tiles_and_hands_calls_back_to_triton(tmp_path, monkeypatch):
    """The bench's table: a shape's best tile, the next measured token count up (the largest
    past them), FALLBACK_TILE for shapes it lacks, and no CUDA where Triton measured faster."""
    bench = _script("bench_w4a16_cuda")
    picks = [dict(mode="pairs", n=1856, k=2688, tokens=t, best=b, best_us=u, triton_us=9.0)
             for t, b, u in ((1, "cuda 2x4x2", 5.0), (7, "cuda 1x8x1", 8.0), (4, "cuda 2x4x1", 6.0))]
    picks.append(dict(mode="dense", n=2688, k=4096, tokens=8, best="cuda 1x16x1", best_us=7.0,
                      triton_us=6.5))
    table = tmp_path / "tiles.json"
    table.write_text(json.dumps({"entries": bench.table_entries(picks)}))
    monkeypatch.setattr(tc, "TILES", table)
    tc.tile_table.cache_clear()
    try:
        assert [tc.default_tile("pairs", t, 1856, 2688) for t in (1, 2, 4, 5, 7, 16)] == [
            (2, 4, 2), (2, 4, 1), (2, 4, 1), (1, 8, 1), (1, 8, 1), (1, 8, 1)]
        assert tc.default_tile("pairs", 1, 2688, 1856) == tc.FALLBACK_TILE    # not measured
        assert tc.measured_tile("dense", 8, 2688, 4096) == "triton"           # Triton faster
        cuda_x = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16,
                                 device=torch.device("cuda", 0))
        monkeypatch.setattr(tc, "major_capability", lambda index: 9)
        w = torch.zeros(2688, 2048, dtype=torch.uint8)
        assert not tc.cuda_ok(cuda_x, w, 8, "dense")
        assert tc.cuda_ok(cuda_x, w, 8, "pairs")            # the same shape in the other mode
        assert tc.cuda_ok(cuda_x, torch.zeros(4, 1856, 1344, dtype=torch.uint8), 3, "pairs")
    finally:
        tc.tile_table.cache_clear()


def test_cuda_pairs_only_for_cuda_tensors(monkeypatch):
    w, s, s2 = _experts(2, 16, 64, seed=0)
    assert not tc.cuda_ok(torch.zeros(2, 64), w, 2, "pairs")
    # before Hopper (no bf16x2 multiply) the Triton kernel keeps every call
    cuda_x = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, device=torch.device("cuda", 0))
    for major, ok in ((8, False), (9, True), (10, True)):
        monkeypatch.setattr(tc, "major_capability", lambda index, m=major: m)
        assert tc.cuda_ok(cuda_x, w, 2, "pairs") is ok
    with pytest.raises(ValueError, match="x must be bf16, got torch.float16"):
        tc.plan_dense(torch.zeros(2, 64, dtype=torch.float16), w[0], s[0], s2[0].reshape(1),
                      relu2=False)


@gpu
@needs_cuda
@pytest.mark.parametrize("m_tiles, k_warps, prefetch",
                         [(1, 4, 1), (2, 4, 1), (2, 8, 1), (2, 4, 2), (1, 16, 2)])
@pytest.mark.parametrize("n, k", [(200, 320), (1856, 2688)])
@pytest.mark.parametrize("tokens", [1, 5, 8, 9, 16])
def test_cuda_pair_kernel_tiles_gpu(m_tiles, k_warps, prefetch, n, k, tokens):
    """Every tile shape against the reference: N not a multiple of the tile, K an odd number
    of 64-wide units, int32 ids, one or two MMA tiles of tokens, shared slices riding."""
    e, topk, shared = 24, 4, 2
    w, s, s2 = _experts(e, n, k, seed=n + tokens, device="cuda")
    ws2 = s2.reshape(e).float()
    ids = _ids(tokens, topk, e - shared, seed=tokens, device="cuda", shared=1).int()
    rows = tokens * (topk + shared)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    xp = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    kw = dict(distinct=True, shared_parts=shared, rows=rows, m_tiles=m_tiles, k_warps=k_warps,
              prefetch=prefetch)
    up = tc.pair_w4a16_cuda(x, ids, w, s, ws2, x_per_pair=False, relu2=True, **kw)
    dn = tc.pair_w4a16_cuda(xp, ids, w, s, ws2, x_per_pair=True, relu2=False, **kw)
    ref_up = tw.pair_w4a16_reference(x, ids, w, s, s2, relu2=True, shared_parts=shared)
    ref_dn = tw.pair_w4a16_reference(xp, ids, w, s, s2, x_per_pair=True, shared_parts=shared)
    assert up.shape == ref_up.shape and _rel(up, ref_up) <= 1e-2
    assert bool((up >= 0).all())
    assert dn.shape == ref_dn.shape and _rel(dn, ref_dn) <= 1e-2


@gpu
@needs_cuda
@pytest.mark.parametrize("n, k, rows", [(6144, 2688, 8), (2688, 4096, 7), (16384, 2688, 1),
                                        (200, 320, 16)])
def test_cuda_dense_mode_gpu(n, k, rows):
    """``w4a16_linear`` of up to 16 rows on CUDA is the CUDA kernel's dense mode: the draft's
    fused projections (a global scale per output row), a head-like wide N, odd shapes."""
    w, s, s2 = (t[0] for t in _experts(1, n, k, seed=n + rows, device="cuda"))
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    per_row = torch.rand(n, device="cuda") * 1e-2 + 1e-3
    for ws2 in (s2, per_row):
        y = tw.w4a16_linear(x, w, s, ws2)
        assert _rel(y, tw.w4a16_linear_reference(x, w, s, ws2)) <= 1e-2
    # the tile keywords' Triton kernel agrees with it
    assert _rel(tw.w4a16_linear(x, w, s, s2, variant="v2"), tw.w4a16_linear(x, w, s, s2)) <= 1e-2


@gpu
@needs_cuda
def test_cuda_pair_kernel_repeated_ids_and_graph_gpu():
    """Non-top-k ids (an expert twice in a token) keep every pair's row; in a CUDA graph the
    leaders follow ids written between replays."""
    e, n, k = 6, 96, 256
    w, s, s2 = _experts(e, n, k, seed=2, device="cuda")
    ids = torch.tensor([[2, 2, 1], [1, 2, 0], [5, 5, 5]], device="cuda")
    xp = torch.randn(9, k, device="cuda", dtype=torch.bfloat16)
    y = tw.pair_w4a16(xp, ids, w, s, s2, x_per_pair=True, dedup=True)
    assert _rel(y, tw.pair_w4a16_reference(xp, ids, w, s, s2, x_per_pair=True)) <= 1e-2
    static = _ids(7, 4, e, seed=1, device="cuda")
    x = torch.randn(7, k, device="cuda", dtype=torch.bfloat16)
    tw.pair_w4a16(x, static, w, s, s2, dedup=True, distinct=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tw.pair_w4a16(x, static, w, s, s2, dedup=True, distinct=True)
    for seed in (3, 4):
        static.copy_(_ids(7, 4, e, seed=seed, device="cuda"))
        graph.replay()
        assert _rel(out, tw.pair_w4a16_reference(x, static, w, s, s2)) <= 1e-2


def test_nvrtc_found_in_the_pip_wheels(tmp_path):
    """Where torch's loader finds no NVRTC, the newest versioned one of the wheels is used."""
    assert tc.wheel_nvrtc([tmp_path]) is None
    for pkg, name in [("cu12", "libnvrtc.so.12"), ("cu13", "libnvrtc.so.13"),
                      ("cu13", "libnvrtc-builtins.so.13.0"), ("cuda_nvrtc", "libnvrtc.so.9")]:
        (tmp_path / pkg / "lib").mkdir(parents=True, exist_ok=True)
        (tmp_path / pkg / "lib" / name).write_bytes(b"")
    assert tc.wheel_nvrtc([tmp_path]) == tmp_path / "cu13" / "lib" / "libnvrtc.so.13"


def _nvrtc_or_skip() -> ctypes.CDLL:
    if torch.version.cuda:
        from torch.cuda import _utils
        return tc._nvrtc_library(_utils)
    spec = importlib.util.find_spec("nvidia")
    path = tc.wheel_nvrtc([Path(p) for p in spec.submodule_search_locations]) if spec else None
    if path is None:
        pytest.skip("no NVRTC: a CPU torch and no nvidia-cuda-nvrtc wheel")
    return ctypes.CDLL(str(path))


@pytest.mark.parametrize("tile", [(1, 1, 4, 1), (2, 1, 4, 1), (2, 2, 4, 2), (2, 1, 8, 3)])
def test_kernel_compiles_for_hopper(tile, tmp_path):
    """The launch path's own NVRTC compile (no GPU needed, only the library): an sm_90 cubin
    with the kernel's symbol, at Lightning's two expert K, kept in the disk cache; a bad
    option says what failed."""
    lib = _nvrtc_or_skip()
    for k in (2688, 1856):
        cubin = tc.compile_cubin(lib, *tile, k, "sm_90")
        assert cubin[:4] == b"\x7fELF" and b"w4a16_cuda" in cubin
        assert tc.cached_cubin(lib, (*tile, k), "sm_90", tmp_path)[:4] == b"\x7fELF"
    assert len(list(tmp_path.glob("*.cubin"))) == 2
    with pytest.raises(RuntimeError, match="NVRTC failed for sm_0"):
        tc.compile_cubin(lib, *tile, 2688, "sm_0")


class _FakeNvrtc:
    def __init__(self, minor: int = 0):
        self.minor = minor

    def nvrtcVersion(self, major, minor):   # noqa: N802 - NVRTC's name
        major._obj.value, minor._obj.value = 13, self.minor
        return 0


def test_compiled_kernels_are_cached_on_disk(tmp_path, monkeypatch):
    """A second process start reads the cubin instead of compiling it; another shape, arch or
    NVRTC version compiles anew; an unwritable cache still returns the kernel."""
    compiled = []

    def compile_cubin(lib, *shape_arch):
        compiled.append(shape_arch)
        return b"\x7fELF" + repr(shape_arch).encode()

    monkeypatch.setattr(tc, "compile_cubin", compile_cubin)
    shape = (2, 1, 4, 1, 2688)
    first = tc.cached_cubin(_FakeNvrtc(), shape, "sm_90", tmp_path)
    assert tc.cached_cubin(_FakeNvrtc(), shape, "sm_90", tmp_path) == first
    assert len(compiled) == 1 and len(list(tmp_path.glob("*.cubin"))) == 1
    tc.cached_cubin(_FakeNvrtc(), (2, 1, 4, 2, 2688), "sm_90", tmp_path)
    tc.cached_cubin(_FakeNvrtc(), shape, "sm_100", tmp_path)
    tc.cached_cubin(_FakeNvrtc(minor=1), shape, "sm_90", tmp_path)
    assert len(compiled) == 4 and len(list(tmp_path.glob("*.cubin"))) == 4
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert tc.cached_cubin(_FakeNvrtc(), shape, "sm_90", blocked / "cubin") == first
    monkeypatch.setenv("BLOCKSPEC_CACHE_DIR", str(tmp_path / "c"))
    assert tc.cache_dir() == tmp_path / "c" / "cubin"
