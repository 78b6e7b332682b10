"""`aiayn --log FILE --attempt N`: output into the log, a user error not run again on a retry; and the
end-of-run summary of the messages in this run's logs and of the model each run reports."""

from __future__ import annotations

import io
import json
import subprocess
import sys

from aiayn.joblog import messages, print_job_messages, print_reported_models, snapshot_logs

# A stand-in for a stage: says it ran (in the log, and in a count file), then ends with the status asked for.
STAGE = """
import sys
from pathlib import Path
from aiayn.joblog import run_logged

log, attempt, status, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])

def stage():
    count.write_text(str(int(count.read_text() or 0) + 1) if count.exists() else "1")
    print("working")
    if status == 2:
        print("error: input.txt is a directory, but a file is expected here", file=sys.stderr)
    return status

sys.exit(run_logged(log, attempt, ["stage", "input.txt"], stage))
"""


def attempt(tmp_path, number: int, status: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", STAGE, str(tmp_path / "logs" / "stage.log"), str(number), str(status),
                           str(tmp_path / "runs")], capture_output=True, text=True, timeout=60)


def runs(tmp_path) -> int:
    return int((tmp_path / "runs").read_text())


def test_all_output_goes_to_the_log(tmp_path):
    result = attempt(tmp_path, 1, 0)
    assert result.returncode == 0 and result.stdout == result.stderr == ""
    assert (tmp_path / "logs" / "stage.log").read_text() == "working\n"


def test_a_retry_after_a_user_error_is_not_run_and_keeps_the_message_in_the_log(tmp_path):
    first = attempt(tmp_path, 1, 2)
    assert first.returncode == 2 and first.stderr == ""  # the message is in the log, shown at the end of the run
    for number in (2, 3):
        retry = attempt(tmp_path, number, 2)
        assert retry.returncode == 2
        assert f"attempt {number} of this command not run: attempt 1 ended with a user error" in retry.stderr
    assert runs(tmp_path) == 1
    log = (tmp_path / "logs" / "stage.log").read_text()
    assert log.startswith("working\nerror: input.txt is a directory") and log.count("not run") == 2


def test_a_retry_after_any_other_failure_runs_again(tmp_path):
    for number, status in ((1, 75), (2, 1), (3, 0)):  # preempted (resumable), crashed, then done
        assert attempt(tmp_path, number, status).returncode == status
    assert runs(tmp_path) == 3


def test_a_new_run_starts_at_attempt_1_which_always_runs(tmp_path):
    attempt(tmp_path, 1, 2)
    attempt(tmp_path, 2, 2)
    assert attempt(tmp_path, 1, 0).returncode == 0  # the input was fixed and Snakemake started again
    assert runs(tmp_path) == 2
    assert not list((tmp_path / "logs").glob(".*user-error"))


def test_a_retry_of_another_command_runs(tmp_path):
    attempt(tmp_path, 1, 2)
    marker = tmp_path / "logs" / ".stage.log.user-error"
    saved = json.loads(marker.read_text())
    marker.write_text(json.dumps({**saved, "command": ["stage", "other.txt"]}))
    attempt(tmp_path, 2, 2)
    assert runs(tmp_path) == 2


