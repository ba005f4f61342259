"""blockspec: Nemotron-H inference with block-parallel speculative decoding (DFlash, DSpark)."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Engine", "EngineArgs"]


def __getattr__(name: str):
    # Lazy: `import blockspec` stays cheap and CLI errors stay fast.
    if name == "Engine":
        from blockspec.engine import Engine
        return Engine
    if name == "EngineArgs":
        from blockspec.args import EngineArgs
        return EngineArgs
    raise AttributeError(name)
