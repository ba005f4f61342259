"""The benchmark harness runs and reports self-consistent figures (speed is never asserted)."""
from __future__ import annotations

import json

import pytest
import torch

from blockspec.bench.engine_bench import decode_window, run, step_weight_bytes
from tests.bench_fixtures import bench_args as _args



def test_bench_reports_consistent_numbers(tmp_path):
    out = tmp_path / "rows.jsonl"
    out.write_text('{"earlier": true}\n')             # --out appends to what is there
    rows = run(_args(device="cpu", input_len=8, output_len=6, batch_size=[2, 1], repeats=1,
                     out=str(out)))
    assert [r["batch_size"] for r in rows] == [2, 1]
    # each row reached the file as it was measured, once
    assert [json.loads(line) for line in out.read_text().splitlines()] == [{"earlier": True}, *rows]
    for r in rows:
        assert r["decode_tok_per_s"] > 0 and r["step_ms"] > 0 and r["model"] == "random:tiny"
        assert r["achieved_GBps"] * 1e9 * r["step_ms"] / 1e3 == pytest.approx(
            r["weight_bytes_per_step"], rel=1e-2)
        assert r["pct_of_floor"] == pytest.approx(
            100 * r["floor_step_ms_at_4.8TBps"] / r["step_ms"], rel=2e-2)


@pytest.mark.parametrize("chunk, prefill_runs", [(None, 0), (8, 2)])
def test_prefill_only_runs_happen_only_when_chunks_interleave(monkeypatch, chunk, prefill_runs):
    """One prefill for every prompt: decode is the runs' own window and no prefill-only run is
    made. Prompts of one chunk each (8 tokens, chunk 8): the second prefills beside the first's
    decode steps, so a prefill-only run per repeat is subtracted instead."""
    from blockspec.engine import Engine

    calls = []
    real = Engine.generate

    def spy(self, *a, **kw):
        calls.append(kw["sampling_params"]["max_new_tokens"])
        return real(self, *a, **kw)

    monkeypatch.setattr(Engine, "generate", spy)
    extra = {} if chunk is None else {"chunked_prefill_size": chunk}
    (row,) = run(_args(device="cpu", input_len=8, output_len=6, batch_size=[2], repeats=2,
                       **extra))
    assert calls.count(1) == prefill_runs and calls.count(6) == 3      # warm-up + 2 timed
    assert row["decode_s"] > 0 and 0 < row["prefill_s"]


def test_decode_window_is_the_runs_own_when_one_prefill_gave_every_first_token():
    def outs(*pairs):
        return [{"meta_info": {"ttft": t, "e2e_latency": e}} for t, e in pairs]

    # one prefill: first tokens together, the window runs from the last of them to the last finish
    assert decode_window(outs((0.100, 1.0), (0.1002, 1.2), (0.1001, 0.9))) == pytest.approx(1.0998)
    # chunks interleaved with decode steps: no clean start, the caller subtracts a prefill run
    assert decode_window(outs((0.1, 1.0), (0.4, 1.2))) is None
    assert decode_window(outs((0.1, 0.1))) is None


@pytest.mark.parametrize("kind, tau", [("dflash", 2.6), ("dspark", 3.2)])
def test_simulated_acceptance_lands_within_ten_percent(kind, tau):
    """--simulate-accept-length TAU: the measured mean committed length comes out near TAU."""
    rows = run(_args(device="cpu", input_len=8, output_len=60, batch_size=[2], repeats=1,
                     random_draft=kind, speculative_num_draft_tokens=4, simulate_accept_length=tau))
    assert rows[0]["verify_width"] == 4
    assert rows[0]["accept_length"] == pytest.approx(tau, rel=0.1)


def test_simulated_acceptance_needs_a_draft_and_a_reachable_tau():
    with pytest.raises(ValueError, match="needs a draft"):
        run(_args(device="cpu", input_len=4, output_len=4, simulate_accept_length=2.0, repeats=1))
    with pytest.raises(ValueError, match=r"in \[1, 4\]"):
        run(_args(device="cpu", input_len=4, output_len=4, random_draft="dflash", repeats=1,
                  speculative_num_draft_tokens=4, simulate_accept_length=5.0))


def test_preset_too_big_for_the_cpu_is_refused_with_the_figure(monkeypatch):
    from blockspec.bench import engine_bench

    monkeypatch.setattr(engine_bench, "_memory_bytes", lambda: 8 << 30)
    with pytest.raises(ValueError, match=r"lightning-mini needs [0-9.]+ GiB"):
        run(_args(device="cpu", preset="lightning-mini", repeats=1))


def test_expert_bytes_follow_touched_experts(tmp_path):
    from blockspec.tiny_model import write_tiny_model
    from blockspec.engine import Engine

    e = Engine(model_path=str(write_tiny_model(tmp_path / "m")), device="cpu")
    one, many = step_weight_bytes(e.model, 1), step_weight_bytes(e.model, 64)
    expert = sum(t.numel() * t.element_size() for n, t in e.model.state_dict().items() if ".experts." in n)
    emb_row = e.config.hidden_size * 4
    # 4 experts, top-2: one token touches half the expert bytes, 64 tokens nearly all; the
    # embedding lookup reads one row per token
    want = expert * (1 - 0.5 ** 64) - expert * 0.5 + 63 * emb_row
    assert many - one == pytest.approx(want, rel=1e-6)


