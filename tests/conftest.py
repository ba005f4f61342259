"""Settings for the whole test run. Under pytest-xdist (the README's command runs two workers)
each worker computes with one thread: the tests' tensors are tiny, and two workers with two
threads each would share two cores four ways."""
from __future__ import annotations

import os

import pytest
import torch

from blockspec.tiny_model import write_tiny_model


def pytest_configure(config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture(scope="package")
def tiny_folder(tmp_path_factory):
    """The tiny random model (``blockspec.tiny_model``), written once for every module that
    only reads it."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
