"""Attention backends: one interface (``base.AttentionBackend``) for the target's causal
attention and the draft's block attention, and the registry that builds them by name
(``create_backend``). The registry lives here rather than in ``base`` so that the interface
module imports no backend and the backends import only the interface."""
from __future__ import annotations

from collections.abc import Callable

from blockspec.attention.base import AttentionBackend
from blockspec.attention.torch_native import TorchNativeAttention
from blockspec.attention.triton_paged import TritonPagedAttention

# Implementations by the names of ``args.BACKENDS`` (resolution and availability are checked
# there, before any model is loaded).
FACTORIES: dict[str, Callable[[], AttentionBackend]] = {"torch_native": TorchNativeAttention,
                                                        "triton": TritonPagedAttention}


def create_backend(name: str) -> AttentionBackend:
    """A new instance of the backend registered under ``name``."""
    if name not in FACTORIES:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(sorted(FACTORIES))}")
    return FACTORIES[name]()


__all__ = ["AttentionBackend", "FACTORIES", "create_backend"]