def test_lightning_plan_matches_the_quantize_recipe():
    """The quantized presets use the formats `quantize --recipe lightning` writes."""
    from blockspec.bench.presets import LightningPlan
    from blockspec.quant.config import FP8, W4A16_NVFP4

    plan = LightningPlan()
    assert plan.format_for("backbone.layers.1.mixer.experts.7.up_proj") == W4A16_NVFP4
    assert plan.format_for("backbone.layers.1.mixer.shared_experts.down_proj") == W4A16_NVFP4
    assert plan.format_for("lm_head") == W4A16_NVFP4
    assert plan.format_for("backbone.layers.0.mixer.in_proj") == FP8
    assert plan.format_for("backbone.layers.3.mixer.q_proj") is None
    assert plan.format_for("backbone.layers.1.mixer.gate") is None


def test_random_preset_weights_are_finite_and_tame():
    from blockspec.bench.presets import build_target

    m = build_target("tiny", torch.device("cpu"), torch.float32)
    for name, t in m.state_dict().items():
        if t.is_floating_point():
            assert torch.isfinite(t.float()).all(), name
            assert t.float().abs().max() < 20, name


def test_bench_writes_nothing(tmp_path, monkeypatch):
    """Presets are built in memory: no temporary model folder, nothing in the working folder."""
    import tempfile

    import torch._dynamo  # noqa: F401 - torch makes its own cache folder under TMPDIR the first
    # time a module constructor imports this; that is torch's, not the bench's

    work, tmp = tmp_path / "cwd", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)          # re-read TMPDIR
    run(_args(device="cpu", input_len=4, output_len=3, repeats=1, random_draft="dflash",
              speculative_num_draft_tokens=3))
    assert list(work.iterdir()) == [] and list(tmp.iterdir()) == []


def test_a_new_graph_size_comes_with_every_smaller_size_it_lacks(tmp_path):
    """``ensure_graph`` captures the graph asked for and every smaller captured size not yet
    there (a batch shrinks into those as requests finish), largest first, each once."""
    from blockspec import Engine
    from blockspec.tiny_model import write_tiny_model
    from blockspec.runtime.graph_runner import capture_sizes

    class Graphs:          # the GraphRunner surface ensure_graph uses, without CUDA
        def __init__(self, max_bs):
            self.sizes, self.captured = capture_sizes(max_bs), []

        def has(self, key):
            return key in self.captured

        def capture(self, key, fn):
            self.captured.append(key)

    e = Engine(model_path=str(write_tiny_model(tmp_path / "m")), device="cpu")
    key = (True, False, False)
    try:
        runner = e.runner
        runner.graphs = Graphs(16)
        assert runner.ensure_graph("decode", key, 4, runner.decode_step) == ("decode", key, 4)
        assert [k[2] for k in runner.graphs.captured] == [4, 2, 1]
        runner.ensure_graph("decode", key, 16, runner.decode_step)
        assert [k[2] for k in runner.graphs.captured] == [4, 2, 1, 16, 8]
        runner.ensure_graph("spec", key, 2, runner.decode_step)       # another kind: its own
        assert runner.graphs.captured[-2:] == [("spec", key, 2), ("spec", key, 1)]
    finally:
        runner.graphs = None
        e.shutdown()


SCHEMA = '{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}'


def test_json_schema_bench_constrains_every_sequence(tmp_path, monkeypatch):
    """--json-schema: every measured sequence is valid-so-far JSON of the schema (the grammar
    ran), and steps are counted from the tokens produced."""
    pytest.importorskip("xgrammar")
    from blockspec.bench import engine_bench
    from blockspec.engine import Engine

    schema = tmp_path / "s.json"
    schema.write_text(SCHEMA)
    seen = []
    real = Engine.generate

    def spy(self, *a, **kw):
        outs = real(self, *a, **kw)
        seen.append((self.tokenizer, outs))
        return outs

    monkeypatch.setattr(Engine, "generate", spy)
    rows = engine_bench.run(_args(device="cpu", input_len=4, output_len=12, batch_size=[2],
                                  repeats=1, json_schema=str(schema)))
    assert rows[0]["json_schema"] == str(schema) and rows[0]["step_ms"] > 0
    tok, outs = seen[-1]
    for o in outs:
        text = tok.decode(o["output_ids"])
        assert text.startswith('{"answer": "'), text      # the schema's only way to begin


def test_json_schema_and_simulated_acceptance_are_refused_together(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(SCHEMA)
    with pytest.raises(ValueError, match="ignore the grammar"):
        run(_args(device="cpu", random_draft="dflash", simulate_accept_length=2.0,
                  json_schema=str(schema), repeats=1))


def test_synthetic_tokenizer_has_the_size_asked_and_json_pieces(tmp_path):
    from blockspec.bench.synthetic_tokenizer import synthetic_tokenizer

    tok = synthetic_tokenizer(5000, tmp_path / "v")
    assert tok.vocab_size == 5000 and tok.eos_token_id == 2 and tok.bos_token_id == 1
    pieces = tok.backend.get_vocab()
    assert len(pieces) == 5000
    assert any('"' in p and len(p) > 1 for p in pieces)           # multi-char pieces with quotes
    assert synthetic_tokenizer(5000, tmp_path / "w").backend.get_vocab() == pieces   # deterministic
