"""Strict reading shared by every stage: text files checked line by line (UTF-8, line endings, compression
named), checkpoints told from text, line counts and fingerprints."""

from __future__ import annotations

import codecs
import contextlib
import errno
import gzip
import hashlib
import itertools
import os
import zlib
from pathlib import Path
from typing import BinaryIO, Iterator

from aiayn.errors import UserError

BLOCK = 1 << 18
GZIP_MAGIC = b"\x1f\x8b"
# What a file that is not UTF-8 text most often is, told by its first bytes, and what to do about it.
# Longer marks first: a UTF-32 little-endian mark begins with UTF-16's.
_NOT_TEXT = (
    (b"\xff\xfe\x00\x00", "UTF-32 text (its first bytes are the byte-order mark FF FE 00 00)",
     "re-encode it as UTF-8: iconv -f UTF-32 -t UTF-8 {path} > {path}.utf8"),
    (b"\x00\x00\xfe\xff", "UTF-32 text (its first bytes are the byte-order mark 00 00 FE FF)",
     "re-encode it as UTF-8: iconv -f UTF-32 -t UTF-8 {path} > {path}.utf8"),
    (b"\xff\xfe", "UTF-16 text (its first bytes are the byte-order mark FF FE)",
     "re-encode it as UTF-8: iconv -f UTF-16 -t UTF-8 {path} > {path}.utf8"),
    (b"\xfe\xff", "UTF-16 text (its first bytes are the byte-order mark FE FF)",
     "re-encode it as UTF-8: iconv -f UTF-16 -t UTF-8 {path} > {path}.utf8"),
    (b"\xfd7zXZ\x00", "xz-compressed", "decompress it first: xz -dc {path} > {xz}"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed", "decompress it first: zstd -dc {path} > {zst}"),
    (b"PK\x03\x04", "a zip archive", "unpack it first: unzip {path}"),
    (b"PAR1", "a Parquet file", "give Parquet files as data.local.<split>.parquet, not as src/tgt text"),
)


# --- reading ---------------------------------------------------------------------------------

def input_exists(path: str | os.PathLike) -> bool:
    """Whether ``path`` exists; a UserError for what "no such file" would misname.

    A loop of symbolic links, a link to nothing, and a folder on the way that may not be searched
    all look missing to ``Path.exists``; each is named here with what to do about it.
    """
    path = Path(path)
    try:
        os.stat(path)
        return True
    except (FileNotFoundError, NotADirectoryError):
        if path.is_symlink():
            raise UserError(f"{path}: a symbolic link to {os.readlink(path)}, which does not exist; "
                            f"point the link at the file (ls -l {path} shows it)") from None
        return False
    except PermissionError:
        raise UserError(f"{path}: permission denied on the way to it (a folder on its path may not be "
                        f"searched by this user; ls -ld on each folder of {path} shows which)") from None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UserError(f"{path}: a loop of symbolic links ({_link_chain(path)}), so it names no file; "
                            "point the link at the file itself") from None
        raise UserError(f"{path}: cannot be read ({error.strerror})") from None


def _link_chain(path: Path, shown: int = 4) -> str:
    """``a -> b -> a``: the links followed from ``path`` until one repeats (or ``shown`` of them)."""
    chain, seen = [str(path)], set()
    while path.is_symlink() and path not in seen and len(chain) <= shown:
        seen.add(path)
        path = path.parent / os.readlink(path)
        chain.append(str(path))
    return " -> ".join(chain) if len(chain) > 1 else f"a folder on the way to {path} is one"


def check_input_path(path: str | os.PathLike) -> Path:
    """``path`` as a Path if it names an existing file, else a UserError that says what it is instead."""
    path = Path(path)
    if not input_exists(path):
        raise UserError(f"{path}: no such file (check the path in your config or on the command line)")
    if path.is_dir():
        inside = sorted(itertools.islice((entry.name for entry in path.iterdir() if not entry.name.startswith(".")),
                                         100))[:4]
        holds = f" (it holds {', '.join(inside)}{', ...' if len(inside) == 4 else ''})" if inside else " (empty)"
        raise UserError(f"{path} is a directory{holds}, but a file is expected here; give the file itself")
    return path


def open_input(path: str | os.PathLike) -> BinaryIO:
    """``path`` opened for reading in binary, after ``check_input_path``; a file this user may not read is
    a UserError that says so (not that the file is damaged: its bytes were never seen)."""
    path = check_input_path(path)
    try:
        return open(path, "rb")
    except PermissionError:
        raise UserError(f"{path}: cannot be read, permission denied (the file itself may be fine); make it "
                        f"readable for this user (ls -l {path} shows its owner and mode; e.g. chmod a+r {path})"
                        ) from None
    except OSError as error:
        raise UserError(f"{path}: cannot be read ({error.strerror or error})") from None


def decompressed_name(path: Path, suffix: str) -> str:
    """Where a decompression command should write ``path``'s text: its name without ``suffix`` if it has
    it, else a ``.plain`` name beside it (a name without the suffix makes gunzip -k, xz -dk, ... refuse)."""
    if path.name.endswith(suffix) and len(path.name) > len(suffix):
        return str(path.with_name(path.name[:-len(suffix)]))
    return str(path.with_name(f"{path.stem}.plain{path.suffix}"))


def _is_torch_archive(path: Path, head: bytes) -> bool:
    """Whether a zip archive is torch.save's: its entries are ``<name>/data.pkl``, ``<name>/data/0``, ..."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return b"/data.pkl" in head


def _not_text(path: Path, head: bytes, tail: bytes) -> str | None:
    """Why a file whose first bytes are ``head`` (last bytes ``tail``) is not UTF-8 text, or None."""
    if head.startswith(b"BZh") and head[4:10] == b"1AY&SY":
        return (f"{path}: bzip2-compressed, not UTF-8 text; decompress it first: "
                f"bunzip2 -c {path} > {decompressed_name(path, '.bz2')}")
    if head.startswith(b"PK\x03\x04") and _is_torch_archive(path, head):
        return (f"{path}: a PyTorch checkpoint or model file (a zip archive holding data.pkl), not text; a model "
                "is given as --model, and this option takes the text itself")
    for magic, what, fix in _NOT_TEXT:
        if head.startswith(magic) and (magic != b"PAR1" or tail == b"PAR1"):
            fix = fix.format(path=path, xz=decompressed_name(path, ".xz"), zst=decompressed_name(path, ".zst"))
            return f"{path}: {what}, not UTF-8 text; {fix}"
    # ASCII as UTF-16 is every other byte NUL; a stray NUL is not that, and the readers name its line (_nul_byte)
    if b"\x00" in head and head.count(b"\x00") * 4 >= len(head):
        return (f"{path}: contains NUL bytes, so it is not UTF-8 text (UTF-16 without a byte-order mark, or not "
                f"text at all); re-encode text as UTF-8 (iconv -f UTF-16 -t UTF-8 {path} > {path}.utf8)")
    return None


@contextlib.contextmanager
def open_text_bytes(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """The bytes of a text file, checked to be text: gzip is read through, other formats are refused.

    A directory, a missing path, UTF-16/UTF-32 (by their byte-order marks), NUL bytes and
    other compressed or binary formats (by their magic bytes) are UserErrors that say what the
    file is and how to make it UTF-8 text.
    """
    path = Path(path)
    with open_input(path) as raw:
        handle: BinaryIO = raw
        if raw.read(2) == GZIP_MAGIC:
            raw.seek(0)
            handle = gzip.GzipFile(fileobj=raw, mode="rb")
        else:
            raw.seek(0)
        try:
            head = handle.peek(64)[:64]
        except (gzip.BadGzipFile, EOFError, zlib.error) as error:
            raise UserError(f"{path}: a damaged gzip file ({error}); check it with gzip -t {path}") from None
        tail = b""
        if head.startswith(b"PAR1") and handle is raw:
            raw.seek(-4, os.SEEK_END)
            tail = raw.read(4)
            raw.seek(0)
        reason = _not_text(path, head, tail)
        if reason:
            raise UserError(reason)
        try:
            yield handle
        except (gzip.BadGzipFile, EOFError, zlib.error) as error:
            if handle is raw:
                raise
            raise UserError(f"{path}: a damaged gzip file ({error}); check it with gzip -t {path}") from None


def _not_utf8(path: Path, line_number: int, bad: bytes) -> UserError:
    return UserError(
        f"{path}, line {line_number}: bytes that are not UTF-8 ({bad!r}); "
        "re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
    )


def _nul_byte(path: Path, line_number: int) -> UserError:
    return UserError(
        f"{path}, line {line_number}: a NUL byte (\\x00), which text never holds (binary data, or a damaged or "
        f"padded file); remove NUL bytes (tr -d '\\000' < {path} > {path}.clean) or fix what wrote the file"
    )


def _cr_only(path: Path, carriage_returns: int) -> UserError:
    return UserError(
        f"{path}: its lines end in a carriage return alone (old Mac line endings: {carriage_returns} CR, no LF), "
        f"so the whole file reads as one line; convert them to newlines: tr '\\r' '\\n' < {path} > {path}.unix"
    )


def _check_line_endings(path: Path, text_without_newlines: bytes | str) -> None:
    """A file without any newline but with carriage returns inside it uses CR alone as line ending."""
    cr = b"\r" if isinstance(text_without_newlines, bytes) else "\r"
    body = text_without_newlines[:-1] if text_without_newlines.endswith(cr) else text_without_newlines
    if cr in body:
        raise _cr_only(path, text_without_newlines.count(cr))


def read_lines(path: str | os.PathLike) -> list[str]:
    """Read a UTF-8 text file as lines split on ``\\n`` only.

    Segments may legitimately contain other Unicode separators (U+2028, U+0085)
    that ``str.splitlines`` would split on, so we never use it. A trailing
    newline does not make an extra empty line; a leading byte-order mark is
    dropped; a gzip file is read through. Bytes that are not UTF-8 raise a
    UserError naming file and line, and so do NUL bytes; so do CR-only line
    endings and files that are not text (``open_text_bytes``).
    """
    path = Path(path)
    with open_text_bytes(path) as handle:
        raw = handle.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _not_utf8(path, raw.count(b"\n", 0, error.start) + 1, raw[error.start:error.start + 4]) from None
    if (nul := raw.find(b"\x00")) >= 0:
        raise _nul_byte(path, raw.count(b"\n", 0, nul) + 1)
    if text.startswith("\ufeff"):
        text = text[1:]
    if "\n" not in text:
        _check_line_endings(path, text)
    if text.endswith("\n"):
        text = text[:-1]
    if not text:
        return []
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


def iter_lines(path: str | os.PathLike) -> Iterator[str]:
    """The lines of ``read_lines``, with its checks, one at a time: memory flat in the file's size."""
    path = Path(path)
    with open_text_bytes(path) as handle:  # binary lines split on b"\n" only, as read_lines splits
        first = next(handle, b"").removeprefix(codecs.BOM_UTF8)
        if not first.endswith(b"\n"):
            _check_line_endings(path, first)
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
                raise _not_utf8(path, number, raw[error.start:error.start + 4]) from None
            if "\x00" in line:
                raise _nul_byte(path, number)
            if line.endswith("\n"):
                line = line[:-1]
            yield line[:-1] if line.endswith("\r") else line


def count_lines(path: str | os.PathLike) -> int:
    """How many lines ``read_lines`` would return, with all of its checks, in blocks (constant memory).

    The whole file is decoded on the way (C speed, about a second per GB), so that a bad byte
    anywhere is found before a stage writes anything.
    """
    path = Path(path)
    newlines, carriage_returns, size, head, last = 0, 0, 0, b"", b""
    carry = b""  # the start of a character cut by the block boundary
    with open_text_bytes(path) as handle:
        for block in iter(lambda: handle.read(BLOCK), b""):
            head = head or block[:3]
            data = carry + block
            try:
                data.decode("utf-8")
                carry = b""
            except UnicodeDecodeError as error:
                if error.reason == "unexpected end of data" and error.end == len(data):
                    carry = data[error.start:]  # everything before it decoded
                else:
                    raise _not_utf8(path, newlines + data.count(b"\n", 0, error.start) + 1,
                                    data[error.start:error.start + 4]) from None
            if (nul := block.find(b"\x00")) >= 0:
                raise _nul_byte(path, newlines + block.count(b"\n", 0, nul) + 1)
            newlines += block.count(b"\n")
            carriage_returns += block.count(b"\r")
            size += len(block)
            last = block[-1:]
    if carry:
        raise _not_utf8(path, newlines + 1, carry[:4])
    if newlines == 0 and carriage_returns > (last == b"\r"):
        raise _cr_only(path, carriage_returns)
    body = size - (3 if head == codecs.BOM_UTF8 else 0)
    if body == 0 or (body == 1 and last == b"\n"):
        return 0
    return newlines + (last != b"\n")


def fingerprint_files(*paths: str | os.PathLike) -> str:
    """A short sha256 over the contents of the given files, in order."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(BLOCK), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def same_file(first: str | os.PathLike, second: str | os.PathLike) -> bool:
    """Whether two paths name one file (another spelling, a symbolic or a hard link); False if either is missing.
    For two inputs given where two different files are meant: a source and its translation, train and test."""
    try:
        return os.path.samefile(first, second)
    except (OSError, ValueError):
        return False
