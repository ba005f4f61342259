"""The grouped W4A16 MoE path (stacked packed experts, two grouped GEMMs) against the reference
expert loop, on a real ModelOpt MIXED_PRECISION fixture (Triton interpreter on CPU, or CUDA)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockspec import Engine
from blockspec.layers.moe import MoE

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
    ref = moe.routed(h, ids, w)          # fp32 input: always the reference expert loop
    got = moe.routed_grouped(h.to(torch.bfloat16), ids, w).float()
    rel = (got - ref).abs().max() / ref.abs().max()
    assert rel < 1e-2, rel
    # stacked buffers are views: the per-expert modules still see the same bytes
    assert moe.experts[1].up_proj.weight.data_ptr() == moe._grouped[0][0][1].data_ptr()


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
    from blockspec.bench.presets import build_target

    packed = _moe("cpu")
    cuda = torch.device("cuda")
    assert packed.graph_safe(torch.bfloat16, cuda) and packed.graph_safe(torch.float16, cuda)
    assert not packed.graph_safe(torch.float32, cuda)
    assert not packed.graph_safe(torch.bfloat16, torch.device("cpu"))
    dense = next(m for m in build_target("tiny", torch.device("cpu"), torch.float32).modules()
                 if isinstance(m, MoE))
    assert dense._dense is not None and dense.graph_safe(torch.float32, cuda)
