"""Nemotron-H configuration: both the hub spelling (hybrid_override_pattern, mamba_* names) and
transformers' current spelling (layers_block_type with linear/full_attention) map to one dataclass."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

PATTERN_CHARS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
BLOCK_ALIASES = {
    "mamba": "mamba", "linear_attention": "mamba",
    "attention": "attention", "full_attention": "attention",
    "mlp": "mlp", "moe": "moe",
}
LEGACY_NAMES = {
    "mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
    "mamba_chunk_size": "chunk_size", "mamba_dt_limit": "time_step_limit",
    "mamba_conv_bias": "use_conv_bias", "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max", "mamba_dt_init_floor": "time_step_floor",
}


class ConfigError(ValueError):
    """A config.json that cannot describe a model this engine runs."""


def decode_json_floats(value: Any) -> Any:
    """transformers writes inf as {"__float__": "Infinity"}; turn such objects back into floats."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: decode_json_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_json_floats(v) for v in value]
    return value


@dataclass
class NemotronHConfig:
    vocab_size: int
    hidden_size: int
    block_types: list[str]
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    attention_bias: bool = False
    intermediate_size: int = 1856
    mlp_bias: bool = False
    mlp_hidden_act: str = "relu2"
    mamba_num_heads: int = 64
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    use_bias: bool = False
    mamba_hidden_act: str = "silu"
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 1856
    moe_shared_expert_intermediate_size: int = 3712
    n_shared_experts: int = 1
    moe_latent_size: int | None = None
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    eos_token_id: list[int] = field(default_factory=lambda: [2])
    bos_token_id: int | None = 1
    pad_token_id: int | None = 0
    max_position_embeddings: int = 4096
    # expert parallelism (set by models/tp_layout.rank_config, never read from config.json):
    # the [first, end) routed experts this rank holds; None: all of them
    local_experts: tuple[int, int] | None = None
    raw: dict = field(default_factory=dict, repr=False)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.block_types)

    @property
    def d_inner(self) -> int:
        """Mamba inner width is heads x head_dim (``expand`` is not used for shapes)."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.ssm_state_size

    @property
    def pattern(self) -> str:
        rev = {v: k for k, v in PATTERN_CHARS.items()}
        return "".join(rev[t] for t in self.block_types)

    def layer_ids(self, kind: str) -> list[int]:
        return [i for i, t in enumerate(self.block_types) if t == kind]

    # ---- parsing ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict) -> "NemotronHConfig":
        d = decode_json_floats(dict(raw))
        model_type = d.get("model_type")
        if model_type != "nemotron_h":
            raise ConfigError(f"config.json: unsupported model_type {model_type!r}; "
                              f"this engine serves 'nemotron_h' targets")
        for old, new in LEGACY_NAMES.items():
            if old in d and new not in d:
                d[new] = d[old]
        block_types = _parse_block_types(d)
        if "num_hidden_layers" in d and d["num_hidden_layers"] not in (None, len(block_types)):
            raise ConfigError(f"config.json: num_hidden_layers={d['num_hidden_layers']} but the "
                              f"layer layout has {len(block_types)} layers")
        for key in ("vocab_size", "hidden_size"):
            if not isinstance(d.get(key), int) or d[key] <= 0:
                raise ConfigError(f"config.json: field '{key}' must be a positive integer, "
                                  f"found {d.get(key)!r}")
        eos = d.get("eos_token_id", 2)
        eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        limit = d.get("time_step_limit") or (0.0, math.inf)
        kwargs = {k: d[k] for k in cls.__dataclass_fields__
                  if k in d and k not in ("block_types", "raw", "eos_token_id", "time_step_limit",
                                          "local_experts")}
        for key in ("mlp_hidden_act",):
            if key in kwargs and kwargs[key] != "relu2":
                raise ConfigError(f"config.json: {key}={kwargs[key]!r} is not supported "
                                  f"(Nemotron-H uses 'relu2')")
        if d.get("mamba_hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json: mamba_hidden_act={d['mamba_hidden_act']!r} is not "
                              f"supported (expected 'silu')")
        cfg = cls(block_types=block_types, eos_token_id=eos_list,
                  time_step_limit=(float(limit[0]), float(limit[1])), raw=dict(raw), **kwargs)
        cfg._check()
        return cfg

    def _check(self) -> None:
        if "attention" in self.block_types and self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("config.json: num_attention_heads must be a multiple of "
                              "num_key_value_heads")
        if "mamba" in self.block_types and self.mamba_num_heads % self.n_groups:
            raise ConfigError("config.json: mamba_num_heads must be a multiple of n_groups")
        if "moe" in self.block_types:
            if self.n_routed_experts % self.n_group:
                raise ConfigError("config.json: n_routed_experts must be a multiple of n_group")
            if self.num_experts_per_tok > self.n_routed_experts:
                raise ConfigError("config.json: num_experts_per_tok exceeds n_routed_experts")


def _parse_block_types(d: dict) -> list[str]:
    if d.get("layers_block_type") is not None:
        names = d["layers_block_type"]
        if not isinstance(names, list):
            raise ConfigError("config.json: layers_block_type must be a list of strings")
        bad = [n for n in names if n not in BLOCK_ALIASES]
        if bad:
            raise ConfigError(f"config.json: layers_block_type has unknown entries {bad}; "
                              f"expected one of {sorted(BLOCK_ALIASES)}")
        return [BLOCK_ALIASES[n] for n in names]
    pattern = d.get("hybrid_override_pattern")
    if pattern is None:
        raise ConfigError("config.json: neither 'layers_block_type' nor "
                          "'hybrid_override_pattern' is present")
    bad = sorted({c for c in pattern if c not in PATTERN_CHARS})
    if bad:
        raise ConfigError(f"config.json: hybrid_override_pattern has unknown characters {bad}; "
                          f"expected M, *, - or E")
    return [PATTERN_CHARS[c] for c in pattern]
