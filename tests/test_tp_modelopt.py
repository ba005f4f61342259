"""Tensor and expert parallelism on checkpoints NVIDIA ModelOpt exported (not our writer):
``tests/fixtures/modelopt_tp2`` (``scripts/make_modelopt_fixtures.py --tp2``: the tiny
Nemotron-H with 2 Mamba groups and expert width 32, so two ranks split every packed
row-parallel input at whole scale groups). Two gloo ranks in the engine give one process's
tokens, greedy and seeded, with the experts split inside (tp 2) or by expert (ep 2)."""
from __future__ import annotations

from pathlib import Path

import pytest

from blockspec.engine.engine import Engine

FIXTURES = Path(__file__).parent / "fixtures" / "modelopt_tp2"
PROMPTS = [[5, 17, 99, 3, 120, 41, 7, 8, 100, 66, 12, 9, 31], [70, 31, 9, 77], [1, 2, 3, 4, 5, 6]]
SAMPLING = [{"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
            [{"max_new_tokens": 8, "temperature": 1.0, "top_k": 20, "seed": 40 + i,
              "ignore_eos": True} for i in range(len(PROMPTS))]]
KW = {"device": "cpu", "max_total_tokens": 512, "chunked_prefill_size": 8}


@pytest.mark.parametrize("recipe", ["nvfp4", "mixed_lightning"])
def test_modelopt_checkpoint_splits_over_two_ranks(recipe: str) -> None:
    folder = str(FIXTURES / recipe)
    one = Engine(model_path=folder, **KW)
    try:
        want = [[o["output_ids"] for o in one.generate(input_ids=PROMPTS, sampling_params=sp)]
                for sp in SAMPLING]
        for ep in (1, 2):
            two = Engine(model_path=folder, tp_size=2, ep_size=ep, **KW)
            try:
                moe = next(b.mixer for b in two.model.backbone.layers if b.kind == "moe")
                assert len(moe.experts) == (2 if ep == 2 else 4)
                got = [[o["output_ids"] for o in two.generate(input_ids=PROMPTS,
                                                              sampling_params=sp)]
                       for sp in SAMPLING]
                assert got == want, f"ep {ep}"
            finally:
                two.shutdown()
    finally:
        one.shutdown()
