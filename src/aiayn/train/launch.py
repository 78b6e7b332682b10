"""The train stage: one model preset, trained the paper's way, resumable, tracked in MLflow.

The command, ``python -m aiayn.train`` or ``aiayn train``. Runs as one process on a CPU or GPU, or relaunches itself
as several under ``torchrun`` (DDP); one trainer per run folder (a lock); a preempted run exits 75 so
that the scheduler retries it, and the retry resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch

from aiayn.config import read_config, resolve_preset, schema_default
from aiayn.errors import UserError, cli
from aiayn.folders import missing_folders, remove_empty_folders
from aiayn.writing import refuse_overwriting_inputs, remove_stale_temporaries_in
from aiayn.layout import CHECKPOINTS, FINAL_MODEL, FINAL_SUMMARY, RUN_LOCK
from aiayn.speed.host_memory import keep_freed_memory
from aiayn.joblog import end_with_parent
from aiayn.train.rendezvous import (Allocation, agent_environment, check_layout, is_worker_of_several_nodes,
                                    nodes_of, processes_per_node, several_nodes_allocation)
from aiayn.train.trainer import Preempted, TrainJob, train

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again"; Snakemake's --retries (or a SLURM requeue) resumes


def processes_to_launch(requested: int | None, device: str, gpus: int) -> int:
    """Processes for this node: ``--processes``, else one per GPU the preset asks for and the node has."""
    if os.environ.get("WORLD_SIZE"):
        return 1  # already one of torchrun's workers
    if requested:
        return requested
    if device == "cpu" or gpus <= 1 or not torch.cuda.is_available():
        return 1
    return min(gpus, torch.cuda.device_count())


def _relaunch_under_torchrun(processes: int, argv: list[str], run_dir: Path,
                             nodes: tuple[int, Allocation] | None = None) -> int:
    """Re-run this command as ``processes`` workers under torchrun; returns the job's exit status.

    torchrun reports any failed worker as status 1, so rank 0 leaves its own status in a file
    and that is returned: a preempted run still exits 75 and is retried. SIGTERM and SIGUSR1
    (a time limit, a preemption) are passed on to torchrun, which passes them to the workers.
    With ``nodes`` (how many, and the SLURM allocation), ``processes`` on each node: one agent a node,
    started by srun (``aiayn.train.rendezvous``); the status file is then on the shared run folder.
    """
    import subprocess
    import tempfile

    run_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=run_dir, prefix=".torchrun-") as scratch:
        status_file = Path(scratch) / "status"
        # all workers are on this node: meet on loopback, not at whatever the host name resolves to
        # (a name that does not resolve left the workers waiting for a rendezvous that never came)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
                   f"--nproc_per_node={processes}", "-m", "aiayn.train", *argv]
        loopback = {"GLOO_SOCKET_IFNAME": "lo"} if sys.platform.startswith("linux") else {}  # gloo's own lookup too
        shape = f"as {processes} processes"
        if nodes is not None:
            count, allocation = nodes
            command, loopback = allocation.srun_command(count, processes, argv), agent_environment(allocation.endpoint)
            shape = f"on {count} nodes, {processes} process{'es' if processes > 1 else ''} each"
        print(f"training {shape}: {' '.join(command)}", file=sys.stderr, flush=True)
        child = subprocess.Popen(command, env={**loopback, **os.environ, "AIAYN_STATUS_FILE": str(status_file)})
        forward = lambda signum, frame: child.send_signal(signum)  # noqa: E731
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
        try:
            returncode = child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if status_file.exists():
            return int(status_file.read_text())
        return returncode


def hold_run_lock(run_dir: Path):
    """One trainer per run folder: an exclusive lock on ``<run_dir>/.lock`` for this process's life.

    A second trainer on the same folder (an orphan of a killed workflow still running, say) would
    interleave its checkpoints and metrics with the first one's, so it refuses, naming the holder.
    """
    import atexit
    import fcntl

    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir {run_dir} is a file, but a run folder is expected; give another path")
    created = ([] if run_dir.exists() else [run_dir]) + missing_folders(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock_path = run_dir / RUN_LOCK
    while True:
        handle = open(lock_path, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            handle.close()
            raise UserError(f"{run_dir} is being trained by another process (pid {holder}, which holds "
                            f"{lock_path}); wait for it to end or stop it (kill -TERM writes a checkpoint), "
                            "then rerun") from None
        if _is_file_at(handle, lock_path):
            break
        handle.close()  # its last holder removed it after we opened it: lock the file now at that path
    atexit.register(_release_run_lock, handle, lock_path, created)
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    # the folder is ours now: what a killed trainer was writing (.tmp-*) goes
    for folder in (run_dir, run_dir / CHECKPOINTS):
        remove_stale_temporaries_in(folder)
    return handle  # the lock lasts while this stays open


def _is_file_at(handle, path: Path) -> bool:
    try:
        return os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _release_run_lock(handle, lock_path: Path, created: list[Path]) -> None:
    """At exit: remove the lock file while still holding it (a trainer that opened it meanwhile finds it
    gone and locks a new one), then the folders the run made if nothing is in them (it failed at once)."""
    lock_path.unlink(missing_ok=True)
    handle.close()
    remove_empty_folders(created)


def _settings(args) -> tuple[dict, dict, str, str]:
    """(resolved preset, `train` section, experiment, tracking URI), through the config door
    (``read_config``): --config's files and --preset, with the options given beside them in place of their keys."""
    config = read_config(args.config, None, {"train.log_every": ("--log-every", args.log_every),
                                             "experiment": ("--experiment", args.experiment),
                                             "tracking_uri": ("--tracking-uri", args.tracking_uri)})
    return (resolve_preset(config, args.preset, [str(path) for path in args.config]), config["train"],
            config["experiment"], config["tracking_uri"])


