"""Writing shared by every stage: the refusal of an output that is an input (or a folder the stage did not
write), the claimed log, temporaries named for their writer, and atomic writes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Mapping, Union

from aiayn import joblog
from aiayn.errors import UserError
from aiayn.folders import missing_folders, remove_empty_folders

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
