"""Atomic writes, strict line reading and fingerprints shared by every stage."""

from __future__ import annotations

import codecs
import contextlib
import errno
import gzip
import hashlib
import itertools
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import zlib
from pathlib import Path
from typing import IO, Any, BinaryIO, Iterable, Iterator, Mapping, Union

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


# --- outputs that are inputs ------------------------------------------------------------------

# What names the files of one option: a path, several, a stream (stdout), or None (an option not given).
Paths = Union[str, os.PathLike, IO, Iterable[Union[str, os.PathLike]], None]


def _each(value: Paths) -> list:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)) or hasattr(value, "fileno"):
        return [value]
    return [item for item in value if item is not None]


def _regular_file_id(thing) -> tuple[int, int] | None:
    """(device, inode) of a path or stream that is a regular file, else None: two terminals or the two
    ends of a pipe share an inode, but writing one does not destroy the other."""
    try:
        status = os.fstat(thing.fileno()) if hasattr(thing, "fileno") else os.stat(thing)
    except (OSError, ValueError):  # missing, or a stream without a descriptor (pytest's capture, say)
        return None
    return (status.st_dev, status.st_ino) if stat.S_ISREG(status.st_mode) else None


def _resolved(thing) -> Path | None:
    if hasattr(thing, "fileno"):
        return None
    try:
        return Path(thing).resolve()
    except (OSError, RuntimeError):  # a loop of symbolic links: compared as written
        return Path(os.path.abspath(thing))


def refuse_overwriting_inputs(outputs: Mapping[str, Paths], inputs: Mapping[str, Paths],
                              replaced_folders: Mapping[str, str | os.PathLike | None] | None = None) -> None:
    """Refuse, before anything is read, a command whose output would destroy one of its inputs.

    ``outputs`` and ``inputs`` map each option (``--output``, ``--model``, ...) to what it names:
    a path, a list of paths (a stage writing named files into ``--out-dir`` lists them), or a stream
    (``sys.stdout`` redirected into a file). An output is an input when both resolve to one path
    (relative spellings, ``..`` and symbolic links included) or are one file (a hard link).
    ``replaced_folders`` names folders the stage replaces as a whole: no input may be inside one.
    One UserError names the output's option and path, the input it would destroy, and the fix.
    A pending ``aiayn --log FILE`` is checked first, against the inputs and the outputs, and opened only
    when it is neither (``joblog.claim_log``): the log is an output like any other.
    """
    _check_the_log(outputs, inputs, replaced_folders or {})
    _refuse_outputs_that_are_inputs(outputs, inputs, replaced_folders)


def _refuse_outputs_that_are_inputs(outputs: Mapping[str, Paths], inputs: Mapping[str, Paths],
                                    replaced_folders: Mapping[str, str | os.PathLike | None] | None = None) -> None:
    sources = [(option, path, _resolved(path), _regular_file_id(path))
               for option, value in inputs.items() for path in _each(value)]
    for option, value in outputs.items():
        several = not isinstance(value, (str, os.PathLike)) and not hasattr(value, "fileno")
        for output in _each(value):
            resolved, identity = _resolved(output), _regular_file_id(output)
            for source_option, source, source_resolved, source_identity in sources:
                same_inode = identity is not None and identity == source_identity
                if not same_inode and (resolved is None or resolved != source_resolved):
                    continue
                stream = hasattr(output, "fileno")
                if stream or str(output) == str(source):
                    how = ""
                elif resolved == source_resolved:
                    how = f" (both are {resolved})"
                else:
                    how = " (the same file under another name: a hard link)"
                named = source_option if hasattr(source, "fileno") else f"{source_option} {source}"
                what = (f"{option} is redirected into the input {named}" if stream else
                        f"{option} would write {output}, which is the input {named}" if several else
                        f"{option} {output} is the input {named}")
                fix = (f"send {option} to a file of its own" if stream else
                       f"give {option} a {'folder' if several else 'path'} of its own")
                raise UserError(f"{what}{how}: writing it would destroy that input; {fix} "
                                "(nothing was read or written)")
    for option, folder in (replaced_folders or {}).items():
        if folder is None:
            continue
        folder_resolved = Path(folder).resolve()
        for source_option, source, source_resolved, _ in sources:
            if source_resolved is not None and (source_resolved == folder_resolved
                                                or folder_resolved in source_resolved.parents):
                raise UserError(f"{option} {folder} holds the input {source_option} {source}, and this command "
                                f"replaces that folder as a whole: writing it would destroy that input; give "
                                f"{option} a folder that holds none of the inputs (nothing was read or written)")


def refuse_replacing_a_folder(option: str, folder: str | os.PathLike, marker: str, stage: str) -> None:
    """Refuse, before the work, a folder that a stage would replace as a whole but did not write.

    ``folder`` may be new, empty, or a folder this stage wrote before, which it recognises by the file
    ``marker`` inside; anything else (the user's own files, the working directory, a symbolic link,
    whose target would be replaced) is a UserError naming what the folder holds.
    """
    folder = Path(folder)
    fix = f"give {option} a new folder (nothing was read or written)"
    if folder.is_symlink():
        raise UserError(f"{option} {folder} is a symbolic link (to {os.readlink(folder)}); {stage} replaces its "
                        f"{option} folder as a whole and does not write through a link; {fix}")
    if not folder.exists():
        return
    if not folder.is_dir():
        raise UserError(f"{option} {folder} is a file, but {stage} writes a folder there; {fix}")
    resolved, here = folder.resolve(), Path.cwd().resolve()
    if resolved == here or resolved in here.parents:
        where = "the working directory" if resolved == here else "a folder above the working directory"
        raise UserError(f"{option} {folder} is {where}; {stage} replaces its {option} folder as a whole, which would "
                        f"remove everything in it; {fix}")
    names = sorted(entry.name for entry in folder.iterdir())
    if not names or marker in names and (folder / marker).is_file():
        return
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    raise UserError(f"{option} {folder} is an existing folder that {stage} did not write (it holds {shown}: "
                    f"{len(names)} {'entry' if len(names) == 1 else 'entries'}, no {marker}); {stage} replaces its "
                    f"{option} folder as a whole, so it writes only a new or empty folder or one it wrote before; "
                    f"{fix}")


