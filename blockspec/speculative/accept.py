"""Speculative acceptance: the one place where drafts are accepted or rejected.

Layout shared by every function here. A verify block for request b is
``cand = [anchor, d_1 .. d_n]`` (``drafts[b] = d_1 .. d_n``); the target forward over cand
gives rows 0..n, and row i is the target's distribution for the token after cand[0..i].
So draft ``drafts[:, j]`` is judged by target row j, and row n gives the bonus when every
draft is accepted. Each function returns ``(accept_len a [B], bonus [B])``; the tokens
committed this step are ``drafts[b, :a] + [bonus[b]]`` (a + 1 tokens, 1 <= a + 1 <= n + 1).

Everything is a pure function of tensors: the random numbers come in as uniforms (the
engine draws them with ``sampling.uniforms`` from each request's seed and counters), and no
function reads the device back, so a whole speculative step can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from blockspec.sampling import inverse_cdf_sample, target_probs as make_target_probs

__all__ = [
    "greedy_accept",
    "rejection_accept",
    "verify_block",
]


def _check_block(drafts: torch.Tensor, target: torch.Tensor, name: str) -> tuple[int, int]:
    if drafts.dim() != 2:
        raise ValueError(f"drafts must be [B, n], got shape {tuple(drafts.shape)}")
    b, n = drafts.shape
    if target.dim() != 3 or target.shape[0] != b or target.shape[1] != n + 1:
        raise ValueError(f"{name} must be [B, n+1, V] = [{b}, {n + 1}, V] for drafts "
                         f"{tuple(drafts.shape)}, got {tuple(target.shape)}")
    return b, n


def greedy_accept(drafts: torch.Tensor, target_logits: torch.Tensor,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest prefix of drafts equal to the target argmax; bonus = target argmax after it.

    This reproduces target-only greedy decoding token for token: every committed token is
    the target's argmax (first maximum) given the committed prefix before it.
    """
    b, n = _check_block(drafts, target_logits, "target_logits")
    t = target_logits.float().argmax(-1)  # [B, n+1]
    match = (drafts.to(t.device).long() == t[:, :n]).long()
    accept_len = match.cumprod(-1).sum(-1) if n else torch.zeros(b, dtype=torch.long, device=t.device)
    bonus = t.gather(1, accept_len[:, None]).squeeze(1)
    return accept_len, bonus


def rejection_accept(drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, u: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative rejection sampling (lossless: every emitted token follows p).

    For j = 0..n-1: accept d_j if u_j * q_j(d_j) < p_j(d_j), i.e. with probability
    min(1, p/q). At the first rejection j, the bonus is drawn from normalize(max(p_j - q_j, 0));
    if all n are accepted it is drawn from p_n.

    ``target_probs`` [B, n+1, V] and ``draft_probs`` [B, n, V] must be normalised rows
    (``draft_probs`` = the distribution each draft was really sampled from).
    ``draft_probs=None`` means point-mass drafts (argmax drafting): q_j = one-hot(d_j), so
    d_j is accepted with probability p_j(d_j) and the residual is p_j with d_j removed.
    If a residual has no mass (p == q up to rounding, where rejection has probability 0 in
    exact arithmetic) the bonus falls back to p_j rather than failing.

    ``u`` [B, n+1] are independent U[0, 1) numbers, never used before: u[:, :n] are the
    acceptance coins of d_1..d_n and u[:, n] is the inverse-CDF uniform of the bonus.
    """
    b, n = _check_block(drafts, target_probs, "target_probs")
    if draft_probs is not None and tuple(draft_probs.shape) != (b, n, target_probs.shape[-1]):
        raise ValueError(f"draft_probs must be [B, n, V] = {(b, n, target_probs.shape[-1])}, "
                         f"got {tuple(draft_probs.shape)}")
    if tuple(u.shape) != (b, n + 1):
        raise ValueError(f"u must be [B, n+1] = {(b, n + 1)}, got {tuple(u.shape)}")
    dev = target_probs.device
    d = drafts.to(dev).long()
    rows = torch.arange(b, device=dev)
    u = u.to(dev, torch.float64)

    # Only the gathered entries and one [B, V] row are promoted to fp64: a full fp64 copy of
    # [B, n+1, V] would be gigabytes at real vocabulary sizes.
    p_d = target_probs[:, :n].gather(-1, d[..., None]).squeeze(-1).double()
    if draft_probs is None:
        accept = u[:, :n] < p_d
    else:
        q_d = draft_probs.to(dev).gather(-1, d[..., None]).squeeze(-1).double()
        accept = u[:, :n] * q_d < p_d
    accept_len = accept.long().cumprod(-1).sum(-1) if n else torch.zeros(b, dtype=torch.long, device=dev)

    p_a = target_probs[rows, accept_len].double()  # [B, V]: row a is p_j (rejected) or p_n
    dist = p_a
    if n:
        j = accept_len.clamp_max(n - 1)
        if draft_probs is None:
            residual = p_a.scatter(1, d[rows, j][:, None], 0.0)
        else:
            residual = (p_a - draft_probs.to(dev)[rows, j].double()).clamp_min(0.0)
        has_mass = residual.sum(-1, keepdim=True) > 0
        residual = torch.where(has_mass, residual, p_a)
        rejected = (accept_len < n)[:, None]
        dist = torch.where(rejected, residual, p_a)
    bonus = inverse_cdf_sample(dist, u[:, n])
    return accept_len, bonus


def verify_block(drafts: torch.Tensor, target_logits: torch.Tensor,
                 draft_probs: torch.Tensor | None, temperature: torch.Tensor,
                 top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                 u: torch.Tensor | None, *, greedy_only: bool = False, filters: bool = True,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a mixed batch: greedy rows (temperature 0) by exact match on the raw logits,
    sampled rows by rejection sampling against ``target_probs`` (temperature, top-k, top-p,
    min-p) of the same logits. Returns (accept_len, bonus) [B] for all rows in batch order.

    Per-row parameters are [B] tensors (``sampling.params_to_tensors``); ``u`` [B, n+1] as in
    ``rejection_accept`` (ignored by greedy rows). ``greedy_only`` / ``filters=False`` are
    host-side promises that skip work; they never change a result. Rows are combined with
    masks, never selected by index, so nothing waits for the device.
    """
    b, n = _check_block(drafts, target_logits, "target_logits")
    if temperature.shape[0] != b:
        raise ValueError(f"verify_block: {b} rows but {temperature.shape[0]} parameter rows")
    dev = target_logits.device
    drafts = drafts.to(dev)
    g_len, g_bonus = greedy_accept(drafts, target_logits)
    if greedy_only:
        return g_len, g_bonus
    if u is None:
        raise ValueError("verify_block: sampled rows need uniforms u [B, n+1]")
    vocab = target_logits.shape[-1]
    per_pos = n + 1  # every verify row of a request shares its parameters
    p = make_target_probs(
        target_logits.reshape(-1, vocab),
        temperature.repeat_interleave(per_pos), top_k.repeat_interleave(per_pos),
        top_p.repeat_interleave(per_pos), min_p.repeat_interleave(per_pos), filters=filters,
    ).view(b, per_pos, vocab)
    s_len, s_bonus = rejection_accept(drafts, draft_probs, p, u)
    greedy = temperature.to(dev) <= 0
    return torch.where(greedy, g_len, s_len), torch.where(greedy, g_bonus, s_bonus)
