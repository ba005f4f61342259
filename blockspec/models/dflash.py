"""DFlash draft model: Qwen3-style pre-norm layers with target-feature K/V injection.

One non-causal forward over a block ``[anchor, mask, ..., mask]`` proposes a whole block.
The model owns no cache: the engine keeps the per-layer context K/V returned by
``project_context`` and passes the gathered K/V of each request back into ``forward_block``.

Parameter names equal checkpoint tensor names (``fc.weight``, ``layers.0.self_attn.q_proj.weight``,
...), and every projection is built through ``build_linear`` with its real checkpoint prefix so
a quantization plan can store any of them packed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.attention.torch_native import masked_attention
from blockspec.checkpoint import logical_linear_weight_shape
from blockspec.configs.draft import DraftConfig, DraftConfigError
from blockspec.kernels.draft_kv import draft_block_qkv, draft_block_qkv_reference, write_draft_kv
from blockspec.kernels.silu_mul import silu_mul, silu_mul_reference
from blockspec.kernels.triton_loader import use_triton
from blockspec.layers.fused_linear import FusedLinear, fuse_linears
from blockspec.layers.linear import QuantPlan, build_linear
from blockspec.layers.norm import RMSNorm
from blockspec.layers.rotary import RotaryEmbedding
from blockspec.quant.linear import make_quant_embedding

if TYPE_CHECKING:
    from blockspec.forward_metadata import ForwardMetadata

ATTN_IMPLS = ("eager", "sdpa")


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

def select_draft_hidden_without_anchor(hidden: torch.Tensor, expected_rows: int) -> torch.Tensor:
    """Drop query row 0 (the anchor) of ``hidden [B, Q, H]``.

    ``expected_rows`` is the number of draft rows wanted back (gamma), so ``hidden`` must have
    exactly ``expected_rows + 1`` rows; anything else is a layout bug (reading a
    ``sample_from_anchor=False`` checkpoint with the gamma-row layout shifts every slot and
    collapses acceptance), so it raises instead of slicing silently.
    """
    if hidden.dim() != 3:
        raise ValueError(f"select_draft_hidden_without_anchor: expected hidden [B, Q, H], got "
                         f"shape {tuple(hidden.shape)}")
    if hidden.shape[1] != expected_rows + 1:
        raise ValueError(
            f"select_draft_hidden_without_anchor: hidden has {hidden.shape[1]} query rows, "
            f"expected {expected_rows + 1} (anchor row + {expected_rows} draft rows)")
    return hidden[:, 1:]


class DraftEmbedding(nn.Module):
    """Dense token embedding with checkpoint name ``<prefix>.weight`` [V, H]."""

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.dim = dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, dtype=dtype),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dim}"


def build_attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor,
                         causal: bool, window: int | None) -> torch.Tensor:
    """``allowed [B, Q, L]``: key valid, and (causal) ``k_pos <= q_pos``, and (window)
    ``q_pos - k_pos < window`` (the window counts the current token).  Keys ahead of the query
    (block keys in non-causal mode) are never cut by the window."""
    qp = q_pos[:, :, None]
    kp = k_pos[:, None, :]
    allowed = k_valid[:, None, :].expand(-1, q_pos.shape[1], -1)
    if causal:
        allowed = allowed & (kp <= qp)
    if window is not None:
        allowed = allowed & ((qp - kp) < window)
    return allowed


# --------------------------------------------------------------------------------------------
# layers
# --------------------------------------------------------------------------------------------

class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_idx: int, quant: QuantPlan | None,
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        p = f"layers.{layer_idx}.self_attn"
        h, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, d
        self.scale = d ** -0.5
        bias = cfg.attention_bias
        self.q_proj = build_linear(f"{p}.q_proj", h, nh * d, bias, quant, dtype)
        self.k_proj = build_linear(f"{p}.k_proj", h, nkv * d, bias, quant, dtype)
        self.v_proj = build_linear(f"{p}.v_proj", h, nkv * d, bias, quant, dtype)
        self.o_proj = build_linear(f"{p}.o_proj", nh * d, h, bias, quant, dtype)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.rotary = RotaryEmbedding(d, cfg.rope_thetas[layer_idx])
        self.qkv: FusedLinear | None = None     # set by fuse(): [q; k; v] rows
        if cfg.attention_sink_bias:
            self.attention_sink_bias = nn.Parameter(torch.zeros(nh, dtype=torch.float32),
                                                    requires_grad=False)
        else:
            self.attention_sink_bias = None

    def fuse(self) -> None:
        """Serving: q/k/v (and k/v for the context) as one GEMM each (``fuse_linears``)."""
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def _kv_rows(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        lead = k.shape[:-1]
        k = self.rotary(self.k_norm(k.reshape(*lead, self.num_kv_heads, self.head_dim)), positions)
        return k, v.reshape(*lead, self.num_kv_heads, self.head_dim)

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (k_norm + RoPE) and V of ``x [..., T, H]`` at ``positions [..., T]``."""
        if self.qkv is not None:
            kv = self.qkv.rows(self.num_heads * self.head_dim)(x)
            return self._kv_rows(*kv.split(self.num_kv_heads * self.head_dim, dim=-1), positions)
        return self._kv_rows(self.k_proj(x), self.v_proj(x), positions)

    def forward(self, hn: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor | None,
                ctx_v: torch.Tensor | None, allowed: torch.Tensor, impl: str) -> torch.Tensor:
        b, nq, _ = hn.shape
        q = self.q_norm(self.q_proj(hn).reshape(b, nq, self.num_heads, self.head_dim))
        q = self.rotary(q, positions)
        k, v = self.project_kv(hn, positions)
        if ctx_k is not None and ctx_k.shape[1] > 0:
            k = torch.cat((ctx_k.to(k.dtype), k), dim=1)
            v = torch.cat((ctx_v.to(v.dtype), v), dim=1)
        o = masked_attention(q, k, v, allowed, self.scale, self.attention_sink_bias, impl)
        return self.o_proj(o.reshape(b, nq, self.num_heads * self.head_dim))

    def forward_paged(self, hn: torch.Tensor, meta: ForwardMetadata, cache_index: int,
                      causal: bool, window: int | None) -> torch.Tensor:
        """The block's rows ``hn [N, H]`` through the attention backend: their K/V go into the
        draft context pool at the block positions (beyond the committed length, so a later
        commit overwrites them) and each row attends to context + block."""
        n = hn.shape[0]
        if self.qkv is not None:
            qkv = self.qkv(hn)
        else:       # projections that do not fuse (biased, FP8): Q, K, V heads per row
            qkv = torch.cat([self.q_proj(hn), self.k_proj(hn), self.v_proj(hn)], dim=-1)
        # both norms, both rotaries and the block's cache write: one launch on the GPU
        write = draft_block_qkv if use_triton(hn) else draft_block_qkv_reference
        q = write(qkv, meta.positions, meta.out_slots, self.q_norm, self.k_norm,
                  self.rotary.inv_freq, meta.kv.k, meta.kv.v, cache_index, self.num_heads)
        o = meta.attn.attend(q, meta.kv.k[cache_index], meta.kv.v[cache_index], meta,
                             scale=self.scale, causal=causal, window=window,
                             sink=self.attention_sink_bias)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_idx: int, quant: QuantPlan | None,
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        p = f"layers.{layer_idx}.mlp"
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = build_linear(f"{p}.gate_proj", h, i, False, quant, dtype)
        self.up_proj = build_linear(f"{p}.up_proj", h, i, False, quant, dtype)
        self.down_proj = build_linear(f"{p}.down_proj", i, h, False, quant, dtype)
        self.gate_up: FusedLinear | None = None   # set by fuse(): [gate; up] rows

    def fuse(self) -> None:
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gu = self.gate_up(x)
            return self.down_proj(silu_mul(gu) if use_triton(gu) else silu_mul_reference(gu))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_idx: int, quant: QuantPlan | None,
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.causal = cfg.layer_is_causal(layer_idx)
        self.window = cfg.layer_window(layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = DraftAttention(cfg, layer_idx, quant, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = DraftMLP(cfg, layer_idx, quant, dtype)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor | None,
                ctx_v: torch.Tensor | None, allowed: torch.Tensor, impl: str) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, ctx_k, ctx_v, allowed, impl)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_paged(self, h: torch.Tensor, pending: torch.Tensor | None, meta: ForwardMetadata
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer with its residual adds inside its norms (one launch each on the GPU):
        ``pending``, the layer before's MLP output (None for the first), joins ``h`` in the
        input norm; returns (h, this MLP's output, which the next norm adds)."""
        h, x = (self.input_layernorm.add_forward(h, pending) if pending is not None
                else (h, self.input_layernorm(h)))
        attn = self.self_attn.forward_paged(x, meta, self.layer_idx, self.causal, self.window)
        h, x = self.post_attention_layernorm.add_forward(h, attn)
        return h, self.mlp(x)


# --------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------

class DFlashDraftModel(nn.Module):
    """DFlash draft backbone (also the DSpark backbone).

    Typical step (engine side)::

        ctx = draft.project_context(feat, pos)                 # once per committed token
        ids, pos = draft.block_inputs(anchor, seq_lens)        # [B, Q]
        x = draft.embed_block(ids, target_embed)
        h = draft.forward_block(x, pos, ctx_k, ctx_v, ctx_valid)
        h = draft.select_draft_hidden(h)                       # [B, gamma, H]
        logits = draft.compute_logits(h, target)               # own head, else the target's
    """

    def __init__(self, cfg: DraftConfig, quant: QuantPlan | None = None,
                 dtype: torch.dtype | None = torch.float32, attn_impl: str = "eager") -> None:
        super().__init__()
        if attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")
        self.config = cfg
        self.attn_impl = attn_impl
        self.is_nemotron_35 = cfg.is_nemotron_35
        h = cfg.hidden_size
        if cfg.is_nemotron_35:
            fmt = quant.format_for("embed_tokens") if quant is not None else None
            if fmt is None:
                self.embed_tokens = DraftEmbedding(cfg.vocab_size, h, dtype=dtype)
            else:
                self.embed_tokens = make_quant_embedding(fmt, cfg.vocab_size, h, dtype, "embed_tokens")
        else:
            self.embed_tokens = None
        self.fc = build_linear("fc", cfg.fc_in_features, h, False, quant, dtype)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nn.ModuleList(
            DraftDecoderLayer(cfg, i, quant, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head: nn.Module | None = None          # see add_own_head
        self.context_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None

    # ---- shapes / layout -------------------------------------------------------------------
    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def block_inputs(self, anchor: torch.Tensor, start_positions: torch.Tensor,
                     drafts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids = [anchor, mask * (Q-1)]`` and ``positions = start + arange(Q)``, both [B, Q],
        with Q = ``config.query_len``, or the rows of a block of ``drafts`` drafts (a shorter
        block, as a smaller ``block_size`` would give).  ``start_positions`` is the committed
        length p."""
        q = self.config.query_len if drafts is None else self.query_rows(drafts)
        ids = torch.full((anchor.shape[0], q), self.config.mask_token_id, dtype=torch.long,
                         device=anchor.device)
        ids[:, 0] = anchor
        pos = start_positions.to(torch.long)[:, None] + torch.arange(q, device=anchor.device)
        return ids, pos

    def query_rows(self, drafts: int) -> int:
        """Rows of a block that proposes ``drafts`` drafts, per the config's block layout."""
        return drafts + 1 if self.config.drops_anchor_row else drafts

    def select_draft_hidden(self, hidden: torch.Tensor, drafts: int | None = None) -> torch.Tensor:
        """The ``[B, gamma, H]`` rows that carry drafts (``drafts`` rows for a shorter block),
        per the config's block layout."""
        gamma = self.config.gamma if drafts is None else drafts
        if self.config.drops_anchor_row:
            return select_draft_hidden_without_anchor(hidden, gamma)
        if hidden.dim() != 3 or hidden.shape[1] != gamma:
            raise ValueError(f"draft hidden has shape {tuple(hidden.shape)}, expected "
                             f"[B, {gamma}, H] (sample_from_anchor layout)")
        return hidden

    # ---- output head -----------------------------------------------------------------------
    def add_own_head(self, vocab_size: int, quant: QuantPlan | None = None,
                     dtype: torch.dtype | None = torch.float32) -> None:
        """Give the draft the ``lm_head`` its checkpoint carries (the loader calls this only
        then): drafts score with their own head when they have one, the target's otherwise."""
        self.lm_head = build_linear("lm_head", self.config.hidden_size, vocab_size, False, quant, dtype)

    def compute_logits(self, hidden: torch.Tensor, target: nn.Module) -> torch.Tensor:
        """fp32 draft logits of ``hidden [..., H]``: the draft's own head if it has one, else
        ``target.compute_logits`` (the target's head, tied or not)."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return target.compute_logits(hidden)

    # ---- embedding -------------------------------------------------------------------------
    def resolve_embedding(self, target_embed: nn.Module | torch.Tensor | None = None):
        """Nemotron 3.5 drafts embed with their own ``embed_tokens``; generic
        drafts with the target's embedding (a module or its weight tensor)."""
        if self.is_nemotron_35:
            if self.embed_tokens is None:
                raise DraftConfigError("Nemotron 3.5 draft has no embed_tokens module")
            return self.embed_tokens
        if target_embed is None:
            raise DraftConfigError("generic DFlash/DSpark drafts embed the block with the "
                                   "target's embedding; pass target_embed")
        return target_embed

    def embed_block(self, ids: torch.Tensor, target_embed: nn.Module | torch.Tensor | None = None,
                    scale: float | None = None) -> torch.Tensor:
        """Embed the block ids; ``scale`` (e.g. a target noise-embedding scale) overrides
        ``dflash_config.input_embedding_scale``."""
        emb: Any = self.resolve_embedding(target_embed)
        x = F.embedding(ids, emb) if isinstance(emb, torch.Tensor) else emb(ids)
        s = scale if scale is not None else self.config.input_embedding_scale
        if s is not None and s != 1.0:
            x = x * s
        return x

    # ---- context K/V -----------------------------------------------------------------------
    def project_context_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """``c = hidden_norm(fc(features))``; features ``[..., K*H]`` in target-layer-id order."""
        kh = self.config.fc_in_features
        if features.shape[-1] != kh:
            raise ValueError(f"context features have {features.shape[-1]} channels, expected "
                             f"K*H = {kh} ({self.config.num_context_features} target layers)")
        return self.hidden_norm(self.fc(features))

    def project_context(self, features: torch.Tensor, positions: torch.Tensor
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context (K, V), each ``[..., N, n_kv, d]``, for features ``[..., N, K*H]``
        at absolute ``positions [..., N]``.  No input_layernorm is applied to ``c``."""
        c = self.project_context_hidden(features)
        return [layer.self_attn.project_kv(c, positions) for layer in self.layers]

    # ---- block forward ---------------------------------------------------------------------
    def forward_block(self, x: torch.Tensor, positions: torch.Tensor,
                      ctx_k: Sequence[torch.Tensor] | None, ctx_v: Sequence[torch.Tensor] | None,
                      ctx_valid: torch.Tensor | None, ctx_positions: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """Run the draft layers over an embedded block.

        x ``[B, Q, H]``; positions ``[B, Q]`` absolute; ``ctx_k[i]``/``ctx_v[i]``
        ``[B, Lc, n_kv, d]`` per layer; ``ctx_valid [B, Lc]`` marks real context rows (all at
        positions strictly before the block).  ``ctx_positions [B, Lc]`` are the context rows'
        absolute positions, default ``arange(Lc)`` (row j = position j); they only matter for
        causal and sliding-window layers.  Returns the hidden after the final norm, ``[B, Q, H]``.
        """
        b, nq, _ = x.shape
        n_layers = len(self.layers)
        if ctx_k is None or len(ctx_k) == 0:
            ctx_k = ctx_v = [None] * n_layers
            lc = 0
        else:
            if len(ctx_k) != n_layers or ctx_v is None or len(ctx_v) != n_layers:
                raise ValueError(f"forward_block: need one context K and V per draft layer "
                                 f"({n_layers})")
            lc = ctx_k[0].shape[1]
        dev = x.device
        if ctx_valid is None:
            ctx_valid = torch.ones(b, lc, dtype=torch.bool, device=dev)
        if ctx_valid.shape != (b, lc):
            raise ValueError(f"forward_block: ctx_valid shape {tuple(ctx_valid.shape)} != {(b, lc)}")
        if ctx_positions is None:
            ctx_positions = torch.arange(lc, device=dev).expand(b, lc)
        positions = positions.to(torch.long)
        k_pos = torch.cat((ctx_positions.to(dev, torch.long), positions), dim=1)
        k_valid = torch.cat((ctx_valid.to(dev, torch.bool),
                             torch.ones(b, nq, dtype=torch.bool, device=dev)), dim=1)
        masks: dict[tuple[bool, int | None], torch.Tensor] = {}
        h = x
        for i, layer in enumerate(self.layers):
            key = (layer.causal, layer.window)
            if key not in masks:
                masks[key] = build_attention_mask(positions, k_pos, k_valid, *key)
            h = layer(h, positions, ctx_k[i], ctx_v[i], masks[key], self.attn_impl)
        return self.norm(h)

    def fuse(self) -> None:
        """Serving: each layer's q/k/v and gate/up projections as one GEMM (weights stay shared
        with the per-projection modules; quantized layers are left as they are)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.context_kv = self._stack_context_kv()

    def _stack_context_kv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None:
        """(k/v rows of every layer as one [L * 2 * n_kv * d, H] weight, k_norm weights
        [L, d], RoPE frequencies [L, d/2], eps) for the one-launch context write, or None when
        a projection has a bias or the k_norm eps differ. Quantized k/v projections are
        dequantized into the stack: one dense GEMM replaces 2L W4A16 launches and L scattered
        writes per step (55 MB at the published Nemotron 3.5 size, a 0.1 ms saving per step at
        batch 1 on an H200); only the draft's proposals see the rounding, never the verify.
        The stack is a copy: reloading weights later needs another ``fuse()``."""
        attns = [layer.self_attn for layer in self.layers]
        projs = [m for a in attns for m in (a.k_proj, a.v_proj)]
        if (any(getattr(m, "bias", None) is not None for m in projs)
                or len({a.k_norm.eps for a in attns}) != 1):
            return None
        dtype = self.norm.weight.dtype
        # (fused or not, each projection's own weight: fusing leaves it a view of its rows)
        kv = torch.cat([w for a in attns
                        for w in (a.k_proj.dense_weight(dtype), a.v_proj.dense_weight(dtype))])
        norm = torch.stack([a.k_norm.weight for a in attns])
        freq = torch.stack([a.rotary.inv_freq.to(torch.float32) for a in attns])
        return kv, norm, freq, attns[0].k_norm.eps

    def forward_paged(self, x: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        """Serving path: the embedded block rows ``x [N, H]`` (N = B x Q, positions in
        ``meta``) over the paged draft context pool ``meta.kv``, through ``meta.attn``; the
        same math as ``forward_block``. Returns the hidden after the final norm, [N, H]."""
        meta.attn.prepare(meta)
        h, pending = x, None
        for layer in self.layers:
            h, pending = layer.forward_paged(h, pending, meta)
        return self.norm(h) if pending is None else self.norm.add_forward(h, pending)[1]

    def write_context(self, features: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor, pool: Any) -> None:
        """Project target features of committed rows and store each layer's K/V at ``slots``
        of the draft context pool (on the GPU after ``fuse()``: one GEMM for every layer's K/V
        and one kernel for the norms, rotations and writes, ``kernels/draft_kv.py``)."""
        if self.context_kv is not None and use_triton(features):
            weight, norm, freq, eps = self.context_kv
            kv = F.linear(self.project_context_hidden(features), weight)
            write_draft_kv(kv, positions, slots, norm, freq, pool.k, pool.v, eps)
            return
        for n, (k, v) in enumerate(self.project_context(features, positions)):
            pool.k[n][slots] = k.to(pool.k.dtype)
            pool.v[n][slots] = v.to(pool.v.dtype)

    # ---- checkpoint helpers ----------------------------------------------------------------
    def fc_in_features_from_weight(self, loaded: torch.Tensor | Sequence[int]) -> int:
        """Logical in-features of a loaded ``fc.weight`` (packed Nemotron weights are unpacked
        logically: two E2M1 codes per byte; plain drafts compare raw shapes).  Raises the K-mismatch
        error when the shape is not ``(H, K*H)``."""
        h, kh = self.config.hidden_size, self.config.fc_in_features
        if self.is_nemotron_35:
            shape = logical_linear_weight_shape(self.fc, loaded, h)
        else:
            shape = tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded)
        if shape != (h, kh):
            raise DraftConfigError(
                f"K mismatch: fc.weight logical shape {shape} != expected {(h, kh)} "
                f"({self.config.num_context_features} target layers x hidden {h})")
        return shape[1]

    @torch.no_grad()
    def init_random_(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random dense init (tests / training from scratch): normal linears and embeddings,
        unit norms, zero biases and sinks.  Quantized modules are left as they are."""
        for name, p in self.named_parameters():
            if not p.is_floating_point():
                continue
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif leaf == "bias" or leaf == "attention_sink_bias":
                p.zero_()
            elif leaf == "weight":
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32) * std)