def _check_the_log(outputs: Mapping[str, Paths], inputs: Mapping[str, Paths],
                   replaced_folders: Mapping[str, str | os.PathLike | None]) -> None:
    """Claim the pending ``--log`` if it is none of the inputs, outputs or replaced folders' files."""
    from aiayn import joblog

    log = joblog.pending_log()
    if log is None:
        return
    try:
        _refuse_outputs_that_are_inputs({"--log": log}, inputs)
        log_resolved, log_identity = _resolved(log), _regular_file_id(log)
        for option, value in outputs.items():
            for output in _each(value):
                if not hasattr(output, "fileno") and (_resolved(output) == log_resolved or (
                        log_identity is not None and _regular_file_id(output) == log_identity)):
                    raise UserError(f"--log {log} is also the output {option} {output}: each would overwrite the "
                                    "other; give --log a file of its own (nothing was read or written)")
        for option, folder in replaced_folders.items():
            if folder is not None and Path(folder).resolve() in log_resolved.parents:
                raise UserError(f"--log {log} is inside {option} {folder}, which this command replaces as a whole: "
                                "the log would be lost with it; give --log a path outside that folder "
                                "(nothing was read or written)")
    except UserError as error:
        joblog.refuse_log(str(error))
    joblog.claim_log()


# --- writing ---------------------------------------------------------------------------------
# A temporary is named for its output, its process and its host: `.tmp-<output name>-<pid>@<host>-<random>`,
# so that a later writer of the same output can tell a stale one (its process gone) from a live one.

_HOST = socket.gethostname()
_TEMPORARY = re.compile(r"(\d+)@(.+)-[a-z0-9_]+")  # what follows `.tmp-<output name>-`


def temporary_prefix(target: str | os.PathLike) -> str:
    return f".tmp-{Path(target).name}-{os.getpid()}@{_HOST}-"


def _process_is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def remove_stale_temporaries(target: str | os.PathLike) -> list[Path]:
    """Remove the temporaries of ``target`` left by writers on this host that no longer run (killed jobs).

    Only ``target``'s own temporaries, and only those whose process is gone: a live writer of the
    same output, or one on another host (a shared file system), is left alone.
    """
    target = Path(target)
    return _remove_stale(target.parent, f".tmp-{target.name}-", _TEMPORARY)


def remove_stale_temporaries_in(folder: str | os.PathLike) -> list[Path]:
    """``remove_stale_temporaries`` for every output in ``folder`` (for a stage that holds the whole folder)."""
    return _remove_stale(Path(folder), ".tmp-", re.compile(r".+-" + _TEMPORARY.pattern))


def _remove_stale(folder: Path, prefix: str, pattern: re.Pattern) -> list[Path]:
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        if not entry.name.startswith(prefix):
            continue
        match = pattern.fullmatch(entry.name[len(prefix):])
        if not match or match.group(2) != _HOST or not _process_is_gone(int(match.group(1))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


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


def prepare_output(target: str | os.PathLike, directory: bool = False, create: bool = True) -> Path:
    """Check that ``target`` can be written (its folder made, a file not replacing a folder) and
    remove its stale temporaries; a UserError names what is in the way.

    ``create=False`` checks without making its folder: a stage that checks its output before the work
    makes the folder only when it writes (``atomic_path``), so that a failed run leaves no empty folder.
    """
    target = Path(target)
    if not directory and target.is_dir():
        raise UserError(f"{target} is a directory; give the name of the file to write (e.g. {target}/<name>)")
    if directory and target.exists() and not target.is_dir():
        raise UserError(f"{target} is a file, but an output folder is expected here; give another path")
    for parent in [target.parent, *target.parent.parents]:
        if parent.exists() and not parent.is_dir():
            raise UserError(f"cannot write {target}: {parent} is a file, not a folder")
    if create:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except PermissionError:
            raise UserError(f"cannot write {target}: permission denied creating its folder") from None
    existing = next(parent for parent in [target.parent, *target.parent.parents] if parent.exists())
    if not os.access(existing, os.W_OK):
        raise UserError(f"cannot write {target}: its folder {existing} is not writable")
    remove_stale_temporaries(target)
    return target


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only on success.

    For a file, or with ``directory`` a folder (which replaces an existing folder of that name;
    a file never replaces a folder). An interrupted job leaves only a hidden ``.tmp-*`` name
    behind, never a file that looks complete, and the next writer of the same output removes it;
    a write that fails removes the folders it made for the output.
    """
    created = missing_folders(path)
    target = prepare_output(path, directory)
    fd, tmp_name = tempfile.mkstemp(prefix=temporary_prefix(target), dir=target.parent)
    os.close(fd)
    os.unlink(tmp_name)
    tmp = Path(tmp_name)
    done = False
    try:
        yield tmp
        old = None
        if directory and target.is_dir() and not target.is_symlink():
            old = Path(f"{tmp}_old")  # moved aside, then removed: the new folder is in place at once
            os.replace(target, old)
        elif target.is_dir():  # made while we wrote: still never replace a folder by a file
            raise UserError(f"{target} is a directory; give the name of the file to write")
        os.replace(tmp, target)
        done = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
        if not done:  # a failed write leaves no empty folder that it made
            remove_empty_folders(created)


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
