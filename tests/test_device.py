"""aiayn.device: a job that asks for GPUs never trains on the CPU silently, and processes do not share GPUs
by accident."""

from __future__ import annotations

import json
from pathlib import Path
import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_preset, train_settings

from aiayn.config import section_defaults
from aiayn.device import choose_device
from aiayn.errors import UserError

SECTION = {**section_defaults("train"), "tokens_per_step": 600, "device_tokens": 600, "log_every": 1,
           "dev_every": 0, "precision": "fp32", "device": "auto"}


def _train(prepared, run_dir, preset, section, *extra, env=None):
    command = [sys.executable, "-m", "aiayn.train", *train_settings(Path(run_dir).parent, preset, section), "--seed",
               "1", "--train-data", str(prepared / "bin" / "train"), "--spm-model", str(prepared / "bpe" / "spm.model"),
               "--no-tracking", "--threads", "1", "--run-dir", str(run_dir), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_a_gpu_preset_where_torch_sees_no_gpu_stops_before_any_step_with_what_torch_sees(prepared, tmp_path):
    preset = tiny_preset(steps=2, checkpoint_steps=2, keep_checkpoints=1, average_last=1, gpus=1)
    result = _train(prepared, tmp_path / "run", preset, SECTION, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    message = result.stderr
    assert "gpus: 1 with train.device: auto" in message and "torch sees no CUDA device" in message
    if torch.version.cuda is None:
        assert "CPU build" in message and "torch.version.cuda is None" in message
    else:
        assert "CUDA_VISIBLE_DEVICES is ''" in message
    assert "install torch's CUDA build" in message and "train.device: cpu" in message
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
    assert not (tmp_path / "run" / "final.json").exists()


def test_the_same_gpu_preset_trains_on_the_cpu_when_asked_to(prepared, tmp_path):
    preset = tiny_preset(steps=2, checkpoint_steps=2, keep_checkpoints=1, average_last=1, gpus=1)
    result = _train(prepared, tmp_path / "run", preset, {**SECTION, "device": "cpu"}, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "final.json").read_text())["device"] == "cpu"


def test_gpus_0_and_auto_without_a_preset_stay_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_device("auto", gpus=0).type == "cpu"
    assert choose_device("auto").type == "cpu"  # decoding and averaging: the GPU where there is one
    assert choose_device("cpu", gpus=8).type == "cpu"


def test_a_cuda_build_with_no_visible_device_names_the_variable_and_the_drivers_error(monkeypatch):
    def driver_error():
        raise RuntimeError("Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "init", driver_error)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(UserError) as caught:
        choose_device("auto", gpus=8)
    message = str(caught.value)
    assert "gpus: 8" in message and "built for CUDA 12.8" in message and "CUDA_VISIBLE_DEVICES is ''" in message
    assert "the driver says: Found no NVIDIA driver on your system" in message
    with pytest.raises(UserError, match="device cuda"):
        choose_device("cuda", gpus=0)


@pytest.fixture
def two_visible_gpus(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_more_processes_on_a_node_than_gpus_are_refused_with_the_counts(two_visible_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(UserError, match=r"4 training processes on this node but torch sees 2 GPU\(s\).*share_gpus"):
        choose_device("auto", gpus=4, local_rank=3)
    assert two_visible_gpus == []


def test_sharing_gpus_on_purpose_puts_processes_round_robin(two_visible_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert choose_device("auto", gpus=4, local_rank=3, share_gpus=True) == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert choose_device("cuda", gpus=2, local_rank=1) == torch.device("cuda", 1)
    assert two_visible_gpus == [1, 1]
