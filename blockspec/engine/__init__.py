"""The engine core: offline API, scheduler, requests and cache memory (no HTTP, no model code)."""
from __future__ import annotations

__all__ = ["Engine", "GenerateError"]


def __getattr__(name: str):
    # Lazy, so runtime modules can import engine.memory without pulling in the Engine.
    if name in __all__:
        from blockspec.engine import engine

        return getattr(engine, name)
    raise AttributeError(name)
