"""Training: the paper's schedule and loss, exact resume, DDP equivalence, MLflow tracking."""

from __future__ import annotations

import copy
import json
from pathlib import Path
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import tiny_preset, train_settings
import torch

from aiayn.checkpoint import list_checkpoints, load_checkpoint, window_steps
from aiayn.config import section_defaults
from aiayn.device import choose_device
from aiayn.errors import UserError
from aiayn.train.schedule import learning_rate
from aiayn.train.trainer import TrainingDiverged, TrainJob, train

# the schema's defaults, with a small batch and frequent logging
TRAIN_SECTION = {**section_defaults("train"), "tokens_per_step": 600, "device_tokens": 600, "log_every": 2,
                 "dev_every": 3, "precision": "fp32", "device": "cpu"}


def job(prepared, run_dir, track=False, tracking_uri=None, **overrides) -> TrainJob:
    section = {**TRAIN_SECTION, **overrides.pop("train", {})}
    stop = overrides.pop("stop_after_steps", None)
    return TrainJob(tiny_preset(**overrides), section, 1, prepared / "bin" / "train", prepared / "bin" / "dev",
                    prepared / "bpe" / "spm.model", run_dir, "tests", tracking_uri, track, "cpu", stop, False)


def final_weights(run_dir):
    return torch.load(run_dir / "final.pt", map_location="cpu", weights_only=True)["model"]


def test_learning_rate_follows_the_paper_at_steps_1_4000_and_100000():
    assert learning_rate(1, 512, 4000) == pytest.approx(512 ** -0.5 * 4000 ** -1.5)
    assert learning_rate(4000, 512, 4000) == pytest.approx(6.99e-4, rel=1e-3)   # docs/PAPER.md: peak 6.99e-4 (base)
    assert learning_rate(4000, 1024, 4000) == pytest.approx(4.94e-4, rel=1e-3)  # and 4.94e-4 (big)
    assert learning_rate(100000, 512, 4000) == pytest.approx(512 ** -0.5 * 100000 ** -0.5)
    assert learning_rate(3999, 512, 4000) < learning_rate(4000, 512, 4000) > learning_rate(4001, 512, 4000)


def test_the_paper_presets_average_their_window_at_the_papers_steps():
    from aiayn.config import load_config, resolve_preset

    config = load_config(["config/wmt14_en_de.yaml"])
    base, big = resolve_preset(config, "base"), resolve_preset(config, "big")
    assert window_steps(base["steps"], base["checkpoint_steps"], base["average_last"]) == [
        94444, 95833, 97222, 98611, 100000]  # 5, 10 minutes of the paper's 12 h run apart
    big_window = window_steps(big["steps"], big["checkpoint_steps"], big["average_last"])
    assert len(big_window) == 20 and big_window[-1] == 300000 and big_window[0] == 300000 - 19 * 595


def test_gpus_0_trains_on_the_cpu_even_where_cuda_is_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert choose_device("auto", gpus=0).type == "cpu"
    assert choose_device("cpu", gpus=8).type == "cpu"


def test_cuda_without_a_gpu_is_a_user_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="sees no CUDA device"):
        choose_device("cuda")


def test_stop_and_resume_ends_with_the_same_parameters_as_an_uninterrupted_run(prepared, tmp_path):
    train(job(prepared, tmp_path / "straight"))
    from aiayn.train.trainer import Preempted

    with pytest.raises(Preempted):
        train(job(prepared, tmp_path / "resumed", stop_after_steps=3))
    assert [step for step, _ in list_checkpoints(tmp_path / "resumed" / "checkpoints")] == [2]  # the window
    assert [path.name for _, path in list_checkpoints(tmp_path / "resumed" / "checkpoints", safety=True)] == [
        "step_00000002.pt", "safety_00000003.pt"]
    summary = train(job(prepared, tmp_path / "resumed"))
    assert summary["step"] == 6
    straight, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name  # bitwise on the CPU


