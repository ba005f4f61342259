"""The graph-ready execution layer on a GPU (skipped without CUDA): captured steps replay
exactly, make no host sync, and every fast path agrees with its torch reference."""
from __future__ import annotations

import pytest
import torch

from pathlib import Path

from blockspec import Engine
from tests.spec_fixtures import two_token_chi_square_pvalue

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FIXTURES = Path(__file__).parent / "fixtures" / "spec_gpu"   # scripts/make_spec_gpu_fixtures.py
PROMPTS = [[3, 5, 7, 11, 2], [8, 1], [13, 4, 9], [6, 6, 6, 1, 2, 3, 4]]
GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def spec():
    """The low-entropy tiny target of tests/spec_fixtures.py and two drafts, committed (a GPU
    machine may have another transformers than the one that wrote them)."""
    return FIXTURES / "target", {k: FIXTURES / k for k in ("dflash", "dspark")}


def _engine(spec, kind, device, dtype="float32", **kw):
    folder, drafts = spec
    extra = dict(speculative_algorithm=kind.upper(), speculative_draft_model_path=str(drafts[kind])) if kind else {}
    return Engine(model_path=str(folder), device=device, dtype=dtype, **extra, **kw)


def _ids(outs):
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("kind", [None, "dflash", "dspark"])
def test_graphs_equal_eager_and_cpu_reference(spec, kind):
    """fp32: CUDA graphs (batch 1, and 3 padded to 4) == eager CUDA == the CPU reference, and
    speculative == target-only."""
    cpu = _ids(_engine(spec, None, "cpu").generate(input_ids=PROMPTS[:3], sampling_params=GREEDY))
    graph_e = _engine(spec, kind, "cuda")
    assert graph_e.runner.graphs is not None and graph_e.backends.decode == "triton"
    eager_e = _engine(spec, kind, "cuda", disable_cuda_graph=True)
    for prompts in (PROMPTS[:1], PROMPTS[:3]):
        want = cpu[: len(prompts)]
        assert _ids(graph_e.generate(input_ids=prompts, sampling_params=GREEDY)) == want
        assert _ids(eager_e.generate(input_ids=prompts, sampling_params=GREEDY)) == want
    assert any(k[2] == 4 for k in graph_e.runner.graphs._graphs)           # 3 ran padded to 4


@pytest.mark.parametrize("kind", [None, "dflash", "dspark"])
def test_bf16_replay_equals_eager_at_a_captured_size(spec, kind):
    """Same kernels, same shapes: a replayed step is bitwise the eager step."""
    sp = {**GREEDY, "max_new_tokens": 24}
    a = _ids(_engine(spec, kind, "cuda", "bfloat16").generate(input_ids=PROMPTS, sampling_params=sp))
    b = _ids(_engine(spec, kind, "cuda", "bfloat16", disable_cuda_graph=True)
             .generate(input_ids=PROMPTS, sampling_params=sp))
    assert a == b


@pytest.mark.parametrize("kind", [None, "dflash", "dspark"])
def test_a_step_makes_no_host_sync(spec, kind):
    """The step function (eager) and its graph replay run under sync_debug_mode('error'):
    any device-to-host read, .item(), nonzero, or blocking copy inside would raise."""
    from blockspec.runtime.metadata import StepBatch

    e = _engine(spec, kind, "cuda", "bfloat16")
    e.generate(input_ids=PROMPTS, sampling_params={**GREEDY, "max_new_tokens": 8})   # captures
    runner = e.runner
    fn = e.drafter.step_fn if kind else runner.decode_step
    held = [e.memory.admit(16) for _ in range(4)]
    try:
        for temperature, top_p in ((0.0, 1.0), (0.8, 0.9)):
            batch = StepBatch(slots=[h.slot for h in held], prefix_lens=[3, 5, 2, 7], tokens=[1, 2, 3, 4],
                              temperature=[temperature] * 4, top_k=[-1] * 4, top_p=[top_p] * 4,
                              min_p=[0.0] * 4, seeds=[1, 2, 3, 4], sample_counters=[0] * 4,
                              verify_counters=[0] * 4)
            key = batch.sampling_key()
            gkey = runner.ensure_graph("spec" if kind else "decode", key, 4, fn)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                runner.inputs.fill(batch, 4)
                fn(runner.inputs.view(4), key)
                runner.graphs.replay(gkey)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    finally:
        for h in held:
            e.memory.release(h)


