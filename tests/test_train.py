"""Training: the paper's schedule and loss, exact resume, DDP equivalence, MLflow tracking."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import tiny_preset
import torch

from aiayn.checkpoint import list_checkpoints, load_checkpoint
from aiayn.train import TrainingDiverged, TrainJob, accumulation_steps, label_smoothed_loss, learning_rate, train

TRAIN_SECTION = {"tokens_per_step": 600, "device_tokens": 600, "adam_betas": [0.9, 0.98], "adam_eps": 1e-9,
                 "log_every": 2, "dev_every": 3, "compile": False, "precision": "fp32", "threads": 0}


def job(prepared, run_dir, track=False, tracking_uri=None, **overrides) -> TrainJob:
    section = {**TRAIN_SECTION, **overrides.pop("train", {})}
    stop = overrides.pop("stop_after_steps", None)
    return TrainJob(tiny_preset(**overrides), section, 1, prepared / "bin" / "train", prepared / "bin" / "dev",
                    prepared / "bpe" / "spm.model", run_dir, "tests", tracking_uri, track, "cpu", stop, False)


def final_weights(run_dir):
    return torch.load(run_dir / "final.pt", map_location="cpu", weights_only=True)["model"]


def test_learning_rate_follows_the_paper_at_steps_1_4000_and_100000():
    assert learning_rate(1, 512, 4000) == pytest.approx(512 ** -0.5 * 4000 ** -1.5)
    assert learning_rate(4000, 512, 4000) == pytest.approx(6.99e-4, rel=1e-3)   # PAPER.md: peak 6.99e-4 (base)
    assert learning_rate(4000, 1024, 4000) == pytest.approx(4.94e-4, rel=1e-3)  # and 4.94e-4 (big)
    assert learning_rate(100000, 512, 4000) == pytest.approx(512 ** -0.5 * 100000 ** -0.5)
    assert learning_rate(3999, 512, 4000) < learning_rate(4000, 512, 4000) > learning_rate(4001, 512, 4000)


def test_label_smoothed_loss_matches_a_hand_computed_case():
    logits = torch.tensor([[[2.0, 0.0, 1.0, -1.0], [0.5, 0.5, 0.5, 0.5]]])
    target = torch.tensor([[2, 0]])  # the second position is padding (id 0): it must not count
    log_probs = [2.0 - math.log(math.exp(2) + 1 + math.exp(1) + math.exp(-1)) + d for d in (0, -2, -1, -3)]
    nll = -log_probs[2]
    smooth = -sum(log_probs) / 4
    loss, nll_sum = label_smoothed_loss(logits, target, epsilon=0.1, pad_id=0)
    assert nll_sum.item() == pytest.approx(nll, rel=1e-6)
    assert loss.item() == pytest.approx(0.9 * nll + 0.1 * smooth, rel=1e-6)
    plain, _ = label_smoothed_loss(logits, target, epsilon=0.0, pad_id=0)
    assert plain.item() == pytest.approx(nll, rel=1e-6)
    reference = torch.nn.functional.cross_entropy(logits[0, :1], target[0, :1], label_smoothing=0.1)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)


def test_accumulation_keeps_the_effective_batch_on_any_number_of_devices():
    assert accumulation_steps(25000, 3125, 1) == 8
    assert accumulation_steps(25000, 3125, 8) == 1
    assert accumulation_steps(25000, 12500, 2) == 1
    assert accumulation_steps(25000, 4000, 2) == 4


def test_stop_and_resume_ends_with_the_same_parameters_as_an_uninterrupted_run(prepared, tmp_path):
    train(job(prepared, tmp_path / "straight"))
    from aiayn.train import Preempted

    with pytest.raises(Preempted):
        train(job(prepared, tmp_path / "resumed", stop_after_steps=3))
    assert [step for step, _ in list_checkpoints(tmp_path / "resumed" / "checkpoints")] == [2, 3]
    summary = train(job(prepared, tmp_path / "resumed"))
    assert summary["step"] == 6
    straight, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name  # bitwise on the CPU


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
                   "padding_efficiency", "train_flops", "dev_loss", "dev_ppl"):
        assert metric in run.data.metrics, metric
    assert (run.info.run_name, tags["attempt"]) == ("tiny-seed1-a1", "1")
    rerun = train(job(prepared, tmp_path / "rerun", track=True, tracking_uri=uri, steps=2))
    assert MlflowClient(uri).get_run(rerun["mlflow_run_id"]).info.run_name == "tiny-seed1-a2"
    history = MlflowClient(uri).get_metric_history(run.info.run_id, "train_loss")
    assert [m.step for m in history] == [2, 4, 6]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert any("dev_ppl" in json.loads(line) for line in lines)


def test_two_gloo_processes_make_the_same_update_as_one_accumulating_two(prepared, tmp_path):
    preset = tiny_preset(steps=2, checkpoint_steps=None, keep_checkpoints=1, average_last=1)
    one = {**TRAIN_SECTION, "tokens_per_step": 1200, "device_tokens": 600}  # 1 process x 2 micro-batches
    common = ["--preset-json", json.dumps(preset), "--seed", "1", "--train-data", str(prepared / "bin" / "train"),
              "--spm-model", str(prepared / "bpe" / "spm.model"), "--no-tracking", "--device", "cpu", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = subprocess.run([sys.executable, "-m", "aiayn.train", *common, "--train-json", json.dumps(one),
                             "--run-dir", str(tmp_path / "one")], capture_output=True, text=True, env=env)
    assert single.returncode == 0, single.stderr
    double = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "-m", "aiayn.train", *common, "--train-json", json.dumps(one),
                             "--run-dir", str(tmp_path / "two")], capture_output=True, text=True, env=env, timeout=300)
    assert double.returncode == 0, double.stderr
    assert json.loads((tmp_path / "two" / "final.json").read_text())["world_size"] == 2
    a, b = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_label_smoothed_loss_gradient_equals_autograd_through_the_formula():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=generator, dtype=torch.float64)
    target = torch.randint(1, 11, (2, 5), generator=generator)
    target[1, 3:] = 0  # padding gets no gradient

    def reference(values):
        log_probs = values.reshape(-1, 11).log_softmax(dim=-1)
        keep = (target.reshape(-1) != 0).double()
        nll = -log_probs.gather(1, target.reshape(-1, 1)).squeeze(1)
        return (((0.9 * nll - 0.1 * log_probs.mean(dim=-1)) * keep).sum(), (nll * keep).sum())

    for weights in ((1.0, 0.0), (0.7, 0.3)):  # the loss alone, and the loss and the NLL together
        ours = logits.clone().requires_grad_()
        theirs = logits.clone().requires_grad_()
        loss, nll = label_smoothed_loss(ours, target, epsilon=0.1)
        (weights[0] * loss + weights[1] * nll).backward()
        expected_loss, expected_nll = reference(theirs)
        (weights[0] * expected_loss + weights[1] * expected_nll).backward()
        torch.testing.assert_close(loss, expected_loss)
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=1e-12)
        assert torch.all(ours.grad[1, 3:] == 0)
