"""Expert parallelism (``TPGroup.ep``): routed experts split by expert over the group. Layer
level in one process: the ranks' partial MoE outputs sum to the whole layer's (the all-reduce
after the mixer combines them), on the dense and the reference expert paths. Model level: two
gloo ranks (test_tensor_parallel's module-wide pair) load only their experts (renumbered from
0) and match the single-process run."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockspec.configs.nemotron_h import ConfigError, NemotronHConfig
from blockspec.layers.moe import MoE
from blockspec.models.tp_layout import local_name, rank_config, shard_for
from blockspec.parallel import SINGLE, TPGroup
from blockspec.quant.quantize import quantize_checkpoint
from blockspec.tiny_model import TINY_CONFIG, write_tiny_model
from tests.test_tensor_parallel import Ranks, assert_equal_runs

CFG = dict(TINY_CONFIG, n_routed_experts=8, num_experts_per_tok=3, n_groups=4)


def _layers(cfg: NemotronHConfig, size: int, dense: bool) -> tuple[MoE, list[MoE]]:
    """The whole MoE and its ``size`` expert-parallel shards, weights copied from it."""
    torch.manual_seed(0)
    full = MoE(cfg, "backbone.layers.3.mixer", dtype=torch.float32)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 0.2)
        full.gate.e_score_correction_bias.normal_(0, 0.1)
    state = full.state_dict()
    parts = []
    for r in range(size):
        rc = rank_config(cfg, size, r, ep=True)
        part = MoE(rc, "backbone.layers.3.mixer", dtype=torch.float32)
        lo, _ = rc.local_experts
        mine = {}
        for name in part.state_dict():
            src = name
            if name.startswith("experts."):
                i, rest = name[len("experts."):].split(".", 1)
                src = f"experts.{int(i) + lo}.{rest}"
            mine[name] = state[src]
        shared = [n for n in mine if n.startswith("shared_experts.")]
        for n in shared:                 # the shared expert: this rank's channels
            t = state[n]
            if "up_proj" in n:
                mine[n] = t.chunk(size, 0)[r]
            elif n.endswith("weight"):
                mine[n] = t.chunk(size, 1)[r]
        part.load_state_dict(mine)
        parts.append(part)
    for m in [full, *parts]:
        if dense:
            assert m.prepare_grouped()
    return full, parts


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "reference"])
@pytest.mark.parametrize("size", [2, 4])
def test_expert_shards_sum_to_the_layer(dense: bool, size: int) -> None:
    cfg = NemotronHConfig.from_dict(CFG)
    full, parts = _layers(cfg, size, dense)
    x = torch.randn(13, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = full(x)
        got = sum(p(x) for p in parts)
        assert [len(p.experts) for p in parts] == [cfg.n_routed_experts // size] * size
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 4, 300])      # the pair path (with dedup) and grouped
def test_gpu_expert_shards_sum_to_the_layer(tokens: int) -> None:
    """The CUDA expert paths, where another rank's pairs repeat local expert 0 in a token."""
    cfg = NemotronHConfig.from_dict(CFG)
    full, parts = _layers(cfg, 2, dense=False)
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        mods = [m.to("cuda", torch.bfloat16) for m in [full, *parts]]
        for m in mods:
            assert m.prepare_grouped()
        xg = x.to("cuda", torch.bfloat16)
        shards = [p(xg).float() for p in mods[1:]]     # the same routing as the whole layer
        whole = mods[0](xg).float()
        shared = [m.shared_experts(xg).float().abs() for m in mods]
    # each layer output is rounded to bf16 (8 significant bits) and so is its shared expert's
    # output (a channel slice's partial sum on a shard) before the combine: the sum of the
    # shards and the whole layer may differ by those roundings, never by an expert's share
    bound = (sum(s.abs() for s in shards) + whole.abs() + sum(shared)) * 2.0 ** -7 + 1e-3
    err = (sum(shards) - whole).abs()
    assert bool((err <= bound).all()), f"worst excess {float((err - bound).max()):.4f}"


def test_layout_names_and_refusals() -> None:
    cfg = NemotronHConfig.from_dict(CFG)
    tp = TPGroup(1, 2, ep=True)
    assert rank_config(cfg, 2, 1, ep=True).local_experts == (4, 8)
    assert rank_config(cfg, 2, 1, ep=True).moe_intermediate_size == cfg.moe_intermediate_size
    assert rank_config(cfg, 2, 1).local_experts is None
    assert local_name("backbone.layers.3.mixer.experts.5.up_proj.weight", cfg, tp) == \
        "backbone.layers.3.mixer.experts.1.up_proj.weight"
    assert local_name("backbone.layers.3.mixer.experts.2.up_proj.weight", cfg, tp) is None
    assert local_name("backbone.layers.3.mixer.shared_experts.up_proj.weight", cfg, tp) == \
        "backbone.layers.3.mixer.shared_experts.up_proj.weight"
    assert local_name("backbone.layers.3.mixer.experts.2.up_proj.weight", cfg, SINGLE) == \
        "backbone.layers.3.mixer.experts.2.up_proj.weight"
    assert shard_for("backbone.layers.3.mixer.experts.1.down_proj.weight", cfg, tp) is None
    assert shard_for("backbone.layers.3.mixer.shared_experts.up_proj.weight", cfg, tp) is not None
    six = NemotronHConfig.from_dict(dict(CFG, n_routed_experts=6))
    with pytest.raises(ConfigError, match="n_routed_experts=6"):
        rank_config(six, 4, 0, ep=True)


@pytest.fixture(scope="module")
def ranks():
    pool = Ranks()
    yield pool
    pool.close()


@pytest.mark.parametrize("algo", [None, "W4A16_NVFP4"])
def test_ep2_matches_single_process(ranks, tmp_path: Path, algo: str | None) -> None:
    folder = write_tiny_model(tmp_path / "tiny", seed=3)
    if algo is not None:
        quantize_checkpoint(folder, tmp_path / "q", algo)
        folder = tmp_path / "q"
    assert_equal_runs(ranks, folder, atol=1e-3, ep=True)
