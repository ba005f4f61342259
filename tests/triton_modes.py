"""Kernel tests run twice: the Triton interpreter on CPU tensors (CI) and compiled on a GPU
(``-m gpu``). Parametrize ``mode`` with ``MODES`` (indirect) to get the device to build inputs on."""
from __future__ import annotations

import pytest
import torch

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MODES = ["cpu", pytest.param("cuda", marks=GPU)]


@pytest.fixture
def mode(request, monkeypatch) -> torch.device:
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return torch.device(request.param)
