"""Triton W4A16 kernels against the pure-torch reference.

CPU: runs through the Triton interpreter (TRITON_INTERPRET=1) when triton is importable; every
v2 variant runs the same exact fp32 decode there, so the CPU tests check indexing, splits and
masks, not the PTX decode.
GPU (``-m gpu``): every variant compiled (the inline-PTX decode included) on Lightning shapes,
odd N and K = 16 * odd, dense and grouped, bf16, relative error <= 1e-2.
"""
import functools

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from blockspec.kernels import tile_counters as tile_counters_mod
from blockspec.kernels import w4a16 as tw
from blockspec.kernels.triton_loader import triton_available
from blockspec.layers.moe import sort_by_expert
from blockspec.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from blockspec.kernels.w4a16_layout import from_kernel_layout, to_kernel_layout

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not importable")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _weights(n, k, seed, scale=0.05, device="cpu", experts=None):
    """Random NVFP4 weights, packed in the kernel's layout (what the kernels take)."""
    g = torch.Generator().manual_seed(seed)
    if experts is None:
        w = (torch.randn(n, k, generator=g) * scale).bfloat16()
        p, s, s2 = quantize_nvfp4(w)
        return to_kernel_layout(p).to(device), s.to(device), s2.to(device)
    ps, ss, s2s = [], [], []
    for e in range(experts):
        w = (torch.randn(n, k, generator=g) * scale * (1 + e % 3)).bfloat16()
        p, s, s2 = quantize_nvfp4(w)
        ps.append(p), ss.append(s), s2s.append(s2)
    return (to_kernel_layout(torch.stack(ps)).to(device), torch.stack(ss).to(device),
            torch.stack(s2s).to(device))


def _exact(p, s, s2, dtype):
    """The exactly dequantized weight of kernel-layout packed ``p``."""
    return dequantize_nvfp4(from_kernel_layout(p), s, s2, dtype)


def test_expert_blocks_cover_rows_without_straddling():
    offsets = torch.tensor([0, 3, 3, 20, 21])
    ex, r0, r1, nb = tw.expert_blocks(offsets, 21, 8)
    covered = []
    for e, a, b in zip(ex.tolist(), r0.tolist(), r1.tolist()):
        if a == b:
            continue
        assert offsets[e] <= a < b <= offsets[e + 1] and b - a <= 8
        covered.extend(range(a, b))
    assert sorted(covered) == list(range(21))
    assert nb == ex.numel()


def test_sort_by_expert():
    topk = torch.tensor([[2, 0], [2, 3], [1, 2]])
    order, offsets = sort_by_expert(topk, 5)
    assert offsets.tolist() == [0, 1, 2, 5, 6, 6]
    assert topk.reshape(-1)[order].tolist() == [0, 1, 2, 2, 2, 3]


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@needs_triton
@pytest.mark.parametrize("m, n, k, split_k, block_k", [
    (1, 48, 64, None, 64), (5, 40, 96, 2, 64), (20, 70, 160, 3, 64), (33, 24, 32, 1, 64),
])
def test_dense_kernel_interpreter(interpreter, m, n, k, split_k, block_k):
    p, s, s2 = _weights(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).bfloat16()
    y = tw.w4a16_linear(x, p, s, s2, split_k=split_k, block_k=block_k, block_n=32)
    ref = tw.w4a16_linear_reference(x, p, s, s2)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert _rel(y, ref) <= 1e-2
    # the bf16 weight tile is the exact dequantized weight: only summation order differs
    exact = x.float() @ _exact(p, s, s2, torch.bfloat16).float().T
    assert _rel(y, exact) <= 4e-3


@needs_triton
@pytest.mark.parametrize("variant", ["v2", "v2w"])
def test_dense_kernel_bias_and_leading_dims(interpreter, variant):
    p, s, s2 = _weights(32, 64, seed=3)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    bias = torch.randn(32).bfloat16()
    y = tw.w4a16_linear(x, p, s, s2, bias, variant=variant, block_k=64, block_n=64)
    ref = tw.w4a16_linear_reference(x, p, s, s2, bias)
    assert y.shape == (2, 3, 32) and _rel(y, ref) <= 1e-2


