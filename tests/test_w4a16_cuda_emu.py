"""The CUDA pair kernel's own source (``kernels/_w4a16_cuda.cu``) run on the CPU by
``tests/cuda_emu`` against ``pair_w4a16_reference``, through the same launch plan the GPU path
uses: every tile shape, one and two MMA tiles of tokens, N not a tile multiple, K units fewer
than the warps splitting them, int32 and int64 ids, repeated ids, threads scheduled in both
orders. Then mutated copies of the kernel, to show these checks fail when the kernel is wrong.
"""
from pathlib import Path

import pytest
import torch

from blockspec.kernels import w4a16 as tw
from blockspec.kernels import w4a16_cuda as tc
from blockspec.kernels.triton_loader import triton_available
from tests import cuda_emu
from tests.test_pair_w4a16 import _experts, _ids, _rel

needs_cxx = pytest.mark.skipif(cuda_emu.compiler() is None, reason="needs a C++ compiler")

E, TOPK, SHARED = 12, 4, 2


def _case(tokens: int, n: int, k: int, seed: int, ids_dtype=torch.int32):
    w, s, s2 = _experts(E, n, k, seed=seed)
    ids = _ids(tokens, TOPK, E - SHARED, seed=seed + tokens, shared=1).to(ids_dtype)
    return w, s, s2, ids


def _run(x, ids, w, s, s2, *, x_per_pair, relu2, distinct=True, shared=SHARED, tile=(2, 4, 1),
         reverse=False, source=tc.SOURCE):
    rows = ids.numel() + ids.shape[0] * shared
    plan = tc.plan_pairs(x, ids, w, s, s2.reshape(-1).float(), x_per_pair=x_per_pair,
                          relu2=relu2, distinct=distinct, shared_parts=shared, rows=rows,
                          m_tiles=tile[0], k_warps=tile[1], prefetch=tile[2])
    return cuda_emu.run_w4a16_cuda(plan, reverse=reverse, source=source)


@needs_cxx
@pytest.mark.parametrize("tile", [(1, 4, 1), (2, 4, 1), (2, 8, 1), (2, 4, 2), (1, 16, 2)])
@pytest.mark.parametrize("tokens", [1, 5, 9, 16])
def test_emulated_kernel_matches_reference(tile, tokens):
    n, k = 200, 448                       # 7 row tiles of 32 (the last one partial), 7 K units
    w, s, s2, ids = _case(tokens, n, k, seed=tile[0] * 10 + tile[1] + tile[2])
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, k, generator=g).bfloat16()
    xp = torch.randn(tokens * (TOPK + SHARED), k, generator=g).bfloat16()
    up = _run(x, ids, w, s, s2, x_per_pair=False, relu2=True, tile=tile)
    ref_up = tw.pair_w4a16_reference(x, ids, w, s, s2, relu2=True, shared_parts=SHARED)
    assert not up.isnan().any(), "a row the kernel owns was never written"
    assert _rel(up, ref_up) <= 1e-2 and bool((up >= 0).all())
    dn = _run(xp, ids, w, s, s2, x_per_pair=True, relu2=False, tile=tile, reverse=tokens > 8)
    ref_dn = tw.pair_w4a16_reference(xp, ids, w, s, s2, x_per_pair=True, shared_parts=SHARED)
    assert not dn.isnan().any() and _rel(dn, ref_dn) <= 1e-2


@needs_cxx
@pytest.mark.parametrize("prefetch", [1, 2, 3])
@pytest.mark.parametrize("k", [2688, 1856])
def test_emulated_kernel_at_lightning_k(k, prefetch):
    """Lightning's expert K (42 and 29 units: 11/11/10/10 and 8/7/7/7 per warp, so the
    buffer ring ends at every position), 7 tokens as a width-7 verify."""
    w, s, s2, ids = _case(7, 48, k, seed=k)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    y = _run(x, ids, w, s, s2, x_per_pair=False, relu2=True, tile=(2, 4, prefetch))
    ref = tw.pair_w4a16_reference(x, ids, w, s, s2, relu2=True, shared_parts=SHARED)
    assert not y.isnan().any() and _rel(y, ref) <= 1e-2


@needs_cxx
def test_emulated_kernel_with_fewer_k_units_than_warps_and_int64_ids():
    """K = 320 is 5 units for 8 warps: three warps own none and must load nothing (the last
    expert's last rows end the weight buffer, so a stray prologue load leaves it)."""
    w, s, s2, ids = _case(6, 200, 320, seed=4, ids_dtype=torch.int64)
    x = torch.randn(6, 320, generator=torch.Generator().manual_seed(1)).bfloat16()
    y = _run(x, ids, w, s, s2, x_per_pair=False, relu2=False, tile=(2, 8, 2))
    assert _rel(y, tw.pair_w4a16_reference(x, ids, w, s, s2, shared_parts=SHARED)) <= 1e-2


