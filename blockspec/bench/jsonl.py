"""The benches' output: JSON lines appended to ``--out`` (one file gathers many runs)."""
from __future__ import annotations

import json


def append_rows(path: str | None, rows: list[dict]) -> None:
    """Append ``rows`` to ``path`` as JSON lines; nothing without a path."""
    if path:
        with open(path, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
