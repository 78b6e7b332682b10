"""A job's log: what ``aiayn --log FILE --attempt N <command>`` does, and what the workflow shows of it.

Every rule runs its stage as ``aiayn --log {log} --attempt {resources.attempt} <stage> ...``:

- All output of the stage (and of its worker processes) goes to the log file. The log is an output like
  any other: it is opened only once the stage has checked that it is none of its inputs or outputs
  (``refuse_overwriting_inputs`` claims it); until then the output waits in a temporary file, and a
  log that is refused, or cannot be written, is never touched: its message goes to the terminal.
- A user error (exit status 2) is final: running the same command again cannot change it. Snakemake
  retries a failed job whatever its exit status (``retries`` in the profiles, for preempted and
  killed jobs), so a retry of a command whose previous attempt ended with status 2 is not run
  again: it puts back that attempt's log, says so, and ends with status 2 at once.
- A job does not outlive the workflow that started it: on Linux it asks for SIGTERM when its parent
  dies (``end_with_parent``). A rule that ``exec``s its command (train) has Snakemake itself as
  parent, so a killed local ``snakemake`` stops its trainer, which checkpoints and exits 75 as on a
  preemption. Under SLURM the parent is the scheduler's step, which owns the job.
- At the end of a run the workflow prints, from the logs its jobs wrote, every ``error:`` and
  ``warning:`` paragraph (``print_job_messages``): once each, whatever the executor (a SLURM job's
  output never reaches the terminal) and however many attempts a job had; after a run that succeeded, which
  model each run reports, from the average stage's summaries (``print_reported_models``).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Callable, Sequence, TextIO

from aiayn.errors import UserError
from aiayn.folders import missing_folders, remove_empty_folders

USER_ERROR = 2
KEPT_LOG = 1 << 20  # the end of a failed attempt's log that a skipped retry puts back


def _marker(log: Path) -> Path:
    """Where an attempt that ended with a user error leaves its log for the next attempt."""
    return log.with_name(f".{log.name}.user-error")


class _Log:
    """The ``--log`` of this process while it is not yet opened: its path, where output waits, and the
    terminal's own stdout and stderr (for the message of a log that is refused)."""

    path: Path | None = None
    state = "none"  # "pending" (output held back), "claimed" (output in the log), "refused" (never opened)
    held = None  # the temporary file that fds 1 and 2 point at while pending
    terminal: tuple[int, int] | None = None


def _hold_output() -> None:
    """Point stdout and stderr at a temporary file until the log is claimed (or refused)."""
    import tempfile

    sys.stdout.flush()
    sys.stderr.flush()
    _Log.terminal = (os.dup(1), os.dup(2))
    _Log.held = tempfile.TemporaryFile()
    os.dup2(_Log.held.fileno(), 1)
    os.dup2(_Log.held.fileno(), 2)


def _held_text() -> bytes:
    sys.stdout.flush()
    sys.stderr.flush()
    return os.pread(_Log.held.fileno(), max(os.fstat(_Log.held.fileno()).st_size, 1), 0)


def pending_log() -> Path | None:
    """The ``--log`` this process has not opened yet (None when there is none, or it is open)."""
    return _Log.path if _Log.state == "pending" else None


def refuse_log(message: str) -> None:
    """The pending log may not be written: it is never opened, and ``message`` (a UserError's) ends up
    on the terminal with whatever the stage printed."""
    _Log.state = "refused"
    raise UserError(message)


def claim_log() -> None:
    """Open the pending log (its folder made), write what waited, and send all further output to it."""
    log = _Log.path
    if log.is_dir():
        refuse_log(f"--log {log} is a folder; give the log a file name (e.g. {log / 'job.log'}) "
                   "(nothing was read or written)")
    created = missing_folders(log)
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as error:
        remove_empty_folders(created)
        reason = "permission denied" if isinstance(error, PermissionError) else (error.strerror or str(error))
        refuse_log(f"--log {log} cannot be written ({reason}: its folder {log.parent} may be read-only or missing "
                   "a part); give --log a path in a folder you can write (nothing was read or written)")
    os.write(fd, _held_text())
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _Log.state = "claimed"


def _release_held_output() -> None:
    """A log that was refused: what the stage printed goes to the terminal after all."""
    text = _held_text()
    os.dup2(_Log.terminal[0], 1)
    os.dup2(_Log.terminal[1], 2)
    os.write(2, text)


def _names_an_argument(log: Path, command: Sequence[str]) -> str | None:
    """The argument of ``command`` that names the file ``log`` (for a stage that never checked its log)."""
    try:
        log_id = os.stat(log)
    except OSError:
        return None
    for argument in command:
        for candidate in (argument, argument.partition("=")[2]):
            try:
                other = os.stat(candidate) if candidate else None
            except OSError:
                continue
            if other is not None and (other.st_dev, other.st_ino) == (log_id.st_dev, log_id.st_ino):
                return candidate
    return None