@needs_cxx
def test_emulated_kernel_keeps_repeated_ids_apart():
    """Without ``distinct`` the key is (expert, earlier occurrences in the token): token 0
    names expert 2 twice and token 2 names expert 5 three times; every pair keeps its row."""
    w, s, s2 = _experts(6, 96, 256, seed=2)
    ids = torch.tensor([[2, 2, 1], [1, 2, 0], [5, 5, 5]], dtype=torch.int32)
    xp = torch.randn(9, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    for reverse in (False, True):
        y = _run(xp, ids, w, s, s2, x_per_pair=True, relu2=False, distinct=False, shared=0,
                 reverse=reverse)
        assert _rel(y, tw.pair_w4a16_reference(xp, ids, w, s, s2, x_per_pair=True)) <= 1e-2


def _mutant(tmp_path: Path, old: str, new: str) -> Path:
    text = tc.SOURCE.read_text()
    assert text.count(old) == 1, old
    path = tmp_path / "_w4a16_cuda.cu"
    path.write_text(text.replace(old, new))
    return path


@needs_cxx
@pytest.mark.parametrize("old, new", [
    ("xv[4 * hf + 2], 0x5410)", "xv[4 * hf + 2], 0x7610)"),     # x paired with the wrong K
    ("    }\n  __syncthreads();\n  for (int idx", "    }\n  for (int idx"),  # sum too early
    ("e = shared_base + b - npairs;", "e = shared_base;"),        # one slice for every slice
    ("(x_per_pair ? orow : tid)", "(x_per_pair ? tid : orow)"),   # a pair's x row for a token's
])
def test_a_wrong_kernel_fails(tmp_path, old, new):
    w, s, s2, ids = _case(5, 64, 256, seed=7)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    ref = tw.pair_w4a16_reference(x, ids, w, s, s2, shared_parts=SHARED)
    good = _run(x, ids, w, s, s2, x_per_pair=False, relu2=False)
    assert _rel(good, ref) <= 1e-2
    try:
        bad = _run(x, ids, w, s, s2, x_per_pair=False, relu2=False,
                   source=_mutant(tmp_path, old, new))
    except RuntimeError as e:                 # the emulator caught a bad access
        assert "cuda_emu:" in str(e)
    else:
        assert bad.isnan().any() or _rel(bad, ref) > 0.05


@needs_cxx
def test_a_stray_load_is_reported(tmp_path):
    source = _mutant(tmp_path, "if (r < iters) load_rows(", "load_rows(")
    w, s, s2, ids = _case(2, 64, 320, seed=5)
    x = torch.randn(2, 320).bfloat16()
    with pytest.raises(RuntimeError, match=r"ld_w .*outside every buffer; x offset"):
        _run(x, ids, w, s, s2, x_per_pair=False, relu2=False, tile=(2, 8, 1), source=source)


@needs_cxx
def test_a_kernel_that_does_not_compile_says_so(tmp_path):
    source = _mutant(tmp_path, "const int BIG = 0x7fffffff;", "const int BIG = ;")
    w, s, s2, ids = _case(1, 32, 64, seed=1)
    with pytest.raises(RuntimeError, match=r"failed on _w4a16_cuda.cu:[\s\S]*BIG"):
        _run(torch.zeros(1, 64).bfloat16(), ids, w, s, s2, x_per_pair=False, relu2=False,
             source=source)


@needs_cxx
def test_pair_w4a16_dispatches_to_the_kernel_as_planned(monkeypatch):
    """``pair_w4a16`` itself, its CUDA branch taken on CPU tensors and the kernel emulated:
    the arguments it derives (rows, the fp32 global scales, dedup of up to 16 tokens, the
    shared slices, 1-token calls without dedup) reach the kernel right."""
    calls = []

    def emulated(plan, device):
        calls.append(plan)
        return cuda_emu.emulated_launcher(plan)

    monkeypatch.setattr(tw, "cuda_ok", lambda x, w, tokens, mode: 0 < tokens <= 16)
    monkeypatch.setattr(tc, "launcher", emulated)
    w, s, s2 = _experts(E, 64, 256, seed=9)
    wd, sd, s2d = _experts(E, 256, 64, seed=10)
    for tokens, dedup in [(1, False), (7, True), (16, True)]:
        ids = _ids(tokens, TOPK, E - SHARED, seed=tokens)
        x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens)).bfloat16()
        kw = dict(dedup=dedup, distinct=True, shared_parts=SHARED)
        up = tw.pair_w4a16(x, ids, w, s, s2, relu2=True, **kw)
        ref_up = tw.pair_w4a16_reference(x, ids, w, s, s2, relu2=True, shared_parts=SHARED)
        assert up.shape == ref_up.shape and _rel(up, ref_up) <= 1e-2
        dn = tw.pair_w4a16(up, ids, wd, sd, s2d, x_per_pair=True, **kw)
        ref_dn = tw.pair_w4a16_reference(up, ids, wd, sd, s2d, x_per_pair=True,
                                         shared_parts=SHARED)
        assert _rel(dn, ref_dn) <= 1e-2
    assert [p.grid[0] for p in calls] == [1 * TOPK + SHARED] * 2 + [7 * TOPK + SHARED] * 2 + \
        [16 * TOPK + SHARED] * 2
    assert [p.n_tiles for p in calls[::2]] == [1, 1, 2]


