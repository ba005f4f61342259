"""A speculative step's bookkeeping in one launch (``kernels/spec_commit.py``) against the
worker's torch form (``SpecWorker.commit_reference``) on random states: committed tokens, the
output columns, the acceptance EWMA (adaptive) or its zero columns (fixed width), and the
advanced inputs, padding rows on the dummy slot included (interpreter on CPU, compiled with
-m gpu)."""
from __future__ import annotations

import pytest
import torch

from blockspec import Engine
from blockspec.kernels.spec_commit import spec_commit_fused
from tests.spec_fixtures import draft_config, make_spec_target, write_draft
from tests.test_dflash import HIDDEN, LAYERS, VOCAB
from tests.triton_modes import MODES, mode  # noqa: F401  (mode: fixture)

pytest.importorskip("triton")
FIELDS = ("slot", "verify_ctr", "token", "prefix", "sample_ctr")


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_commit")
    _, folder = make_spec_target(root, offset=2.0, mix=0.3, pull=3.5)
    cfg = draft_config("dflash", hidden=HIDDEN, vocab=VOCAB, target_layers=LAYERS, block_size=5)
    draft = write_draft(root / "draft", cfg, std=0.05)
    out = {a: Engine(model_path=str(folder), device="cpu", speculative_algorithm="DFLASH",
                     speculative_draft_model_path=str(draft), speculative_adaptive=a)
           for a in (True, False)}
    yield {a: e.drafter for a, e in out.items()}
    for e in out.values():
        e.shutdown()


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("bs, pad, width", [(1, 0, 1), (1, 0, 5), (5, 2, 3), (9, 3, 5),
                                           (16, 0, 5), (13, 3, 4)])
def test_commit_fused_equals_reference(workers, mode, adaptive, bs, pad, width):
    w = workers[adaptive]
    g = torch.Generator().manual_seed(bs * 10 + width + 100 * adaptive)
    dummy, n = w.memory.dummy_slot, bs + pad
    inp = {"slot": torch.cat([torch.randperm(dummy, generator=g)[:bs],
                              torch.full((pad,), dummy, dtype=torch.long)]),
           "verify_ctr": torch.randint(0, 3, (n,), generator=g),
           "token": torch.randint(0, VOCAB, (n,), generator=g),
           "prefix": torch.randint(10, 100, (n,), generator=g),
           "sample_ctr": torch.randint(0, 50, (n,), generator=g)}
    acc = torch.randint(0, width, (n,), generator=g)
    bonus = torch.randint(0, VOCAB, (n,), generator=g)
    drafts = torch.randint(0, VOCAB, (n, w.gamma), generator=g)[:, :width - 1]   # a slice
    if width > 1:       # row 0 commits an end-of-sequence id: its acceptance is not observed
        drafts[0, 0], acc[0] = w.runner.cfg.eos_token_id[0], max(int(acc[0]), 1)
    if adaptive:
        w.ewma.table.copy_(torch.rand(w.ewma.table.shape, generator=g))
        w.ewma.engine.copy_(torch.rand(w.ewma.engine.shape, generator=g))
        # observation counts 0-60: the running mean's first weights and the EWMA past them
        w.ewma.engine_n.copy_(torch.randint(0, 61, w.ewma.engine_n.shape, generator=g))
        # requests that committed an end-of-sequence id in an earlier step (a new request in
        # the slot, verify counter 0, does not inherit it)
        w.ewma.ended.copy_(torch.randint(0, 2, w.ewma.ended.shape, generator=g))
    # the EWMA's state on the kernel's device, copies (the reference updates the worker's own)
    ewma = ({k: v.clone().to(mode) if torch.is_tensor(v) else v
             for k, v in w.ewma.kernel_args().items()} if adaptive else {})
    # the step inputs are rows of one int64 block, as StepInputs keeps them (offset views)
    block = torch.stack([inp[k] for k in FIELDS]).to(mode)
    dev = {k: block[i] for i, k in enumerate(FIELDS)}

    want_toks, want = w.commit_reference(inp, acc, bonus, drafts, width)
    toks, got = spec_commit_fused(acc.to(mode), bonus.to(mode), drafts.to(mode), dev,
                                  width=width, gamma=w.gamma, dummy=dummy, **ewma)
    assert torch.equal(toks.cpu(), want_toks)
    assert got.shape == want.shape and got.dtype == torch.float64
    assert torch.equal(got.cpu()[:, :1 + 2 * width], want[:, :1 + 2 * width])
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-6)
    for k in FIELDS:
        assert torch.equal(dev[k].cpu(), inp[k]), k
    if adaptive:
        torch.testing.assert_close(ewma["engine"].cpu(), w.ewma.engine, rtol=0, atol=1e-6)
        assert torch.equal(ewma["engine_n"].cpu(), w.ewma.engine_n)
        assert torch.equal(ewma["ended"].cpu()[:-1], w.ewma.ended[:-1])
        assert w.ewma.ended[inp["slot"][0]] == (width > 1)      # row 0 committed one
        torch.testing.assert_close(ewma["table"].cpu()[:-1], w.ewma.table[:-1], rtol=0,
                                   atol=1e-6)
    # the check can fail: the inputs moved (real rows only) and the bonus is committed
    live = inp["slot"] != dummy
    assert torch.equal(inp["token"][live], bonus[live])
    assert torch.equal(want_toks.gather(1, acc[:, None])[:, 0], bonus)
