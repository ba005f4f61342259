"""blockspec: Nemotron-H inference with block-parallel speculative decoding (DFlash, DSpark)."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Engine", "EngineArgs"]


def __getattr__(name: str):
    if name == "Engine":
        # lazy: `import blockspec` (and so `blockspec --help`) must not import torch
        from blockspec.engine import Engine
        return Engine
    if name == "EngineArgs":
        from blockspec.args import EngineArgs  # lazy: as above
        return EngineArgs
    raise AttributeError(name)