def test_training_on_the_cpu_uses_the_cheaper_dropout_mask(prepared, tmp_path):
    from aiayn.speed.dropout import MaskDropout
    from aiayn.train.trainer import Trainer

    model = Trainer(job(prepared, tmp_path / "run")).model
    assert not any(type(module) is torch.nn.Dropout for module in model.modules())
    assert sum(isinstance(module, MaskDropout) for module in model.modules()) == 2 * model.config.n_layers + 1


def test_the_trainers_adam_is_fused_on_the_cpu(prepared, tmp_path):
    from aiayn.train.trainer import Trainer

    groups = Trainer(job(prepared, tmp_path / "run")).optimizer.param_groups
    assert [group["fused"] for group in groups] == [True] and groups[0]["betas"] == (0.9, 0.98)


def test_a_for_loop_adams_state_loads_into_the_fused_one_and_continues_as_the_for_loop_would():
    from aiayn.train.hardware import adam, load_optimizer_state

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def train_steps(net, optimizer, steps):
        for step in range(steps):
            generator = torch.Generator().manual_seed(step)
            net(torch.randn(32, 8, generator=generator)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    settings = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-9)
    old_net, new_net = model(), model()
    old = torch.optim.Adam(old_net.parameters(), foreach=False, **settings)  # as checkpoints before it were saved
    train_steps(old_net, old, 3)
    new_net.load_state_dict(old_net.state_dict())
    fused = adam(new_net.parameters(), torch.device("cpu"), **settings)
    load_optimizer_state(fused, copy.deepcopy(old.state_dict()))  # as read back from a checkpoint
    assert fused.param_groups[0]["fused"] is True  # the saved state's `fused: None` did not replace it
    train_steps(old_net, old, 3)
    train_steps(new_net, fused, 3)
    for a, b in zip(old_net.parameters(), new_net.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)  # one rounding apart, not another optimizer


def test_checkpoints_hold_everything_to_resume_and_load_weights_only(prepared, tmp_path):
    train(job(prepared, tmp_path / "run"))
    steps = [step for step, _ in list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert steps == [2, 4, 6]  # keep_checkpoints = 3
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_00000006.pt", weights_only=True)
    for key in ("model", "optimizer", "schedule", "progress", "rng", "config", "model_config",
                "vocab_fingerprint", "data_fingerprint"):
        assert key in state, key
    assert state["progress"]["step"] == 6 and state["schedule"]["warmup_steps"] == 4
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp*"))


def test_a_non_finite_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(prepared, tmp_path):
    with pytest.raises(TrainingDiverged, match=r"at step \d+ \(preset tiny\); the last good checkpoint is kept"):
        train(job(prepared, tmp_path / "run", lr_scale=1e30, steps=8, checkpoint_steps=1))
    for _, path in list_checkpoints(tmp_path / "run" / "checkpoints"):
        state = load_checkpoint(path)
        assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    assert not (tmp_path / "run" / "final.json").exists()


def test_the_mlflow_run_holds_config_fingerprints_and_metrics(prepared, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    summary = train(job(prepared, tmp_path / "run", track=True, tracking_uri=uri))
    run = MlflowClient(uri).get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert (tmp_path / "run" / "mlflow_run_id").read_text().strip() == run.info.run_id
    params, tags = run.data.params, run.data.tags
    assert params["preset.d_model"] == "32" and params["train.tokens_per_step"] == "600"
    assert params["model.parameters"] == str(summary["parameters"])
    for tag in ("git_commit", "data_fingerprint", "vocab_fingerprint", "device", "preset"):
        assert tags[tag], tag
    for metric in ("train_loss", "train_nll", "train_ppl", "lr", "grad_norm", "target_tokens_per_second",
                   "padding_efficiency", "train_flops", "dev_loss", "dev_ppl", "distinct_shapes",
                   "new_shape_seconds"):
        assert metric in run.data.metrics, metric
    assert (run.info.run_name, tags["attempt"]) == ("tiny-seed1-a1", "1")
    rerun = train(job(prepared, tmp_path / "rerun", track=True, tracking_uri=uri, steps=2))
    assert MlflowClient(uri).get_run(rerun["mlflow_run_id"]).info.run_name == "tiny-seed1-a2"
    history = MlflowClient(uri).get_metric_history(run.info.run_id, "train_loss")
    assert [m.step for m in history] == [2, 4, 6]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert any("dev_ppl" in json.loads(line) for line in lines)


@pytest.mark.parametrize("buckets", [False, True])
def test_a_run_counts_its_distinct_micro_batch_shapes_and_the_seconds_of_the_steps_that_met_them(prepared, tmp_path,
                                                                                                 buckets):
    from types import SimpleNamespace

    from aiayn.binarize import load_split
    from aiayn.train.steps import Progress, StepSource, TrainSettings

    summary = train(job(prepared, tmp_path / "run", train={"shape_buckets": buckets}))
    written = json.loads((tmp_path / "run" / "final.json").read_text())
    # the shapes of the same steps, drawn as the trainer draws them
    split = load_split(prepared / "bin" / "train")
    settings = TrainSettings.from_config(tiny_preset(), {**TRAIN_SECTION, "shape_buckets": buckets}, seed=1)
    source, progress, shapes = StepSource(split, settings), Progress(), set()
    for _ in range(summary["step"]):
        shapes.update(source.next(progress)[1].shapes)
    assert written["distinct_shapes"] == len(shapes) >= 1
    assert 1 <= written["new_shape_steps"] <= summary["step"] and written["new_shape_seconds"] > 0
    if buckets:  # each side's computed length + 1 has at most 4 significant bits
        assert all(bin(size)[2:][4:].strip("0") == "" for shape in shapes for size in shape[1:])


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_processes_train_on_the_same_tokens_and_reach_the_same_weights_as_one_process(prepared, tmp_path, world):
    preset = tiny_preset(steps=3, checkpoint_steps=3, keep_checkpoints=1, average_last=1, gpus=world)
    section = {**TRAIN_SECTION, "tokens_per_step": 1200, "device_tokens": 300}  # 4 micro-batches a step
    single = _run(_train_command(prepared, tmp_path / "one", preset, section))
    assert single.returncode == 0, single.stderr
    several = _run(_train_command(prepared, tmp_path / "several", preset, section, "--processes", str(world)))
    assert several.returncode == 0, several.stderr
    one, many = (json.loads((tmp_path / name / "final.json").read_text()) for name in ("one", "several"))
    assert (one["world_size"], many["world_size"]) == (1, world)
    for key in ("real_src_tokens_per_step", "real_tgt_tokens_per_step", "padded_src_tokens_per_step"):
        assert one[key] == many[key], key
    assert_same_weights(final_weights(tmp_path / "one"), final_weights(tmp_path / "several"))


def test_processes_on_one_node_meet_on_loopback_where_the_host_name_does_not_resolve(prepared, tmp_path):
    # torchrun publishes the host's name for the workers to meet at; where that name does not resolve
    # (a container without its name in /etc/hosts) they used to wait for the whole rendezvous timeout
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import socket\nsocket.gethostname = lambda: 'aiayn-no-such-host.invalid'\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    preset = tiny_preset(steps=2, checkpoint_steps=2, keep_checkpoints=1, average_last=1, gpus=2)
    section = {**TRAIN_SECTION, "tokens_per_step": 1200, "device_tokens": 300}
    command = _train_command(prepared, tmp_path / "run", preset, section, "--processes", "2")
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             start_new_session=True)
    try:
        output, _ = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        output, _ = child.communicate()
        pytest.fail(f"2 processes still training after 120 s:\n{output[-3000:]}")
    assert child.returncode == 0, output[-3000:]
    assert json.loads((tmp_path / "run" / "final.json").read_text())["world_size"] == 2


def assert_same_weights(a, b):
    """Equal within float tolerance where Adam does not magnify rounding. Key biases are left out: their
    true gradient is zero (softmax does not change when a constant is added to every score), so Adam turns
    rounding noise into steps. Elsewhere a weight whose gradient happens to be near zero does the same on a
    smaller scale, so at most one element in a thousand of a tensor may be off by more, up to 1e-4; other
    masks or tokens would move most elements."""
    for name in a:
        if name.endswith("key.bias"):
            continue
        off = int((~torch.isclose(a[name], b[name], rtol=1e-5, atol=1e-5)).sum())
        assert off <= a[name].numel() // 1000, f"{name}: {off} of {a[name].numel()} elements differ"
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-4, msg=name)


def test_a_preempted_torchrun_job_exits_75_and_resumes_exactly_on_another_number_of_processes(prepared, tmp_path):
    preset = tiny_preset(steps=4, checkpoint_steps=2, keep_checkpoints=2, average_last=2, gpus=2)
    section = {**TRAIN_SECTION, "tokens_per_step": 1200, "device_tokens": 300}
    straight = _run(_train_command(prepared, tmp_path / "straight", preset, section))
    assert straight.returncode == 0, straight.stderr
    stopped = _run(_train_command(prepared, tmp_path / "moved", preset, section, "--processes", "2",
                                  "--stop-after-steps", "1"))
    assert stopped.returncode == 75, stopped.stderr  # not torchrun's 1: Snakemake's retry resumes it
    resumed = _run(_train_command(prepared, tmp_path / "moved", preset, section))  # now on 1 process
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr and "on 1 process" in resumed.stderr
    assert_same_weights(final_weights(tmp_path / "straight"), final_weights(tmp_path / "moved"))


def test_resuming_with_another_batch_rule_is_refused_naming_what_changed(prepared, tmp_path):
    from aiayn.train.trainer import Preempted

    with pytest.raises(Preempted):
        train(job(prepared, tmp_path / "run", stop_after_steps=1))
    with pytest.raises(UserError, match=r"tokens_per_step 600 -> 900.*delete .* to start afresh"):
        train(job(prepared, tmp_path / "run", train={"tokens_per_step": 900}))


