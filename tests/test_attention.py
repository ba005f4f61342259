"""Attention backends against each other and against a naive per-row reference.

The Triton paged kernel runs through the Triton interpreter on CPU (and compiled on a GPU);
every case draws fresh random caches, shuffled pages and ragged lengths."""
from __future__ import annotations

import math

import pytest
import torch

from blockspec.attention.torch_native import TorchNativeAttention
from blockspec.forward_metadata import Mode
from blockspec.runtime.metadata import extend_metadata, uniform_metadata

triton = pytest.importorskip("triton")

PAGE = 4


def naive(q, k_cache, v_cache, table, slot, seq_len, qpos, scale, causal, window, sink):
    """One query row of one request, in fp64, straight from the definition."""
    hq, d = q.shape
    hkv = k_cache.shape[1]
    out = torch.zeros(hq, d, dtype=torch.float64)
    keys = [kp for kp in range(seq_len)
            if (not causal or kp <= qpos) and (window is None or qpos - kp < window)]
    slots = [int(table[slot, kp // PAGE]) * PAGE + kp % PAGE for kp in keys]
    for h in range(hq):
        kh = h // (hq // hkv)
        logits = [float(q[h].double() @ k_cache[s, kh].double()) * scale for s in slots]
        if sink is not None:
            logits.append(float(sink[h]))
        mx = max(logits)
        ex = [math.exp(x - mx) for x in logits]
        z = sum(ex)
        for e, s in zip(ex, slots):
            out[h] += e / z * v_cache[s, kh].double()
    return out


class Case:
    def __init__(self, seed, hq, hkv, d, starts, q_lens, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        self.hq, self.hkv, self.d = hq, hkv, d
        self.starts, self.q_lens = starts, q_lens
        n_req = len(starts)
        pages_per = max(s + q for s, q in zip(starts, q_lens)) // PAGE + 2
        total = n_req * pages_per + 3
        perm = torch.randperm(total, generator=g)
        self.table = torch.zeros(n_req + 1, pages_per, dtype=torch.int32)
        self.slots = list(range(n_req))[::-1]             # request b lives in slot n-1-b
        for b in range(n_req):
            self.table[self.slots[b]] = perm[b * pages_per:(b + 1) * pages_per].to(torch.int32)
        self.k = torch.randn(total * PAGE, hkv, d, generator=g).to(dtype)
        self.v = torch.randn(total * PAGE, hkv, d, generator=g).to(dtype)
        n = sum(q_lens)
        self.q = torch.randn(n, hq, d, generator=g).to(dtype)
        self.sink = torch.randn(hq, generator=g)

    def meta(self, backend, uniform: bool):
        if uniform:
            q_len = self.q_lens[0]
            inp = {"slot": torch.tensor(self.slots), "prefix": torch.tensor(self.starts)}
            return uniform_metadata(inp, q_len, Mode.VERIFY, torch.zeros(len(self.starts) * q_len, dtype=torch.long),
                                    self.table, PAGE, backend, None,
                                    max_seq_len=max(s + q for s, q in zip(self.starts, self.q_lens)))
        ids = [[0] * q for q in self.q_lens]
        return extend_metadata(self.slots, self.starts, ids, device=torch.device("cpu"),
                               block_table=self.table, page_size=PAGE, attn=backend, kv=None,
                               mamba=None, logits_all=True)


def run(backend, case: Case, uniform: bool, **kw):
    meta = case.meta(backend, uniform)
    return backend.attend(case.q, case.k, case.v, meta, **kw)


def expected(case: Case, scale, causal, window, sink):
    rows, r = [], 0
    for b, (s, q) in enumerate(zip(case.starts, case.q_lens)):
        for t in range(q):
            rows.append(naive(case.q[r], case.k, case.v, case.table, case.slots[b], s + q, s + t,
                              scale, causal, window, sink))
            r += 1
    return torch.stack(rows)


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


VARIANTS = {
    "causal": dict(causal=True, window=None, sink=False),
    "noncausal": dict(causal=False, window=None, sink=False),
    "window": dict(causal=True, window=5, sink=False),
    "noncausal_window_sink": dict(causal=False, window=6, sink=True),
    "sink": dict(causal=True, window=None, sink=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_torch_native_matches_naive(variant):
    kw = VARIANTS[variant]
    case = Case(1, hq=4, hkv=2, d=16, starts=[0, 9, 3], q_lens=[5, 2, 7])
    sink = case.sink if kw["sink"] else None
    got = run(TorchNativeAttention(), case, False, scale=0.3, causal=kw["causal"],
              window=kw["window"], sink=sink)
    torch.testing.assert_close(got.double(), expected(case, 0.3, kw["causal"], kw["window"], sink),
                               rtol=1e-5, atol=1e-5)


# every variant, split count, GQA group and layout appears at least once (the interpreter is
# slow, so not the full product)
TRITON_CASES = [
    ("causal", 1, 4, True), ("causal", 4, 2, False), ("noncausal", 4, 1, True),
    ("noncausal", 1, 8, False), ("window", 2, 4, True), ("window", 1, 2, False),
    ("sink", 4, 4, True), ("noncausal_window_sink", 1, 2, False),
    ("noncausal_window_sink", 4, 8, True), ("sink", 2, 8, True),
]
# masked head dims (not a power of two >= 16), and one wide enough that the split merge runs
# over several column chunks as well as several row chunks
HEAD_DIMS = {("window", 1, 2, False): 8, ("sink", 4, 4, True): 24, ("sink", 2, 8, True): 80}


@pytest.mark.parametrize("variant, splits, group, uniform", TRITON_CASES)
def test_triton_paged_matches_torch_native(interpreter, variant, splits, group, uniform):
    from blockspec.kernels import paged_attention as tp

    kw = VARIANTS[variant]
    seed = hash((variant, splits, group, uniform)) % 1000
    d = HEAD_DIMS.get((variant, splits, group, uniform), 16)
    if uniform:
        case = Case(seed, hq=2 * group, hkv=2, d=d, starts=[0, 11, 6], q_lens=[3, 3, 3])
    else:
        case = Case(seed, hq=2 * group, hkv=2, d=d, starts=[2, 0, 13], q_lens=[9, 4, 1])
    sink = case.sink if kw["sink"] else None
    meta = case.meta(TorchNativeAttention(), uniform)
    ref = TorchNativeAttention().attend(case.q, case.k, case.v, meta, scale=0.25,
                                        causal=kw["causal"], window=kw["window"], sink=sink)
    block_m = tp.pick_block_m(case.q_lens[0] * group) if uniform else 16
    if uniform:
        tr, t0 = tp.uniform_tiles(len(case.starts), case.q_lens[0], group, block_m, torch.device("cpu"))
    else:
        tr, t0 = tp.ragged_tiles(case.q_lens, group, block_m, torch.device("cpu"))
    got = tp.paged_attention(case.q, case.k, case.v, meta.block_table, meta.req_slots,
                             meta.seq_lens, meta.q_start, tr, t0, page_size=PAGE,
                             block_m=block_m, scale=0.25, causal=kw["causal"],
                             window=kw["window"], sink=sink, splits=splits)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_m, block_n, full, variant, d",
                         [(128, 32, False, "causal", 16), (64, 128, True, "causal", 16),
                          (256, 16, True, "causal", 16),
                          (32, 16, True, "causal", 24), (16, 16, True, "noncausal", 16),
                          (16, 16, True, "window", 16), (16, 32, True, "sink", 16)])
def test_triton_paged_prefill_launch_configs_match_torch_native(interpreter, block_m, block_n,
                                                                full, variant, d):
    """The tile heights, key blocks and unmasked full blocks ``scripts/tune_attention_prefill``
    sweeps, on ragged prefill chunks (GQA 4) with page-crossing key blocks and long contexts
    (the full blocks before each tile's first query), a masked head dim among them."""
    from blockspec.kernels import paged_attention as tp

    kw = VARIANTS[variant]
    case = Case(block_m + block_n + d, hq=8, hkv=2, d=d, starts=[2, 0, 53], q_lens=[37, 9, 3])
    sink = case.sink if kw["sink"] else None
    meta = case.meta(TorchNativeAttention(), False)
    ref = TorchNativeAttention().attend(case.q, case.k, case.v, meta, scale=0.25,
                                        causal=kw["causal"], window=kw["window"], sink=sink)
    tr, t0 = tp.ragged_tiles(case.q_lens, 4, block_m, torch.device("cpu"))
    got = tp.paged_attention(case.q, case.k, case.v, meta.block_table, meta.req_slots,
                             meta.seq_lens, meta.q_start, tr, t0, page_size=PAGE,
                             block_m=block_m, block_n=block_n, scale=0.25, causal=kw["causal"],
                             window=kw["window"], sink=sink, num_warps=8, num_stages=2,
                             full_blocks=full)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_launch_config_keeps_decode_tiles_and_gives_prefill_its_own():
    from blockspec.kernels import paged_attention as tp

    decode = tp.launch_config(16, torch.bfloat16)
    assert decode["block_m"] == 16 and decode["num_warps"] is None
    assert tp.launch_config(tp.PREFILL_ROWS, torch.bfloat16) == tp.PREFILL_CONFIG
    with pytest.raises(ValueError, match="block_n"):
        case = Case(1, hq=2, hkv=1, d=16, starts=[0], q_lens=[2])
        meta = case.meta(TorchNativeAttention(), True)
        tr, t0 = tp.uniform_tiles(1, 2, 2, 16, torch.device("cpu"))
        tp.paged_attention(case.q, case.k, case.v, meta.block_table, meta.req_slots,
                           meta.seq_lens, meta.q_start, tr, t0, page_size=PAGE, block_m=16,
                           scale=1.0, block_n=48)


def test_triton_backend_through_the_interface(interpreter):
    from blockspec.attention.triton_paged import TritonPagedAttention

    case = Case(7, hq=8, hkv=2, d=32, starts=[5, 0], q_lens=[4, 4])
    backend = TritonPagedAttention()
    for uniform in (True, False):
        meta = case.meta(backend, uniform)
        got = backend.attend(case.q, case.k, case.v, meta, scale=0.2, causal=True, window=None, sink=None)
        ref = run(TorchNativeAttention(), case, uniform, scale=0.2, causal=True, window=None, sink=None)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_forward_writes_new_rows_before_attending():
    """A block attends to itself: forward() writes K/V at out_slots first."""
    case = Case(3, hq=2, hkv=1, d=16, starts=[4], q_lens=[3])
    backend = TorchNativeAttention()
    meta = case.meta(backend, True)
    k_new, v_new = torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    out = backend.forward(case.q, k_new, v_new, case.k, case.v, meta, scale=0.25, causal=True)
    for t in range(3):
        pos = 4 + t
        slot = int(case.table[case.slots[0], pos // PAGE]) * PAGE + pos % PAGE
        assert torch.equal(case.k[slot], k_new[t]) and torch.equal(case.v[slot], v_new[t])
    torch.testing.assert_close(out.double(), expected(case, 0.25, True, None, None), rtol=1e-5, atol=1e-5)


def test_prefill_launch_config_follows_the_dtype():
    """16-bit prefill chunks take the tuned tiles; fp32 ones tiles whose pipelined K/V blocks
    and query tile fit an H200's 227 KB of shared memory (the 256-row tiles need 384 KB at
    fp32)."""
    from blockspec.kernels import paged_attention as tp

    assert tp.launch_config(tp.PREFILL_ROWS, torch.float16) == tp.PREFILL_CONFIG
    fp32 = tp.launch_config(4 * tp.PREFILL_ROWS, torch.float32)
    assert fp32 == tp.PREFILL_CONFIG_FP32
    d = 128
    smem = 4 * d * (fp32["block_m"] + 2 * fp32["block_n"] * fp32["num_stages"])
    assert smem <= 227 * 1024, smem
