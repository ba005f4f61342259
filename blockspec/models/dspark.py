"""DSpark draft model: the DFlash backbone plus a sequential Markov head.

The backbone gives base logits for all gamma block rows in one forward; the Markov head then
walks the block left to right, adding a bias that depends on the token actually drafted at the
previous slot (``run_markov_block``).  The walk returns the corrected draft distributions, which
the sampling verifier needs as q.
"""
from __future__ import annotations

import torch
from torch import nn

from blockspec.kernels.markov_walk import markov_walk_greedy
from blockspec.kernels.triton_loader import use_triton
from blockspec.layers.linear import Linear, QuantPlan, build_linear
from blockspec.sampling import inverse_cdf_sample
from blockspec.models.dflash import DFlashDraftModel, DraftEmbedding
from blockspec.configs.draft import DraftConfig, DraftConfigError, SUPPORTED_MARKOV_HEAD_TYPES

MIN_DRAFT_TEMPERATURE = 1e-5


class MarkovHead(nn.Module):
    """Common part: ``markov_w1`` (embedding [V, r], a plain parameter) and ``markov_w2``
    (linear r -> V, weight [V, r], built through ``build_linear`` so a plan can pack it)."""

    head_type = "base"

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, quant: QuantPlan | None,
                 dtype: torch.dtype | None, prefix: str = "markov_head") -> None:
        super().__init__()
        if rank <= 0:
            raise DraftConfigError(f"Markov head rank must be > 0, got {rank}")
        self.vocab_size, self.rank, self.hidden_size = vocab_size, rank, hidden_size
        self.markov_w1 = DraftEmbedding(vocab_size, rank, dtype=dtype)
        self.markov_w2 = build_linear(f"{prefix}.markov_w2", rank, vocab_size, False, quant, dtype)

    def init_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """The per-block state before slot 0 (None for stateless heads)."""
        return None

    def embed_prev(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev_tokens.long())

    def step(self, prev_tokens: torch.Tensor, h: torch.Tensor | None, state: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``prev_tokens [B]``, ``h [B, H]`` (this slot's draft hidden), state ->
        (bias ``[B, V]``, new state)."""
        raise NotImplementedError


class VanillaMarkovHead(MarkovHead):
    """bias = W2 · W1[prev]: a rank-r bigram table; ignores h."""

    head_type = "vanilla"

    def step(self, prev_tokens, h, state):
        return self.markov_w2(self.embed_prev(prev_tokens)), state


class GatedMarkovHead(MarkovHead):
    """g = sigmoid(gate_proj([h ; e])), bias = W2 · (g ⊙ e), with e = W1[prev]."""

    head_type = "gated"

    def __init__(self, vocab_size, rank, hidden_size, quant, dtype, prefix="markov_head"):
        super().__init__(vocab_size, rank, hidden_size, quant, dtype, prefix)
        self.gate_proj = build_linear(f"{prefix}.gate_proj", hidden_size + rank, rank, True,
                                      quant, dtype)

    def step(self, prev_tokens, h, state):
        e = self.embed_prev(prev_tokens)
        g = torch.sigmoid(self.gate_proj(torch.cat((h.to(e.dtype), e), dim=-1)))
        return self.markov_w2(g * e), state


class RnnMarkovHead(MarkovHead):
    """(a, c, o) = split(joint_proj([s ; e ; h])); s' = σ(a)⊙s + (1−σ(a))⊙tanh(c);
    bias = W2 · tanh(o).  The state starts at zero for every block."""

    head_type = "rnn"

    def __init__(self, vocab_size, rank, hidden_size, quant, dtype, prefix="markov_head"):
        super().__init__(vocab_size, rank, hidden_size, quant, dtype, prefix)
        self.joint_proj = build_linear(f"{prefix}.joint_proj", 2 * rank + hidden_size, 3 * rank,
                                       True, quant, dtype)

    def init_state(self, batch, device, dtype):
        return torch.zeros(batch, self.rank, device=device, dtype=dtype)

    def step(self, prev_tokens, h, state):
        e = self.embed_prev(prev_tokens)
        if state is None:
            state = self.init_state(e.shape[0], e.device, e.dtype)
        a, c, o = self.joint_proj(torch.cat((state.to(e.dtype), e, h.to(e.dtype)), dim=-1)
                                  ).split(self.rank, dim=-1)
        gate = torch.sigmoid(a)
        new_state = gate * state.to(e.dtype) + (1 - gate) * torch.tanh(c)
        return self.markov_w2(torch.tanh(o)), new_state


_HEADS = {"vanilla": VanillaMarkovHead, "gated": GatedMarkovHead, "rnn": RnnMarkovHead}


def build_markov_head(cfg: DraftConfig, quant: QuantPlan | None = None,
                      dtype: torch.dtype | None = torch.float32,
                      is_nemotron_35: bool | None = None) -> MarkovHead:
    """The head named by ``cfg.markov_head_type`` (prefix ``markov_head``).  Nemotron 3.5
    drafts allow only ``vanilla`` (its W2 is W4A16_NVFP4 when the plan says so)."""
    if is_nemotron_35 is None:
        is_nemotron_35 = cfg.is_nemotron_35
    rank = cfg.markov_rank
    if rank is None or rank <= 0:
        raise DraftConfigError(f"DSpark needs a Markov head: markov_rank must be > 0, got {rank}")
    head_type = cfg.markov_head_type or "vanilla"
    if head_type not in _HEADS:
        raise DraftConfigError(f"unsupported markov_head_type {head_type!r}; supported: "
                               f"{', '.join(SUPPORTED_MARKOV_HEAD_TYPES)}")
    if is_nemotron_35 and head_type != "vanilla":
        raise DraftConfigError(f"Nemotron 3.5 DSpark drafts support only the 'vanilla' Markov "
                               f"head, got {head_type!r}")
    if cfg.vocab_size is None:
        raise DraftConfigError("DSpark Markov head needs vocab_size")
    return _HEADS[head_type](cfg.vocab_size, rank, cfg.hidden_size, quant, dtype)


def run_markov_block(head: MarkovHead, base_logits: torch.Tensor, hidden: torch.Tensor,
                     anchor: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor | None = None,
                     *, greedy_only: bool = False, return_logits: bool = False,
                     with_probs: bool = True):
    """Sequential DSpark walk over one block.

    base_logits ``[B, γ, V]``, hidden ``[B, γ, H]``, anchor ``[B]``, temperature ``[B]``
    (0 = greedy row), ``u [B, γ]`` uniforms for the sampled rows (slot k draws with
    ``u[:, k]``). prev₀ = anchor; logits_k = base_k + bias(prev_k, h_k) (fp32); greedy rows
    take the argmax (q = one-hot), sampled rows draw by inverse CDF from
    softmax(logits_k / max(T, 1e-5)) with no top-k/top-p (q = that softmax); prev_{k+1} = x_k.
    Rows are mixed with masks (nothing is read back), so the walk can run in a CUDA graph;
    ``greedy_only`` (a host-side promise) skips the softmax.

    Returns ``(tokens [B, γ] long, draft_probs [B, γ, V] fp32)`` and, with
    ``return_logits=True``, also the corrected logits ``[B, γ, V]`` fp32. ``with_probs=False``
    (greedy verification needs no q) returns None for the probabilities and skips writing them.
    """
    if base_logits.dim() != 3 or hidden.dim() != 3 or hidden.shape[:2] != base_logits.shape[:2]:
        raise ValueError(f"run_markov_block: base_logits {tuple(base_logits.shape)} and hidden "
                         f"{tuple(hidden.shape)} must be [B, γ, V] and [B, γ, H]")
    b, gamma, v = base_logits.shape
    dev = base_logits.device
    temperature = temperature.to(dev, torch.float32).reshape(b)
    greedy = (temperature <= 0)[:, None]
    temp = temperature.clamp_min(MIN_DRAFT_TEMPERATURE)[:, None]
    if not greedy_only and (u is None or tuple(u.shape) != (b, gamma)):
        raise ValueError(f"run_markov_block: sampled rows need uniforms u [B, γ] = {(b, gamma)}, "
                         f"got {None if u is None else tuple(u.shape)}")

    if greedy_only and not return_logits and _fused_walk_ok(head, base_logits):
        tokens = markov_walk_greedy(base_logits, head.markov_w1.weight, head.markov_w2.weight,
                                    anchor.to(dev))
        if not with_probs:
            return tokens, None
        q = torch.zeros(b, gamma, v, dtype=torch.float32, device=dev)
        return tokens, q.scatter_(2, tokens[..., None], 1.0)

    tokens = torch.empty(b, gamma, dtype=torch.long, device=dev)
    probs_out = torch.empty(b, gamma, v, dtype=torch.float32, device=dev) if with_probs else None
    logits_out = torch.empty(b, gamma, v, dtype=torch.float32, device=dev) if return_logits else None
    prev = anchor.to(dev).long().reshape(b)
    state = None
    for k in range(gamma):
        bias, state = head.step(prev, hidden[:, k], state)
        logits = base_logits[:, k].float() + bias.float()
        tok = logits.argmax(dim=-1)
        if not greedy_only:
            probs = torch.softmax(logits / temp, dim=-1)
            tok = torch.where(greedy[:, 0], tok, inverse_cdf_sample(probs, u[:, k]))
        tokens[:, k] = tok
        if probs_out is not None:
            q = torch.zeros(b, v, dtype=torch.float32, device=dev).scatter_(1, tok[:, None], 1.0)
            probs_out[:, k] = q if greedy_only else torch.where(greedy, q, probs)
        if logits_out is not None:
            logits_out[:, k] = logits
        prev = tok
    if return_logits:
        return tokens, probs_out, logits_out
    return tokens, probs_out


def _fused_walk_ok(head: MarkovHead, base_logits: torch.Tensor) -> bool:
    """The greedy walk runs as one Triton kernel per slot for the vanilla head with dense
    weights (its bias depends on the previous token alone)."""
    return (type(head) is VanillaMarkovHead and type(head.markov_w2) is Linear
            and head.markov_w2.bias is None and use_triton(base_logits))


class DSparkDraftModel(DFlashDraftModel):
    """DFlash backbone + ``markov_head``.  Block layout follows ``config.sample_from_anchor``:
    True → γ query rows, all drafts; False → γ+1 rows, row 0 (anchor) dropped."""

    def __init__(self, cfg: DraftConfig, quant: QuantPlan | None = None,
                 dtype: torch.dtype | None = torch.float32, attn_impl: str = "eager") -> None:
        if cfg.algorithm != "dspark":
            raise DraftConfigError(f"DSparkDraftModel needs a DSpark config, got {cfg.algorithm!r}")
        super().__init__(cfg, quant, dtype, attn_impl)
        self.markov_head = build_markov_head(cfg, quant, dtype, cfg.is_nemotron_35)

    def markov_walk(self, base_logits: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor,
                    temperature: torch.Tensor, u: torch.Tensor | None = None, *,
                    greedy_only: bool = False, return_logits: bool = False,
                    with_probs: bool = True):
        return run_markov_block(self.markov_head, base_logits, hidden, anchor, temperature, u,
                                greedy_only=greedy_only, return_logits=return_logits,
                                with_probs=with_probs)
