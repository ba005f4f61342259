"""The benches' output: JSON lines appended to ``--out`` (one file gathers many runs), and the
GPU scripts' text tables printed and kept."""
from __future__ import annotations

import json


def append_rows(path: str | None, rows: list[dict]) -> None:
    """Append ``rows`` to ``path`` as JSON lines; nothing without a path."""
    if path:
        with open(path, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


def emit_text(lines: list[str], path: str | None) -> None:
    """Print a script's table and write it to ``path`` as well, when given."""
    text = "\n".join(lines)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
