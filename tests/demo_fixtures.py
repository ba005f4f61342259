"""A tiny trained demo family (a few steps each, CPU) for tests of training, loading and eval."""
from __future__ import annotations

from pathlib import Path

from blockspec.cli import main as cli

TRAIN = ["--size", "tiny", "--num-samples", "300", "--batch-size", "8", "--device", "cpu",
         "--time-budget-s", "120"]
DRAFTS = {   # name: (algorithm, layout, extra flags)
    "dflash": ("dflash", "generic", ["--block-size", "4"]),
    "dspark": ("dspark", "generic", ["--block-size", "3", "--markov-rank", "16"]),
    "dflash_nvfp4": ("dflash", "nemotron35", ["--block-size", "4", "--quantize", "W4A16_NVFP4"]),
    "dspark_nvfp4": ("dspark", "nemotron35", ["--block-size", "3", "--markov-rank", "16",
                                              "--quantize", "W4A16_NVFP4"]),
}


def train_target(folder: Path, steps: int = 3, *extra: str) -> Path:
    assert cli(["train-target", "--output", str(folder), "--max-steps", str(steps), *TRAIN,
                *extra]) == 0
    return folder


def train_draft(target: Path, folder: Path, name: str, steps: int = 2, *extra: str) -> Path:
    algo, layout, flags = DRAFTS[name]
    assert cli(["train-draft", "--target-model-path", str(target), "--algorithm", algo,
                "--layout", layout, "--output", str(folder), "--max-steps", str(steps),
                "--num-anchors", "4", *flags, *TRAIN, *extra]) == 0
    return folder


def tiny_family(root: Path, drafts: tuple[str, ...] = tuple(DRAFTS)) -> dict[str, Path]:
    target = train_target(root / "target")
    return {"target": target, **{n: train_draft(target, root / n, n) for n in drafts}}
