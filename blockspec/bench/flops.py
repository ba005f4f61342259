"""FLOPs of one prefill, counted from the config: the compute floor the prefill benchmark
divides by a measured matmul rate.

Counted (a multiply-add is 2 FLOPs):
* every projection that runs per token, with its active parameters: Mamba in/out projections,
  attention q/k/v/o, the MoE router, top-k routed experts (up + down; the latent projections
  when the config has them), the shared expert, dense MLP layers;
* causal attention's scores and values: a query at position i (1-based) attends to i keys, so
  QK^T and PV cost 2 * 2 * i * head_dim * heads; summed over a length-L prompt that is
  2 * L (L + 1) * head_dim * heads per attention layer (chunking does not change it);
* the Mamba-2 chunked SSD scan as the engine runs it (``layers/mamba2.ssd_chunked_scan``,
  restarted at every prefill chunk): per scan chunk of q tokens and per head, C B^T
  (2 q^2 N), (G * L) @ (dt x) (2 q^2 P), the carried-state read C S (2 q N P) and the state
  update B^T (dt x) (2 q N P); plus the depthwise causal conv (2 K per channel per token);
* the lm_head once per prefill chunk: the engine scores each chunk's last row only.

Not counted: norms, activations, softmax, gating, residual adds and the embedding gather
(elementwise work; bandwidth, not matmul rate, bounds it).
"""
from __future__ import annotations

from blockspec.configs.nemotron_h import NemotronHConfig


def chunk_lengths(input_len: int, chunk: int | None) -> list[int]:
    """Lengths of the prefill forwards a prompt is split into (one without chunking)."""
    if chunk is None or chunk >= input_len:
        return [input_len]
    return [min(chunk, input_len - s) for s in range(0, input_len, chunk)]


def per_token_projection_flops(cfg: NemotronHConfig) -> dict[str, int]:
    """Matmul FLOPs every token pays in each kind of layer (one layer of that kind)."""
    d = cfg.hidden_size
    mamba_proj = cfg.d_inner + cfg.conv_dim + cfg.mamba_num_heads
    q_dim = cfg.num_attention_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim
    expert_in = cfg.moe_latent_size or d
    routed = cfg.num_experts_per_tok * 2 * 2 * expert_in * cfg.moe_intermediate_size
    if cfg.moe_latent_size:
        routed += 2 * 2 * d * cfg.moe_latent_size               # fc1/fc2 latent projections
    shared = 2 * 2 * d * cfg.moe_shared_expert_intermediate_size if cfg.n_shared_experts else 0
    return {
        "mamba_proj": 2 * d * mamba_proj + 2 * cfg.d_inner * d,
        "attn_proj": 2 * d * (2 * q_dim + 2 * kv_dim),         # q, o: d x q_dim; k, v: d x kv_dim
        "moe_router": 2 * d * cfg.n_routed_experts,
        "moe_routed": routed,
        "moe_shared": shared,
        "mlp": 2 * 2 * d * cfg.intermediate_size,
    }


def ssd_scan_flops(cfg: NemotronHConfig, seq_len: int) -> int:
    """Matmul FLOPs of one Mamba layer's chunked scan and conv over ``seq_len`` tokens
    (one prefill forward)."""
    H, P, N, Q = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.chunk_size
    total = 2 * cfg.conv_kernel * cfg.conv_dim * seq_len
    for c0 in range(0, seq_len, Q):
        q = min(Q, seq_len - c0)
        total += H * (2 * q * q * N + 2 * q * q * P + 2 * 2 * q * N * P)
    return total


def prefill_flops(cfg: NemotronHConfig, input_len: int, chunk: int | None = None) -> dict[str, int]:
    """FLOPs of a batch-1 prefill of ``input_len`` tokens split into ``chunk``-token forwards,
    by part, with their ``total``."""
    if input_len < 1:
        raise ValueError(f"input_len must be >= 1, got {input_len}")
    n = {kind: len(cfg.layer_ids(kind)) for kind in ("mamba", "attention", "moe", "mlp")}
    per = per_token_projection_flops(cfg)
    chunks = chunk_lengths(input_len, chunk)
    L = input_len
    parts = {
        "mamba_proj": n["mamba"] * per["mamba_proj"] * L,
        "mamba_scan": n["mamba"] * sum(ssd_scan_flops(cfg, c) for c in chunks),
        "attn_proj": n["attention"] * per["attn_proj"] * L,
        "attn_scores": n["attention"] * 2 * L * (L + 1) * cfg.head_dim * cfg.num_attention_heads,
        "moe_router": n["moe"] * per["moe_router"] * L,
        "moe_routed": n["moe"] * per["moe_routed"] * L,
        "moe_shared": n["moe"] * per["moe_shared"] * L,
        "mlp": n["mlp"] * per["mlp"] * L,
        "lm_head": len(chunks) * 2 * cfg.hidden_size * cfg.vocab_size,
    }
    parts["total"] = sum(parts.values())
    return parts