def test_seeded_sampling_alone_and_batched_on_gpu(spec):
    e = _engine(spec, "dflash", "cuda", "bfloat16")
    sp = {"max_new_tokens": 24, "temperature": 0.9, "top_p": 0.95, "ignore_eos": True, "seed": 1234}
    alone = e.generate(input_ids=PROMPTS[0], sampling_params=sp)["output_ids"]
    batch = e.generate(input_ids=PROMPTS, sampling_params=[sp, GREEDY, {**sp, "seed": 9}, GREEDY])
    assert batch[0]["output_ids"] == alone
    assert len(set(alone)) > 2


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_sampling_is_lossless_on_gpu(spec, kind):
    """Chi-square of the first two sampled tokens against the exact target joint, through
    captured graphs (batches of up to 32)."""
    params = {"max_new_tokens": 2, "temperature": 0.7, "top_p": 0.9, "ignore_eos": True}
    prompt, n = [7, 5], 12000
    e = _engine(spec, kind, "cuda", max_running_requests=32, max_total_tokens=32 * 16)
    outs = e.generate(input_ids=[prompt] * n, sampling_params=params)
    assert e.runner.graphs._graphs
    assert two_token_chi_square_pvalue(e, outs, prompt, params) > 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len, uniform", [(1, True), (4, True), (9, False)])
def test_triton_paged_attention_matches_reference_at_lightning_shape(dtype, q_len, uniform):
    """32 query heads, 2 KV heads, head dim 128, long and short contexts, shuffled pages."""
    from blockspec.attention import triton_paged as tp
    from blockspec.attention.torch_native import TorchNativeAttention
    from blockspec.forward_metadata import Mode
    from blockspec.runtime.metadata import extend_metadata, uniform_metadata

    g = torch.Generator(device="cuda").manual_seed(q_len)
    page, hq, hkv, d = 16, 32, 2, 128
    starts = [5, 700, 2047] if uniform else [0, 300, 1500]
    lens = [q_len] * 3 if uniform else [9, 17, 3]
    pages_per = max(s + q for s, q in zip(starts, lens)) // page + 2
    perm = torch.randperm(3 * pages_per + 1, device="cuda", generator=g)
    table = torch.zeros(4, pages_per, dtype=torch.int32, device="cuda")
    table[:3] = perm[: 3 * pages_per].view(3, pages_per).to(torch.int32)
    k = torch.randn((3 * pages_per + 1) * page, hkv, d, device="cuda", generator=g).to(dtype)
    v = torch.randn_like(k)
    q = torch.randn(sum(lens), hq, d, device="cuda", generator=g).to(dtype)
    ref_backend = TorchNativeAttention()
    if uniform:
        inp = {"slot": torch.arange(3, device="cuda"), "prefix": torch.tensor(starts, device="cuda")}
        meta = uniform_metadata(inp, q_len, Mode.VERIFY, torch.zeros(3 * q_len, dtype=torch.long, device="cuda"),
                                table, page, ref_backend, None, max_seq_len=max(starts) + q_len)
    else:
        meta = extend_metadata([0, 1, 2], starts, [[0] * n for n in lens], device=torch.device("cuda"),
                               block_table=table, page_size=page, attn=ref_backend, kv=None, mamba=None,
                               logits_all=True)
    ref = ref_backend.attend(q.float(), k.float(), v.float(), meta, scale=d ** -0.5, causal=True,
                             window=None, sink=None)
    got = tp.TritonPagedAttention().attend(q, k, v, meta, scale=d ** -0.5, causal=True, window=None, sink=None)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)


def test_fp8_scaled_mm_matches_reference():
    from blockspec.quant.linear import fp8_w8a8, fp8_w8a8_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    for m, n, kdim in ((1, 10304, 2688), (16, 2688, 4096), (5, 64, 32)):
        x = torch.randn(m, kdim, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, kdim, device="cuda", generator=g) * 2).clamp(-400, 400).to(torch.float8_e4m3fn)
        ws = torch.tensor(0.01, device="cuda")
        xs = x.abs().amax().float() / 448
        got = fp8_w8a8(x, w, ws, xs).float()
        ref = fp8_w8a8_reference(x, w, ws, xs).float()
        assert ((got - ref).abs().max() / ref.abs().max()) < 1e-2


def test_grouped_mm_moe_matches_reference_loop():
    from blockspec.bench.presets import build_target
    from blockspec.layers.moe import MoE

    model = build_target("lightning-mini", torch.device("cuda"), torch.bfloat16)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert moe._dense is not None
    h = torch.randn(37, 2688, device="cuda").bfloat16()
    ids, w = moe.gate(h)
    got = moe.routed_dense(h, ids, w, None).float()
    ref = moe.routed_reference(h, ids, w).float()
    assert ((got - ref).abs().max() / ref.abs().max()) < 2e-2
    # decode-sized: the per-pair path, with the shared expert's add fused into the combine
    few = h[:3]
    with torch.no_grad():                     # the fast paths run without autograd only
        shared = moe.shared_experts(few)
        got = moe.routed(few, ids[:3], w[:3], shared).float()
        ref = moe.routed_reference(few, ids[:3], w[:3], shared).float()
    assert ((got - ref).abs().max() / ref.abs().max()) < 2e-2
