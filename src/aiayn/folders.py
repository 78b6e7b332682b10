"""The folders a command makes for what it writes, and takes away again when it fails: a failed stage
leaves no empty folder behind (``aiayn.writing``'s outputs, ``aiayn.joblog``'s log, a run's folder)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable


def missing_folders(path: str | os.PathLike) -> list[Path]:
    """The folders above ``path`` that do not exist yet, deepest first: what making it would create."""
    return [parent for parent in Path(path).parents if not parent.exists()]


def remove_empty_folders(folders: Iterable[Path]) -> None:
    """Remove each of ``folders`` (deepest first) that is empty: what a failed stage made for its output."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (or already gone): leave it, and everything above it
            return
