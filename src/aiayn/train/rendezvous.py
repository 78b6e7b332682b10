"""One training job across several nodes: the job's devices, and torchrun's rendezvous inside a SLURM allocation.

A preset asks for ``nodes`` machines with ``gpus`` devices each. A step is laid out for all of them
(``devices``: nodes x gpus micro-batches or a multiple), so ``tokens_per_step`` and its micro-batches are
those of one node with that many GPUs, and a run resumes with the same steps on any shape of that total.
Under SLURM the training command, on the allocation's first node, starts one torchrun agent on each node
with ``srun`` (one task a node); the agents meet through torchrun's c10d rendezvous at the first node
(``scontrol show hostnames``), on a port derived from the job id. Outside SLURM a preset of several nodes
is refused: its agents are then started by hand, on each node (``agent_command``, docs/cluster.md).
"""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import sys
from dataclasses import dataclass

from aiayn.config import preset_default
from aiayn.errors import UserError

# the rendezvous port is FIRST_PORT + job id mod PORTS: below Linux's ephemeral ports (32768 and up), so no
# outgoing connection of the node holds it, and the same for every node of the job without being told
FIRST_PORT, PORTS = 10000, 10000
# what an agent passes on to its workers: SLURM's preemption and time-limit signals with torchrun's own
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def nodes_of(preset: dict) -> int:
    """The machines a preset's training job spans (the schema's default where the preset leaves it out)."""
    return preset.get("nodes", preset_default("nodes"))


def devices(preset: dict) -> int:
    """The devices a step is laid out for: every node's ``gpus`` (0, the CPU, counts as 1)."""
    return nodes_of(preset) * max(1, preset["gpus"])


def check_layout(processes: int, preset: dict) -> None:
    """A step is split into a multiple of the preset's devices micro-batches: more processes would idle."""
    layout, nodes = devices(preset), nodes_of(preset)
    if processes <= layout:
        return
    if nodes == 1:
        raise UserError(f"{processes} processes, but preset {preset.get('name')!r} is laid out for gpus: {layout}, "
                        f"so a step has too few micro-batches for every process; set the preset's gpus to "
                        f"{processes} (or run {layout} processes or fewer)")
    raise UserError(f"{processes} processes on {nodes} nodes, but preset {preset.get('name')!r} is laid out for "
                    f"nodes: {nodes} x gpus: {layout // nodes} = {layout} devices, so a step has too few "
                    f"micro-batches for every process; run {layout // nodes} processes a node or fewer "
                    "(--processes), or raise the preset's gpus")


def processes_per_node(requested: int | None, device: str, gpus: int) -> int:
    """Workers on each node: ``--processes``, else one per GPU of the preset (each node has them: the job
    asked SLURM for them), or 1 on the CPU. Not what the first node's torch sees: a batch step may be shown
    none of the GPUs the job step gets."""
    if requested:
        return requested
    return 1 if device == "cpu" else max(1, gpus)


def rendezvous_port(job_id: str) -> int:
    return FIRST_PORT + int(job_id) % PORTS


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def agent_command(nodes: int, processes: int, endpoint: str, run_id: str, argv: list[str]) -> list[str]:
    """One node's torchrun agent: ``processes`` workers of ``aiayn.train argv``, meeting the other nodes'
    agents at ``endpoint`` (HOST:PORT) through c10d. A failed worker or node fails the job, which the
    scheduler retries from the last checkpoint (no elastic restarts: a restart would not resume)."""
    host = endpoint.rsplit(":", 1)[0]
    loopback = ["--local-addr", "127.0.0.1"] if is_loopback(host) else []  # every node is this machine
    signals = [f"--signals-to-handle={FORWARDED_SIGNALS}"] if _torchrun_takes("--signals-to-handle") else []
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={processes}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", "--max-restarts=0",
            *signals, *loopback, "-m", "aiayn.train", *argv]


def agent_environment(endpoint: str) -> dict[str, str]:
    """What the agents need beyond the job's environment: on loopback, gloo's interface too (it would
    look up the host's name, which a container may not resolve). Elsewhere the site's NCCL_SOCKET_IFNAME
    and GLOO_SOCKET_IFNAME, if it needs them, come with the job's environment."""
    loopback = is_loopback(endpoint.rsplit(":", 1)[0]) and sys.platform.startswith("linux")
    return {"GLOO_SOCKET_IFNAME": "lo"} if loopback and "GLOO_SOCKET_IFNAME" not in os.environ else {}


