"""Several nodes: the torchrun agents a SLURM job starts on its nodes, here two on loopback (gloo on the CPU),
against one agent with all the processes; preemption and a node that dies; the refusal outside SLURM."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_preset
from test_train import TRAIN_SECTION, _run, _train_command, assert_same_weights

from aiayn.checkpoint import list_checkpoints
from aiayn.train.rendezvous import (Allocation, agent_command, agent_environment, processes_per_node,
                                    rendezvous_port)

# 4 micro-batches a step, 2 per node; a step logged each time so that the losses can be compared
SECTION = {**TRAIN_SECTION, "tokens_per_step": 1200, "device_tokens": 300, "log_every": 1, "dev_every": 0}
STEPS = 8


def preset(**overrides) -> dict:
    return tiny_preset(**{"steps": STEPS, "checkpoint_steps": STEPS, "keep_checkpoints": 1, "average_last": 1,
                          "nodes": 2, "gpus": 2, **overrides})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Agents:
    """Two torchrun agents, as srun starts one on each node of the job: the command of
    ``Allocation.srun_command`` after ``srun``, meeting on loopback."""

    def __init__(self, prepared, run_dir: Path, preset: dict, status_file: Path | None = None):
        endpoint = f"127.0.0.1:{free_port()}"
        argv = _train_command(prepared, run_dir, preset, SECTION)[3:]  # what follows `python -m aiayn.train`
        command = agent_command(2, preset["gpus"], endpoint, f"test-{run_dir.name}", argv)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **agent_environment(endpoint)}
        if status_file:  # what the launching command gives its agents (launch.py)
            env["AIAYN_STATUS_FILE"] = str(status_file)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.logs = [run_dir.parent / f"{run_dir.name}-agent{node}.log" for node in range(2)]
        self.processes = []
        for log in self.logs:
            with open(log, "w") as output:
                self.processes.append(subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT,
                                                       start_new_session=True))

    def output(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in self.logs)

    def wait(self, timeout: float = 240) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [process.wait(timeout=max(1.0, deadline - time.monotonic())) for process in self.processes]
        except subprocess.TimeoutExpired:
            pytest.fail(f"the agents still run after {timeout} s:\n{self.output()}")
        finally:
            self.stop()

    def stop(self) -> None:
        """Whatever is left of both agents' process groups (their workers too)."""
        for process in self.processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


def logged_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [record for record in map(json.loads, lines) if "train_loss" in record]


