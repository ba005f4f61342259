"""The bench's simulated text: under ``--simulate-text`` (implied by the simulated acceptance
flags) every step commits a fixed random token stream, so plain decoding and every verify
width commit the same tokens and their steps route the MoE alike."""
from __future__ import annotations


import pytest
import torch

from blockspec.bench.engine_bench import build_engine, run
from blockspec.simulated_text import simulated_text
from tests.bench_fixtures import bench_args as _args

VOCAB = 131072



def test_text_is_a_function_of_seed_and_output_index():
    """Token k of a request is the same whichever step asks for it and however many tokens
    that step asks for; requests with other seeds get other text; a block's tokens are distinct
    (a verify of them routes to as many experts as a trained draft's distinct tokens)."""
    seeds, ctr = torch.tensor([7, 8, 9]), torch.tensor([0, 0, 3])
    a = simulated_text(seeds, ctr, 5, VOCAB)
    assert a.shape == (3, 5) and a.dtype == torch.int64
    assert int(a.min()) >= 0 and int(a.max()) < VOCAB
    assert torch.equal(simulated_text(seeds, ctr + 2, 3, VOCAB), a[:, 2:])
    assert torch.equal(simulated_text(seeds, ctr + 4, 1, VOCAB)[:, 0], a[:, 4])
    assert not torch.equal(a[0], a[1])                  # seeds 7 and 8 from the same index
    assert all(len(set(row)) == 5 for row in a.tolist())
    assert int(simulated_text(seeds, ctr, 4, 11).max()) < 11


def _outputs(device: str = "cpu", **kw) -> list[list[int]]:
    """Output ids of three seeded greedy requests on the tiny preset, built as the bench builds."""
    engine, _ = build_engine(_args(device=device, input_len=6, output_len=24, **kw), 3)
    try:
        prompts = [[5 + i, 9, 13, 21 + i, 7, 3] for i in range(3)]
        outs = engine.generate(input_ids=prompts, sampling_params=[
            {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True, "seed": 100 + i}
            for i in range(3)])
        return [o["output_ids"] for o in outs]
    finally:
        engine.shutdown()


GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", GPU])
def test_plain_decoding_and_every_width_commit_the_same_text(device):
    """AR under --simulate-text, DFlash at widths 2 and 4, adaptive DFlash and DSpark under a
    simulated profile: the same tokens for each request (on CUDA inside the step graphs). The
    first comes from the prefill (the model's own choice); the rest are the text, not the
    model's argmax."""
    own = _outputs(device)
    text = _outputs(device, simulate_text=True)
    # the text is the same on every device (the first token is the model's, in its dtype)
    assert [t[1:] for t in text] == [t[1:] for t in _outputs("cpu", simulate_text=True)]
    prof = dict(simulate_accept_profile="0.9,0.6,0.3")
    for kw in (dict(random_draft="dflash", speculative_num_draft_tokens=2, **prof),
               dict(random_draft="dflash", speculative_num_draft_tokens=4, **prof),
               dict(random_draft="dflash", speculative_num_draft_tokens=4,
                    speculative_adaptive=True, **prof),
               dict(random_draft="dspark", speculative_num_draft_tokens=4, **prof)):
        assert _outputs(device, **kw) == text, kw
    for o, t in zip(own, text):
        assert o[0] == t[0] and o[1:] != t[1:]


def test_rows_say_whether_the_text_was_simulated():
    common = dict(device="cpu", input_len=4, output_len=8, batch_size=[1], repeats=1)
    assert run(_args(**common))[0]["simulated_text"] is False
    assert run(_args(simulate_text=True, **common))[0]["simulated_text"] is True
    assert run(_args(random_draft="dflash", simulate_accept_length=2.0,
                     **common))[0]["simulated_text"] is True


def test_text_with_a_real_verify_or_a_grammar_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--simulate-text with a draft needs"):
        run(_args(device="cpu", input_len=4, output_len=4, repeats=1, random_draft="dflash",
                  simulate_text=True))
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    with pytest.raises(ValueError, match="--simulate-text cannot be combined with --json-schema"):
        run(_args(device="cpu", input_len=4, output_len=4, repeats=1, simulate_text=True,
                  json_schema=str(schema)))
