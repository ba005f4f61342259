"""The greedy DSpark Markov walk on the GPU: gamma + 1 launches of one kernel per draft block.

Slot k's token is the argmax of base[:, k] + W2 · W1[prev] over the whole vocabulary, and slot
k + 1 needs it, so the walk is sequential across slots but wide within one (131k columns on
Lightning). Each launch spreads slot k's columns over many programs: each reads its rows of
W2 once, adds the base logits and leaves a partial (max, index); the next launch's programs
first reduce those partials to the previous token. The corrected logits never go to memory.
``models/dspark.run_markov_block`` is the reference (and the path for sampled rows and for the
gated / rnn heads, whose bias also depends on the draft hidden state).
"""
from __future__ import annotations

from pathlib import Path

import torch

from blockspec.kernels.triton_loader import interpreting, load_kernels, next_pow2

_KERNELS = Path(__file__).with_name("_markov_walk_kernels.py")


def markov_walk_greedy(base_logits: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                       anchor: torch.Tensor) -> torch.Tensor:
    """Tokens ``[B, γ]`` (int64) of the greedy walk: ``x_k = argmax(base[:, k] + W2 · W1[x_{k-1}])``
    with ``x_{-1} = anchor``; ``base_logits [B, γ, V]``, ``w1 [V, r]``, ``w2 [V, r]`` dense."""
    b, gamma, v = base_logits.shape
    r = w1.shape[1]
    if w2.shape != (v, r) or w1.shape[0] != v:
        raise ValueError(f"markov_walk_greedy: W1 {tuple(w1.shape)} and W2 {tuple(w2.shape)} must "
                         f"both be [V={v}, r]")
    base = base_logits if base_logits.stride(-1) == 1 else base_logits.contiguous()
    w1, w2 = w1.contiguous(), w2.contiguous()
    anchor = anchor.reshape(b).to(torch.int64).contiguous()
    block_r = next_pow2(r, 16)
    block_v = min(next_pow2(v, 16), max(16, 32768 // block_r))
    nb = -(-v // block_v)
    dev = base.device
    pv = torch.empty(b * gamma * nb, dtype=torch.float32, device=dev)
    pi = torch.empty(b * gamma * nb, dtype=torch.int32, device=dev)
    tokens = torch.empty(b, gamma, dtype=torch.int64, device=dev)
    kernel = load_kernels(_KERNELS)._markov_slot_kernel
    opts = {} if interpreting() else {"num_warps": 4}
    common = (w1, w2, anchor, pv, pi, tokens)
    for k in range(gamma + 1):
        final = k == gamma
        kernel[(b, 1 if final else nb)](
            base, *common, k, v, r, nb, gamma, base.stride(0), base.stride(1), w1.stride(0),
            w2.stride(0), BLOCK_V=block_v, BLOCK_R=block_r, BLOCK_NB=next_pow2(nb, 16), FINAL=final,
            **opts)
    return tokens
