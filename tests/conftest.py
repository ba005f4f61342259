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


@pytest.fixture(scope="package")
def tiny_server(tiny_folder):
    """``blockspec serve`` of the tiny model (served as "tiny") on 127.0.0.1, shared by the
    modules that only send it requests: (ServerThread, Engine)."""
    pytest.importorskip("fastapi")
    from blockspec import Engine  # lazy: only server tests need an engine here
    from blockspec.server.launch import ServerThread  # lazy: fastapi may be missing

    engine = Engine(model_path=str(tiny_folder), device="cpu")
    server = ServerThread(engine, served_model_name="tiny")
    yield server, engine
    server.stop()
    engine.shutdown()