def ignore_stop_signals() -> None:
    """SIGTERM and SIGUSR1 from now on change nothing: the process is ending with its checkpoint written."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def _report_status(status: int, any_rank: bool = False) -> int:
    """Rank 0 of a relaunched job leaves its exit status where the launching process reads it; with
    ``any_rank`` (a user error: another process ran out of memory, say) so does any rank, unless one has."""
    target = os.environ.get("AIAYN_STATUS_FILE")
    if target and os.environ.get("RANK", "0") == "0":
        Path(target).write_text(str(status))
    elif target and any_rank:
        try:
            with open(target, "x", encoding="utf-8") as status_file:
                status_file.write(str(status))
        except FileExistsError:
            pass
    return status


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiayn train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", nargs="+", metavar="FILE", required=True,
                        help="config files, merged in order and validated (what the Snakefile passes: the resolved "
                             "config)")
    parser.add_argument("--preset", required=True, help="the preset to train (one of the config's or the paper's)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--train-data", required=True, type=Path, help="binarized train split folder")
    parser.add_argument("--dev-data", type=Path, help="binarized dev split folder")
    parser.add_argument("--spm-model", required=True, type=Path)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--experiment", help=f"the MLflow experiment (default: the config's experiment; where it "
                                             f"sets none, {schema_default('experiment')}, the schema's)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: the config's tracking_uri; "
                                               "MLFLOW_TRACKING_URI wins)")
    parser.add_argument("--no-tracking", action="store_true", help="metrics.jsonl only, no MLflow")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: leave torch's default)")
    parser.add_argument("--log-every", type=int, help="overrides train.log_every")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="overrides train.device (auto: a GPU when there is one and the preset has gpus > 0)")
    parser.add_argument("--processes", type=int, default=None,
                        help="data-parallel processes on this node (each node of a preset of several) under "
                             "torchrun (default: one per GPU, up to the preset's gpus; 1 on the CPU)")
    parser.add_argument("--stop-after-steps", type=int, default=None,
                        help="checkpoint and exit with status 75 after this many steps (resume by rerunning)")
    return parser


def _relaunch_if_several(args, argv: list[str], job: TrainJob, preset: dict,
                         allocation: Allocation | None) -> int | None:
    """The job's exit status where it runs as several processes (torchrun on this node, or srun over several
    nodes); None where this process trains alone."""
    if allocation is not None:
        processes = processes_per_node(args.processes, job.requested_device, preset["gpus"])
        check_layout(nodes_of(preset) * processes, preset)
        return _relaunch_under_torchrun(processes, argv, args.run_dir, (nodes_of(preset), allocation))
    processes = processes_to_launch(args.processes, job.requested_device, preset["gpus"])
    if processes > 1:
        check_layout(processes, preset)
        return _relaunch_under_torchrun(processes, argv, args.run_dir)
    return None


def _train_here(job: TrainJob, threads: int) -> int:
    """Train in this process; the exit status: 0 done, 75 preempted (rerun to resume), a user error raised."""
    if threads:
        torch.set_num_threads(threads)
    keep_freed_memory()  # the process that trains: each step reuses the last one's host memory
    try:
        summary = train(job)
    except Preempted as stopped:
        print(f"{stopped}; rerun the same command to resume", file=sys.stderr)
        if os.environ.get("WORLD_SIZE"):  # torchrun's agent signals the workers still running once one has
            ignore_stop_signals()         # ended: at exit (without the trainer's handler) they would die of it
        return _report_status(EXIT_PREEMPTED)
    except UserError:
        _report_status(2, any_rank=True)
        raise
    if summary:
        print(json.dumps({k: v for k, v in summary.items() if k != "dev_history"}, indent=2))
    return _report_status(0)


@cli
def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = arguments().parse_args(argv)
    preset, train_section, experiment, tracking_uri = _settings(args)
    if args.processes is not None and args.processes < 1:
        raise UserError(f"--processes {args.processes}: give 1 or more")
    refuse_overwriting_inputs({"--run-dir": [args.run_dir / FINAL_MODEL, args.run_dir / FINAL_SUMMARY]},
                              {"--train-data": args.train_data, "--dev-data": args.dev_data,
                               "--spm-model": args.spm_model}, {"--run-dir": args.run_dir / CHECKPOINTS})
    several_nodes = nodes_of(preset) > 1 and not os.environ.get("WORLD_SIZE")
    allocation = several_nodes_allocation(preset) if several_nodes else None  # refused outside SLURM
    if is_worker_of_several_nodes():
        end_with_parent()  # its node's agent: a worker left without one stops at the next step, checkpointing
    if not os.environ.get("AIAYN_STATUS_FILE") and os.environ.get("RANK", "0") == "0":
        lock = hold_run_lock(args.run_dir)  # noqa: F841 (held until the process ends); workers share the launcher's
    job = TrainJob(preset, train_section, args.seed, args.train_data, args.dev_data, args.spm_model, args.run_dir,
                   experiment, tracking_uri, not args.no_tracking, args.device, args.stop_after_steps)
    status = _relaunch_if_several(args, argv, job, preset, allocation)
    if status is not None:
        return status
    return _train_here(job, args.threads or train_section["threads"])