@needs_cxx
def test_moe_layer_with_the_shared_expert_riding(monkeypatch):
    """A quantized tiny target's MoE layer on its pair path (the shared expert's slices
    riding in the routed experts' two launches) through the emulated kernel, against its
    reference expert loop plus the shared expert."""
    from blockspec.bench import presets

    launches = []

    def emulated(plan, device):
        launches.append(plan.grid)
        return cuda_emu.emulated_launcher(plan)

    monkeypatch.setattr(tw, "cuda_ok", lambda x, w, tokens, mode: 0 < tokens <= tc.MAX_TOKENS
                        and (w.shape[-1] * 2) % tc.UNIT_K == 0)
    monkeypatch.setattr(tc, "launcher", emulated)
    torch.manual_seed(0)
    model = presets.build_target("tiny", torch.device("cpu"), torch.bfloat16, True)
    moe = next(b.mixer for b in model.backbone.layers if b.kind == "moe")
    assert moe._shared_parts > 0
    for tokens in (1, 7):
        x = torch.randn(tokens, model.cfg.hidden_size).bfloat16()
        with torch.no_grad():
            ids, w = moe.gate(x)
            y = moe.routed_pairs(x, ids, w, None, ride=True)
            ref = moe.routed_reference(x, ids, w, moe.shared_experts(x))
        assert _rel(y, ref) <= 1e-2
    assert len(launches) == 4


def test_kernel_source_ships_with_the_package():
    """The kernel is compiled from its .cu file at run time, so a non-editable install must
    carry it (pyproject's package-data)."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["blockspec"]
    rel = tc.SOURCE.relative_to(root / "blockspec").as_posix()
    assert any(fnmatch.fnmatch(rel, g) for g in globs)


@needs_cxx
@pytest.mark.parametrize("rows", [1, 7, 16])
def test_emulated_dense_mode(rows):
    """``w4a16_linear``'s CUDA branch (the kernel's dense mode: one expert, no ids): one
    global scale or one per output row (q/k/v stacked with their own), relu^2."""
    n, k = 200, 448
    w, s, s2 = (t[0] for t in _experts(1, n, k, seed=rows))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    per_row = torch.rand(n, generator=torch.Generator().manual_seed(1)) * 1e-2 + 1e-3
    for ws2, relu2 in [(s2, True), (per_row, False)]:
        plan = tc.plan_dense(x, w, s, ws2.reshape(-1).float(), relu2=relu2)
        assert plan.grid[0] == 1
        y = cuda_emu.run_w4a16_cuda(plan)
        ref = tw.w4a16_linear_reference(x, w, s, ws2)
        ref = torch.square(torch.relu(ref)) if relu2 else ref
        assert not y.isnan().any() and _rel(y, ref) <= 1e-2


@needs_cxx
@pytest.mark.skipif(not triton_available(), reason="triton not importable")
def test_w4a16_linear_dispatch(monkeypatch):
    """Up to 16 rows with no tile keyword: the CUDA kernel (emulated here); a tile keyword
    asks for the Triton kernel (the tuner's and its tests' way in)."""
    launches = []

    def emulated(plan, device):
        launches.append(plan.grid)
        return cuda_emu.emulated_launcher(plan)

    monkeypatch.setenv("TRITON_INTERPRET", "1")          # the Triton kernel on CPU tensors
    monkeypatch.setattr(tw, "cuda_ok", lambda x, w, tokens, mode: 0 < tokens <= tc.MAX_TOKENS)
    monkeypatch.setattr(tc, "launcher", emulated)
    w, s, s2 = (t[0] for t in _experts(1, 96, 256, seed=3))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    ref = tw.w4a16_linear_reference(x, w, s, s2)
    assert _rel(tw.w4a16_linear(x, w, s, s2), ref) <= 1e-2 and len(launches) == 1
    assert _rel(tw.w4a16_linear(x, w, s, s2, block_n=16, block_k=64), ref) <= 1e-2
    assert len(launches) == 1
