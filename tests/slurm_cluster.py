"""A throwaway SLURM cluster on this machine, for the cluster tests.

Debian's ``slurm-wlm`` and ``munge`` (installed with apt-get when missing and we are root), one
``munged``, ``slurmctld`` and a ``slurmd`` for each node started from a generated ``/etc/slurm/slurm.conf``,
every state, log and key file under one temporary folder, and all of it stopped by pid at the end.

Several nodes are several slurmd on this one host, each under its own node name (``slurmd -N``) with its
own port, spool folder and log, which Debian's build allows. Each node has the host's CPUs and memory, and
is named by a loopback address (127.0.0.1, 127.0.0.2, ...), which resolves everywhere: a job's first node
is where its torchrun agents meet (aiayn/train/rendezvous.py), so its name must be an address.

Two things are forced on us. The configuration must sit at the default path, because Snakemake's
SLURM job-step plugin removes ``SLURM_CONF`` from the environment of the ``srun`` it runs inside
each job. And without slurmdbd there is no ``sacct``: job states come from ``squeue``, which only
remembers a finished job for ``MinJobAge`` seconds, so that is set long.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SLURM_CONF = Path("/etc/slurm/slurm.conf")
MARKER = "# written by tests/slurm_cluster.py for a test run; removed when the run stops"
PARTITION = "local"
SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")


class ClusterUnavailable(Exception):
    """This machine cannot host the test cluster; the message says why (a reason to skip)."""


def _which(program: str) -> str | None:
    return shutil.which(program) or shutil.which(program, path=os.pathsep.join(SBIN))


def ensure_installed() -> None:
    """Install Debian's SLURM and MUNGE if they are missing; ClusterUnavailable if we cannot."""
    if all(_which(p) for p in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0:
        raise ClusterUnavailable("slurmctld/munged are not installed and installing them needs root")
    if not shutil.which("apt-get"):
        raise ClusterUnavailable("slurmctld/munged are not installed and there is no apt-get to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # The packages' own daemons must not start (they would use the host's configuration): a
    # policy-rc.d that says no, for the length of the install, unless the machine has one.
    policy = Path("/usr/sbin/policy-rc.d")
    own_policy = not policy.exists()
    if own_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        for command in (["apt-get", "update", "-qq"],
                        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm", "munge"]):
            result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
            if result.returncode != 0:
                raise ClusterUnavailable(f"{' '.join(command)} failed: {(result.stderr or result.stdout)[-800:]}")
    finally:
        if own_policy:
            policy.unlink(missing_ok=True)
    missing = [p for p in ("slurmctld", "slurmd", "sbatch", "munged") if not _which(p)]
    if missing:
        raise ClusterUnavailable(f"apt-get installed slurm-wlm and munge but {', '.join(missing)} are missing")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _controller_answers() -> bool:
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return ping.returncode == 0 and " is UP" in ping.stdout


def node_line() -> str:
    """This machine as SLURM sees it (``slurmd -C``): its name, real CPU layout and memory."""
    result = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, timeout=60)
    line = next((l for l in result.stdout.splitlines() if l.startswith("NodeName=")), None)
    if result.returncode != 0 or line is None:
        raise ClusterUnavailable(f"slurmd -C did not describe this node: {result.stderr.strip()[-400:]}")
    return line.strip()


@dataclass
class LocalCluster:
    """One controller and ``nodes`` compute nodes on localhost, their files under ``root``."""

    root: Path
    nodes: int = 1
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    wrote_config: bool = False
    node: str = ""
    cpus: int = 0

    @property
    def jobcomp_log(self) -> Path:
        return self.root / "jobcomp.log"

    def log(self, daemon: str) -> str:
        path = self.root / f"{daemon}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # --- start ------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> "LocalCluster":
        ensure_installed()
        if SLURM_CONF.exists() and MARKER not in SLURM_CONF.read_text(errors="replace"):
            raise ClusterUnavailable(f"{SLURM_CONF} belongs to a SLURM installation of this machine; "
                                     "the test cluster does not overwrite it")
        if SLURM_CONF.exists() and _controller_answers():
            raise ClusterUnavailable(f"another test run's cluster is up (its {SLURM_CONF} answers)")
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self._start_munge()
            self._write_config()
            self._spawn("slurmctld", [_which("slurmctld"), "-D"])
            self._wait(_controller_answers, timeout, "slurmctld answers")
            if self.nodes == 1:
                self._spawn("slurmd", [_which("slurmd"), "-D"])
            for name in self.node_names if self.nodes > 1 else ():
                self._spawn(f"slurmd-{name}", [_which("slurmd"), "-D", "-N", name])
            self._wait(self._node_idle, timeout, "the nodes are idle")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munge(self) -> None:
        """A private munged: its own key and socket, so a host's MUNGE is neither used nor touched."""
        munge = self.root / "munge"
        munge.mkdir(mode=0o700, exist_ok=True)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = munge / "munge.socket"
        self._spawn("munged", [_which("munged"), "--foreground", "--force", f"--key-file={key}",
                               f"--socket={self.munge_socket}", f"--pid-file={munge / 'munged.pid'}",
                               f"--seed-file={munge / 'munged.seed'}", f"--log-file={self.root / 'munged.log'}"])
        self._wait(lambda: self.munge_socket.exists(), 30, "munged listens")

    @property
    def node_names(self) -> list[str]:
        return [self.node] if self.nodes == 1 else [f"127.0.0.{index + 1}" for index in range(self.nodes)]

    def _node_lines(self, line: str) -> str:
        """slurm.conf's nodes: this host as ``slurmd -C`` describes it, once, or under several names."""
        if self.nodes == 1:
            return f"{line} NodeAddr=127.0.0.1 State=UNKNOWN"
        host, layout = line.split(None, 1)
        return "\n".join(f"NodeName={name} NodeHostname={host.split('=', 1)[1]} NodeAddr=127.0.0.1 "
                         f"Port={_free_port()} {layout} State=UNKNOWN" for name in self.node_names)

    def _write_config(self) -> None:
        line = node_line()
        self.node = re.search(r"NodeName=(\S+)", line).group(1)
        self.cpus = int(re.search(r"CPUs=(\d+)", line).group(1))
        for folder in ("ctld", "spool", *(f"spool/{name}" for name in self.node_names if self.nodes > 1)):
            (self.root / folder).mkdir(exist_ok=True)
        root = self.root
        # one slurmd: its files as ever; several: each its own, by node name (%n)
        node = "" if self.nodes == 1 else "-%n"
        spool = "spool" if self.nodes == 1 else "spool/%n"
        config = f"""{MARKER}
ClusterName=aiayntest
SlurmctldHost=localhost
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/{spool}
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd{node}.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd{node}.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups: a container may not delegate them
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# no slurmdbd, so no sacct: squeue answers for finished jobs while MinJobAge lasts,
# and a completion log records every job that ran
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.log
MinJobAge=3600
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# without a default, a job that names no memory is given the whole node
DefMemPerCPU=256
ReturnToService=2
# jobs are not requeueable unless sbatch says --requeue, so that Requeue=1 shows it did
JobRequeue=0
MpiDefault=none
{self._node_lines(line)}
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
        SLURM_CONF.write_text(config)
        self.wrote_config = True

    def _spawn(self, name: str, command: list[str]) -> None:
        with open(self.root / f"{name}.stdout", "w") as output:
            self.processes[name] = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT,
                                                    stdin=subprocess.DEVNULL, start_new_session=True)

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise ClusterUnavailable(f"{name} exited with status {process.returncode} before {what}:\n"
                                             f"{self._tail(name)}")
            try:
                if ready():
                    return
            except (OSError, subprocess.SubprocessError):
                pass
            time.sleep(0.5)
        raise ClusterUnavailable(f"timed out after {timeout:.0f} s waiting until {what}:\n"
                                 + "\n".join(self._tail(name) for name in self.processes))

    def _tail(self, name: str) -> str:
        """The last lines a daemon wrote, to its log file and to its stdout."""
        stdout = self.root / f"{name}.stdout"
        text = self.log(name) + (stdout.read_text(errors="replace") if stdout.exists() else "")
        return f"--- {name}\n" + "\n".join(text.splitlines()[-15:])

    def _node_idle(self) -> bool:
        states = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%T"], capture_output=True,
                                text=True, timeout=10).stdout.split()
        return states == ["idle"] * self.nodes

    # --- use --------------------------------------------------------------------------
    def completed_jobs(self) -> list[dict[str, str]]:
        """The completion log, one dict per finished job (JobId, Name, JobState, ExitCode, ...)."""
        if not self.jobcomp_log.exists():
            return []
        return [dict(pair.split("=", 1) for pair in line.split() if "=" in pair)
                for line in self.jobcomp_log.read_text(errors="replace").splitlines() if line.strip()]

    def job_record(self, job_id: str) -> dict[str, str]:
        """What slurmctld holds about a job (``scontrol show job``; kept for MinJobAge after it ends)."""
        shown = subprocess.run(["scontrol", "--oneliner", "show", "job", job_id], capture_output=True, text=True,
                               timeout=10).stdout
        return dict(re.findall(r"(\w+)=(\S*)", shown))

    # --- stop -------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel what still runs, stop the daemons this object started, remove the configuration."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            subprocess.run(["scancel", f"--partition={PARTITION}"], capture_output=True, timeout=30)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                queue = subprocess.run(["squeue", "--noheader", "--states=RUNNING,PENDING,COMPLETING",
                                        "--format=%i"], capture_output=True, text=True, timeout=10)
                if queue.returncode != 0 or not queue.stdout.strip():
                    break
                time.sleep(0.5)
        slurmds = [name for name in self.processes if name.startswith("slurmd")]
        for name in (*slurmds, "slurmctld", "munged"):
            process = self.processes.pop(name, None)
            if process is None or process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if self.wrote_config and SLURM_CONF.exists() and MARKER in SLURM_CONF.read_text(errors="replace"):
            SLURM_CONF.unlink()
        self.wrote_config = False
