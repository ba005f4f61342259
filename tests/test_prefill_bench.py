"""The prefill benchmark reports self-consistent figures, its FLOPs model matches a hand count
and the model's own weight shapes, and its breakdown's parts fit inside the measured time
(speed itself is never asserted)."""
from __future__ import annotations

import math

import pytest
import torch

from blockspec.bench.engine_bench import run as decode_run
from blockspec.bench.flops import chunk_lengths, per_token_projection_flops, prefill_flops
from blockspec.bench.prefill_bench import run
from blockspec.bench.prefill_breakdown import NESTED, TOP, format_table
from blockspec.configs.nemotron_h import NemotronHConfig
from blockspec.models.nemotron_h import NemotronHForCausalLM
from blockspec.tiny_model import TINY_CONFIG
from tests.bench_fixtures import bench_args as _args



def _cfg(**over) -> NemotronHConfig:
    return NemotronHConfig.from_dict({**TINY_CONFIG, **over})


@pytest.fixture(scope="module")
def rows():
    """One run: two lengths, the second split into two prefill chunks, with the breakdown."""
    ns = _args(["--prefill", "--input-len", "32,80", "--chunked-prefill-size", "48",
                "--breakdown", "--repeats", "1", "--device", "cpu", "--dtype", "float32"])
    return run(ns)


def test_prefill_rows_are_self_consistent(rows):
    bench = [r for r in rows if r["bench"] == "prefill"]
    assert [r["input_len"] for r in bench] == [32, 80]
    for r in bench:
        assert r["model"] == "random:tiny" and r["batch_size"] == 1 and not r["quantized"]
        assert r["chunked_prefill_size"] == 48 and r["dtype"] == "float32"
        assert r["ttft_s"] > 0 and r["matmul_tflops"] > 0
        assert r["prefill_tok_per_s"] * r["ttft_s"] == pytest.approx(r["input_len"], rel=1e-9)
        assert r["floor_tok_per_s"] * r["floor_s"] == pytest.approx(r["input_len"], rel=1e-9)
        assert r["floor_s"] == pytest.approx(r["flops"] / (r["matmul_tflops"] * 1e12), rel=1e-9)
        assert r["pct_of_floor"] == pytest.approx(100 * r["floor_s"] / r["ttft_s"], rel=1e-9)
        assert r["pct_of_floor"] == pytest.approx(
            100 * r["prefill_tok_per_s"] / r["floor_tok_per_s"], rel=1e-9)
        assert r["flops_per_token"] * r["input_len"] == pytest.approx(r["flops"], rel=1e-12)
        assert sum(r["flops_by_part"].values()) == r["flops"]
        assert r["flops"] == prefill_flops(_cfg(), r["input_len"], 48)["total"]


def test_breakdown_parts_sum_within_the_total(rows):
    parts = [r for r in rows if r["bench"] == "prefill_breakdown"]
    flops = {r["input_len"]: r["flops_by_part"] for r in rows if r["bench"] == "prefill"}
    assert [r["input_len"] for r in parts] == [32, 80]
    assert [r["forwards"] for r in parts] == [1, 2]          # 80 tokens in chunks of 48
    for r in parts:
        f = flops[r["input_len"]]
        assert set(r["achieved_tflops"]) == {"mamba", "attention", "moe", "lm_head"}
        assert r["achieved_tflops"]["attention"] == pytest.approx(
            (f["attn_proj"] + f["attn_scores"]) / r["parts_s"]["attention"] / 1e12)
        assert "TFLOP/s" in format_table(r) and "moe.router" in format_table(r)
        p = r["parts_s"]
        assert set(p) == {*TOP, "other_forward", "engine"}
        assert all(v >= 0 for v in p.values())
        for kind in ("mamba", "attention", "moe", "norm", "lm_head"):   # the tiny model's kinds
            assert p[kind] > 0, kind
        assert p["mlp"] == 0                                  # M*ME has no dense MLP layer
        measured = sum(p[k] for k in TOP)
        assert measured <= r["forward_s"] * (1 + 1e-9)
        assert r["forward_s"] <= r["ttft_s"]
        assert sum(p.values()) == pytest.approx(r["ttft_s"], rel=1e-9)
        assert set(r["nested_s"]) == set(NESTED)
        assert all(r["nested_s"][k] > 0 for k in NESTED if k.startswith("mamba."))
        for kind in ("mamba", "moe"):
            inside = sum(v for k, v in r["nested_s"].items() if k.startswith(kind + "."))
            assert inside <= p[kind] * (1 + 1e-9)
        assert "mamba.scan" in format_table(r)
        assert r["pct_of_ttft"]["mamba"] == pytest.approx(100 * p["mamba"] / r["ttft_s"])


