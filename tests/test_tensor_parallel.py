"""Tensor parallelism of the Nemotron-H target: two gloo ranks on loopback (torch.multiprocessing)
load their shards of a tiny checkpoint and run a prefill plus greedy decode steps; every rank's
logits must equal the single-process run's (fp32) and its greedy tokens exactly."""
from __future__ import annotations

import json
from dataclasses import replace
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from blockspec.attention.torch_native import TorchNativeAttention
from blockspec.cache import KVPool, MambaStatePool
from blockspec.configs.nemotron_h import ConfigError, NemotronHConfig
from blockspec.forward_metadata import Mode
from blockspec.models.loader import load_target
from blockspec.models.nemotron_h import NemotronHForCausalLM
from blockspec.models.tp_layout import rank_config, shard_for
from blockspec.parallel import SINGLE, Shard, TPGroup, init_tp
from blockspec.quant.quantize import quantize_checkpoint
from blockspec.runtime.metadata import extend_metadata, uniform_metadata
from blockspec.tiny_model import TINY_CONFIG, random_state, write_tiny_model

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 8, 120, 66, 12], [200, 31, 9, 77, 140]]
DECODE_STEPS = 4
PAGE = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def greedy_run(folder: Path, tp: TPGroup) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill both prompts in one batch, then greedy decode steps: the logits of every
    forward and the tokens chosen."""
    torch.manual_seed(0)
    model, _ = load_target(folder, torch.float32, torch.device("cpu"), tp=tp)
    rc = model.rank_cfg
    n_attn, n_mamba = len(rc.layer_ids("attention")), len(rc.layer_ids("mamba"))
    pages = 8
    kv = KVPool(n_attn, (len(PROMPTS) * pages + 1) * PAGE, rc.num_key_value_heads, rc.head_dim,
                torch.float32, torch.device("cpu"))
    mamba = MambaStatePool(n_mamba, len(PROMPTS) + 1, rc.conv_dim, rc.conv_kernel,
                           rc.mamba_num_heads, rc.mamba_head_dim, rc.ssm_state_size,
                           torch.float32, torch.device("cpu"), groups=rc.n_groups)
    table = torch.arange(1, 1 + len(PROMPTS) * pages, dtype=torch.int32).view(len(PROMPTS), pages)
    attn = TorchNativeAttention()
    slots = list(range(len(PROMPTS)))
    logits_seen, tokens = [], [[] for _ in PROMPTS]
    with torch.no_grad():
        meta = extend_metadata(slots, [0] * len(PROMPTS), PROMPTS, device=torch.device("cpu"),
                               block_table=table, page_size=PAGE, attn=attn, kv=kv,
                               mamba=mamba, logits_all=False)
        logits = model(meta).logits
        lens = [len(p) for p in PROMPTS]
        for _ in range(DECODE_STEPS):
            logits_seen.append(logits)
            nxt = logits.argmax(-1)
            for b, t in enumerate(nxt.tolist()):
                tokens[b].append(t)
            inp = {"slot": torch.tensor(slots), "prefix": torch.tensor(lens)}
            meta = uniform_metadata(inp, 1, Mode.DECODE, nxt, table, PAGE, attn, kv, mamba,
                                    max_seq_len=max(lens) + 1)
            logits = model(meta).logits
            lens = [n + 1 for n in lens]
        logits_seen.append(logits)
    return logits_seen, tokens


def _rank(rank: int, size: int, port: int, jobs, results) -> None:
    """One rank for the whole module: joins the group once, then runs ``greedy_run`` on every
    folder it is sent until it gets None (spawning two ranks per case cost seconds each)."""
    tp = init_tp(f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, backend="gloo")
    try:
        while (job := jobs.get()) is not None:
            folder, ep = job         # ep: the routed experts split by expert (TPGroup.ep)
            try:
                logits, tokens = greedy_run(Path(folder), replace(tp, ep=ep))
            except BaseException as e:
                results.put((rank, None, repr(e)))
                raise
            # numpy pickles by value: a tensor would be shared through a handle that dies with us
            results.put((rank, [x.numpy() for x in logits], tokens))
    finally:
        torch.distributed.destroy_process_group()


class Ranks:
    """``size`` gloo ranks (spawned processes) kept for the module's cases; each case sends
    them its folder. A failed rank fails that case at once and every rank is ended (the next
    case starts new ones)."""

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self.procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(self.size)]
        port = _free_port()
        self.procs = [ctx.Process(target=_rank, args=(r, self.size, port, q, self.results))
                      for r, q in enumerate(self.jobs)]
        for p in self.procs:
            p.start()

    def run(self, folder: Path, ep: bool = False) -> list:
        if not self.procs:
            self._start()
        for q in self.jobs:
            q.put((str(folder), ep))
        out = []
        try:
            for _ in self.procs:
                item = self.results.get(timeout=120)
                assert item[1] is not None, f"rank {item[0]} failed: {item[2]}"
                out.append(item)
        except BaseException:
            self.end()
            raise
        return sorted(out, key=lambda x: x[0])

    def end(self) -> None:
        for p in self.procs:             # a rank left waiting on a failed peer
            if p.is_alive():
                p.terminate()
        self.procs = []

    def close(self) -> None:
        """Stop the ranks; each must have exited cleanly."""
        procs = self.procs
        for q in self.jobs if procs else []:
            q.put(None)
        try:
            for p in procs:
                p.join(timeout=60)
                assert p.exitcode == 0
        finally:
            self.end()


@pytest.fixture(scope="module")
def ranks():
    pool = Ranks()
    yield pool
    pool.close()


def assert_equal_runs(pool: Ranks, folder: Path, atol: float, ep: bool = False) -> None:
    ref_logits, ref_tokens = greedy_run(folder, SINGLE)
    assert ref_logits[0].shape[-1] == TINY_CONFIG["vocab_size"]
    ranks = pool.run(folder, ep)
    assert [r for r, _, _ in ranks] == [0, 1]
    for _, logits, tokens in ranks:
        assert tokens == ref_tokens
        for got, want in zip(logits, ref_logits):
            got = torch.from_numpy(got)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tp") / "tiny", seed=3)


def test_tp2_matches_single_process(ranks: Ranks, tiny: Path) -> None:
    assert_equal_runs(ranks, tiny, atol=1e-4)


@pytest.mark.parametrize("algo", ["NVFP4", "W4A16_NVFP4", "FP8"])
def test_tp2_quantized_matches_single_process(ranks: Ranks, tiny: Path, tmp_path: Path,
                                             algo: str) -> None:
    out = tmp_path / algo.lower()
    report = quantize_checkpoint(tiny, out, algo)
    # row-parallel projections split their packed input dimension and its scale groups
    assert {"backbone.layers.0.mixer.out_proj", "backbone.layers.1.mixer.o_proj"} <= set(report.formats)
    assert_equal_runs(ranks, out, atol=1e-3)


def test_tp2_variants_match_single_process(ranks: Ranks, tmp_path: Path) -> None:
    """One KV head for two ranks (replicated), random biases on every projection (row-parallel
    ones added once), a dense MLP block, a latent MoE and a tied head."""
    raw = dict(TINY_CONFIG, hybrid_override_pattern="M*-E", num_key_value_heads=1,
               attention_bias=True, mlp_bias=True, use_bias=True, moe_latent_size=32,
               tie_word_embeddings=True)
    cfg = NemotronHConfig.from_dict(raw)
    state = random_state(NemotronHForCausalLM(cfg, dtype=torch.float32), seed=5)
    g = torch.Generator().manual_seed(6)
    biases = [n for n in state if n.endswith("proj.bias")]
    assert any("o_proj" in n for n in biases) and any("down_proj" in n for n in biases)
    for n in biases:
        state[n] = torch.randn(state[n].shape, generator=g) * 0.1
    folder = tmp_path / "variants"
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    assert_equal_runs(ranks, folder, atol=1e-4)


def test_each_rank_holds_only_its_share(tiny: Path) -> None:
    """The sharded parameters are the rank's slices: the two ranks' in_proj rows together are
    the whole tensor, and lm_head is padded to ceil(V / 2) rows a rank."""
    full, _ = load_target(tiny, torch.float32, torch.device("cpu"))
    halves = [load_target(tiny, torch.float32, torch.device("cpu"), tp=TPGroup(r, 2))[0]
              for r in range(2)]
    name = "backbone.layers.0.mixer.in_proj.weight"
    whole = full.state_dict()[name]
    parts = [h.state_dict()[name] for h in halves]
    assert parts[0].shape[0] * 2 == whole.shape[0]
    assert sorted(torch.cat(parts).flatten().tolist()) == sorted(whole.flatten().tolist())
    v = TINY_CONFIG["vocab_size"]
    heads = [h.state_dict()["lm_head.weight"] for h in halves]
    assert [x.shape[0] for x in heads] == [(v + 1) // 2] * 2
    torch.testing.assert_close(torch.cat(heads)[:v], full.state_dict()["lm_head.weight"])
    assert not heads[1][v - (v + 1) // 2:].any()


def test_layout_refusals() -> None:
    cfg = NemotronHConfig.from_dict(dict(TINY_CONFIG, n_groups=1))
    with pytest.raises(ConfigError, match="n_groups=1"):
        rank_config(cfg, 2)
    cfg = NemotronHConfig.from_dict(dict(TINY_CONFIG, n_groups=4))
    assert rank_config(cfg, 4).num_key_value_heads == 1           # KV heads replicated
    assert shard_for("backbone.layers.1.mixer.k_proj.weight", cfg, TPGroup(3, 4)).pieces == ((16, 32),)
    assert shard_for("backbone.layers.0.mixer.out_proj.bias", cfg, TPGroup(1, 2)).zero
    with pytest.raises(ValueError, match="splits a pack"):
        Shard(1, ((0, 8),), 64).read(torch.zeros(4, 4), [4, 4])   # 8 of a 16-wide group
