"""Large-M (prefill) configs of the W4A16 kernels: the table's lookup and validation, which calls
take the prefill path, and the prefill tiles (no split-K, tall row blocks, swapped or not,
N tiles innermost) against the torch references under the Triton interpreter on CPU."""
import pytest
import torch

from blockspec.kernels import w4a16 as tw
from blockspec.kernels import w4a16_prefill as wp
from blockspec.kernels.triton_loader import triton_available
from blockspec.kernels.w4a16_layout import to_kernel_layout
from blockspec.quant.nvfp4 import quantize_nvfp4

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not importable")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _weights(n, k, seed, experts=None):
    g = torch.Generator().manual_seed(seed)
    ws = [quantize_nvfp4((torch.randn(n, k, generator=g) * 0.05 * (1 + e % 3)).bfloat16())
          for e in range(experts or 1)]
    p, s, s2 = (torch.stack(t) for t in zip(*ws))
    if experts is None:
        return to_kernel_layout(p[0]), s[0], s2[0]
    return to_kernel_layout(p), s, s2


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def launches(monkeypatch):
    """The keyword arguments of every ``_launch_v2`` call (block_m included)."""
    seen = []
    real = tw._launch_v2

    def spy(*args, **kw):
        seen.append({"block_m": args[6], "prefill": kw.get("prefill"), **kw})
        return real(*args, **kw)

    monkeypatch.setattr(tw, "_launch_v2", spy)
    return seen


@pytest.fixture
def flags(monkeypatch):
    """The constexpr flags of every v2 kernel launch (what the launcher really asked for)."""
    seen = []
    real = tw.v2_kernel

    class Spy:
        def __getitem__(self, grid):
            launch = real()[grid]

            def run(*args, **kw):
                seen.append({**kw, "grid": grid})
                return launch(*args, **kw)
            return run

    monkeypatch.setattr(tw, "v2_kernel", Spy)
    return seen


def test_m_bucket_and_thresholds():
    assert wp.m_bucket(1) == 512 and wp.m_bucket(2048) == 2048 and wp.m_bucket(12288) == 8192
    assert wp.m_bucket(10 ** 6) == wp.M_EDGES[-1]
    assert not wp.is_dense_prefill(wp.DENSE_PREFILL_ROWS - 1) and wp.is_dense_prefill(2048)
    # 12,288 pairs over 128 experts (a 2048-token chunk) is prefill; a 64-token verify is not
    assert wp.is_grouped_prefill(12288, 128) and not wp.is_grouped_prefill(384, 128)


def test_wide_dense_needs_a_table_entry(monkeypatch):
    """An output head at hundreds of rows (a speculative verify) keeps its built-in tiles until
    the table names its shape."""
    assert wp.is_dense_prefill(2048, 3712, 2688) and not wp.is_dense_prefill(2048, 131072, 2688)
    monkeypatch.setitem(wp.PREFILL_TABLE, ("dense", 131072, 2688, 2048), {"block_n": 256})
    assert wp.is_dense_prefill(600, 131072, 2688)


def test_shipped_prefill_table_is_valid():
    """Every measured entry names a kind, a bucket edge and a config the kernel takes."""
    assert wp.PREFILL_TABLE
    for (kind, n, k, bucket), cfg in wp.PREFILL_TABLE.items():
        assert kind in wp.DEFAULT_PREFILL and bucket in wp.M_EDGES and n > 0 and k > 0
        assert wp.check_prefill_config(cfg) == cfg


def test_prefill_config_table_over_defaults(monkeypatch):
    monkeypatch.setattr(wp, "PREFILL_TABLE", {})      # the rules, not the shipped entries
    base = wp.prefill_config("grouped", 1856, 2688, 12288)
    assert base == wp.DEFAULT_PREFILL["grouped"]
    assert wp.prefill_config("dense", 2688, 1856, 2048)["block_k"] == 64  # 128 does not divide K
    entry = {"block_m": 64, "block_n": 256, "num_stages": 4}
    monkeypatch.setitem(wp.PREFILL_TABLE, ("grouped", 1856, 2688, 8192), entry)
    got = wp.prefill_config("grouped", 1856, 2688, 12288)
    assert got["block_n"] == 256 and got["block_m"] == 64 and got["num_stages"] == 4
    # other M take the nearest measured bucket: below if there is one, else above
    assert wp.prefill_config("grouped", 1856, 2688, 40000)["block_n"] == 256
    monkeypatch.setitem(wp.PREFILL_TABLE, ("grouped", 1856, 2688, 32768), {"block_n": 64})
    assert wp.prefill_config("grouped", 1856, 2688, 40000)["block_n"] == 64
    assert wp.prefill_config("grouped", 1856, 2688, 20000)["block_n"] == 256
    assert wp.prefill_config("grouped", 1856, 2688, 600)["block_n"] == 256
    assert wp.prefill_config("grouped", 2688, 1856, 12288)["block_n"] == base["block_n"]
    with pytest.raises(ValueError, match="kind"):
        wp.prefill_config("pairs", 1, 1, 1)


@pytest.mark.parametrize("cfg, match", [
    ({"block_n": 96}, "power of two"), ({"split_k": 2}, "unknown option"),
    ({"block_k": 32}, "block_k >= 64"), ({"block_n": 32, "swap": True}, "multiple of 64"),
    ({"num_warps": True}, "positive integer"),
])
def test_check_prefill_config_rejects(cfg, match):
    with pytest.raises(ValueError, match=match):
        wp.check_prefill_config(cfg)


def test_defaults_are_valid():
    for cfg in wp.DEFAULT_PREFILL.values():
        assert wp.check_prefill_config(cfg) == cfg


def test_grouped_blocks_take_the_prefill_block_m(monkeypatch):
    offsets = torch.tensor([0, 130, 230])
    assert tw.grouped_blocks(offsets, 230)[4] == wp.DEFAULT_PREFILL["grouped"]["block_m"]
    monkeypatch.setitem(wp.PREFILL_TABLE, ("grouped", 64, 128, 512), {"block_m": 64})
    assert tw.grouped_blocks(offsets, 230, shape=(64, 128))[4] == 64
    assert tw.grouped_blocks(offsets, 230, block_m=32)[4] == 32
    small = torch.tensor([0, 3, 9])  # decode sizes keep the row-per-expert pick
    assert tw.grouped_blocks(small, 9)[4] == 16


@needs_triton
@pytest.mark.parametrize("cfg", [
    {},                                                      # the defaults: 128-row tiles, swap
    {"block_m": 64, "block_n": 128, "block_k": 64, "swap": False, "n_inner": True},
    {"block_m": 64, "block_n": 64, "block_k": 128, "num_stages": 4},
    {"block_m": 64, "block_n": 128, "block_k": 64, "x_perm": True},          # x in stream order
    {"block_m": 32, "block_n": 64, "block_k": 128, "x_perm": True, "swap": False},
])
def test_dense_prefill_interpreter(interpreter, launches, flags, cfg):
    m, n, k = 512, 96, 256                                   # N ragged against every block_n
    p, s, s2 = _weights(n, k, seed=21)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = tw.w4a16_linear(x, p, s, s2, **cfg)
    ref = tw.w4a16_linear_reference(x, p, s, s2)
    assert y.shape == (m, n) and _rel(y, ref) <= 1e-2
    (call,) = launches
    assert call["prefill"]                                   # the large-M path
    assert call["block_m"] == cfg.get("block_m", wp.DEFAULT_PREFILL["dense"]["block_m"])
    (launch,) = flags
    assert launch["SPLIT"] == 1 and launch["X_PERM"] == cfg.get("x_perm", False)
    assert launch["SWAP"] == cfg.get("swap", True)
    y2 = tw.w4a16_linear(x, p, s, s2, relu2=True, **cfg)
    assert _rel(y2, torch.square(torch.relu(ref))) <= 1e-2 and bool((y2 >= 0).all())


@needs_triton
@pytest.mark.parametrize("n_inner, swap, x_perm", [(True, True, False), (False, False, False),
                                                   (True, True, True)])