def test_the_cli_takes_log_and_attempt_before_the_command(tmp_path):
    result = subprocess.run([sys.executable, "-m", "aiayn.cli", "--log", str(tmp_path / "score.log"), "--attempt", "1",
                             "score", "--hyp", str(tmp_path / "missing.de"), "--ref", str(tmp_path / "missing.de")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr == ""
    assert (tmp_path / "score.log").read_text().startswith("error: ")


def test_messages_are_the_warnings_and_the_last_error_paragraph():
    log = ("download train: 100%\nwarning: 3 pairs had whitespace\nsome output\nerror: first line\n"
           "       continued\nafter\naiayn: attempt 2 of this command not run\n")
    assert messages(log) == ["warning: 3 pairs had whitespace", "error: first line\n       continued"]


def test_a_crash_shows_the_last_line_of_its_traceback_only_when_the_run_failed():
    log = 'step 5\nTraceback (most recent call last):\n  File "x.py", line 1\nValueError: bad shape (3, 4)\n'
    assert messages(log, failed=True) == ["crashed: ValueError: bad shape (3, 4)"]
    assert messages(log, failed=False) == []
    assert messages("step 5\nstep 6\n", failed=True) == []


def test_the_summary_shows_only_logs_written_since_the_snapshot(tmp_path):
    logs = tmp_path / "logs"
    (logs / "old").mkdir(parents=True)
    (logs / "old" / "bpe.log").write_text("error: an old failure, fixed since\n")
    before = snapshot_logs(logs)
    (logs / "download.log").write_text("warning: 2 pairs look Moses-escaped\nerror: data.local.train.src: bad\n")
    (logs / "train.log").write_text("all fine\n")
    out = io.StringIO()
    assert print_job_messages(logs, before, failed=True, out=out) == 2
    assert out.getvalue() == (f"{logs / 'download.log'}:\nwarning: 2 pairs look Moses-escaped\n"
                              "error: data.local.train.src: bad\n")


def average_summary(path, dev_ppl_averaged: float, dev_ppl_last: float, choose: str = "dev"):
    """An average.json as the average stage writes it (aiayn.average_dev), for the last 3 of steps 10-30."""
    from aiayn.average_dev import chosen, reported_model

    summary = {"dev_ppl_averaged": dev_ppl_averaged, "dev_ppl_last": dev_ppl_last, "averaged_steps": [20, 25, 30],
               "last_steps": [30], "averaged_worse": dev_ppl_averaged > dev_ppl_last, "choose": choose}
    summary["reported"] = chosen(summary, choose)
    summary["reported_model"] = reported_model(summary, summary["reported"])
    path.write_text(json.dumps(summary))
    return path


def test_the_end_of_a_run_names_the_model_each_run_reports_with_the_dev_figures_that_chose_it(tmp_path):
    summaries = {"base seed 1": average_summary(tmp_path / "a.json", 4.5, 4.75),
                 "big seed 1": average_summary(tmp_path / "b.json", 5.5, 5.25),
                 "big seed 2": average_summary(tmp_path / "c.json", 5.5, 5.25, choose="paper"),
                 "tiny seed 1": tmp_path / "not-averaged-yet.json"}
    out = io.StringIO()
    assert print_reported_models(summaries, out) == 3
    header, *lines = out.getvalue().splitlines()
    assert "model each run reports" in header
    assert lines == [
        "  base seed 1: averaged, steps 20-30; dev perplexity 4.50, the last checkpoint's 4.75",
        "  big seed 1: last checkpoint, step 30: the average (steps 20-30) was worse on dev by 0.25 perplexity "
        "(5.50 against 5.25)",
        "  big seed 2: averaged, steps 20-30 (worse on dev than the last checkpoint; average.choose: paper); "
        "dev perplexity 5.50, the last checkpoint's 5.25"]


def test_no_line_for_runs_not_averaged_yet():
    out = io.StringIO()
    assert print_reported_models({"base seed 1": "missing/average.json"}, out) == 0
    assert out.getvalue() == ""


def test_a_job_ends_when_the_process_that_started_it_is_killed(tmp_path):
    """The parent (Snakemake, for a rule that execs its command) killed with SIGKILL: the job gets SIGTERM."""
    import signal
    import subprocess
    import sys
    import time

    child = ("import signal, sys, time\n"
             "from aiayn.joblog import end_with_parent\n"
             "signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[1], 'w').write('terminated'), sys.exit(75)))\n"
             "assert end_with_parent()\n"
             "open(sys.argv[2], 'w').write('ready')\n"
             "time.sleep(60)\n")
    done, ready = tmp_path / "done", tmp_path / "ready"
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time\n"
                               f"subprocess.Popen([sys.executable, '-c', {child!r}, {str(done)!r}, {str(ready)!r}])\n"
                               "time.sleep(60)\n"])
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists()
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done.read_text() == "terminated"