def test_breakdown_leaves_the_model_unhooked():
    from blockspec.bench.engine_bench import build_engine
    from blockspec.bench.prefill_breakdown import breakdown

    ns = _args(["--device", "cpu", "--dtype", "float32"], input_len=16, output_len=1)
    engine, _ = build_engine(ns, 1)
    try:
        row = breakdown(engine, 16, list(range(3, 19)))
        assert row["forwards"] == 1
        modules = list(engine.model.modules())
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in modules)
        assert not any(name in m.__dict__ for m in modules
                       for name in ("_mamba", "compute_logits", "add_forward", "_in", "_conv",
                                    "_norm_out"))
        from blockspec.layers import mamba2
        assert all(not hasattr(getattr(mamba2, f), "__wrapped__") and
                   getattr(mamba2, f).__module__ != "blockspec.bench.prefill_breakdown"
                   for f in ("causal_conv1d", "ssd_scan", "ssd_chunked_scan"))
        with pytest.raises(ValueError, match="input_len"):
            breakdown(engine, 17, list(range(3, 19)))
    finally:
        engine.shutdown()


def test_flops_match_a_hand_count_of_the_tiny_model():
    """M*ME, d=64, vocab 259; 40 tokens in prefill chunks of 24 and 16."""
    L, d = 40, 64
    mamba_proj = 2 * d * (64 + 128 + 4) + 2 * 64 * d          # in_proj (z, xBC, dt), out_proj
    attn_proj = 2 * d * 64 * 2 + 2 * d * 32 * 2               # q, o (4 x 16); k, v (2 x 16)
    scores = 2 * 2 * 16 * 4 * sum(range(1, L + 1))            # QK^T + PV over positions 1..L
    router, routed, shared = 2 * d * 4, 2 * (2 * d * 64 * 2), 2 * d * 64 * 2

    def scan_chunk(q: int) -> int:                            # 4 heads, P = N = 16
        return 4 * (2 * q * q * 16 + 2 * q * q * 16 + 2 * 2 * q * 16 * 16)
    # prefill chunk 24 -> scan chunks 16 + 8; prefill chunk 16 -> one scan chunk of 16
    scan = 2 * 4 * 128 * L + scan_chunk(16) + scan_chunk(8) + scan_chunk(16)
    expected = (2 * (mamba_proj * L + scan) + attn_proj * L + scores
                + (router + routed + shared) * L + 2 * 2 * d * 259)       # lm_head per chunk
    got = prefill_flops(_cfg(), L, 24)
    assert got["total"] == expected
    assert got["attn_scores"] == scores and got["lm_head"] == 2 * 2 * d * 259
    assert chunk_lengths(L, 24) == [24, 16] and chunk_lengths(L, None) == [40]


def test_projection_flops_are_twice_the_weights_a_token_multiplies():
    """Cross-check against the model's own shapes: 2 x the weight elements of each projection
    a token runs through (top-k of the E experts)."""
    cfg = _cfg()
    with torch.device("meta"):
        model = NemotronHForCausalLM(cfg)
    numel = lambda m: sum(p.numel() for n, p in m.named_parameters() if n.endswith("weight"))
    layers = model.backbone.layers
    mamba = next(b.mixer for b in layers if b.kind == "mamba")
    attn = next(b.mixer for b in layers if b.kind == "attention")
    moe = next(b.mixer for b in layers if b.kind == "moe")
    per = per_token_projection_flops(cfg)
    assert per["mamba_proj"] == 2 * (numel(mamba.in_proj) + numel(mamba.out_proj))
    assert per["attn_proj"] == 2 * sum(numel(getattr(attn, f"{x}_proj")) for x in "qkvo")
    assert per["moe_router"] == 2 * moe.gate.weight.numel()
    assert per["moe_routed"] == 2 * numel(moe.experts) * cfg.num_experts_per_tok // cfg.n_routed_experts
    assert per["moe_shared"] == 2 * numel(moe.shared_experts)
    head = model.lm_head.weight.numel()
    assert prefill_flops(cfg, 10)["lm_head"] == 2 * head


def test_flops_scale_as_the_formula_says():
    L = 64
    k1, k2 = prefill_flops(_cfg(num_experts_per_tok=1), L), prefill_flops(_cfg(num_experts_per_tok=2), L)
    one_expert = 2 * 2 * 64 * 64 * L                          # up + down of one expert, L tokens
    assert k2["total"] - k1["total"] == one_expert            # one MoE layer
    a, b = prefill_flops(_cfg(), L)["attn_scores"], prefill_flops(_cfg(), 2 * L)["attn_scores"]
    assert b / a == pytest.approx(2 * (2 * L + 1) / (L + 1))  # ~4x: quadratic
    assert prefill_flops(_cfg(hybrid_override_pattern="MEME"), L)["attn_scores"] == 0
    # chunking moves only the scan's chunk boundaries and the lm_head count
    whole, chunked = prefill_flops(_cfg(), 100), prefill_flops(_cfg(), 100, 30)
    for part in ("mamba_proj", "attn_proj", "attn_scores", "moe_routed", "moe_shared"):
        assert whole[part] == chunked[part], part
    assert chunked["lm_head"] == math.ceil(100 / 30) * whole["lm_head"]
    with pytest.raises(ValueError, match="input_len"):
        prefill_flops(_cfg(), 0)


def test_flags_and_refusals():
    assert _args(["--input-len", "1024,4096,16384"]).input_len == [1024, 4096, 16384]
    with pytest.raises(ValueError, match="--input-len takes one length"):
        decode_run(_args(["--input-len", "8,16", "--device", "cpu"]))
    with pytest.raises(ValueError, match="--breakdown"):
        decode_run(_args(["--breakdown", "--device", "cpu"]))
    with pytest.raises(ValueError, match="--random-draft"):
        run(_args(["--prefill", "--random-draft", "dflash", "--device", "cpu"]))
    with pytest.raises(ValueError, match="batch 1"):
        run(_args(["--prefill", "--batch-size", "2", "--device", "cpu"]))


def test_chunk_sizes_run_on_one_engine():
    """A list of chunk sizes: every length at every size, each row naming its size (80 tokens
    in two forwards of 40, then one of 80); the decode benchmark takes one size."""
    ns = _args(["--prefill", "--input-len", "80", "--chunked-prefill-size", "40,80",
                "--breakdown", "--repeats", "1", "--device", "cpu", "--dtype", "float32"])
    rows = run(ns)
    parts = [r for r in rows if r["bench"] == "prefill_breakdown"]
    assert [(r["chunked_prefill_size"], r["forwards"]) for r in parts] == [(40, 2), (80, 1)]
    assert [r["chunked_prefill_size"] for r in rows if r["bench"] == "prefill"] == [40, 80]
    with pytest.raises(ValueError, match="one size"):
        decode_run(_args(["--chunked-prefill-size", "40,80", "--device", "cpu"]))