def test_more_processes_than_the_preset_is_laid_out_for_are_refused(prepared, tmp_path):
    result = _run(_train_command(prepared, tmp_path / "run", tiny_preset(gpus=1), TRAIN_SECTION, "--processes", "2"))
    assert result.returncode == 2
    assert "2 processes, but preset 'tiny' is laid out for gpus: 1" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_sigterm_between_window_checkpoints_averages_the_same_steps_as_an_uninterrupted_run(prepared, tmp_path):
    from aiayn.average import average_checkpoints
    from aiayn.checkpoint import last_checkpoints

    preset = tiny_preset(steps=30, checkpoint_steps=4, keep_checkpoints=3, average_last=3)
    section = {**TRAIN_SECTION, "tokens_per_step": 300, "device_tokens": 300, "dev_every": 0, "log_every": 1}
    straight = _run(_train_command(prepared, tmp_path / "straight", preset, section))
    assert straight.returncode == 0, straight.stderr
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(_train_command(prepared, tmp_path / "killed", preset, section), env=env,
                               stderr=subprocess.PIPE, text=True)
    checkpoints = tmp_path / "killed" / "checkpoints"
    deadline = time.monotonic() + 120
    while not (checkpoints / "step_00000006.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the first window checkpoint (30, 26, ..., 6, 2 are the window's steps)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 75, process.stderr.read()
    stopped_at = list_checkpoints(checkpoints, safety=True)[-1][0]
    assert stopped_at < 30
    resumed = _run(_train_command(prepared, tmp_path / "killed", preset, section))
    assert resumed.returncode == 0, resumed.stderr
    assert not list((checkpoints).glob("safety_*.pt"))  # a safety checkpoint lasts only until the next window one
    averaged = [average_checkpoints(last_checkpoints(tmp_path / run / "checkpoints", 3)) for run in ("straight", "killed")]
    assert averaged[0]["averaged_steps"] == averaged[1]["averaged_steps"] == [22, 26, 30]
    for name, tensor in averaged[0]["model"].items():
        assert torch.equal(tensor, averaged[1]["model"][name]), name  # resuming is exact on the CPU


def test_a_non_finite_gradient_norm_stops_the_run_naming_the_step(prepared, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", lambda gradients: torch.tensor(float("nan")))
    with pytest.raises(TrainingDiverged, match=r"gradient norm became nan at step 1 \(preset tiny\)"):
        train(job(prepared, tmp_path / "run"))
    assert not list_checkpoints(tmp_path / "run" / "checkpoints", safety=True)  # nothing written


def test_real_tokens_per_step_are_counted_and_reported(prepared, tmp_path):
    summary = train(job(prepared, tmp_path / "run", train={"tokens_per_step": 900, "device_tokens": 300}))
    assert summary["padded_src_tokens_per_step"] <= 900 * 1.5 and summary["padded_tgt_tokens_per_step"] > 0
    for side in ("src", "tgt"):
        real = summary[f"real_{side}_tokens_per_step"]
        assert 0.6 * 900 < real <= summary[f"padded_{side}_tokens_per_step"]
    assert summary["real_tgt_tokens_per_step"] * summary["step"] == summary["target_tokens"]


def _train_command(prepared, run_dir, preset, section, *extra):
    return [sys.executable, "-m", "aiayn.train", *train_settings(Path(run_dir).parent, preset, section), "--seed", "1",
            "--train-data", str(prepared / "bin" / "train"), "--spm-model", str(prepared / "bpe" / "spm.model"),
            "--no-tracking", "--device", "cpu", "--threads", "1", "--run-dir", str(run_dir), *extra]


def _run(command, timeout=300):
    """The command's CompletedProcess; one still running after ``timeout`` seconds fails the test with
    every Python process's stacks (faulthandler, on SIGABRT to its process group: torchrun and workers)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGABRT)
        time.sleep(5)
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stdout, stderr = child.communicate()
        pytest.fail(f"still running after {timeout} s: {command[:4]}...; stacks and output:\n{stderr[-8000:]}")
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)


def test_a_time_budget_ends_the_run_normally_with_its_last_step_in_the_window(prepared, tmp_path):
    from aiayn.checkpoint import last_checkpoints

    preset = tiny_preset(steps=10_000, checkpoint_steps=3, keep_checkpoints=3, average_last=3, max_minutes=0.002)
    summary = train(job(prepared, tmp_path / "run", **{k: v for k, v in preset.items() if k != "name"}))
    assert summary["stopped_by"] == "max_minutes" and 0 < summary["step"] < 10_000
    assert summary["planned_steps"] == 10_000 and summary["wall_hours"] * 60 >= 0.002
    assert (tmp_path / "run" / "final.pt").exists()
    window = [path.name for path in last_checkpoints(tmp_path / "run" / "checkpoints", 3)]
    assert window[-1] == f"step_{summary['step']:08d}.pt"  # the last step is averaged, no safety file
    assert not list((tmp_path / "run" / "checkpoints").glob("safety_*"))
    again = train(job(prepared, tmp_path / "run", **{k: v for k, v in preset.items() if k != "name"}))
    assert (again["step"], again["stopped_by"]) == (summary["step"], "max_minutes")  # the budget is spent


def test_a_truncated_newest_checkpoint_is_skipped_and_the_run_resumes_from_the_one_before(prepared, tmp_path, capsys):
    from aiayn.train.trainer import Preempted

    train(job(prepared, tmp_path / "straight"))
    with pytest.raises(Preempted):
        train(job(prepared, tmp_path / "run", stop_after_steps=3))
    newest = tmp_path / "run" / "checkpoints" / "safety_00000003.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # killed while writing
    summary = train(job(prepared, tmp_path / "run"))
    assert summary["step"] == 6
    assert "skipping safety_00000003.pt" in capsys.readouterr().err
    straight, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "run")
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


def test_a_second_trainer_on_a_run_folder_in_use_refuses_naming_the_first(prepared, tmp_path):
    preset = tiny_preset(steps=100000, checkpoint_steps=100000)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(_train_command(prepared, tmp_path / "run", preset, TRAIN_SECTION), env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        second = _run(_train_command(prepared, tmp_path / "run", preset, TRAIN_SECTION))
        assert second.returncode == 2
        assert f"being trained by another process (pid {first.pid}" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 75


def test_a_run_resumed_after_a_kill_logs_each_step_once(prepared, tmp_path):
    from mlflow.tracking import MlflowClient

    from aiayn.train.trainer import Preempted

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with pytest.raises(Preempted):
        train(job(prepared, tmp_path / "run", track=True, tracking_uri=uri, stop_after_steps=5,
                  train={"log_every": 1}))
    # as if killed before the step-5 checkpoint was written: the rerun recomputes step 5 from step 4
    (tmp_path / "run" / "checkpoints" / "safety_00000005.pt").unlink()
    summary = train(job(prepared, tmp_path / "run", track=True, tracking_uri=uri, train={"log_every": 1}))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == [1, 2, 3, 4, 5, 6]
    history = MlflowClient(uri).get_metric_history(summary["mlflow_run_id"], "train_loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6]


def test_the_experiment_is_marked_as_training_and_runs_carry_datasets_and_git_source(prepared, tmp_path):
    from mlflow.tracking import MlflowClient

    from aiayn.tracking import EXPERIMENT_KIND

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    summary = train(job(prepared, tmp_path / "run", track=True, tracking_uri=uri))
    client = MlflowClient(uri)
    run = client.get_run(summary["mlflow_run_id"])
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == EXPERIMENT_KIND
    assert "Attention Is All You Need" in experiment.tags["mlflow.note.content"]
    inputs = {entry.dataset.name: entry for entry in run.inputs.dataset_inputs}
    assert inputs["train"].dataset.digest == summary["data_fingerprint"]
    assert str(prepared / "bin" / "train") in inputs["train"].dataset.source
    assert [tag.value for tag in inputs["dev"].tags if tag.key == "mlflow.data.context"] == ["validation"]
    assert run.data.tags["mlflow.source.git.commit"] == run.data.tags["git_commit"]
    assert run.data.tags["precision"] == summary["precision"] == "fp32"  # what train.precision became here


def test_auto_precision_is_bf16_on_cpus_with_bf16_instructions_and_fp32_elsewhere(monkeypatch):
    from aiayn.speed.precision import resolved_precision

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100's
    for capabilities, expected in (({"amx_bf16": True, "amx_tile": True, "avx512_bf16": True}, "bf16"),
                                   ({"avx512_bf16": True, "amx_bf16": False}, "bf16"),
                                   ({"avx512_bf16": False, "avx512_f": True, "amx_bf16": False}, "fp32"),
                                   ({"avx512_f": True, "avx2": True}, "fp32"), ({"architecture": "arm64"}, "fp32")):
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda capabilities=capabilities: capabilities)
        assert resolved_precision("auto", cpu) == expected, capabilities
        assert resolved_precision("auto", cuda) == "bf16"
        assert resolved_precision("fp32", cpu) == resolved_precision("fp32", cuda) == "fp32"  # given, it wins
        assert resolved_precision("bf16", cpu) == resolved_precision("bf16", cuda) == "bf16"
        assert resolved_precision("fp16", cpu) == resolved_precision("fp16", cuda) == "fp16"


def test_compiled_training_compiles_a_bounded_number_of_graphs_over_many_batch_shapes(prepared, tmp_path,
                                                                                        monkeypatch):
    import torch._dynamo
    import torch.fx.experimental._config
    from torch._dynamo.utils import counters

    import aiayn.train.hardware
    import aiayn.train.steps
    from aiayn.batching import padded_to_multiple

    monkeypatch.setattr(aiayn.train.hardware, "COMPILE_BACKEND", "aot_eager")  # traced as inductor would, nothing built
    monkeypatch.setattr(torch.fx.experimental._config, "use_duck_shape", True)  # restored after the test
    shapes = []

    def recorded(batch, multiple):
        padded = padded_to_multiple(batch, multiple)
        shapes.append((*padded.src.shape, padded.tgt_in.shape[1]))
        return padded

    monkeypatch.setattr(aiayn.train.steps, "padded_to_multiple", recorded)
    torch._dynamo.reset()
    counters.clear()
    summary = train(job(prepared, tmp_path / "run", steps=12, train={"compile": True, "dev_every": 0}))
    assert summary["step"] == 12 and math.isfinite(summary["dev_loss"])
    assert len(set(shapes)) >= 5 and all(size % 8 == 0 for shape in shapes for size in shape)
    # one graph of the encoder and decoder (the loss stays eager), and the empty one of the frame that calls it
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def test_training_on_the_cpu_uses_the_bf16_attention(prepared, tmp_path):
    from aiayn.speed.cpu_attention import BF16CPUAttention
    from aiayn.model import MultiHeadAttention
    from aiayn.train.trainer import Trainer

    model = Trainer(job(prepared, tmp_path / "run")).model
    assert not any(type(module) is MultiHeadAttention for module in model.modules())
    assert sum(isinstance(module, BF16CPUAttention) for module in model.modules()) == 3 * model.config.n_layers


def test_dev_pairs_longer_than_a_learned_table_are_left_out_of_the_dev_loss_and_counted(prepared, tmp_path, capsys):
    """Evaluation splits keep every pair; one longer than a learned positional table used to end the run at its
    first dev evaluation. Now it is left out of the dev loss, warned about once and counted in final.json."""
    import dataclasses

    from aiayn.binarize import binarize_split, load_split

    train_split = load_split(prepared / "bin" / "train")
    table = int(max(train_split.src_lengths.max(), train_split.tgt_lengths.max())) + 1  # every training pair fits
    src = (prepared / "data" / "dev.en").read_text(encoding="utf-8").splitlines()
    tgt = (prepared / "data" / "dev.de").read_text(encoding="utf-8").splitlines()
    src[4], tgt[9] = " ".join(src[:12]), " ".join(tgt[:12])  # two pairs made longer than any training pair
    (tmp_path / "dev.en").write_text("\n".join(src) + "\n", encoding="utf-8")
    (tmp_path / "dev.de").write_text("\n".join(tgt) + "\n", encoding="utf-8")
    binarize_split("dev", tmp_path / "dev.en", tmp_path / "dev.de", prepared / "bpe" / "spm.model", tmp_path / "dev",
                   workers=1)
    dev = load_split(tmp_path / "dev")
    assert max(dev.src_lengths[4], dev.tgt_lengths[9]) + 1 > table
    learned = job(prepared, tmp_path / "run", positional="learned", max_positions=table)
    summary = train(dataclasses.replace(learned, dev_data=tmp_path / "dev"))
    assert summary["dev_pairs_skipped"] == 2 and math.isfinite(summary["dev_loss"])
    assert [entry["step"] for entry in summary["dev_history"]] == [3, 6]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "2 of the 60 dev pairs" in warnings[0] and "lines 5, 10 of" in warnings[0]
