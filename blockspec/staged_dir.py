"""Write a folder whole or not at all: files go into a temporary sibling that replaces the
destination only when writing finished, so an error or Ctrl-C never leaves half a model."""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

TMP_MARK = ".tmp"     # temporary folders are named f"{dst.name}{TMP_MARK}{pid}-{random}"


@contextlib.contextmanager
def staged_dir(dst: Path) -> Iterator[Path]:
    """Yield an empty folder next to ``dst``. On a clean exit it replaces ``dst`` (an existing
    ``dst`` is deleted first: callers decide whether that is allowed); on any exception,
    KeyboardInterrupt included, it is deleted and ``dst`` is left as it was."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(3)}")
    tmp.mkdir()
    try:
        yield tmp
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
