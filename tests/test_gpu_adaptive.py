"""The adaptive verify width through CUDA graphs (skipped without CUDA): every width's graph
replays token-exactly, the cost table is timed for every captured (size, width), and no step
width makes a host sync."""
from __future__ import annotations

import random

import pytest
import torch

from tests.test_gpu_runtime import GREEDY, PROMPTS, _engine, _ids, spec  # noqa: F401 - fixture

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_graphs_at_random_widths_equal_target_only(spec, kind):  # noqa: F811
    want = _ids(_engine(spec, None, "cpu").generate(input_ids=PROMPTS, sampling_params=GREEDY))
    e = _engine(spec, kind, "cuda", speculative_adaptive=True)
    d = e.drafter
    rng = random.Random(0)
    d.chooser.force = iter(lambda: rng.randint(1, d.width), None)
    outs = e.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert _ids(outs) == want
    assert all(n > 0 for n in [sum(c) for c in zip(*[o["meta_info"]["spec_width_histogram"]
                                                     for o in outs])])
    captured = {(k[0], k[2]) for k in e.runner.graphs._graphs}
    for w in d.widths:
        assert (f"spec{w}", 4) in captured and (f"spec{w}", 1) in captured
        assert d.cost.measured[(4, w)] > 0 and d.cost.measured[(1, w)] > 0
    d.chooser.force = None                               # the real chooser, same answer
    assert _ids(e.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == want


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_no_width_makes_a_host_sync(spec, kind):  # noqa: F811
    from blockspec.runtime.metadata import StepBatch

    e = _engine(spec, kind, "cuda", "bfloat16", speculative_adaptive=True)
    runner, d = e.runner, e.drafter
    held = [e.memory.admit(16) for _ in range(4)]
    try:
        batch = StepBatch(slots=[h.slot for h in held], prefix_lens=[3, 5, 2, 7], tokens=[1, 2, 3, 4],
                          temperature=[0.8] * 4, top_k=[-1] * 4, top_p=[0.9] * 4, min_p=[0.0] * 4,
                          seeds=[1, 2, 3, 4], sample_counters=[0] * 4, verify_counters=[0] * 4)
        key = batch.sampling_key()
        d._ensure_steps(batch)
        for w in d.widths:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                runner.inputs.fill(batch, 4)
                d.step_fn(runner.inputs.view(4), key, w)
                runner.graphs.replay((f"spec{w}", key, 4))
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    finally:
        for h in held:
            e.memory.release(h)
