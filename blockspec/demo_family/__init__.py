"""The trained demo family shipped inside the package (``scripts/train_demo.sh`` makes it).

Members, one folder each beside this file:

==================  ==========================================================================
``target``          Nemotron-H (M, *, -, E layers), bf16, with the tokenizer
``target_mixed``    the target through ``blockspec quantize --quant-algo MIXED_PRECISION
                    --recipe lightning``
``dflash``          DFlash draft, generic layout (verify width 8)
``dspark``          DSpark draft, generic layout (gamma 7, verify width 8)
``dflash_nvfp4``    DFlash draft, Nemotron-3.5 layout, W4A16_NVFP4
``dspark_nvfp4``    DSpark draft, Nemotron-3.5 layout, W4A16_NVFP4
==================  ==========================================================================

``demo_engine_kwargs`` is how an ``Engine`` without ``model_path`` picks this family, with
DFlash on by default; while the weights are not shipped it returns nothing and the engine keeps
its random stand-in model (``blockspec.demo``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

FAMILY_DIR = Path(__file__).resolve().parent
MEMBERS = ("target", "target_mixed", "dflash", "dspark", "dflash_nvfp4", "dspark_nvfp4")
DEFAULT_DRAFT = {"DFLASH": "dflash", "DSPARK": "dspark"}
SIZE_LIMIT_BYTES = 40 * 1000 * 1000
_OFF = ("NONE", "OFF", "")


def member_path(name: str, root: Path | None = None) -> Path:
    if name not in MEMBERS:
        raise ValueError(f"unknown demo family member {name!r}; members: {', '.join(MEMBERS)}")
    return (root or FAMILY_DIR) / name


def is_shipped(root: Path | None = None) -> bool:
    """Every member has its config.json and weights."""
    return all((member_path(m, root) / "config.json").is_file()
               and (member_path(m, root) / "model.safetensors").is_file() for m in MEMBERS)


def family_bytes(root: Path | None = None) -> int:
    base = root or FAMILY_DIR
    return sum(f.stat().st_size for m in MEMBERS for f in (base / m).glob("*") if f.is_file())


def demo_engine_kwargs(model_path: str | None, kwargs: dict[str, Any],
                       root: Path | None = None) -> tuple[str | None, dict[str, Any]]:
    """Engine arguments for a call that named no model.

    With the family shipped and no ``model_path``: the family target, and DFlash with the
    family draft unless the caller chose otherwise (``speculative_algorithm="DSPARK"`` picks
    the DSpark draft; ``"none"`` turns speculation off).  Anything else is returned unchanged.
    """
    if model_path is not None or not is_shipped(root):
        return model_path, kwargs
    kw = dict(kwargs)
    algo = kw.get("speculative_algorithm")
    if algo is None:
        algo = "DFLASH"
    algo = str(algo).upper()
    if algo in _OFF:
        kw["speculative_algorithm"] = None
    else:
        kw["speculative_algorithm"] = algo
        if not kw.get("speculative_draft_model_path") and algo in DEFAULT_DRAFT:
            kw["speculative_draft_model_path"] = str(member_path(DEFAULT_DRAFT[algo], root))
    return str(member_path("target", root)), kw
