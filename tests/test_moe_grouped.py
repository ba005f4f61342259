"""The MoE fast paths against the reference expert loop: grouped W4A16 (stacked packed experts,
two grouped GEMMs) and the per-pair decode path, on a real ModelOpt MIXED_PRECISION fixture, and
the per-pair path over dense experts (Triton interpreter on CPU, or CUDA)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockspec import Engine
from blockspec.bench.presets import build_target
from blockspec.layers import moe as moe_mod
from blockspec.layers.moe import MoE

from tests.triton_modes import MODES, mode  # noqa: F401  (mode: fixture)

pytest.importorskip("triton")
FIXTURE = Path(__file__).parent / "fixtures" / "modelopt" / "mixed_lightning"


def _moe(device: str) -> MoE:
    e = Engine(model_path=str(FIXTURE), device=device, dtype="float32")
    moe = next(m for m in e.model.modules() if isinstance(m, MoE))
    assert moe._grouped is not None                    # stacked at load: experts are NVFP4
    return moe


def _compare(moe: MoE, device: str) -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 32, generator=g).to(device)
    ids, w = moe.gate(h)
    ref = moe.routed_reference(h, ids, w)
    got = moe.routed_grouped(h.to(torch.bfloat16), ids, w, None).float()
    rel = (got - ref).abs().max() / ref.abs().max()
    assert rel < 1e-2, rel
    # decode-sized batch through the per-pair path, with the shared expert's add fused
    few, sh = h[:5], torch.randn(5, 32, generator=g).to(device)
    ref = moe.routed_reference(few, ids[:5], w[:5], sh)
    got = moe.routed_pairs(few.to(torch.bfloat16), ids[:5], w[:5], sh.to(torch.bfloat16)).float()
    rel = (got - ref).abs().max() / ref.abs().max()
    assert rel < 1e-2, rel
    # the shared expert riding in the routed launches as its slices (the fixture's shared
    # width is twice the routed one): the same sum as the module's own output added after
    assert moe._shared_parts == 2
    sh = moe.shared_experts(few.to(torch.bfloat16)).float()
    ref = moe.routed_reference(few, ids[:5], w[:5], sh)
    got = moe.routed_pairs(few.to(torch.bfloat16), ids[:5], w[:5], None, ride=True).float()
    err = (got - ref).abs().max()
    assert err / ref.abs().max() < 1e-2, err
    # the shared part is in there: leaving it out moves the result well past that error
    assert (got - moe.routed_reference(few, ids[:5], w[:5])).abs().max() > 4 * err
    # stacked buffers are views: the per-expert modules (and the shared up projection) still
    # see the same bytes
    assert moe.experts[1].up_proj.weight.data_ptr() == moe._grouped[0][0][1].data_ptr()
    assert moe.shared_experts.up_proj.weight.data_ptr() == moe._grouped[0][0][4].data_ptr()


def test_grouped_moe_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _compare(_moe("cpu"), "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_moe_cuda():
    _compare(_moe("cuda"), "cuda")


def test_graph_safe_names_the_configurations_without_a_sync_free_path():
    """The runner turns CUDA graphs off when an MoE layer would fall back to the reference loop
    (it reads expert counts back): packed experts need the bf16/fp16 Triton kernel on CUDA."""
    packed = _moe("cpu")
    cuda = torch.device("cuda")
    assert packed.graph_safe(torch.bfloat16, cuda) and packed.graph_safe(torch.float16, cuda)
    assert not packed.graph_safe(torch.float32, cuda)
    assert not packed.graph_safe(torch.bfloat16, torch.device("cpu"))
    dense = next(m for m in build_target("tiny", torch.device("cpu"), torch.float32).modules()
                 if isinstance(m, MoE))
    assert dense._dense is not None and dense.graph_safe(torch.float32, cuda)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_pair_path_over_dense_experts(mode):
    device = mode
    model = build_target("tiny", device, torch.float32)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, moe.gate.weight.shape[1], generator=g).to(device)
    ids, w = moe.gate(h)
    shared = moe.shared_experts(h) if moe.shared_experts is not None else None
    want = moe.routed_reference(h, ids, w, shared)
    got = moe.routed_pairs(h, ids, w, shared)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(moe.routed_pairs(h, ids, w.flip(1), shared), want, atol=1e-5)


def test_pair_path_cut(monkeypatch):
    """Which path a decode-sized call takes (as on the GPU, where both are graph-safe): pairs up
    to PAIR_PATH_MAX_PAIRS, and packed experts only while the dedup kernel serves the tokens
    (past them each pair would read its expert again: 1.8-2.7x the grouped path's time)."""
    monkeypatch.setattr(moe_mod, "use_triton", lambda t: True)
    packed = _moe("cpu")
    dense = next(m for m in build_target("tiny", torch.device("cpu"), torch.float32).modules()
                 if isinstance(m, MoE))
    for m in (packed, dense):
        monkeypatch.setattr(m, "graph_safe", lambda dtype, device: True)
    h = torch.zeros(1, 32, dtype=torch.bfloat16)
    cap, tokens = moe_mod.PAIR_PATH_MAX_PAIRS, moe_mod.PAIR_DEDUP_MAX_TOKENS

    def takes_pairs(m: MoE, t: int, k: int) -> bool:
        return m._pair_path(h, torch.zeros(t, k, dtype=torch.long))

    assert cap >= 6 * tokens                       # top-6 (Lightning): every deduped count
    assert takes_pairs(packed, tokens, 6) and takes_pairs(dense, tokens, 6)
    assert not takes_pairs(packed, tokens + 1, 2)  # within the pair cap, past the dedup kernel
    assert takes_pairs(dense, tokens + 1, 2)       # dense dedup serves more tokens
    assert not takes_pairs(dense, cap + 1, 1) and not takes_pairs(packed, 1, cap + 1)
