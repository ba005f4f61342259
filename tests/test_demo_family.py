"""How an Engine without a model path picks the shipped demo family, and the family's size."""
from __future__ import annotations

import pytest

from blockspec.demo_family import (MEMBERS, SIZE_LIMIT_BYTES, demo_engine_kwargs, family_bytes,
                                   is_shipped, member_path)


def _fake_family(root):
    for m in MEMBERS:
        (root / m).mkdir(parents=True)
        (root / m / "config.json").write_text("{}")
        (root / m / "model.safetensors").write_bytes(b"")
    return root


def test_not_shipped_changes_nothing(tmp_path):
    assert not is_shipped(tmp_path)
    assert demo_engine_kwargs(None, {"device": "cpu"}, tmp_path) == (None, {"device": "cpu"})


def test_shipped_family_defaults_to_dflash(tmp_path):
    root = _fake_family(tmp_path)
    path, kw = demo_engine_kwargs(None, {"device": "cpu"}, root)
    assert path == str(root / "target")
    assert kw == {"device": "cpu", "speculative_algorithm": "DFLASH",
                  "speculative_draft_model_path": str(root / "dflash")}
    _, kw = demo_engine_kwargs(None, {"speculative_algorithm": "dspark"}, root)
    assert kw["speculative_draft_model_path"] == str(root / "dspark")
    _, kw = demo_engine_kwargs(None, {"speculative_algorithm": "none"}, root)
    assert kw["speculative_algorithm"] is None and "speculative_draft_model_path" not in kw
    # an explicit model path or draft is never overridden
    assert demo_engine_kwargs("/m", {}, root) == ("/m", {})
    _, kw = demo_engine_kwargs(None, {"speculative_draft_model_path": "/d"}, root)
    assert kw["speculative_draft_model_path"] == "/d"
    with pytest.raises(ValueError, match="member"):
        member_path("nope", root)


@pytest.mark.skipif(not is_shipped(), reason="the trained demo family is not in the package yet")
def test_shipped_family_fits_the_size_budget():
    assert family_bytes() <= SIZE_LIMIT_BYTES