def end_with_parent() -> bool:
    """Ask Linux to send this process SIGTERM when its parent process dies (prctl PR_SET_PDEATHSIG).

    Returns whether it was set up. If the parent is already gone (it died before the request), the
    signal is sent now, as it would have been."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import signal

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def _settle_log(log: Path, command: Sequence[str], status: int) -> int:
    """At the end of the stage: a log still pending is claimed now (a stage that never checked its
    outputs, or failed before it did) unless the command line names it; a refused one gives the
    terminal back what the stage printed. Returns the exit status."""
    if _Log.state == "pending":  # a stage that never checked its outputs (or failed before it did)
        try:
            named = _names_an_argument(log, command)
            if named is not None:
                refuse_log(f"--log {log} is {named}, named on the command line: writing the log would destroy "
                           "it; give --log a file of its own")
            claim_log()
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            status = USER_ERROR
    if _Log.state == "refused":
        _release_held_output()
    return status


def run_logged(log: str | os.PathLike, attempt: int, command: Sequence[str], run: Callable[[], int]) -> int:
    """Run ``run`` with all output in ``log``; on a retry after a user error, don't (see the module).

    ``command`` identifies the command line: a retry is skipped only if the previous attempt ran the
    very same one, and only if it was attempt ``attempt - 1``. A skipped attempt hands the marker on,
    so a run of skips reaches the last attempt Snakemake makes; a later run starts at attempt 1, which
    always runs (and removes the marker), so it can never take an old marker for its own.
    The output stays redirected when this returns: the process is about to exit, and a traceback
    that follows belongs in the log.
    """
    log = Path(log)
    marker = _marker(log)
    try:
        previous = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        previous = None
    try:
        marker.unlink(missing_ok=True)
    except OSError:  # no folder to hold it (a file stands in the log's path): the log is refused below
        pass
    if (attempt > 1 and isinstance(previous, dict) and previous.get("attempt") == attempt - 1
            and previous.get("command") == list(command)):
        failed = previous.get("failed", attempt - 1)
        note = (f"aiayn: attempt {attempt} of this command not run: attempt {failed} ended with a user error "
                f"(exit status {USER_ERROR}), which running it again cannot change\n")
        text = previous.get("log", "") + note
        log.write_text(text, encoding="utf-8")
        _write_marker(marker, attempt, command, text, failed)
        print(note, end="", file=sys.stderr)
        return USER_ERROR
    _Log.path, _Log.state = log, "pending"
    _hold_output()
    end_with_parent()
    try:
        status = run()
    except BaseException:  # a crash: its traceback goes where the output went, the log or the terminal
        _settle_log(log, command, 1)
        raise
    status = _settle_log(log, command, status)
    if _Log.state != "claimed":
        return status
    if status == USER_ERROR:
        sys.stdout.flush()
        sys.stderr.flush()
        _write_marker(marker, attempt, command, log.read_text(encoding="utf-8", errors="replace")[-KEPT_LOG:], attempt)
    return status


def _write_marker(marker: Path, attempt: int, command: Sequence[str], log_text: str, failed: int) -> None:
    marker.write_text(json.dumps({"attempt": attempt, "command": list(command), "log": log_text, "failed": failed}),
                      encoding="utf-8")


# --- what the workflow shows at the end of a run ---------------------------------------------

_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*")


def messages(text: str, failed: bool = True) -> list[str]:
    """The ``warning:`` paragraphs of a log, then its last ``error:`` paragraph (a paragraph is a line
    and the indented lines after it); where the log ends in a Python traceback and ``failed``, its
    last line."""
    lines = text.splitlines()
    found: list[str] = []
    error = None
    for i, line in enumerate(lines):
        if line.startswith(("warning: ", "error: ")):
            end = i + 1
            while end < len(lines) and lines[end].startswith((" ", "\t")) and lines[end].strip():
                end += 1
            paragraph = "\n".join(lines[i:end])
            if line.startswith("error: "):
                error = paragraph
            elif paragraph not in found:
                found.append(paragraph)
    if error is not None:
        found.append(error)
    elif failed:
        tail = [line for line in lines if line.strip()][-1:]
        if tail and "Traceback (most recent call last):" in text and _EXCEPTION_LINE.fullmatch(tail[0]):
            found.append(f"crashed: {tail[0]}")
    return found


def snapshot_logs(folder: str | os.PathLike) -> dict[str, tuple[int, int, int]]:
    """Each log file under ``folder`` with its inode, modification time and size, to tell later which
    logs this run's jobs wrote (Snakemake removes a job's log before it runs)."""
    found = {}
    for path in Path(folder).rglob("*.log"):
        try:
            stat = path.stat()
        except OSError:
            continue
        found[str(path)] = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
    return found


def print_job_messages(folder: str | os.PathLike, before: dict[str, tuple[int, int, int]], failed: bool,
                       out: TextIO | None = None) -> int:
    """Print the messages of the logs under ``folder`` that changed since ``before``; returns how many."""
    out = out or sys.stderr
    shown = 0
    for path, state in sorted(snapshot_logs(folder).items()):
        if before.get(path) == state:
            continue
        try:
            found = messages(Path(path).read_text(encoding="utf-8", errors="replace"), failed)
        except OSError:
            continue
        if found:
            print(f"{path}:", *found, sep="\n", file=out)
            shown += len(found)
    out.flush()
    return shown


def print_reported_models(summaries: dict[str, str | os.PathLike], out: TextIO | None = None) -> int:
    """For each run (name -> its average stage's ``average.json``, where it exists), one line: the model its
    Table 2 row reports, which decode and export use too (the average of its last checkpoints, or its last
    checkpoint), with the dev perplexities that chose it. Returns how many lines."""
    lines = []
    for run, path in summaries.items():
        try:
            summary = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if "reported_model" not in summary:  # written before the stage recorded its choice
            continue
        figures = "" if summary["reported"] == "last" else (  # the last checkpoint's line names both already
            f"; dev perplexity {summary['dev_ppl_averaged']:.2f}, the last checkpoint's {summary['dev_ppl_last']:.2f}")
        lines.append(f"  {run}: {summary['reported_model']}{figures}")
    if lines:
        out = out or sys.stdout
        print("The model each run reports (Table 2, decode, export), as the average stage chose it on dev:", *lines,
              sep="\n", file=out)
        out.flush()
    return len(lines)