def test_grouped_prefill_interpreter(interpreter, launches, flags, n_inner, swap, x_perm):
    w, s, s2 = _weights(128, 128, seed=22, experts=3)
    counts = [150, 0, 110]                                   # >= 48 rows per expert
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist())
    x = torch.randn(sum(counts), 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    ref = tw.grouped_w4a16_reference(x, offsets, w, s, s2)
    blocks = tw.grouped_blocks(offsets, x.shape[0], shape=(128, 128))
    assert blocks[4] == wp.DEFAULT_PREFILL["grouped"]["block_m"]
    y = tw.grouped_w4a16(x, offsets, w, s, s2, blocks=blocks, block_k=64, n_inner=n_inner,
                         swap=swap, x_perm=x_perm)
    assert _rel(y, ref) <= 1e-2
    for e in (0, 2):  # each expert's rows used its own weights
        a, b = offsets[e].item(), offsets[e + 1].item()
        assert _rel(y[a:b], tw.w4a16_linear_reference(x[a:b], w[e], s[e], s2[e])) <= 1e-2
    y2 = tw.grouped_w4a16(x, offsets, w, s, s2, blocks=blocks, block_k=64, n_inner=n_inner,
                          swap=swap, x_perm=x_perm, relu2=True)
    assert _rel(y2, torch.square(torch.relu(ref))) <= 1e-2
    assert all(c["prefill"] for c in launches) and len(launches) == 2
    assert all(f["X_PERM"] == x_perm and f["N_INNER"] == n_inner and f["SPLIT"] == 1
               for f in flags)
    tiles_n = -(-128 // flags[0]["BLOCK_N"])
    assert flags[0]["grid"][0 if n_inner else 1] == tiles_n  # N tiles on the fast axis


@needs_triton
def test_decode_sizes_skip_the_prefill_table(interpreter, launches, monkeypatch):
    """A decode-sized call never reads the prefill table (its configs stay the tuned ones)."""
    monkeypatch.setattr(tw, "prefill_config", lambda *a: pytest.fail("prefill table read"))
    p, s, s2 = _weights(64, 128, seed=23)
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert _rel(tw.w4a16_linear(x, p, s, s2), tw.w4a16_linear_reference(x, p, s, s2)) <= 1e-2
    w, sw, sw2 = _weights(64, 128, seed=24, experts=4)
    offsets = torch.tensor([0, 3, 3, 10, 12])
    xg = torch.randn(12, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    got = tw.grouped_w4a16(xg, offsets, w, sw, sw2)
    assert _rel(got, tw.grouped_w4a16_reference(xg, offsets, w, sw, sw2)) <= 1e-2
    assert [c["prefill"] for c in launches] == [{}, {}]


def test_stream_order_and_the_chunk_the_moe_gathers_in(monkeypatch):
    x = torch.arange(2 * 128).reshape(2, 128)
    p = tw.stream_order(x, 64)
    assert p[0, :4].tolist() == [0, 4, 8, 12] and p[0, 16].item() == 1 and p[1, 64].item() == 192
    monkeypatch.setattr(wp, "PREFILL_TABLE", {})
    assert tw.grouped_x_chunk(1856, 2688, 12288, 128) == 0          # defaults: no x_perm
    monkeypatch.setitem(wp.PREFILL_TABLE, ("grouped", 1856, 2688, 8192),
                        {"x_perm": True, "block_k": 128})
    assert tw.grouped_x_chunk(1856, 2688, 12288, 128) == 128
    assert tw.grouped_x_chunk(1856, 2688, 384, 128) == 0            # decode sizes: never


@needs_triton
def test_grouped_x_ordered_interpreter(interpreter, flags):
    """x permuted by the caller (the MoE's gather) gives the launcher's own x_perm result."""
    w, s, s2 = _weights(64, 128, seed=25, experts=2)
    offsets = torch.tensor([0, 100, 200])
    x = torch.randn(200, 128, generator=torch.Generator().manual_seed(6)).bfloat16()
    ref = tw.grouped_w4a16_reference(x, offsets, w, s, s2)
    got = tw.grouped_w4a16(tw.stream_order(x, 64), offsets, w, s, s2, block_k=64, x_ordered=64)
    assert _rel(got, ref) <= 1e-2 and flags[-1]["X_PERM"]
    with pytest.raises(ValueError, match="x_ordered=128"):
        tw.grouped_w4a16(x, offsets, w, s, s2, block_k=64, x_ordered=128)


# ---------------------------------------------------------------- GPU (run on the H200)
def _gpu_stack(n, k, experts):
    """Random packed bytes and E4M3 scales (every bit pattern is a valid NVFP4 weight)."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, device="cuda",
                      generator=g)
    s = (torch.rand((experts, n, k // 16), device="cuda", generator=g) + 0.25).to(
        torch.float8_e4m3fn)
    return w, s, torch.full((experts,), 0.01, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_triton
@pytest.mark.parametrize("cfg", [{}, {"x_perm": True}, {"swap": False},
                                 {"block_m": 64, "block_n": 256}])
def test_prefill_lightning_shapes_gpu(cfg):
    """The compiled prefill path (inline-PTX decode) on the MoE's shapes: the routed up and down
    projections over 128 experts at a 2048-token chunk's 12,288 rows, the shared expert's up."""
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = (torch.rand((2048, 128), device="cuda", generator=g)).topk(6, dim=-1).indices
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=128)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    for n, k in ((1856, 2688), (2688, 1856)):
        w, s, s2 = _gpu_stack(n, k, 128)
        x = torch.randn((2048, k), device="cuda", generator=g).bfloat16()[order // 6]
        blocks = tw.grouped_blocks(offsets, x.shape[0], block_m=cfg.get("block_m"),
                                   shape=(n, k))
        kw = {key: v for key, v in cfg.items() if key != "block_m"}
        y = tw.grouped_w4a16(x, offsets, w, s, s2, blocks=blocks, relu2=True, **kw)
        ref = tw.grouped_w4a16_reference(x, offsets, w, s, s2)
        assert _rel(y, torch.square(torch.relu(ref))) <= 1e-2
    w, s, s2 = _gpu_stack(3712, 2688, 1)
    x = torch.randn((2048, 2688), device="cuda", generator=g).bfloat16()
    y = tw.w4a16_linear(x, w[0], s[0], s2[0], **cfg)
    assert _rel(y, tw.w4a16_linear_reference(x, w[0], s[0], s2[0])) <= 1e-2
