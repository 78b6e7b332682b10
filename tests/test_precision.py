"""Precision by device: ``auto`` by a GPU's compute capability, peaks per precision, and fp16 training with
loss scaling (aiayn.train.precision), run on the CPU under fp16 autocast."""

from __future__ import annotations

import copy
import math

import pytest
from conftest import tiny_preset
import torch

from aiayn.binarize import load_split
from aiayn.config import section_defaults
from aiayn.train.hardware import peak_flops
from aiayn.speed.precision import autocast_context, inference_precision, resolved_precision
from aiayn.train.trainer import Trainer, TrainingDiverged, TrainJob, train

TRAIN_SECTION = {**section_defaults("train"), "tokens_per_step": 600, "device_tokens": 300, "log_every": 2,
                 "dev_every": 0, "precision": "fp16", "device": "cpu"}
CUDA = torch.device("cuda", 0)


def job(prepared, run_dir, stop_after_steps=None, track=False, tracking_uri=None, train=None, **preset) -> TrainJob:
    section = {**TRAIN_SECTION, **(train or {})}
    return TrainJob(tiny_preset(**preset), section, 1, prepared / "bin" / "train", prepared / "bin" / "dev",
                    prepared / "bpe" / "spm.model", run_dir, "tests", tracking_uri, track, "cpu", stop_after_steps,
                    False)


def overflow_at(monkeypatch, steps):
    """Make one gradient element infinite after the backward passes of ``steps`` (global step numbers), in
    every Trainer: an fp16 overflow, wherever it came from."""
    original = Trainer.forward_backward

    def forward_backward(self, step, micro, shape):
        sums = original(self, step, micro, shape)
        if step in steps:
            next(self.model.parameters()).grad.view(-1)[0] = math.inf
        return sums

    monkeypatch.setattr(Trainer, "forward_backward", forward_backward)


def fake_gpu(monkeypatch, capability, name="NVIDIA test GPU"):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.delenv("AIAYN_PEAK_FLOPS", raising=False)


# --- which precision, and its peak ------------------------------------------------------------

@pytest.mark.parametrize("capability, expected", [((6, 1), "fp32"), ((6, 0), "fp32"), ((7, 0), "fp16"),
                                                  ((7, 5), "fp16"), ((8, 0), "bf16"), ((8, 9), "bf16"),
                                                  ((9, 0), "bf16")])
def test_auto_precision_on_a_gpu_follows_its_compute_capability(monkeypatch, capability, expected):
    fake_gpu(monkeypatch, capability)
    assert resolved_precision("auto", CUDA) == expected
    assert inference_precision(CUDA) == expected  # decoding follows the same rule
    assert resolved_precision("fp32", CUDA) == "fp32" and resolved_precision("fp16", CUDA) == "fp16"  # given, it wins


def test_decoding_on_the_cpu_stays_fp32_whatever_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_bf16": True, "avx512_bf16": True})
    assert resolved_precision("auto", torch.device("cpu")) == "bf16"  # training's rule on the CPU, unchanged
    assert inference_precision(torch.device("cpu")) == "fp32"


@pytest.mark.parametrize("name, precision, peak", [
    ("Tesla V100-SXM2-16GB", "fp16", 125e12), ("Tesla V100-SXM2-16GB", "bf16", None),
    ("Tesla V100-PCIE-32GB", "fp16", 112e12), ("Tesla V100S-PCIE-32GB", "fp16", 130e12),
    ("Tesla T4", "fp16", 65e12), ("Tesla T4", "bf16", None), ("Tesla P100-PCIE-16GB", "bf16", None),
    ("Tesla P100-PCIE-16GB", "fp16", 18.7e12), ("Tesla P100-PCIE-16GB", "fp32", 9.3e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12), ("NVIDIA A100 80GB PCIe", "fp16", 312e12),
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12), ("NVIDIA H100 PCIe", "bf16", 756e12), ("NVIDIA H200", "fp16", 989e12),
    ("NVIDIA L4", "bf16", 121e12), ("NVIDIA L40S", "bf16", 362e12), ("NVIDIA A10G", "bf16", 70e12),
    ("NVIDIA A10", "bf16", 125e12), ("NVIDIA RTX A1000", "bf16", None), ("NVIDIA GeForce RTX 4090", "bf16", None),
])
def test_the_peak_is_the_chips_dense_peak_for_the_precision_used_and_none_where_it_has_none(monkeypatch, name,
                                                                                             precision, peak):
    fake_gpu(monkeypatch, (8, 0), name)
    assert peak_flops(CUDA, precision) == peak


def test_the_peak_on_a_cpu_is_unknown_unless_given(monkeypatch):
    monkeypatch.delenv("AIAYN_PEAK_FLOPS", raising=False)
    assert peak_flops(torch.device("cpu"), "fp32") is None
    monkeypatch.setenv("AIAYN_PEAK_FLOPS", "1e12")
    assert peak_flops(torch.device("cpu"), "bf16") == 1e12


def test_autocast_context_multiplies_in_fp16_where_asked_and_leaves_fp32_alone():
    a = torch.randn(4, 4)
    for precision, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)):
        with autocast_context(torch.device("cpu"), precision):
            assert (a @ a).dtype == dtype, precision


