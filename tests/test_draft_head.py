"""A draft's output head follows the target's rule: the draft folder's own ``lm_head.weight`` is
used when it has one (vLLM's DFlash loader does the same), the target's head when it has none.
The published DFlash, DSpark and Nemotron 3.5 drafts carry no head, so a head there is a stray
one: it must be used consistently by both algorithms, or refused with a clear error."""
from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec import Engine
from blockspec.configs.draft import DraftConfigError
from blockspec.speculative.draft_loader import load_draft
from tests.ckpt_edit import edited_copy
from tests.spec_fixtures import draft_config, make_spec_target, write_draft

VOCAB, HIDDEN, LAYERS = 24, 32, 7
PROMPTS = [[(3 + 5 * i) % 23, (5 + 3 * i) % 23, 7 + i % 3, 11, 2 + i][: 2 + i % 4] for i in range(8)]
GREEDY = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_head")
    _, folder = make_spec_target(root, offset=2.0, mix=0.3, pull=3.5)
    engine = Engine(model_path=str(folder), device="cpu")
    ref = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    head = load_file(str(folder / "model.safetensors"))["lm_head.weight"]
    return root, folder, engine, ref, head


def _draft(root, kind, name, head=None):
    cfg = draft_config(kind, hidden=HIDDEN, vocab=VOCAB, target_layers=LAYERS, block_size=4)
    folder = write_draft(root / f"{kind}_{name}", cfg, std=0.05)
    if head is not None:
        tensors = load_file(str(folder / "model.safetensors"))
        tensors["lm_head.weight"] = head.contiguous()
        save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _run(folder, draft, kind):
    e = Engine(model_path=str(folder), device="cpu", speculative_algorithm=kind.upper(),
               speculative_draft_model_path=str(draft))
    try:
        outs = e.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    finally:
        e.shutdown()
    hist = [sum(c) for c in zip(*[o["meta_info"]["spec_accept_histogram"] for o in outs])]
    return [o["output_ids"] for o in outs], hist


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_draft_scores_with_its_own_head_else_the_targets(target, kind, caplog):
    root, _, engine, _, head = target
    plain = _draft(root, kind, "plain")
    other = torch.randn(head.shape, generator=torch.Generator().manual_seed(5))
    own = _draft(root, kind, "own", other)
    with caplog.at_level(logging.INFO, logger="blockspec"):
        d_plain = load_draft(plain, engine.config, torch.float32, torch.device("cpu"))
        d_own = load_draft(own, engine.config, torch.float32, torch.device("cpu"))
    notes = [r.getMessage() for r in caplog.records if "output head" in r.getMessage()]
    assert len(notes) == 2 and "the target's" in notes[0] and "draft's own lm_head.weight" in notes[1]
    assert d_plain.lm_head is None
    h = torch.randn(3, 4, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(d_plain.compute_logits(h, engine.model),
                                   engine.model.compute_logits(h))
        torch.testing.assert_close(d_own.compute_logits(h, engine.model), h @ other.T)


def test_stray_head_equal_to_the_targets_changes_nothing(target):
    root, folder, _, ref, head = target
    ids, hist = _run(folder, _draft(root, "dflash", "plain"), "dflash")
    ids_own, hist_own = _run(folder, _draft(root, "dflash", "copy", head), "dflash")
    assert ids == ids_own == ref
    assert hist == hist_own and sum(hist[1:]) > 0


def test_own_head_decides_the_drafts(target):
    """A zero head makes every logit equal, so every draft is token 0; the target's greedy
    continuation never starts with 0 here, so nothing is accepted — and output stays exact."""
    root, folder, _, ref, head = target
    assert all(0 not in r for r in ref)
    ids, hist = _run(folder, _draft(root, "dflash", "zero", torch.zeros_like(head)), "dflash")
    assert ids == ref
    assert hist[0] > 0 and sum(hist[1:]) == 0, hist


def test_bad_draft_heads_are_refused(target, tmp_path):
    root, _, engine, _, head = target
    small = _draft(root, "dflash", "small_vocab", head[:16])
    with pytest.raises(DraftConfigError, match=r"lm_head.weight has 16 rows but the target "
                                               r"vocabulary has 24.*d2t"):
        load_draft(small, engine.config, torch.float32, torch.device("cpu"))
    claimed = edited_copy(_draft(root, "dflash", "plain"), tmp_path / "claimed",
                          lambda c: c.update(has_lm_head=True))
    with pytest.raises(DraftConfigError, match="has_lm_head=true but the folder has no lm_head.weight"):
        load_draft(claimed, engine.config, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_nvfp4_draft_head_changes_proposals_only(target, kind):
    """--speculative-draft-lm-head nvfp4: the draft scores with a W4A16 copy of the target's
    head (its logits are exactly those of the dequantized copy), and decoding stays
    token-identical to the target alone."""
    from blockspec.quant.linear import NVFP4Linear
    from blockspec.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

    root, folder, engine, ref, head = target
    e = Engine(model_path=str(folder), device="cpu", speculative_algorithm=kind.upper(),
               speculative_draft_model_path=str(_draft(root, kind, "plain")),
               speculative_draft_lm_head="nvfp4")
    try:
        worker = e.drafter
        assert isinstance(worker.head, NVFP4Linear)
        h = torch.randn(2, 3, HIDDEN, generator=torch.Generator().manual_seed(3))
        w = dequantize_nvfp4(*quantize_nvfp4(head))
        assert not torch.equal(w, head)          # the copy really is quantized
        with torch.no_grad():
            torch.testing.assert_close(worker.draft_logits(h), h @ w.T)
        outs = e.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    finally:
        e.shutdown()
    assert [o["output_ids"] for o in outs] == ref
    hist = [sum(c) for c in zip(*[o["meta_info"]["spec_accept_histogram"] for o in outs])]
    assert sum(hist[1:]) > 0


def test_nvfp4_draft_head_keeps_an_already_quantized_head(target, caplog):
    from blockspec.quant.linear import NVFP4Linear
    from blockspec.speculative.draft_head import nvfp4_draft_head

    _, _, engine, _, _ = target

    class Quantized(torch.nn.Module):
        tied_head = False
        lm_head = NVFP4Linear(HIDDEN, VOCAB)

    draft = torch.nn.Module()
    draft.lm_head = None
    with caplog.at_level(logging.INFO, logger="blockspec"):
        assert nvfp4_draft_head(draft, Quantized()) is None
        assert isinstance(nvfp4_draft_head(draft, engine.model), NVFP4Linear)
    assert any("already quantized" in r.getMessage() for r in caplog.records)


def test_draft_lm_head_flag_is_checked():
    from blockspec.args import ArgsError, EngineArgs

    with pytest.raises(ArgsError, match="speculative_draft_lm_head must be one of auto, target, nvfp4"):
        EngineArgs.from_kwargs(speculative_draft_lm_head="fp8")


def test_auto_keeps_the_stored_head_on_cpu_and_in_fp32(target):
    """The default (auto) makes the NVFP4 copy only for a 16-bit head on CUDA: CPU engines and
    fp32 models score drafts with the head as stored."""
    from blockspec.speculative.draft_head import make_draft_head

    root, folder, engine, _, _ = target
    e = Engine(model_path=str(folder), device="cpu", speculative_algorithm="DSPARK",
               speculative_draft_model_path=str(_draft(root, "dspark", "plain")))
    try:
        assert e.args.speculative_draft_lm_head == "auto" and e.drafter.head is None
    finally:
        e.shutdown()
    draft = torch.nn.Module()
    draft.lm_head = None
    assert make_draft_head("auto", draft, engine.model) is None          # fp32 on CPU
    assert make_draft_head("target", draft, engine.model) is None
    assert make_draft_head("nvfp4", draft, engine.model) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_quantizes_a_bf16_head_on_cuda(target):
    from blockspec.quant.linear import NVFP4Linear
    from blockspec.speculative.draft_head import make_draft_head

    _, _, engine, _, head = target

    class Bf16Target(torch.nn.Module):
        tied_head = False

        def __init__(self):
            super().__init__()
            from blockspec.layers.linear import Linear
            self.lm_head = Linear(HIDDEN, VOCAB, dtype=torch.bfloat16).cuda()
            self.lm_head.weight.data.copy_(head)

    draft = torch.nn.Module()
    draft.lm_head = None
    assert isinstance(make_draft_head("auto", draft, Bf16Target()), NVFP4Linear)