@needs_triton
def test_grouped_kernel_interpreter(interpreter):
    w, s, s2 = _weights(40, 64, seed=11, experts=5)
    counts = [3, 0, 17, 1, 0]
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist())
    x = torch.randn(sum(counts), 64, generator=torch.Generator().manual_seed(9)).bfloat16()
    for split in (1, 2):
        y = tw.grouped_w4a16(x, offsets, w, s, s2, block_k=64, block_n=16, split_k=split)
        ref = tw.grouped_w4a16_reference(x, offsets, w, s, s2)
        assert _rel(y, ref) <= 1e-2
        for e in (0, 2, 3):  # each expert's rows really used its own weights
            a, b = offsets[e].item(), offsets[e + 1].item()
            assert _rel(y[a:b], tw.w4a16_linear_reference(x[a:b], w[e], s[e], s2[e])) <= 1e-2


@needs_triton
@pytest.mark.parametrize("variant", ["v2", "v2w"])
@pytest.mark.parametrize("m, n, k, cfg", [
    (1, 48, 64, {"block_n": 16, "block_k": 64}),
    (5, 40, 96, {"split_k": 2, "block_k": 64}),        # K = 16 * 6: masked K block
    (20, 70, 176, {"split_k": 3, "block_n": 32, "block_k": 64}),  # odd N, K = 16 * 11
    (3, 64, 256, {"k_slices": 2, "block_n": 32, "block_k": 64}),  # batched K slices (v2)
    (3, 64, 384, {"split_k": 2}),                      # scales read as int32 words
    (33, 128, 128, {}),                                # default config: swapped, BLOCK_M = 32
])
def test_dense_v2_interpreter(interpreter, variant, m, n, k, cfg):
    if variant == "v2w":
        if cfg.get("k_slices", 1) != 1:
            pytest.skip("v2w has no K slices")
        cfg = {**cfg, "block_n": 64}
    p, s, s2 = _weights(n, k, seed=m + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    y = tw.w4a16_linear(x, p, s, s2, variant=variant, **cfg)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    # v2 multiplies exact E2M1 * E4M3 products and applies weight_scale_2 in fp32: against the
    # exact fp32 product only the bf16 output rounding remains.
    exact = x.float() @ _exact(p, s, s2, torch.float32).T
    assert _rel(y, exact) <= 3e-3
    assert _rel(y, tw.w4a16_linear_reference(x, p, s, s2)) <= 1e-2


def _stacked_rows(parts):
    """Sibling weights stacked by rows, with one global scale per row."""
    return (torch.cat([p for p, _, _ in parts]), torch.cat([s for _, s, _ in parts]),
            torch.cat([s2.reshape(1).expand(p.shape[0]) for p, _, s2 in parts]))


@needs_triton
@pytest.mark.parametrize("m, cfg", [(3, {"block_n": 32, "block_k": 64}),
                                    (5, {"split_k": 2, "block_n": 32, "block_k": 64}),
                                    (33, {})])
def test_dense_per_row_global_scale_interpreter(interpreter, m, cfg):
    """Three projections with their own weight_scale_2, stacked by rows: one call with a
    global scale per row gives each projection's own product (split-K and the swapped
    large-M form included), and a wrong count of scales is refused."""
    parts = [_weights(n, 128, seed=20 + i, scale=0.05 * (1 + 3 * i))
             for i, n in enumerate((64, 32, 32))]
    assert len({float(s2) for _, _, s2 in parts}) == 3
    p, s, s2 = _stacked_rows(parts)
    x = torch.randn(m, 128, generator=torch.Generator().manual_seed(9)).bfloat16()
    y = tw.w4a16_linear(x, p, s, s2, **cfg)
    exact = torch.cat([x.float() @ _exact(pp, ss, ss2, torch.float32).T for pp, ss, ss2 in parts],
                      dim=-1)
    assert y.shape == (m, 128) and _rel(y, exact) <= 3e-3
    for lo, hi in ((0, 64), (64, 96), (96, 128)):   # each projection on its own scale
        assert _rel(y[:, lo:hi], exact[:, lo:hi]) <= 3e-3
    torch.testing.assert_close(tw.w4a16_linear_reference(x, p, s, s2).float(),
                               exact.bfloat16().float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="one per output row"):
        tw.w4a16_linear(x, p, s, s2[:100])


@needs_triton
@pytest.mark.parametrize("variant", ["v2", "v2w"])
def test_grouped_v2_interpreter(interpreter, variant):
    w, s, s2 = _weights(64, 128, seed=12, experts=5)
    counts = [3, 0, 17, 1, 0]
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist())
    x = torch.randn(sum(counts), 128, generator=torch.Generator().manual_seed(9)).bfloat16()
    ref = tw.grouped_w4a16_reference(x, offsets, w, s, s2)
    for split in (1, 2):
        y = tw.grouped_w4a16(x, offsets, w, s, s2, variant=variant, block_k=64, block_n=64,
                             split_k=split)
        assert _rel(y, ref) <= 1e-2
        # an expert's up projection: relu^2 in the epilogue, of the rounded result
        y2 = tw.grouped_w4a16(x, offsets, w, s, s2, variant=variant, block_k=64, block_n=64,
                              split_k=split, relu2=True)
        assert _rel(y2, torch.square(torch.relu(ref))) <= 1e-2 and bool((y2 >= 0).all())


