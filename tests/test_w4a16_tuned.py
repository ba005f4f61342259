"""The W4A16 tuned-config table (lookup, fallback, validation, use by the launcher) and the
decode sweep script's planning, problem builders and table writer, all on CPU: kernels run
under the Triton interpreter, the sweep's timer is a fake."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from blockspec.kernels import w4a16 as tw
from blockspec.kernels import w4a16_tuned as tt
from blockspec.kernels.triton_loader import triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not importable")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_w4a16_decode.py"


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def fresh_tables(monkeypatch):
    """Every test starts from the packaged table and leaves no cached table behind."""
    monkeypatch.delenv(tt.TUNED_ENV, raising=False)
    tt._read_tuned.cache_clear()
    yield
    tt._read_tuned.cache_clear()


@pytest.fixture(scope="module")
def sweep():
    """The sweep script as a module (registered first: its dataclasses look themselves up)."""
    spec = importlib.util.spec_from_file_location("bench_w4a16_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _table(tmp_path: Path, configs: dict, monkeypatch=None, name: str = "t.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"about": "test", "configs": configs}))
    if monkeypatch is not None:
        monkeypatch.setenv(tt.TUNED_ENV, str(path))
    return path


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


# ------------------------------------------------------------------------------- lookup
def test_buckets_and_keys():
    assert [tt.bucket(v, tt.ROW_EDGES) for v in (1, 2, 4, 5, 8, 9, 16, 17, 64, 65, 200)] == [
        "1", "2-4", "2-4", "5-8", "5-8", "9-16", "9-16", "17-32", "33-64", "65-128", "129-256"]
    assert [tt.bucket(v, tt.BLOCK_EDGES) for v in (1, 6, 8, 9, 24, 32, 36, 64, 65)] == [
        "1-8", "1-8", "1-8", "9-32", "9-32", "9-32", "33-64", "33-64", "65-128"]
    assert tt.problem_key(3712, 2688, 6) == "dense N=3712 K=2688 rows=5-8"
    assert (tt.problem_key(1856, 2688, 16, 24)
            == "grouped N=1856 K=2688 block_m=16 blocks=9-32")


def test_packaged_table_is_valid_and_shipped():
    """Whatever the shipped table holds parses, its keys are ones a call can produce, and a
    non-editable install carries it (pyproject's package-data)."""
    import tomllib

    data = json.loads(tt.TUNED_PATH.read_text(encoding="utf-8"))
    assert tt.parse_tuned_table(data, str(tt.TUNED_PATH)) == tt.tuned_table()
    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["blockspec"]
    assert tt.TUNED_PATH.relative_to(root / "blockspec").as_posix() in globs


def test_lookup_picks_the_entry_and_falls_back(tmp_path, monkeypatch):
    builtin_g = tw._builtin_v2_config(1856, 2688, 16)
    builtin_d = tw._builtin_v2_config(3712, 2688, 4)
    entry_g = {"block_n": 32, "block_k": 256, "k_slices": 1, "split_k": 4, "num_warps": 2,
               "num_stages": 4}
    entry_d = {"block_n": 16, "split_k": None}
    _table(tmp_path, {"grouped N=1856 K=2688 block_m=16 blocks=1-8": entry_g,
                      "dense N=3712 K=2688 rows=2-4": entry_d}, monkeypatch)
    assert tw.v2_default_config(1856, 2688, 16, blocks=6) == {**builtin_g, **entry_g}
    assert tw.v2_default_config(3712, 2688, 3) == {**builtin_d, **entry_d}
    # other classes keep the built-in defaults
    assert tw.v2_default_config(1856, 2688, 16, blocks=24) == builtin_g
    assert tw.v2_default_config(1856, 2688, 32, blocks=6) == tw._builtin_v2_config(1856, 2688,
                                                                                   32)
    assert tw.v2_default_config(3712, 2688, 1) == tw._builtin_v2_config(3712, 2688, 1)
    assert tw.v2_default_config(3712, 2688, 4, blocks=1) == builtin_d  # dense key != grouped
    assert tw.v2_default_config(1856, 2688, 16, blocks=6, tuned=False) == builtin_g
    monkeypatch.setenv(tt.TUNED_ENV, "none")
    assert tt.tuned_table() == {}
    assert tw.v2_default_config(1856, 2688, 16, blocks=6) == builtin_g


def test_builtin_defaults_unchanged():
    """The table aside, the defaults are the pre-table ones (block_m decides the tile)."""
    assert tw.v2_default_config(1856, 2688, 1, tuned=False) == {
        "block_m": 16, "block_n": 64, "block_k": 128, "k_slices": 1, "swap": False,
        "num_warps": 4, "num_stages": 3, "split_k": None, "maxnreg": None}
    assert tw.v2_default_config(131072, 2688, 64, tuned=False) == {
        "block_m": 64, "block_n": 256, "block_k": 64, "k_slices": 1, "swap": True,
        "num_warps": 8, "num_stages": 3, "split_k": None, "maxnreg": None}
    # a dense call whose caller fixed block_m=16 at 64 rows keeps the M <= 16 tile
    assert tw.v2_default_config(131072, 2688, 64, block_m=16, tuned=False)["block_n"] == 128


@pytest.mark.parametrize("configs, match", [
    ({"dense N=64 K=128 rows=1": {"block_n": 32, "warps": 4}}, "unknown option"),
    ({"dense N=64 K=128 rows=1": {"block_n": 48}}, "power of two"),
    ({"dense N=64 K=128 rows=1": {"block_k": 32}}, "block_k"),
    ({"dense N=64 K=128 rows=1": {"k_slices": 3}}, "k_slices"),
    ({"dense N=64 K=128 rows=1": {"split_k": 0}}, "positive integer"),
    ({"dense N=64 K=128 rows=1": {"num_stages": "3"}}, "positive integer"),
    ({"dense N=64 K=128 rows=1": {"num_warps": True}}, "positive integer"),
    ({"dense N=64 K=128 rows=1": {"num_warps": 3}}, "num_warps"),
    ({"dense N=64 K=128 rows=1": {"maxnreg": 300}}, "maxnreg"),
    ({"dense N=64 K=128 rows=1": {"maxnreg": 0}}, "positive integer"),
    ({"dense N=64 K=128 rows=1": [32, 128]}, "expected an object"),
    ({"dense N=64 K=128 rows=3": {"block_n": 32}}, "not one of the buckets"),
    ({"dense N=64 K=128 rows=1-4": {"block_n": 32}}, "not one of the buckets"),
    ({"grouped N=64 K=128 blocks=1-8": {"block_n": 32}}, "expected 'dense"),
    ({"dense 64x128 rows=1": {"block_n": 32}}, "expected 'dense"),
    ({"dense N=64 K=128 block_m=16 blocks=1-8": {"block_n": 32}}, "expected 'dense"),
    ({"grouped N=64 K=128 rows=1": {"block_n": 32}}, "expected 'dense"),
    ({"grouped N=64 K=128 block_m=16 blocks=9-16": {"block_n": 32}}, "not one of the buckets"),
])
def test_malformed_entry_names_file_and_key(tmp_path, monkeypatch, configs, match):
    path = _table(tmp_path, configs, monkeypatch)
    key = next(iter(configs))
    with pytest.raises(tt.TunedTableError, match=match) as info:
        tt.tuned_table()
    assert str(path) in str(info.value) and repr(key) in str(info.value)
    # and the error reaches the caller of the kernel, before any launch
    p = torch.zeros(64, 64, dtype=torch.uint8)
    s = torch.ones(64, 8).to(torch.float8_e4m3fn)
    with pytest.raises(tt.TunedTableError, match=match):
        tw.w4a16_linear(torch.zeros(1, 128), p, s, torch.tensor(1.0), variant="v2")


def test_unreadable_tables_name_the_file(tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    monkeypatch.setenv(tt.TUNED_ENV, str(bad))
    with pytest.raises(tt.TunedTableError, match="bad.json.*not valid JSON"):
        tt.tuned_table()
    bad.write_text(json.dumps({"dense N=64 K=128 rows=1": {}}))  # no "configs"
    tt._read_tuned.cache_clear()
    with pytest.raises(tt.TunedTableError, match="bad.json.*'configs'"):
        tt.tuned_table()
    monkeypatch.setenv(tt.TUNED_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(tt.TunedTableError, match="missing.json"):
        tt.tuned_table()


def test_table_is_read_once(tmp_path, monkeypatch):
    path = _table(tmp_path, {"dense N=64 K=128 rows=1": {"block_n": 32}}, monkeypatch)
    assert tt.tuned_config(64, 128, 1) == {"block_n": 32}
    path.write_text("{not json")  # not read again
    assert tt.tuned_config(64, 128, 1) == {"block_n": 32}


# ------------------------------------------------------------------------------- launcher
class _Spy:
    """Wraps the v2 kernel: records the constexprs of each launch, then runs it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append({"grid": grid, **kwargs})
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.fixture
def spy(monkeypatch):
    real = tw.v2_kernel
    holder = {}

    def kernel():
        holder.setdefault("spy", _Spy(real()))
        return holder["spy"]

    monkeypatch.setattr(tw, "v2_kernel", kernel)
    return lambda: holder["spy"].launches


def _weights(n, k, experts=None, seed=0):
    from blockspec.quant.nvfp4 import quantize_nvfp4

    from blockspec.kernels.w4a16_layout import to_kernel_layout

    g = torch.Generator().manual_seed(seed)
    if experts is None:
        p, s, s2 = quantize_nvfp4((torch.randn(n, k, generator=g) * 0.05).bfloat16())
        return to_kernel_layout(p), s, s2
    parts = [quantize_nvfp4((torch.randn(n, k, generator=g) * 0.05).bfloat16())
             for _ in range(experts)]
    w, s, s2 = (torch.stack(t) for t in zip(*parts))
    return to_kernel_layout(w), s, s2


@needs_triton
def test_dense_launch_honours_the_table(interpreter, spy, tmp_path, monkeypatch):
    n, k, m = 64, 256, 3
    p, s, s2 = _weights(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref = tw.w4a16_linear_reference(x, p, s, s2)
    _table(tmp_path, {tt.problem_key(n, k, m): {"block_n": 16, "block_k": 64, "k_slices": 2,
                                                "split_k": 2}}, monkeypatch)
    y = tw.w4a16_linear(x, p, s, s2, variant="v2")
    last = spy()[-1]
    assert (last["BLOCK_N"], last["BLOCK_K"], last["SLICES"], last["SPLIT"]) == (16, 64, 2, 2)
    assert last["grid"] == (1, n // 16, 2)
    assert _rel(y, ref) <= 1e-2
    # explicit keywords win over the table
    y = tw.w4a16_linear(x, p, s, s2, variant="v2", block_n=32, split_k=1)
    assert (spy()[-1]["BLOCK_N"], spy()[-1]["SPLIT"], spy()[-1]["SLICES"]) == (32, 1, 2)
    assert _rel(y, ref) <= 1e-2
    # another row bucket, or a comparison variant, keeps the built-in tile
    tw.w4a16_linear(x[:1], p, s, s2, variant="v2")
    assert spy()[-1]["BLOCK_N"] == tw._builtin_v2_config(n, k, 1)["block_n"]
    tw.w4a16_linear(x, p, s, s2, variant="v2t")
    assert spy()[-1]["BLOCK_N"] == tw._builtin_v2_config(n, k, m)["block_n"]


@needs_triton
def test_pair_launch_honours_the_table(interpreter, spy, tmp_path, monkeypatch):
    n, k, experts = 32, 128, 5
    w, s, s2 = _weights(n, k, experts, seed=2)
    ids = torch.tensor([[3, 0, 4], [1, 3, 2]])
    x = torch.randn(ids.numel(), k, generator=torch.Generator().manual_seed(3)).bfloat16()
    _table(tmp_path, {tt.problem_key(n, k, 16, ids.numel()): {"block_n": 16, "split_k": 2,
                                                              "block_k": 64}}, monkeypatch)
    y = tw.pair_w4a16(x, ids, w, s, s2, x_per_pair=True)
    last = spy()[-1]
    assert (last["BLOCK_N"], last["SPLIT"], last["grid"]) == (16, 2, (6, 2, 2))
    for pair, e in enumerate(ids.reshape(-1).tolist()):
        assert _rel(y[pair], tw.w4a16_linear_reference(x[pair:pair + 1], w[e], s[e],
                                                       s2[e])[0]) <= 1e-2


@needs_triton
def test_tuned_point_is_what_the_model_launches(sweep, interpreter, spy, tmp_path, monkeypatch):
    """``--tuned-only`` times the config a model's call launches: the table's entry, with the
    split the launcher resolves (auto where the entry leaves it open)."""
    dense = sweep.Problem("d", "dense", 64, 256, 3)
    pairs = sweep.Problem("p", "grouped", 32, 128, 12, experts=6, shared=0)
    _table(tmp_path, {dense.key: {"block_n": 16, "block_k": 64, "k_slices": 2},
                      pairs.key: {"block_n": 16, "block_k": 64, "split_k": 2}}, monkeypatch)
    p, s, s2 = _weights(64, 256)
    tw.w4a16_linear(torch.randn(3, 256).bfloat16(), p, s, s2)
    w, ws, ws2 = _weights(32, 128, 6)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0]])
    tw.pair_w4a16(torch.randn(2, 128).bfloat16(), ids, w, ws, ws2, dedup=True, distinct=True)
    for problem, launch in zip((dense, pairs), spy()[-2:]):
        point = sweep.tuned_point(problem, sms=4)
        assert point["builtin"] and ((point["block_n"], point["block_k"], point["k_slices"],
                                      point["split_k"]) == (launch["BLOCK_N"], launch["BLOCK_K"],
                                                            launch["SLICES"], launch["SPLIT"]))


# ------------------------------------------------------------------------------- the sweep
def test_decode_problems(sweep):
    probs = sweep.decode_problems()
    assert [p.name for p in probs] == [
        "expert_up/pairs=6", "expert_up/pairs=24", "expert_up/pairs=36",
        "expert_down/pairs=6", "expert_down/pairs=24", "expert_down/pairs=36",
        "shared_up/M=1", "shared_up/M=4", "shared_up/M=6",
        "shared_down/M=1", "shared_down/M=4", "shared_down/M=6",
        "lm_head/M=1", "lm_head/M=4", "lm_head/M=8",
        "draft_qkv/M=4", "draft_qkv/M=8", "draft_o/M=4", "draft_o/M=8",
        "draft_gate_up/M=4", "draft_gate_up/M=8", "draft_down/M=4", "draft_down/M=8"]
    assert {(p.n, p.k) for p in probs if p.name.startswith("expert_up")} == {(1856, 2688)}
    assert {(p.n, p.k) for p in probs if p.name.startswith("expert_down")} == {(2688, 1856)}
    assert {(p.n, p.k) for p in probs if p.name.startswith("shared_down")} == {(2688, 3712)}
    keys = [p.key for p in probs]
    assert len(set(keys)) == len(keys)  # one table entry per problem
    assert tt.parse_tuned_table({"configs": {key: {} for key in keys}}, "x") == {
        key: {} for key in keys}
    assert [p.key.split("blocks=")[1] for p in probs[:3]] == ["1-8", "9-32", "33-64"]


def test_merge_needs_a_table_to_write(sweep, capsys):
    with pytest.raises(SystemExit):
        sweep.main(["--plan", "--merge"])
    assert "--merge" in capsys.readouterr().err


def test_plan_configs(sweep):
    for p in sweep.decode_problems():
        points, dropped = sweep.plan_configs(p, 132)
        launches = [tuple(sweep.launch_config(q).values()) for q in points]
        assert len(set(launches)) == len(launches) > 50
        assert sum(q["builtin"] for q in points) == 1 and sum(dropped.values()) > 0
        for q in points:
            tt.check_v2_tile(q["block_n"], q["block_k"], q["k_slices"])
            chunk = q["block_k"] * q["k_slices"]
            assert tw.split_plan(p.k, chunk, q["split_k"])[0] == q["split_k"]  # as launched
        builtin = next(q for q in points if q["builtin"])
        cfg = tw._builtin_v2_config(p.n, p.k, 16 if p.grouped else p.m)
        assert {k: builtin[k] for k in ("block_n", "block_k", "num_warps", "num_stages")} == {
            k: cfg[k] for k in ("block_n", "block_k", "num_warps", "num_stages")}
        first = sweep.first_stage(points, sweep._builtin_warps(p))
        assert len({sweep.tile_of(points[i]) for i in first}) == len(
            {sweep.tile_of(q) for q in points})
    quick, _ = sweep.plan_configs(sweep.decode_problems()[0], 132, sweep.QUICK_AXES)
    assert 0 < len(quick) <= 8


@needs_triton
def test_sweep_end_to_end_with_a_fake_timer(sweep, interpreter, tmp_path, monkeypatch):
    """Tiny problems through the real builders, reference checks and staged search under the
    interpreter; a fake timer ranks configs; the written table is what the loader then uses."""
    probs = [sweep.Problem("tiny_up", "grouped", 32, 128, 12, experts=8, repeat_x=True),
             sweep.Problem("tiny_down", "grouped", 32, 128, 6, experts=8),
             sweep.Problem("tiny_dense", "dense", 32, 128, 2)]
    axes = {"block_n": (16, 32), "block_k": (64,), "k_slices": (1, 2), "split_k": (None, 1, 2),
            "num_warps": (1, 2), "num_stages": (2,)}
    plans = {p.name: sweep.plan_configs(p, 4, axes)[0] for p in probs}

    def fake_ms(fn, calls, reps):  # smaller tiles and more splits "win"; warps break ties
        c = fn.config
        return 1e-3 * (c["block_n"] / 16 + 1 / c["split_k"] + c["num_warps"] / 100
                       + c["k_slices"] / 10)

    results = sweep.run_sweep(probs, plans, "cpu", fake_ms, calls=2, reps=1, beam=1,
                              log=lambda line: None)
    for res in results:
        assert res.points and all(r["ok"] for r in res.points), [
            r.get("error") for r in res.points]
        assert {r["stage"] for r in res.points} == {1, 2}
        assert res.builtin is not None
        best = res.best
        assert (best["block_n"], best["split_k"], best["num_warps"], best["k_slices"]) == (
            16, 2, 1, 1)
        assert math.isclose(best["gbs"], res.bytes_per_call / (best["us"] * 1e-6) / 1e9)
    path = tmp_path / "tuned.json"
    data = sweep.write_table(path, results, {"device": "cpu (fake timer)"})
    assert json.loads(path.read_text()) == data
    assert set(data["configs"]) == {p.key for p in probs}
    monkeypatch.setenv(tt.TUNED_ENV, str(path))
    assert tt.tuned_config(32, 128, 16, 12) == sweep.launch_config(results[0].best)
    assert tt.tuned_config(32, 128, 2) == sweep.launch_config(results[2].best)
    assert data["measured"][probs[0].key]["tiny_up"]["us"] == results[0].best["us"]
    # a partial sweep laid over a base table keeps the base's other classes
    base = {"configs": {"dense N=64 K=128 rows=1": {"block_n": 32}},
            "measured": {"dense N=64 K=128 rows=1": {"x": {"us": 1.0}}}}
    merged = sweep.write_table(tmp_path / "merged.json", results[2:], {}, base)
    assert set(merged["configs"]) == {"dense N=64 K=128 rows=1", probs[2].key}
    assert merged["configs"][probs[2].key] == data["configs"][probs[2].key]


@needs_triton
def test_sweep_records_compile_failures_without_running_them(sweep, interpreter):
    p = sweep.Problem("tiny_dense", "dense", 32, 128, 1)
    plan = sweep.plan_configs(p, 4, {"block_n": (16, 32), "block_k": (64,), "k_slices": (1,),
                                     "split_k": (1,), "num_warps": (1,),
                                     "num_stages": (2,)})[0]
    ran = []

    def timer(fn, calls, reps):
        ran.append(fn.config["block_n"])
        return 1e-3

    (res,) = sweep.run_sweep([p], {p.name: plan}, "cpu", timer, calls=1, reps=1, beam=None,
                             compile_points=lambda tasks: {1: "boom"}, log=lambda line: None)
    by_n = {r["block_n"]: r for r in res.points if not r["builtin"]}
    assert by_n[16]["ok"] and by_n[32] == {**by_n[32], "ok": False, "error": "boom"}
    assert 32 not in ran


@needs_triton
def test_precompile_pool_records_failures(sweep, interpreter, monkeypatch):
    """The spawned compile pool on CPU (interpreter): a good config compiles, a bad one comes
    back as its error instead of taking the sweep down."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # the workers import the script by name
    p = sweep.Problem("tiny", "grouped", 32, 128, 6, experts=8)
    good = {"block_n": 16, "block_k": 64, "k_slices": 1, "split_k": 2, "num_warps": 1,
            "num_stages": 2}
    errors = sweep.precompile([(p, good), (p, {**good, "block_n": 48})], jobs=2, device="cpu")
    assert list(errors) == [1] and "ValueError" in errors[1] and "48" in errors[1]


def test_pair_reference_matches_per_pair_products(sweep):
    """The grouped builder's reference is each pair's row (its token's for the up projection)
    times its own expert's weight."""
    p = sweep.Problem("tiny", "grouped", 16, 64, 12, experts=8, repeat_x=True)
    built = sweep.build(p, "cpu", variants=2)
    x, ids, w, s, s2 = built.variants[0]
    assert len(built.variants) == 2 and x.shape == (2, 64) and ids.shape == (2, 6)
    for pair, e in enumerate(ids.reshape(-1).tolist()):
        row = x[pair // 6:pair // 6 + 1]                                 # one row per token
        ref = tw.w4a16_linear_reference(row, w[e], s[e], s2[e])[0]
        assert torch.equal(built.ref[pair], ref)


def test_script_help_plan_and_no_cuda(sweep, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        sweep.main(["--help"])
    assert info.value.code == 0 and "--write-table" in capsys.readouterr().out
    sweep.main(["--plan", "--problems", "expert_up/pairs=6", "lm_head/M=1", "--jobs", "16"])
    out = capsys.readouterr().out
    assert "expert_up/pairs=6" in out and "kernels to compile" in out
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            sweep.main(["--out", str(tmp_path / "x.json")])
        assert not (tmp_path / "x.json").exists()
