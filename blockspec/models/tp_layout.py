"""How the Nemotron-H target splits over a tensor-parallel group (the layout peers use):

* attention by query heads; KV heads split too while they outnumber the ranks, else each rank
  keeps the one KV head its query heads read (replicated); ``o_proj`` row-parallel;
* Mamba-2 by heads and groups (``n_groups`` must divide by the TP size): ``in_proj`` keeps the
  rank's rows of each of its [z, x, B, C, dt] parts, ``conv1d`` its x/B/C channels, A/D/dt_bias
  its heads, the gated norm its groups; ``out_proj`` row-parallel;
* MLP and MoE experts (routed and shared) by intermediate channels: ``up_proj`` column-,
  ``down_proj`` row-parallel; the router and a latent MoE's projections replicated. With
  expert parallelism (``TPGroup.ep``) the routed experts split by expert instead: each rank
  holds E / size whole experts and computes the (token, expert) pairs that name them (every
  rank routes the same replicated tokens, so dispatch is a local selection); the all-reduce
  after the mixer combines them. The shared expert stays split by channels;
* ``lm_head`` by vocabulary rows (ceil(V / size) a rank, the last padded with zero rows),
  gathered before sampling; embeddings and norms replicated (a tied head scores the whole
  vocabulary with them on every rank).

Each rank builds the model from ``rank_config`` (the per-rank head and channel counts, so
layers and caches size themselves with no TP code), sums every mixer's partial output
(``TPGroup.all_reduce``) and reads from the checkpoint only what ``shard_for`` names. A
row-parallel bias is held by rank 0 (zeros elsewhere) so the sum adds it once. Packed weights
(NVFP4 codes, per-16 scales) split on the same logical ranges; a split inside a scale group is
refused at load.
"""
from __future__ import annotations

import re
from dataclasses import replace

from blockspec.configs.nemotron_h import ConfigError, NemotronHConfig
from blockspec.parallel import Shard, TPGroup

_LAYER = re.compile(r"backbone\.layers\.(\d+)\.mixer\.(.+)")
_EXPERT = re.compile(r"backbone\.layers\.\d+\.mixer\.experts\.(\d+)\..+")