@needs_triton
def test_grouped_offsets_cover_the_first_experts_of_a_longer_stack(interpreter):
    """The MoE's stacks end in the shared expert's slices: offsets over the routed experts
    alone run against the first experts of the stack, as against a stack of those alone."""
    w, s, s2 = _weights(32, 64, seed=13, experts=6)
    counts = [2, 0, 5, 1]
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist())
    x = torch.randn(sum(counts), 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    got = tw.grouped_w4a16(x, offsets, w, s, s2, variant="v2", block_k=64, block_n=16)
    ref = tw.grouped_w4a16_reference(x, offsets, w[:4], s[:4], s2[:4])
    assert _rel(got, ref) <= 1e-2
    with pytest.raises(ValueError, match="2 to E\\+1=7 entries"):
        tw.grouped_w4a16(x, torch.zeros(8, dtype=torch.int64), w, s, s2)


def test_variant_selection(monkeypatch):
    monkeypatch.delenv(tw.VARIANT_ENV, raising=False)
    assert tw.default_variant() == "v2"          # picked by the H200 run (docs/benchmarks.md)
    monkeypatch.setenv(tw.VARIANT_ENV, "v2t")
    assert tw.default_variant() == "v2t"
    monkeypatch.setenv(tw.VARIANT_ENV, "v9")
    with pytest.raises(ValueError, match="v9"):
        tw.default_variant()


def test_kernel_input_checks():
    p, s, s2 = _weights(16, 32, seed=1)
    with pytest.raises(ValueError, match="K=48"):
        tw.w4a16_linear(torch.zeros(1, 48), p, s, s2)


# ---------------------------------------------------------------- GPU (run on the H200)
LIGHTNING_SHAPES = [(1856, 2688), (2688, 1856), (3712, 2688), (131072, 2688)]
# N not a multiple of any block, K = 16 * odd (masked K blocks, scale rows of odd length).
ODD_SHAPES = [(1000, 2688), (520, 16 * 77)]
gpu = pytest.mark.gpu


@functools.lru_cache(maxsize=8)
def _gpu_weights(n, k, experts=None):
    """Fresh random NVFP4 weights made on the GPU (the CPU quantizer is slow at lm_head size)."""
    g = torch.Generator(device="cuda").manual_seed(n * 7 + k + (experts or 0))
    shape = (n, k) if experts is None else (experts, n, k)
    w = torch.randn(shape, device="cuda", generator=g) * 0.05
    if experts is not None:
        w = w * (1 + torch.arange(experts, device="cuda") % 3)[:, None, None]
        ps, ss, s2s = zip(*(quantize_nvfp4(w[e].bfloat16()) for e in range(experts)))
        return to_kernel_layout(torch.stack(ps)), torch.stack(ss), torch.stack(s2s)
    p, s, s2 = quantize_nvfp4(w.bfloat16())
    return to_kernel_layout(p), s, s2


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("variant", tw.VARIANTS)
@pytest.mark.parametrize("n, k", LIGHTNING_SHAPES + ODD_SHAPES)
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_dense_kernel_gpu(variant, n, k, m):
    p, s, s2 = _gpu_weights(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = tw.w4a16_linear(x, p, s, s2, variant=variant)
    ref = tw.w4a16_linear_reference(x, p, s, s2)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert _rel(y, ref) <= 1e-2


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("m", [1, 7, 56])
def test_dense_per_row_global_scale_gpu(m):
    """The draft's stacked q/k/v at the published Nemotron 3.5 size: one launch with a global
    scale per row against each projection's own reference."""
    parts = [_gpu_weights(n, 2688) for n in (4096, 1024, 1025)]
    parts[1] = (parts[1][0], parts[1][1], parts[1][2] * 4)   # distinct global scales
    p, s, s2 = _stacked_rows(parts)
    x = torch.randn(m, 2688, device="cuda", dtype=torch.bfloat16)
    y = tw.w4a16_linear(x, p, s, s2)
    ref = torch.cat([tw.w4a16_linear_reference(x, *part) for part in parts], dim=-1)
    for lo, hi in ((0, 4096), (4096, 5120), (5120, 6145)):
        assert _rel(y[:, lo:hi], ref[:, lo:hi]) <= 1e-2


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("variant", tw.VARIANTS)
def test_v2_decode_exact_on_gpu(variant):
    """Every code, subnormal E4M3 block scales and all-zero blocks: each output row must equal
    the exact fp32 product up to the bf16 output rounding (a wrong decode of a rare code or of a
    tiny scale would hide in a whole-matrix norm, so rows are checked one by one)."""
    n, k = 128, 1024
    g = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(n, k, device="cuda", generator=g)
    w[0, 0] = 400.0                       # sets weight_scale_2
    w[1:32] *= torch.logspace(-2.3, -3.5, 31, device="cuda")[:, None]  # subnormal E4M3 scales
    w[32:40, 64:128] = 0.0                # all-zero blocks (scale 1.0)
    w[40:56] = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6], device="cuda").repeat(k // 8)
    w[48:56] *= -1                        # every E2M1 magnitude, both signs
    p, s, s2 = quantize_nvfp4(w.bfloat16())
    assert (s.view(torch.uint8)[1:32] < 8).sum() > 100  # many scales really are subnormal
    x = torch.randn(16, k, device="cuda", generator=g).bfloat16()
    exact = x.double() @ dequantize_nvfp4(p, s, s2, torch.float32).double().T
    y = tw.w4a16_linear(x, to_kernel_layout(p), s, s2, variant=variant).double()
    norm = exact.norm(dim=0)
    err = (y - exact).norm(dim=0) / norm.clamp_min(1e-30)
    assert err[norm > 0].max() <= 4e-3


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("variant", tw.VARIANTS)
def test_v2_split_k_counters_replay_in_cuda_graph(variant):
    """The in-kernel split-K reduction resets its tile counters: eager calls and CUDA-graph
    replays keep giving the right answer."""
    n, k = 1856, 2688
    p, s, s2 = _gpu_weights(n, k)
    x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
    ref = tw.w4a16_linear_reference(x, p, s, s2)
    for _ in range(3):
        assert _rel(tw.w4a16_linear(x, p, s, s2, variant=variant, split_k=4), ref) <= 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tw.w4a16_linear(x, p, s, s2, variant=variant, split_k=4)
    for _ in range(3):
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(y, ref) <= 1e-2


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("variant", tw.VARIANTS)
@pytest.mark.parametrize("n, k", [(1856, 2688), (2688, 1856), (200, 16 * 21)])
@pytest.mark.parametrize("tokens", [1, 3, 16, 64])
def test_grouped_kernel_gpu(variant, n, k, tokens):
    e, top_k = 128, 6
    w, s, s2 = _gpu_weights(n, k, experts=e)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    topk = torch.stack([torch.randperm(e, device="cuda", generator=g)[:top_k]
                        for _ in range(tokens)])
    order, offsets = sort_by_expert(topk, e)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    xs = x[order // top_k]
    y = tw.grouped_w4a16(xs, offsets, w, s, s2, variant=variant)
    ref = tw.grouped_w4a16_reference(xs, offsets, w, s, s2)
    assert _rel(y, ref) <= 1e-2


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("variant", tw.VARIANTS)
def test_fp16_activations_gpu(variant):
    p, s, s2 = _gpu_weights(1856, 2688)
    x = torch.randn(4, 2688, device="cuda", dtype=torch.float16)
    y = tw.w4a16_linear(x, p, s, s2, variant=variant)
    assert y.dtype == torch.float16
    assert _rel(y, tw.w4a16_linear_reference(x, p, s, s2)) <= 1e-2


@gpu
@needs_cuda
@needs_triton
def test_nvfp4_linear_module_on_gpu_matches_cpu():
    from blockspec.quant.linear import make_quant_linear

    p, s, s2 = _weights(256, 512, seed=5)
    p = from_kernel_layout(p)             # a checkpoint's bytes
    mod = make_quant_linear("w4a16_nvfp4", 512, 256, prefix="t")
    mod.weight.copy_(p), mod.weight_scale.copy_(s), mod.weight_scale_2.copy_(s2)
    x = torch.randn(8, 512).bfloat16()
    cpu = mod(x)
    gpu = mod.to("cuda")(x.cuda())
    assert mod.weight.dtype == torch.uint8 and mod.weight.is_cuda
    assert _rel(gpu.cpu(), cpu) <= 1e-2
    # the kernel converted the weight in place; the state dict and the reference keep the
    # checkpoint's bytes and values
    assert mod.kernel_layout and torch.equal(mod.state_dict()["weight"].cpu(), p)
    assert torch.equal(mod.cpu()(x), cpu)


def test_outgrown_tile_counters_stay_alive(monkeypatch):
    """A graph captured with a split-K counters buffer keeps its address: a later launch that
    needs more tiles gets a new buffer, and the old one is never freed (freed, a capture after
    it could place its tensors there, and the old graph's counters would write into them)."""
    monkeypatch.setattr(tile_counters_mod, "_COUNTERS", {})
    monkeypatch.setattr(tile_counters_mod, "_OUTGROWN", [])
    dev = torch.device("cpu")
    small = tile_counters_mod.tile_counters(dev, 10)
    old = StorageWeakRef(small.untyped_storage())
    big = tile_counters_mod.tile_counters(dev, small.numel() + 1)
    assert big.numel() > small.numel() and big.data_ptr() != small.data_ptr()
    del small
    assert not old.expired()
    assert tile_counters_mod.tile_counters(dev, 5) is big   # the newest serves smaller ones
    big.fill_(3)
    tile_counters_mod._OUTGROWN[0].fill_(3)
    tile_counters_mod.zero_all()                       # the outgrown buffer is reset too
    assert not big.any() and not tile_counters_mod._OUTGROWN[0].any()