def _torchrun_takes(option: str) -> bool:
    """Whether this torch's torchrun has an option (``--signals-to-handle`` came in torch 2.8)."""
    from torch.distributed.run import get_args_parser

    return any(option in action.option_strings for action in get_args_parser()._actions)


@dataclass(frozen=True)
class Allocation:
    """The SLURM job this command runs in: its id, its nodes in order and the CPUs of each task."""

    job_id: str
    hosts: tuple[str, ...]
    cpus_per_task: int | None

    @classmethod
    def of_this_job(cls) -> "Allocation | None":
        """The allocation named by ``SLURM_JOB_ID``, read from slurmctld (the plugin's job step keeps only
        the id in the environment, not the node list); None outside a SLURM job."""
        job_id = os.environ.get("SLURM_JOB_ID", "")
        if not job_id.isdigit():
            return None
        record = dict(re.findall(r"(\S+?)=(\S*)", _scontrol("--oneliner", "show", "job", job_id)))
        hosts = tuple(_scontrol("show", "hostnames", record.get("NodeList", "")).split())
        if not hosts:
            raise UserError(f"SLURM job {job_id} has no nodes yet (scontrol show job {job_id}: "
                            f"NodeList={record.get('NodeList')}); run the training command inside the job")
        cpus = record.get("CPUs/Task", "")
        return cls(job_id, hosts, int(cpus) if cpus.isdigit() else None)

    @property
    def endpoint(self) -> str:
        return f"{self.hosts[0]}:{rendezvous_port(self.job_id)}"

    def srun_command(self, nodes: int, processes: int, argv: list[str]) -> list[str]:
        """One job step, one task a node, each task a torchrun agent; the step ends as soon as one task
        fails (a node that dies does not leave the others waiting for it until the time limit)."""
        step = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
        if self.cpus_per_task:  # a step's task gets one CPU unless told: each agent's workers need the job's
            step.append(f"--cpus-per-task={self.cpus_per_task}")
        return [*step, *agent_command(nodes, processes, self.endpoint, f"aiayn-{self.job_id}", argv)]


def several_nodes_allocation(preset: dict) -> Allocation:
    """The SLURM allocation a preset of several nodes trains in; refused outside one, or in one too small."""
    nodes = nodes_of(preset)
    allocation = Allocation.of_this_job()
    if allocation is None:
        raise UserError(f"preset {preset['name']!r} asks for nodes: {nodes}, one torchrun agent a node, which "
                        f"needs a SLURM allocation of {nodes} nodes: run it through the SLURM profile (snakemake "
                        "--profile profiles/slurm) or start its agents on each node (docs/cluster.md, "
                        "\"Several nodes\"); to train on this machine, set the preset's nodes to 1")
    if len(allocation.hosts) < nodes:
        raise UserError(f"preset {preset['name']!r} asks for nodes: {nodes}, but SLURM job {allocation.job_id} "
                        f"has {len(allocation.hosts)} ({','.join(allocation.hosts)}); submit it with --nodes="
                        f"{nodes} (the SLURM profile does), or set the preset's nodes to {len(allocation.hosts)}")
    return allocation


def _scontrol(*arguments: str) -> str:
    """scontrol's answer. One that does not come ends the command with status 1, not a user error's 2:
    a controller too busy to answer is worth a retry."""
    command = f"scontrol {' '.join(arguments)}"
    try:
        result = subprocess.run(["scontrol", *arguments], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SystemExit(f"error: SLURM_JOB_ID is set, but `{command}` did not answer ({error})") from None
    if result.returncode != 0:
        raise SystemExit(f"error: `{command}` failed: {result.stderr.strip()[-300:]}")
    return result.stdout


def is_worker_of_several_nodes() -> bool:
    """torchrun's workers know the whole world and their node's share of it. Such a worker is asked to
    receive SIGTERM when its agent dies (``aiayn.joblog.end_with_parent``): it then stops as a preempted
    run does, with every other node's workers, where it would train on unwatched while the agents wait."""
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    return bool(world and local and world != local)
