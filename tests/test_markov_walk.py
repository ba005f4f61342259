"""The greedy DSpark Markov walk kernel against ``run_markov_block`` (the torch reference) on
fresh random inputs: the Triton interpreter on CPU, compiled on a GPU (``-m gpu``)."""
from __future__ import annotations

import pytest
import torch

from blockspec.models.dspark import VanillaMarkovHead, run_markov_block

from tests.triton_modes import GPU, MODES, mode  # noqa: F401  (mode: fixture)

pytest.importorskip("triton")




def _head(vocab: int, rank: int, dtype: torch.dtype, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)
    head = VanillaMarkovHead(vocab, rank, 8, None, dtype)
    head.markov_w1.weight.data = torch.randn(vocab, rank, generator=g).to(dtype)
    head.markov_w2.weight.data = (torch.randn(vocab, rank, generator=g) * 0.5).to(dtype)
    return head.to(device)


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("batch, gamma, vocab, rank, dtype", [
    (1, 3, 1000, 64, torch.float32),      # vocabulary not a multiple of the block
    (3, 4, 2048, 24, torch.bfloat16),     # rank not a power of two, bias rounded to bf16
    (2, 1, 300, 256, torch.float32),      # one slot, wide rank
])
def test_greedy_walk_kernel_matches_reference(mode, batch, gamma, vocab, rank, dtype, monkeypatch):
    from blockspec.kernels.markov_walk import markov_walk_greedy

    head = _head(vocab, rank, dtype, mode, seed=vocab + rank)
    g = torch.Generator().manual_seed(gamma)
    # base logits comparable to the bias, so the walk's choice depends on the previous token
    base = (torch.randn(batch, gamma, vocab, generator=g) * 2).to(dtype).to(mode)
    anchor = torch.randint(0, vocab, (batch,), generator=g).to(mode)
    hidden = torch.zeros(batch, gamma, 8, dtype=dtype, device=mode)
    walk = dict(greedy_only=True, with_probs=False)
    with torch.no_grad(), monkeypatch.context() as m:
        m.setenv("BLOCKSPEC_DISABLE_TRITON", "1")        # the torch walk, even on CUDA
        want, _ = run_markov_block(head, base, hidden, anchor, torch.zeros(batch), **walk)
    got = markov_walk_greedy(base, head.markov_w1.weight, head.markov_w2.weight, anchor)
    assert got.dtype == torch.int64 and got.shape == (batch, gamma)
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=0, atol=0)
    if mode.type == "cuda":                               # and the walk takes the kernel there
        with torch.no_grad():
            fused, _ = run_markov_block(head, base, hidden, anchor, torch.zeros(batch), **walk)
        torch.testing.assert_close(fused, got, rtol=0, atol=0)
    # the walk must matter: the tokens differ from the argmax of the base logits alone
    if gamma > 1:
        assert not torch.equal(got.cpu(), base.float().argmax(-1).cpu())


def test_walk_kernel_rejects_mismatched_tables():
    from blockspec.kernels.markov_walk import markov_walk_greedy

    with pytest.raises(ValueError, match="W1 .* W2"):
        markov_walk_greedy(torch.zeros(1, 2, 10), torch.zeros(10, 4), torch.zeros(9, 4),
                           torch.zeros(1, dtype=torch.long))