def wait_for_step(run_dir: Path, agents: Agents, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not any(record["step"] >= step for record in logged_steps(run_dir)):
        if time.monotonic() > deadline or any(process.poll() is not None for process in agents.processes):
            agents.stop()
            pytest.fail(f"no step {step} logged:\n{agents.output()}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def two_nodes(prepared, tmp_path_factory):
    """One run as two agents of 2 processes each (nodes: 2, gpus: 2), uninterrupted."""
    run_dir = tmp_path_factory.mktemp("nodes") / "two"
    agents = Agents(prepared, run_dir, preset())
    assert agents.wait() == [0, 0], agents.output()
    return run_dir


def test_two_agents_of_two_processes_train_as_one_agent_of_four(prepared, two_nodes, tmp_path):
    one = _run(_train_command(prepared, tmp_path / "one", preset(nodes=1, gpus=4), SECTION, "--processes", "4"))
    assert one.returncode == 0, one.stderr
    summaries = [json.loads((run / "final.json").read_text()) for run in (two_nodes, tmp_path / "one")]
    assert [summary["world_size"] for summary in summaries] == [4, 4]
    for key in ("real_src_tokens_per_step", "real_tgt_tokens_per_step", "padded_tgt_tokens_per_step"):
        assert summaries[0][key] == summaries[1][key], key  # the same batches: tokens_per_step at any shape
    losses = [[record["train_loss"] for record in logged_steps(run)][:5] for run in (two_nodes, tmp_path / "one")]
    assert len(losses[0]) == 5 and losses[0] == losses[1]  # the same ranks sum the same numbers: bit for bit
    checkpoints = [torch.load(run / "checkpoints" / f"step_{STEPS:08d}.pt", weights_only=True)
                   for run in (two_nodes, tmp_path / "one")]
    assert checkpoints[0]["batch_rule"] == checkpoints[1]["batch_rule"] == {
        "tokens_per_step": 1200, "device_tokens": 300, "gpus": 4, "seed": 1, "shape_buckets": False}
    for part in ("model", "optimizer"):
        torch.testing.assert_close(checkpoints[0][part], checkpoints[1][part], rtol=0, atol=0, msg=part)
    assert checkpoints[0]["progress"]["cursor"] == checkpoints[1]["progress"]["cursor"]


def test_a_sigterm_to_one_agent_checkpoints_once_and_every_rank_exits_75_then_the_retry_resumes(prepared, two_nodes,
                                                                                                tmp_path):
    run_dir, status = tmp_path / "stopped", tmp_path / "status"
    agents = Agents(prepared, run_dir, preset(), status_file=status)
    wait_for_step(run_dir, agents, 2)
    agents.processes[1].send_signal(signal.SIGTERM)  # the agent of the second node only
    codes, output = agents.wait(), agents.output()
    assert status.read_text() == "75", output  # rank 0's status, which the launching command exits with
    assert all(code != 0 for code in codes), output  # the agents: torchrun's own status
    assert output.count("; rerun the same command to resume") == 4, output  # every rank ended preempted ...
    assert set(re.findall(r"exitcode\s*: (-?\d+)", output)) == {"75"}, output  # ... none killed by a signal
    written = list_checkpoints(run_dir / "checkpoints", safety=True)
    assert len(written) == 1 and written[0][0] < STEPS, written  # one checkpoint, at the step all stopped
    stopped_at = written[0][0]
    resumed = Agents(prepared, run_dir, preset())
    assert resumed.wait() == [0, 0], resumed.output()
    assert f"resuming from {written[0][1]} (step {stopped_at})" in resumed.output()
    # the steps up to the stop are the uninterrupted run's, bit for bit; after it, DDP sums the 4 processes'
    # gradients of the first step of a start in another order than later (its buckets are rebuilt after
    # that step), so the weights agree within rounding, as a resume of 3 or more processes on one node
    losses = [[record["train_loss"] for record in logged_steps(run)] for run in (two_nodes, run_dir)]
    assert losses[0][:stopped_at] == losses[1][:stopped_at] and len(losses[1]) == STEPS
    assert_same_weights(*[torch.load(run / "final.pt", weights_only=True)["model"] for run in (two_nodes, run_dir)])


def test_a_sigkill_of_one_agent_ends_the_other_within_seconds(prepared, tmp_path):
    run_dir = tmp_path / "killed"
    agents = Agents(prepared, run_dir, preset(steps=10_000, checkpoint_steps=10_000, gpus=1))  # 1 worker a node
    wait_for_step(run_dir, agents, 1)
    os.kill(agents.processes[1].pid, signal.SIGKILL)  # the agent alone, not its process group
    started = time.monotonic()
    try:
        code = agents.processes[0].wait(timeout=60)
    except subprocess.TimeoutExpired:
        agents.stop()
        pytest.fail(f"the other node's agent still runs 60 s after the kill:\n{agents.output()}")
    print(f"the other agent exited {code} after {time.monotonic() - started:.1f} s")
    agents.stop()
    assert code != 0, agents.output()
    # the dead agent's workers stopped (SIGTERM when their parent died), and so every worker did, at one step
    assert len(list_checkpoints(run_dir / "checkpoints", safety=True)) == 1, agents.output()


def test_a_preset_of_several_nodes_is_refused_outside_slurm(prepared, tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    result = subprocess.run(_train_command(prepared, tmp_path / "run", preset(), SECTION), capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("error: preset 'tiny' asks for nodes: 2, one torchrun agent a node, which needs "
                                    "a SLURM allocation of 2 nodes"), result.stderr
    assert not (tmp_path / "run").exists()


def test_the_job_step_is_one_torchrun_agent_a_node_meeting_at_the_first_node():
    allocation = Allocation("1234567", ("gpu-a17", "gpu-a18"), 64)
    command = allocation.srun_command(2, 8, ["--run-dir", "results/x"])
    assert command[:6] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                           "--cpus-per-task=64"]
    agent = command[6:]
    assert agent[:3] == [sys.executable, "-m", "torch.distributed.run"]
    for option in ("--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=gpu-a17:14567",
                   "--rdzv-id=aiayn-1234567", "--max-restarts=0"):
        assert option in agent, option
    assert "--standalone" not in agent and "--local-addr" not in agent  # real nodes: their own addresses
    assert agent[-4:] == ["-m", "aiayn.train", "--run-dir", "results/x"]
    assert rendezvous_port("1234567") == 14567 and rendezvous_port("1240000") == 10000
    assert agent_environment(allocation.endpoint) == {}
    # each node runs its preset's gpus workers, whatever the first node's torch sees; 1 on the CPU
    assert [processes_per_node(requested, device, gpus) for requested, device, gpus in
            ((None, "auto", 8), (None, "cpu", 8), (None, "auto", 0), (3, "auto", 8))] == [8, 1, 1, 3]
