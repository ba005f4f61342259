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

``demo_engine_kwargs`` is how an ``Engine`` (and so ``blockspec generate``, ``serve`` and
``eval``) without ``model_path`` picks this family, with DFlash on by default;
``speculative_algorithm="DSPARK"`` picks the DSpark draft and ``"NONE"`` turns speculation off.
The family is trained on GSM8K-format word problems (``blockspec/gsm8k_data``): ask it one.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

FAMILY_DIR = Path(__file__).resolve().parent
MEMBERS = ("target", "target_mixed", "dflash", "dspark", "dflash_nvfp4", "dspark_nvfp4")
DEFAULT_DRAFT = {"DFLASH": "dflash", "DSPARK": "dspark"}
SIZE_LIMIT_BYTES = 40 * 1000 * 1000
_OFF = ("NONE", "OFF", "")
# A question of the shipped test split (blockspec/gsm8k_data/gsm8k_demo_test.jsonl, row 1), the
# README's first command; the family answers it with "#### 147".
EXAMPLE_QUESTION = ("A book has 387 pages. Diego reads 60 pages a day for 4 days. "
                    "How many pages are left to read?")


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


def missing_files(root: Path | None = None) -> list[str]:
    return [f"{m}/{f}" for m in MEMBERS for f in ("config.json", "model.safetensors")
            if not (member_path(m, root) / f).is_file()]


def demo_engine_kwargs(model_path: str | None, kwargs: dict[str, Any],
                       root: Path | None = None) -> tuple[str | None, dict[str, Any]]:
    """Engine arguments for a call that named no model.

    Without ``model_path``: the family target, and DFlash with the family draft unless the
    caller chose otherwise (``speculative_algorithm="DSPARK"`` picks the DSpark draft;
    ``"none"`` turns speculation off; an explicit draft path is kept).  A ``model_path`` is
    returned unchanged with its kwargs.  A family with files missing is an error (an install
    without the package data), never a silent stand-in.
    """
    if model_path is not None:
        return model_path, kwargs
    if not is_shipped(root):
        missing = missing_files(root)
        raise FileNotFoundError(
            f"no model path given and the demo family at {root or FAMILY_DIR} is incomplete "
            f"(missing {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); pass "
            f"--model-path / model_path, or reinstall blockspec with its package data")
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


def describe(model_path: str, algorithm: str | None, draft_path: str | None) -> str:
    """One line naming what ``demo_engine_kwargs`` picked (the CLI prints it on stderr)."""
    spec = f"{algorithm} on, draft {draft_path}" if algorithm else "speculation off"
    return (f"no --model-path: using the demo family's target {model_path} ({spec}); it answers "
            f"GSM8K-style math word problems")
