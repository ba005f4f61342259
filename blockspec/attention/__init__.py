"""Attention backends: one interface (``base.AttentionBackend``) for the target's causal
attention and the draft's block attention, selected by name (``create_backend``)."""
from __future__ import annotations

from blockspec.attention.base import AttentionBackend, create_backend

__all__ = ["AttentionBackend", "create_backend"]