# --- fp16 training with loss scaling ----------------------------------------------------------

def test_an_fp16_run_learns_as_the_fp32_run_does(prepared, tmp_path):
    """Over the same steps, fp16 with loss scaling gives the dev losses fp32 gives, to a small fraction of
    what the run learned (another seed moves them more), and skips no step."""
    dev = {"dev_every": 5}
    fp32 = train(job(prepared, tmp_path / "fp32", steps=10, checkpoint_steps=10, train={**dev, "precision": "fp32"}))
    fp16 = train(job(prepared, tmp_path / "fp16", steps=10, checkpoint_steps=10, train=dev))
    assert (fp16["precision"], fp16["loss_scale"], fp16["skipped_steps"]) == ("fp16", 65536.0, 0)
    assert (fp32["precision"], fp32["loss_scale"], fp32["skipped_steps"]) == ("fp32", None, 0)
    uniform = math.log(load_split(prepared / "bin" / "train").meta["vocab_size"])  # the untrained model's loss
    losses = [(a["dev_loss"], b["dev_loss"]) for a, b in zip(fp32["dev_history"], fp16["dev_history"])]
    assert len(losses) == 2
    for loss32, loss16 in losses:
        assert loss32 < uniform - 0.5  # it learned
        assert loss16 == pytest.approx(loss32, abs=0.02)


def test_an_overflow_skips_the_step_halves_the_scale_and_leaves_weights_and_adam_untouched(prepared, tmp_path,
                                                                                           monkeypatch):
    overflow_at(monkeypatch, {3})
    trainer = Trainer(job(prepared, tmp_path / "run"))
    seen = {}
    optimizer_step = trainer.optimizer_step

    def spied(step, grad_norm):
        state = lambda: copy.deepcopy((trainer.model.state_dict(), trainer.optimizer.state_dict()["state"],
                                       trainer.scaling.record()))
        seen[step] = {"before": state(), "grad_norm": grad_norm}
        lr = optimizer_step(step, grad_norm)
        seen[step]["after"] = state()
        return lr

    trainer.optimizer_step = spied
    summary = trainer.run()
    assert math.isinf(seen[3]["grad_norm"]) and all(math.isfinite(seen[s]["grad_norm"]) for s in (1, 2, 4, 5, 6))
    (weights, adam, scaling), (weights_after, adam_after, scaling_after) = seen[3]["before"], seen[3]["after"]
    for name in weights:
        assert torch.equal(weights[name], weights_after[name]), name
    for index in adam:
        for key in adam[index]:
            assert torch.equal(adam[index][key], adam_after[index][key]), (index, key)  # moments and step count
    assert scaling == {"loss_scale": 65536.0, "skipped_steps": 0}
    assert scaling_after == {"loss_scale": 32768.0, "skipped_steps": 1}
    weights_4, _, _ = seen[4]["after"]
    assert any(not torch.equal(weights[name], weights_4[name]) for name in weights)  # the next step updates
    assert (summary["step"], summary["loss_scale"], summary["skipped_steps"]) == (6, 32768.0, 1)


def test_gradients_that_overflow_below_the_least_scale_end_the_run_as_diverged(prepared, tmp_path, monkeypatch):
    import aiayn.train.precision as precision

    monkeypatch.setattr(precision, "MIN_LOSS_SCALE", 2.0 ** 15)  # two halvings from 2**16 reach below it
    overflow_at(monkeypatch, {1, 2, 3, 4, 5, 6})
    with pytest.raises(TrainingDiverged, match=r"gradient norm became inf at step 3 .* trains in fp16.*loss scale "
                                               r"now 16384"):
        train(job(prepared, tmp_path / "run"))


def test_a_resumed_fp16_run_goes_on_with_the_saved_scale_and_ends_as_an_uninterrupted_one(prepared, tmp_path,
                                                                                         monkeypatch):
    from aiayn.checkpoint import load_checkpoint
    from aiayn.train.trainer import Preempted

    overflow_at(monkeypatch, {2})  # the scale is 32768 from step 2 on: a fresh scaler's would differ
    straight = train(job(prepared, tmp_path / "straight"))
    with pytest.raises(Preempted):
        train(job(prepared, tmp_path / "resumed", stop_after_steps=3))
    saved = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "safety_00000003.pt")
    assert saved["loss_scaling"]["scaler"]["scale"] == 32768.0 and saved["loss_scaling"]["skipped_steps"] == 1
    resumed = train(job(prepared, tmp_path / "resumed"))
    assert (resumed["loss_scale"], resumed["skipped_steps"]) == (straight["loss_scale"], straight["skipped_steps"]) \
        == (32768.0, 1)
    weights = [torch.load(tmp_path / run / "final.pt", weights_only=True)["model"] for run in ("straight", "resumed")]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name  # bitwise on the CPU


def test_the_loss_scale_and_skipped_steps_go_to_mlflow(prepared, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    overflow_at(monkeypatch, {1})
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    summary = train(job(prepared, tmp_path / "run", track=True, tracking_uri=uri, steps=4))
    client = MlflowClient(uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.tags["precision"] == "fp16"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss_scale")] == [
        (2, 32768.0), (4, 32768.0)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "skipped_steps")] == [1, 1]
