"""Atomic writes, strict line reading and fingerprints shared by every stage."""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from aiayn.errors import UserError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only on success.

    Works for files and directories. An interrupted job leaves only a hidden
    ``.tmp-*`` name behind, never a file that looks complete.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".tmp-{target.name}-", dir=target.parent)
    os.close(fd)
    os.unlink(tmp_name)
    tmp = Path(tmp_name)
    try:
        yield tmp
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_lines_atomic(path: str | os.PathLike, lines: Iterator[str] | list[str]) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8", newline="\n") as handle:
            for line in lines:
                handle.write(line)
                handle.write("\n")


def read_lines(path: str | os.PathLike) -> list[str]:
    """Read a UTF-8 text file as lines split on ``\\n`` only.

    Segments may legitimately contain other Unicode separators (U+2028, U+0085)
    that ``str.splitlines`` would split on, so we never use it. A trailing
    newline does not make an extra empty line; a leading byte-order mark is
    dropped. Bytes that are not UTF-8 raise a UserError naming file and line.
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file (check the path in your config)")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line_number = raw.count(b"\n", 0, error.start) + 1
        raise UserError(
            f"{path}, line {line_number}: bytes that are not UTF-8 ({raw[error.start:error.start + 4]!r}); "
            "re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    if not text:
        return []
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


def iter_lines(path: str | os.PathLike) -> Iterator[str]:
    """The lines of ``read_lines``, with its checks, one at a time: memory flat in the file's size."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file (check the path in your config)")
    with open(path, "rb") as handle:  # binary lines split on b"\n" only, as read_lines splits
        first = next(handle, b"").removeprefix(codecs.BOM_UTF8)
        if first == b"\n" and (second := next(handle, None)) is not None:
            yield ""
            first = second
            start = 2
        elif first in (b"", b"\n"):  # a lone newline is an empty file, as for read_lines
            return
        else:
            start = 1
        for number, raw in enumerate(itertools.chain([first], handle), start=start):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise UserError(
                    f"{path}, line {number}: bytes that are not UTF-8 ({raw[error.start:error.start + 4]!r}); "
                    "re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
                ) from None
            if line.endswith("\n"):
                line = line[:-1]
            yield line[:-1] if line.endswith("\r") else line


def count_lines(path: str | os.PathLike) -> int:
    """How many lines ``read_lines`` would return, counted in blocks (no decoding, constant memory)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file (check the path in your config)")
    newlines, size, head, last = 0, 0, b"", b""
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 18), b""):
            head = head or block[:3]
            newlines += block.count(b"\n")
            size += len(block)
            last = block[-1:]
    body = size - (3 if head == codecs.BOM_UTF8 else 0)
    if body == 0 or (body == 1 and last == b"\n"):
        return 0
    return newlines + (last != b"\n")


def fingerprint_files(*paths: str | os.PathLike) -> str:
    """A short sha256 over the contents of the given files, in order."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 18), b""):
                digest.update(block)
    return digest.hexdigest()[:16]
