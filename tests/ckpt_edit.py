"""Copy a checkpoint folder with edits to its config or tensors (for bad-input tests)."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file, save_file


def edited_copy(src: Path, dst: Path, cfg_edit: Callable[[dict], object] | None = None,
                tensor_edit: Callable[[dict], object] | None = None) -> Path:
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    if cfg_edit:
        cfg_edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    if tensor_edit:
        tensor_edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst
