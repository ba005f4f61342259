"""Nemotron-H target: pre-norm residual blocks, each one mixer (M Mamba-2, * attention,
- relu^2 MLP, E MoE), then norm_f and lm_head. Parameter names equal checkpoint names.

The model reads a ``ForwardMetadata`` (the batch as device tensors, with the caches and the
attention backend it runs against); it knows nothing of requests.
Aux-hidden capture (DFlash/DSpark conditioning) taps the residual stream *before* layer i for
every i in ``meta.capture_layers`` (index ``num_layers`` means after the last layer, before
norm_f); with an empty tuple nothing is captured and nothing is paid.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from blockspec.configs.nemotron_h import NemotronHConfig
from blockspec.forward_metadata import ForwardMetadata, Mode
from blockspec.layers.attention import Attention
from blockspec.layers.linear import QuantPlan, build_linear
from blockspec.layers.mamba2 import Mamba2Mixer
from blockspec.layers.moe import MoE, ReluSquaredMLP
from blockspec.layers.norm import RMSNorm
from blockspec.models.tp_layout import rank_config, vocab_rows
from blockspec.parallel import SINGLE, TPGroup


@dataclass
class ModelOutput:
    logits: torch.Tensor                 # [len(meta.logits_rows) or N, V] fp32
    aux_hidden: torch.Tensor | None      # [T_total, K*H] when capture was requested


class Block(nn.Module):
    def __init__(self, cfg: NemotronHConfig, i: int, quant: QuantPlan | None,
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        self.kind = cfg.block_types[i]
        prefix = f"backbone.layers.{i}.mixer"
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype)
        if self.kind == "mamba":
            self.mixer = Mamba2Mixer(cfg, prefix, quant, dtype)
        elif self.kind == "attention":
            self.mixer = Attention(cfg, prefix, quant, dtype)
        elif self.kind == "mlp":
            self.mixer = ReluSquaredMLP(prefix, cfg.hidden_size, cfg.intermediate_size,
                                        cfg.mlp_bias, quant, dtype)
        else:
            self.mixer = MoE(cfg, prefix, quant, dtype)


class Backbone(nn.Module):
    def __init__(self, cfg: NemotronHConfig, quant: QuantPlan | None, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embeddings.requires_grad_(False)
        self.layers = nn.ModuleList(Block(cfg, i, quant, dtype) for i in range(cfg.num_layers))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype)


class NemotronHForCausalLM(nn.Module):
    def __init__(self, cfg: NemotronHConfig, quant: QuantPlan | None = None,
                 dtype: torch.dtype | None = None, tie_head: bool | None = None,
                 tp: TPGroup = SINGLE) -> None:
        """``tie_head``: score with the embedding matrix instead of an ``lm_head`` of its own;
        default ``cfg.tie_word_embeddings``. The loader passes False when the folder carries an
        ``lm_head.weight`` (transformers saves one even for tied configs, and it can differ).
        ``cfg`` is the whole model's config; ``rank_cfg`` this rank's (what caches size by)."""
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.rank_cfg = rank_config(cfg, tp.size, tp.rank, tp.ep)
        self.tied_head = cfg.tie_word_embeddings if tie_head is None else tie_head
        self.backbone = Backbone(self.rank_cfg, quant, dtype)
        if not self.tied_head:     # a tied head scores with the replicated embeddings
            self.lm_head = build_linear("lm_head", cfg.hidden_size, vocab_rows(cfg, tp.size),
                                        False, quant, dtype)
        self.mamba_index = {i: n for n, i in enumerate(cfg.layer_ids("mamba"))}
        self.attn_index = {i: n for n, i in enumerate(cfg.layer_ids("attention"))}

    # ---- shared modules a drafter borrows ----------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embeddings(ids)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """norm_f'd hidden -> fp32 logits."""
        if self.tied_head:
            return torch.nn.functional.linear(h, self.backbone.embeddings.weight).float()
        logits = self.lm_head(h).float()
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[..., :self.cfg.vocab_size]

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, meta: ForwardMetadata) -> ModelOutput:
        meta.attn.prepare(meta)
        h = self.embed(meta.input_ids)
        taps = set(meta.capture_layers)
        captured: dict[int, torch.Tensor] = {}
        out = None
        for i, block in enumerate(self.backbone.layers):
            # the residual add of the previous block and this block's norm run fused; before
            # a Mamba step's FP8 in_proj the norm also quantizes its output (one launch less)
            fp8 = (block.mixer.input_fp8_scale(h)
                   if block.kind == "mamba" and meta.mode != Mode.EXTEND else None)
            h, x = (block.norm.add_forward(h, out, fp8_scale=fp8) if out is not None
                    else (h, block.norm(h, fp8_scale=fp8)))
            if i in taps:
                captured[i] = h
            if block.kind == "mamba":
                out = self._mamba(block.mixer, self.mamba_index[i], x, meta)
            elif block.kind == "attention":
                out = block.mixer(x, meta, self.attn_index[i])
            else:
                out = block.mixer(x)
            out = self.tp.all_reduce(out)
        norm_f = self.backbone.norm_f
        if meta.logits_rows is None:
            h, final = norm_f.add_forward(h, out)
        else:
            h = h + out
            final = norm_f(h[meta.logits_rows])
        n_layers = len(self.backbone.layers)
        if n_layers in taps:
            captured[n_layers] = h
        aux = torch.cat([captured[i] for i in meta.capture_layers], dim=-1) if taps else None
        return ModelOutput(logits=self.compute_logits(final), aux_hidden=aux)

    @staticmethod
    def _mamba(mixer: Mamba2Mixer, n: int, x: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        pool = meta.mamba
        conv, ssm = pool.conv[n], pool.ssm[n]
        if meta.mode == Mode.EXTEND:
            # requests with equal chunk lengths share one batched chunked scan; consecutive
            # ones read and write their rows as views (the groups come from host-side lengths)
            groups = meta.extend_groups()
            out = None if len(groups) == 1 and groups[0].rows is None else torch.empty_like(x)
            for g in groups:
                if g.rows is None:
                    xs = x[g.start:g.start + g.n * g.q].view(g.n, g.q, -1)
                else:
                    xs = x[g.rows]
                real = None
                if meta.real_rows is not None:
                    real = (meta.real_rows[g.start:g.start + g.n * g.q].view(g.n, g.q)
                            if g.rows is None else meta.real_rows[g.rows])
                y, window, state = mixer.extend(xs, conv[g.slots], ssm[g.slots], real)
                conv[g.slots] = window
                ssm[g.slots] = state
                y = y.reshape(-1, y.shape[-1])
                if out is None:
                    return y
                if g.rows is None:
                    out[g.start:g.start + g.n * g.q] = y
                else:
                    out[g.rows.reshape(-1)] = y
            return out
        if meta.mode == Mode.DECODE:
            return mixer.forward_steps(x, conv, ssm, meta.req_slots, meta.q_len, commit=True)
        return mixer.forward_steps(x, conv, ssm, meta.req_slots, meta.q_len, commit=False,
                                   xbc_scratch=pool.xbc_scratch[n], step_scratch=pool.step_scratch[n])
