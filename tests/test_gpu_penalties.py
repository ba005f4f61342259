"""Penalties and top logprobs on the GPU (skipped without CUDA): captured CUDA graphs give the
tokens and numbers eager steps give, and speculation stays token-exact with penalties."""
from __future__ import annotations

import pytest
import torch

from blockspec import Engine
from blockspec.tiny_model import write_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPTS = [[5, 17, 33, 8, 60, 21, 9], [44, 3], [12, 70, 71, 72, 15, 16, 90, 4]]
PENALISED = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "presence_penalty": 0.6,
             "frequency_penalty": 0.4, "repetition_penalty": 1.3, "logit_bias": {17: 3.0},
             "min_new_tokens": 8}
PLAIN = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("gpu_penalties") / "demo")


def _run(e: Engine) -> list[dict]:
    return e.generate(input_ids=PROMPTS * 2, sampling_params=[PENALISED] * 3 + [PLAIN] * 3,
                      top_logprobs_num=3)


def test_graphs_match_eager_with_penalties_and_top_logprobs(demo):
    eager = _run(Engine(model_path=str(demo), device="cuda", dtype="float32",
                        disable_cuda_graph=True))
    graphs = Engine(model_path=str(demo), device="cuda", dtype="float32")
    assert graphs.runner.graphs is not None
    got = _run(graphs)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in eager]
    for a, b in zip(got, eager):
        for ta, tb in zip(a["meta_info"]["output_top_logprobs"], b["meta_info"]["output_top_logprobs"]):
            assert [t for _, t in ta] == [t for _, t in tb]
            assert max(abs(x - y) for (x, _), (y, _) in zip(ta, tb)) < 1e-4
    assert [o["output_ids"] for o in got[:3]] != [o["output_ids"] for o in got[3:]]


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_cuda_speculative_with_penalties_equals_target_only(demo, kind):
    from blockspec.bench.draft_presets import build_random_draft
    from blockspec.bench.presets import preset_config

    target = Engine(model_path=str(demo), device="cuda", dtype="float32")
    ref = _run(target)
    draft = build_random_draft(kind, preset_config("tiny"), 4 if kind == "dflash" else 3,
                        torch.device("cuda"), torch.float32)
    spec = _run(Engine.from_model(target.model, draft=draft))
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in ref]
