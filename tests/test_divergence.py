"""A diverged run (aiayn.train.divergence): the rules, one deterministic retry from the last checkpoint,
then a stop with exit 2 and its reason, the checkpoints kept."""

from __future__ import annotations

import json
import math

from conftest import tiny_preset, train_settings
import pytest
import torch

from aiayn.checkpoint import list_checkpoints, load_checkpoint
from aiayn.config import section_defaults
from aiayn.train.divergence import DivergenceGuard
from aiayn.train.trainer import Trainer, TrainJob, train

TRAIN_SECTION = {**section_defaults("train"), "tokens_per_step": 600, "device_tokens": 300, "log_every": 2,
                 "dev_every": 0, "precision": "fp32", "device": "cpu", "dev_bleu_sentences": 0}
PRESET = {"steps": 8, "checkpoint_steps": 2, "keep_checkpoints": 4}


def job(prepared, run_dir, **train) -> TrainJob:
    return TrainJob(tiny_preset(**PRESET), {**TRAIN_SECTION, **train}, 1, prepared / "bin" / "train",
                    prepared / "bin" / "dev", prepared / "bpe" / "spm.model", run_dir, "tests", None, False, "cpu",
                    None, False)


def fault_at(monkeypatch, step, times, kind="nan"):
    """Make the training loss of step ``step`` NaN (or 100 times larger: a spike) the first ``times`` times that
    step is taken, in every Trainer."""
    original, left = Trainer.forward_backward, {"times": times}

    def forward_backward(self, at, micro, shape):
        sums = original(self, at, micro, shape)
        if at == step and left["times"]:
            left["times"] -= 1
            sums = sums * 100 if kind == "spike" else torch.full_like(sums, math.nan)
        return sums

    monkeypatch.setattr(Trainer, "forward_backward", forward_backward)


def test_a_spike_is_a_loss_far_above_the_recent_mean_and_std_and_half_again_above_the_mean():
    guard = DivergenceGuard(window=4, sigmas=3)
    for step, loss in enumerate((2.0, 2.1, 1.9, 2.0), 1):
        assert guard.fired(step, loss, 1.0, skipped=False) is None
    assert guard.fired(5, 2.2, 1.0, skipped=False) is None  # within mean + 3 std
    what, rule = guard.fired(6, 5.0, 1.0, skipped=False)
    assert what == "the training loss spiked to 5" and rule.startswith("spike (above mean + 3 std")
    steady = DivergenceGuard(window=4, sigmas=3)
    for step in range(1, 5):
        steady.fired(step, 2.0, 1.0, skipped=False)
    assert steady.fired(5, 2.5, 1.0, skipped=False) is None  # far above a std of 0, not 1.5 x the mean
    assert steady.fired(6, math.nan, 1.0, skipped=False)[1].startswith("non-finite")
    assert steady.fired(7, 2.0, math.inf, skipped=True) is None  # an fp16 overflow that loss scaling skips


def test_no_spike_rule_before_its_window_is_full_or_with_a_window_of_zero():
    for guard in (DivergenceGuard(window=4, sigmas=3), DivergenceGuard(window=0, sigmas=3)):
        for step, loss in enumerate((2.0, 2.0, 2.0), 1):
            guard.fired(step, loss, 1.0, skipped=False)
        assert guard.fired(4, 50.0, 1.0, skipped=False) is None


@pytest.mark.parametrize("kind, train", [("nan", {}), ("spike", {"spike_window": 3, "spike_sigmas": 3})])
def test_a_one_off_fault_is_rolled_back_and_the_run_ends_as_an_uninterrupted_one(prepared, tmp_path, monkeypatch,
                                                                                  capsys, kind, train):
    straight = train_and_weights(prepared, tmp_path / "straight", train)
    fault_at(monkeypatch, 5, times=1, kind=kind)
    faulty = train_and_weights(prepared, tmp_path / "faulty", train)
    assert "going back to step_00000004.pt (step 4) to take the steps again once" in capsys.readouterr().err
    for name, tensor in straight.items():
        assert torch.equal(tensor, faulty[name]), name  # the retry takes the same steps
    summaries = [json.loads((tmp_path / run / "final.json").read_text()) for run in ("straight", "faulty")]
    assert summaries[0]["step"] == summaries[1]["step"] == 8
    assert summaries[0]["target_tokens"] == summaries[1]["target_tokens"]


def train_and_weights(prepared, run_dir, train_settings) -> dict:
    train(job(prepared, run_dir, **train_settings))
    return torch.load(run_dir / "final.pt", weights_only=True)["model"]


def test_a_non_finite_loss_that_comes_back_stops_with_its_reason_and_exit_2_and_keeps_the_checkpoints(
        prepared, tmp_path, monkeypatch, capsys):
    from aiayn.train.launch import main

    fault_at(monkeypatch, 5, times=2)
    run_dir = tmp_path / "run"
    status = main([*train_settings(tmp_path, tiny_preset(**PRESET), TRAIN_SECTION), "--seed", "1",
                   "--train-data", str(prepared / "bin" / "train"), "--dev-data", str(prepared / "bin" / "dev"),
                   "--spm-model", str(prepared / "bpe" / "spm.model"), "--no-tracking", "--device", "cpu",
                   "--threads", "1", "--run-dir", str(run_dir)])
    assert status == 2
    message = capsys.readouterr().err
    assert "going back to step_00000004.pt" in message
    paragraph = message[message.index("error: "):]
    for part in ("the training loss became nan at step 5 (preset tiny)", "the last good checkpoint is kept in",
                 "took the steps again", "The rule that fired: non-finite", "learning rate 0.0", "lr_scale = 1",
                 "warmup_steps = 4", "train.precision = fp32"):
        assert part in paragraph, part
    assert "Traceback" not in message
    checkpoints = list_checkpoints(run_dir / "checkpoints", safety=True)
    assert [step for step, _ in checkpoints] == [2, 4]
    for _, path in checkpoints:
        assert all(torch.isfinite(value).all() for value in load_checkpoint(path)["model"].values())
    assert not (run_dir / "final.json").exists()


def test_a_fault_before_the_first_checkpoint_stops_at_once_saying_there_is_none(prepared, tmp_path, monkeypatch):
    from aiayn.train.divergence import TrainingDiverged

    fault_at(monkeypatch, 1, times=1)
    with pytest.raises(TrainingDiverged, match=r"became nan at step 1 \(preset tiny\); no checkpoint was written "
                                               r"before it, so there is none to go back to"):
        train(job(prepared, tmp_path / "run"))


def test_a_learning_rate_100_times_too_high_is_stopped_with_the_settings_at_fault(prepared, tmp_path):
    from aiayn.train.divergence import TrainingDiverged

    with pytest.raises(TrainingDiverged, match=r"at step \d+ \(preset tiny\).* lr_scale = 100 \(lower it\)"):
        train(TrainJob(tiny_preset(**PRESET, lr_scale=100.0), {**TRAIN_SECTION, "spike_window": 2}, 1,
                       prepared / "bin" / "train", prepared / "bin" / "dev", prepared / "bpe" / "spm.model",
                       tmp_path / "run", "tests", None, False, "cpu", None, False))