def rank_config(cfg: NemotronHConfig, size: int, rank: int = 0,
                ep: bool = False) -> NemotronHConfig:
    """The config rank ``rank`` of ``size`` builds its layers from (whole config at size 1);
    ``ep``: its routed experts are whole experts [rank E / size, (rank + 1) E / size)."""
    if size == 1:
        return cfg
    need: dict[str, int] = {}
    kinds = set(cfg.block_types)
    if "attention" in kinds:
        need["num_attention_heads"] = cfg.num_attention_heads
        kv = cfg.num_key_value_heads
        if kv % size and size % kv:
            raise ConfigError(f"tensor parallel: num_key_value_heads={kv} and tp size {size} "
                              "must divide one another")
    if "mamba" in kinds:
        need.update(mamba_num_heads=cfg.mamba_num_heads, n_groups=cfg.n_groups)
    if "mlp" in kinds:
        need["intermediate_size"] = cfg.intermediate_size
    if "moe" in kinds:
        if not ep:
            need["moe_intermediate_size"] = cfg.moe_intermediate_size
        elif cfg.n_routed_experts % size:
            raise ConfigError(f"expert parallel size {size} does not divide "
                              f"n_routed_experts={cfg.n_routed_experts}")
        if cfg.n_shared_experts:
            need["moe_shared_expert_intermediate_size"] = cfg.moe_shared_expert_intermediate_size
    bad = [f"{k}={v}" for k, v in need.items() if v % size]
    if bad:
        raise ConfigError(f"tensor parallel size {size} does not divide {', '.join(bad)}")
    out = {k: v // size for k, v in need.items()}
    if "attention" in kinds:
        out["num_key_value_heads"] = max(1, cfg.num_key_value_heads // size)
    if "moe" in kinds and ep:
        out["local_experts"] = expert_range(cfg, size, rank)
    return replace(cfg, **out)


def expert_range(cfg: NemotronHConfig, size: int, rank: int) -> tuple[int, int]:
    """[first, end) of the routed experts rank ``rank`` of ``size`` holds under expert
    parallelism (``rank_config`` refuses a size that does not divide them)."""
    n = cfg.n_routed_experts // size
    return rank * n, (rank + 1) * n


def local_name(name: str, cfg: NemotronHConfig, tp: TPGroup) -> str | None:
    """The model's name for checkpoint tensor ``name`` on this rank, None where the rank does
    not hold it: under expert parallelism the rank's routed experts are numbered from 0 (its
    ``ModuleList``), the other ranks' are skipped."""
    if not tp.ep or tp.size == 1:
        return name
    m = _EXPERT.fullmatch(name)
    if m is None:
        return name
    lo, hi = expert_range(cfg, tp.size, tp.rank)
    e = int(m.group(1))
    return name[:m.start(1)] + str(e - lo) + name[m.end(1):] if lo <= e < hi else None


def vocab_rows(cfg: NemotronHConfig, size: int) -> int:
    """Rows of the vocabulary-parallel ``lm_head`` on each rank."""
    return -(-cfg.vocab_size // size)


def _split(start: int, length: int, tp: TPGroup) -> tuple[int, int]:
    """Rank ``tp.rank``'s [start, stop) of ``length`` elements beginning at ``start``."""
    n = length // tp.size
    return start + tp.rank * n, start + (tp.rank + 1) * n


def _linear(tensor: str, out_pieces, out_full: int, in_pieces, in_full: int) -> Shard | None:
    """A linear's tensor: column-parallel when ``out_pieces`` is given, row-parallel when
    ``in_pieces`` is; 0-d scales are read whole by the loader."""
    if out_pieces is not None:
        return Shard(0, tuple(out_pieces), out_full)
    if tensor == "bias":
        return None                      # row-parallel bias: decided by the caller
    return Shard(1, tuple(in_pieces), in_full)


def shard_for(name: str, cfg: NemotronHConfig, tp: TPGroup) -> Shard | None:
    """This rank's part of the target tensor ``name`` (None: the whole tensor)."""
    if tp.size == 1:
        return None
    if name.startswith("lm_head."):
        rows = vocab_rows(cfg, tp.size)
        start = min(tp.rank * rows, cfg.vocab_size)
        stop = min(start + rows, cfg.vocab_size)
        return Shard(0, ((start, stop),), cfg.vocab_size, pad=rows - (stop - start))
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    kind = cfg.block_types[int(m.group(1))]
    module, _, tensor = m.group(2).rpartition(".")
    row_bias = Shard(zero=True) if tensor == "bias" and tp.rank != 0 else None
    if kind == "attention":
        hd = cfg.head_dim
        q = _split(0, cfg.num_attention_heads * hd, tp)
        if module == "q_proj":
            return _linear(tensor, [q], cfg.num_attention_heads * hd, None, 0)
        if module in ("k_proj", "v_proj"):
            kv = cfg.num_key_value_heads
            if kv >= tp.size:
                piece = _split(0, kv * hd, tp)
            else:
                head = tp.rank * kv // tp.size
                piece = (head * hd, (head + 1) * hd)
            return _linear(tensor, [piece], kv * hd, None, 0)
        if module == "o_proj":
            return row_bias if tensor == "bias" else _linear(tensor, None, 0, [q], cfg.num_attention_heads * hd)
    if kind == "mamba":
        di, gn, h = cfg.d_inner, cfg.n_groups * cfg.ssm_state_size, cfg.mamba_num_heads
        x, b, c = _split(0, di, tp), _split(di, gn, tp), _split(di + gn, gn, tp)
        heads = _split(0, h, tp)
        if module == "in_proj":
            parts = [_split(0, di, tp)] + [(a + di, z + di) for a, z in (x, b, c)]
            parts.append(_split(2 * di + 2 * gn, h, tp))
            return _linear(tensor, parts, 2 * di + 2 * gn + h, None, 0)
        if module == "conv1d":
            return Shard(0, (x, b, c), di + 2 * gn)
        if module == "" and tensor in ("A_log", "D", "dt_bias"):
            return Shard(0, (heads,), h)
        if module == "norm":
            return Shard(0, (x,), di)
        if module == "out_proj":
            return row_bias if tensor == "bias" else _linear(tensor, None, 0, [x], di)
    if kind in ("mlp", "moe"):
        if module.endswith("fc2_latent_proj"):
            return row_bias
        part = module.rpartition(".")[2]
        if part not in ("up_proj", "down_proj"):
            return None                  # router, latent fc1: replicated
        if tp.ep and ".experts." in f".{module}":
            return None                  # expert parallel: whole experts
        inner = (cfg.intermediate_size if kind == "mlp"
                 else cfg.moe_shared_expert_intermediate_size if "shared_experts" in module
                 else cfg.moe_intermediate_size)
        piece = _split(0, inner, tp)
        if part == "up_proj":
            return _linear(tensor, [piece], inner, None, 0)
        return row_bias if tensor == "bias" else _linear(tensor, None, 0, [piece], inner)
    return None
