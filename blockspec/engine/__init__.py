"""The engine core: offline API, scheduler, requests and the loop (no HTTP, no model code)."""
from __future__ import annotations

from blockspec.engine.engine import Engine, GenerateError

__all__ = ["Engine", "GenerateError"]
