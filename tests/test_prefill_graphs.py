"""Prefill chunks through the padded forward that CUDA graphs replay (``runtime/prefill_graphs``),
run eagerly on the CPU: a padded chunk leaves the caches exactly as the plain chunk does
(its padded rows write only the dummy slot and carry the Mamba state over unchanged), and
whole engines answer token for token as with eager prefill (AR, DFlash, DSpark; greedy and
seeded; with prefix-cache hits that resume mid-prompt)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from blockspec import Engine
from blockspec.runtime.prefill_graphs import MAX_PAD, PAD_FREE, PrefillGraphs, buckets, pieces
from tests.spec_fixtures import low_entropy_target_and_drafts


@pytest.mark.parametrize("cap", [16, 40, 512, 2048])
def test_pieces_cover_the_chunk_with_bounded_padding(cap):
    sizes = buckets(cap)
    assert sizes == sorted(set(sizes)) and sizes[-1] == cap
    for n in range(1, cap + 1):
        parts = pieces(n, sizes)
        assert sum(r for r, _ in parts) == n
        assert all(b in sizes and r <= b for r, b in parts)
        assert all(r == b for r, b in parts[:-1])            # only the last piece pads
        real, bucket = parts[-1]
        assert bucket <= max(PAD_FREE, sizes[0]) or bucket - real <= MAX_PAD * real
        assert len(parts) <= 4, (n, parts)


def _tiny_engine(folder, **kw):
    return Engine(model_path=str(folder), device="cpu", max_total_tokens=512, page_size=4, **kw)


def _same_caches(engine, padded, tol: float) -> None:
    """Two slots prefill the same 70 tokens in chunks of 13, 40 and 17: one through eager
    extend, one padded (to 16, 40 and 32 rows). Logits, positions of the rows, the Mamba
    state and the prompt's K/V agree within ``tol`` (relative to each tensor's largest
    value); K/V past the prompt is untouched."""
    runner, m = engine.runner, engine.memory
    page = m.page_size
    a, b = m.admit(80), m.admit(80)
    for cache in (m.kv.k, m.kv.v):
        for layer in cache:
            layer.fill_(7.0)

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        scale = float(want.float().abs().max()) or 1.0
        assert float((got.float() - want.float()).abs().max()) <= tol * scale

    vocab = engine.config.vocab_size
    ids = [random.Random(0).randrange(3, vocab) for _ in range(70)]
    at = 0
    for n in (13, 40, 17):
        want, want_rows = runner.extend([a.slot], [at], [ids[at:at + n]])
        got, got_rows = padded.extend(b.slot, at, ids[at:at + n], ())
        close(got.logits, want.logits)
        assert got_rows[0].tolist() == want_rows[0].tolist()     # positions
        assert got_rows.shape == want_rows.shape
        at += n
    for pool in (m.mamba.conv, m.mamba.ssm):
        for layer in pool:
            close(layer[b.slot], layer[a.slot])

    def slots_of(r, n: int) -> torch.Tensor:
        flat = torch.tensor(r.pages)[:, None] * page + torch.arange(page)
        return flat.reshape(-1)[:n].to(m.device)

    for cache in (m.kv.k, m.kv.v):
        for layer in cache:
            close(layer[slots_of(b, 70)], layer[slots_of(a, 70)])
            rest = slots_of(b, 80)[70:]
            assert bool((layer[rest] == 7.0).all()), "a padded row wrote into the request"
    m.release(a)
    m.release(b)


def test_padded_chunks_write_the_caches_the_plain_chunks_write(tiny_folder):
    with _tiny_engine(tiny_folder) as engine:
        r = engine.runner
        _same_caches(engine, PrefillGraphs(r.model, engine.memory, r.prefill_attn, 40,
                                           capture=False), 1e-5)


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return low_entropy_target_and_drafts(tmp_path_factory.mktemp("padded_spec"))


GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_new_tokens": 8, "temperature": 1.0, "top_k": 8, "seed": 5, "ignore_eos": True}


@pytest.mark.parametrize("algo", [None, "DFLASH", "DSPARK"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_engine_answers_with_padded_prefill_are_the_eager_ones(tiny_folder, spec, algo, params):
    """Prompts of 5-90 tokens (one to three chunks of 40, prefix hits resuming at page and
    checkpoint boundaries) with every chunk padded, against the same engine kind prefilling
    eagerly."""
    folder, vocab = (tiny_folder, 259) if algo is None else (spec[0], 23)
    extra = {} if algo is None else {"speculative_algorithm": algo,
                                     "speculative_draft_model_path": str(spec[1][algo])}
    kw = dict(chunked_prefill_size=40, enable_radix_cache=True, mamba_track_interval=16, **extra)
    eager, padded = _tiny_engine(folder, **kw), _tiny_engine(folder, **kw)
    r = padded.runner
    r.prefill_graphs = PrefillGraphs(r.model, padded.memory, r.prefill_attn, 40, capture=False)
    calls = []
    real = r.prefill_graphs.extend
    r.prefill_graphs.extend = lambda *a: (calls.append(len(a[2])), real(*a))[1]
    rng = random.Random(4)
    base = [rng.randrange(3, vocab) for _ in range(90)]
    prompts = [base[:5], base[:37], base[:90], base[:50] + [3], base[:90] + [4, 5]]
    with eager, padded:
        for p in prompts:
            want = eager.generate(input_ids=p, sampling_params=params)
            got = padded.generate(input_ids=p, sampling_params=params)
            assert got["output_ids"] == want["output_ids"], f"prompt of {len(p)}"
            assert got["meta_info"]["cached_tokens"] == want["meta_info"]["cached_tokens"]
        assert calls and any(n % 16 for n in calls)          # padded pieces ran
        assert padded.memory.prefix.hit_tokens > 0


MODELOPT = Path(__file__).parent / "fixtures" / "modelopt"


@pytest.mark.parametrize("name, dtype, tol", [("tiny", "float32", 1e-4),
                                              ("mixed_lightning", "bfloat16", 3e-2)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graph_replayed_chunks_write_what_eager_chunks_write(tiny_folder, name, dtype, tol):
    """The captured graphs (Triton attention, scan and conv; for the ModelOpt fixture the
    W4A16 grouped experts) against eager chunks on the same GPU."""
    folder = tiny_folder if name == "tiny" else MODELOPT / name
    with Engine(model_path=str(folder), device="cuda", dtype=dtype, max_total_tokens=512,
                page_size=4) as engine:
        r = engine.runner
        graphs = PrefillGraphs(r.model, engine.memory, r.prefill_attn, 40, capture=True)
        r.prefill_graphs = None            # the runner's own extend runs eagerly
        _same_caches(engine, graphs, tol)
        assert {b for b, _ in graphs.graphs._graphs} == {16, 32, 40}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("algo", [None, "DFLASH", "DSPARK"])
def test_gpu_engine_answers_with_graph_prefill_are_the_eager_ones(tiny_folder, spec, algo):
    """fp32 on the GPU, prefix cache on: graph-replayed prefill chunks against
    ``cuda_graph_max_prefill_tokens=0``, token for token."""
    folder, vocab = (tiny_folder, 259) if algo is None else (spec[0], 23)
    extra = {} if algo is None else {"speculative_algorithm": algo,
                                     "speculative_draft_model_path": str(spec[1][algo])}
    kw = dict(model_path=str(folder), device="cuda", dtype="float32", page_size=4,
              chunked_prefill_size=40, enable_radix_cache=True, mamba_track_interval=16, **extra)
    rng = random.Random(6)
    base = [rng.randrange(3, vocab) for _ in range(90)]
    prompts = [base[:5], base[:37], base[:90], base[:50] + [3], base[:90] + [4, 5]]
    with Engine(cuda_graph_max_prefill_tokens=0, **kw) as eager, Engine(**kw) as graphs:
        assert eager.runner.prefill_graphs is None
        for params in (GREEDY, SEEDED):
            for p in prompts:
                want = eager.generate(input_ids=p, sampling_params=params)
                got = graphs.generate(input_ids=p, sampling_params=params)
                assert got["output_ids"] == want["output_ids"], f"prompt of {len(p)}"
        assert graphs.runner.prefill_graphs.graphs._graphs
