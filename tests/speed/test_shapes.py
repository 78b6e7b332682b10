"""Bounded step shapes (aiayn.speed.shapes): bucketed lengths, the shapes an epoch brings, the padding they
add, the tensors grown to them, and the trainer's log of first-seen shapes."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from aiayn.batching import Batch, padded_to_shape
from aiayn.config import section_defaults
from aiayn.loss import teacher_forced_loss
from aiayn.model import ModelConfig, Transformer
from aiayn.speed.shapes import ShapeLog, bucketed, bucketed_lengths
from aiayn.train.steps import Progress, StepSource, TrainSettings

PAPER_PRESET = {"steps": 100000, "warmup_steps": 4000, "lr_scale": 1.0, "label_smoothing": 0.1, "keep_checkpoints": 5,
                "average_last": 5, "checkpoint_steps": 1389, "checkpoint_minutes": None, "gpus": 8}


def wmt_like_lengths(pairs: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """BPE lengths shaped like WMT'14 EN-DE's training pairs: log-normal sources (median 24), targets within
    about 20% of them, cut to binarize's 250 tokens."""
    rng = np.random.default_rng(seed)
    src = np.clip(np.round(24 * np.exp(0.6 * rng.standard_normal(pairs))), 1, 250).astype(np.int64)
    tgt = np.clip(np.round(src * np.exp(0.2 * rng.standard_normal(pairs))), 1, 250).astype(np.int64)
    return src, tgt


def settings(buckets: bool, device=None, **train) -> TrainSettings:
    section = {**section_defaults("train"), "tokens_per_step": 25000, "device_tokens": 12500,
               "shape_buckets": buckets, **train}
    return TrainSettings.from_config(PAPER_PRESET, section, seed=1, device=device)


def epoch_shapes(src, tgt, buckets: bool, epoch: int = 0):
    """Every micro-batch shape of one epoch as the trainer draws it, and the epoch's real and padded tokens."""
    source = StepSource(SimpleNamespace(src_lengths=src, tgt_lengths=tgt), settings(buckets))
    progress = Progress(epoch=epoch)
    shapes, real, padded = set(), 0, 0
    while progress.epoch == epoch and progress.cursor < len(source.steps_of(epoch)):
        _, shape = source.next(progress)
        shapes.update(shape.shapes)
        real += shape.real_src + shape.real_tgt
        padded += shape.padded_src + shape.padded_tgt
    return shapes, real, padded


def test_bucketed_sizes_are_at_most_an_eighth_longer_and_exact_up_to_16():
    sizes = np.arange(1, 2000)
    rounded = bucketed(sizes)
    assert (rounded[:16] == sizes[:16]).all()
    assert (rounded >= sizes).all() and (rounded <= sizes * 9 / 8).all()
    assert (rounded / sizes).mean() < 1 + 1 / 16
    assert (bucketed(rounded) == rounded).all()  # a bucket is its own bucket
    assert len(np.unique(bucketed(np.arange(1, 252)))) <= 48  # binarize's longest pair, 250 tokens + eos
    assert (bucketed_lengths(np.array([0, 15, 16, 17, 30])) == [0, 15, 17, 17, 31]).all()


def test_an_epoch_of_wmt_like_lengths_has_a_bounded_set_of_micro_batch_shapes():
    """The paper's batch (25000 tokens a side, 8 micro-batches a step) over 300,000 WMT-like pairs: about one
    shape a micro-batch without buckets (2035), no more than the bucket pairs present with them (535 of 668),
    for little more padding."""
    src, tgt = wmt_like_lengths(300_000)
    plain, plain_real, plain_padded = epoch_shapes(src, tgt, buckets=False)
    shapes, real, padded = epoch_shapes(src, tgt, buckets=True)
    pairs = len(set(zip(bucketed_lengths(src).tolist(), bucketed_lengths(tgt).tolist())))
    assert len(shapes) <= min(pairs, 600) and len(shapes) < len(plain) / 3, (len(shapes), pairs, len(plain))
    assert real == plain_real  # every sentence once a epoch either way
    assert padded / real <= plain_padded / plain_real + 0.04  # at most 4 points more padding
    # the sort and the cut follow from the lengths alone, so every epoch brings the same shapes: the bound
    # holds over a whole run
    assert epoch_shapes(src, tgt, buckets=True, epoch=3)[0] == shapes


def test_shape_buckets_are_on_for_cuda_and_off_on_the_cpu_unless_set():
    assert settings("auto", torch.device("cuda")).shape_buckets
    assert not settings("auto", torch.device("cpu")).shape_buckets and not settings("auto").shape_buckets
    assert settings(True, torch.device("cpu")).shape_buckets and not settings(False, torch.device("cuda")).shape_buckets
    assert settings(True).batch_rule()["shape_buckets"] is True  # a resumed run must draw the same batches


def test_a_batch_grown_to_its_bucketed_shape_has_the_same_loss_and_gradients():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, n_layers=1, d_model=16, d_ff=32, n_heads=2, dropout=0.0))
    src = torch.tensor([[5, 6, 7, 3], [8, 9, 3, 0], [4, 3, 0, 0]])
    tgt = torch.tensor([[2, 11, 12, 13], [2, 14, 15, 0], [2, 16, 0, 0]])
    out = torch.tensor([[11, 12, 13, 3], [14, 15, 3, 0], [16, 3, 0, 0]])
    batch = Batch(src, tgt, out, int((src != 0).sum()), int((out != 0).sum()))
    grown = padded_to_shape(batch, 5, 6, 7)
    assert grown.src.shape == (5, 6) and grown.tgt_in.shape == grown.tgt_out.shape == (5, 7)
    assert (grown.src[3:, 0] == 3).all() and (grown.src[3:, 1:] == 0).all() and (grown.tgt_out[3:] == 0).all()
    results = []
    for each in (batch, grown):
        model.zero_grad()
        loss, nll = teacher_forced_loss(model, each.src, each.tgt_in, each.tgt_out, 0.1, tgt_real=each.tgt_real)
        loss.backward()
        results.append((loss.item(), nll.item(), [p.grad.clone() for p in model.parameters()]))
    (loss, nll, grads), (grown_loss, grown_nll, grown_grads) = results
    assert grown_loss == pytest.approx(loss, rel=1e-5) and grown_nll == pytest.approx(nll, rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, grown_grads))
    assert padded_to_shape(batch, 3, 4, 4) is batch  # its own shape: nothing to grow


def test_the_shape_log_counts_new_shapes_and_the_seconds_of_the_steps_that_met_them():
    log, progress = ShapeLog(), Progress()
    assert log.step(((8, 16, 17),), progress, 0.5)
    assert not log.step(((8, 16, 17),), progress, 0.1)
    assert log.step(((8, 16, 17), (4, 32, 32)), progress, 0.4)
    assert progress.shape_costs() == {"distinct_shapes": 2, "new_shape_steps": 2, "new_shape_seconds": 0.9}


def test_attention_kernels_and_the_loss_chunk_are_the_cpus_own_there(monkeypatch):
    import contextlib

    from aiayn.train.hardware import loss_chunk_tokens
    from aiayn.speed.precision import ATTENTION_KERNELS, attention_kernels

    assert isinstance(attention_kernels("flash", "cpu"), contextlib.nullcontext)
    assert isinstance(attention_kernels("auto", "cuda"), contextlib.nullcontext)
    assert torch.nn.attention.SDPBackend.CUDNN_ATTENTION not in ATTENTION_KERNELS["flash"]
    assert loss_chunk_tokens(torch.device("cpu"), 37000, 25000) is None
    # on a GPU: one chunk for the micro-batch where an eighth of free memory holds it, fewer tokens where not
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 2**30, 141 * 2**30))
    assert loss_chunk_tokens(torch.device("cuda"), 37000, 25000) == 25000
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30, 141 * 2**30))
    assert loss_chunk_tokens(torch.device("cuda"), 37000, 25000) == 2**30 // 8 // (8 * 37000)


def test_the_settings_read_the_keys_the_config_reader_filled():
    section = section_defaults("train")  # what the reader fills a config's train section with
    assert (section["shape_buckets"], section["attention"]) == ("auto", "auto")
    on_cpu = TrainSettings.from_config(PAPER_PRESET, section, seed=1, device=torch.device("cpu"))
    assert not on_cpu.shape_buckets and on_cpu.attention == "auto"  # auto: exact lengths on the CPU
    assert replace(on_cpu, shape_buckets=True).batch_rule() != on_cpu.batch_rule()
    assert math.isfinite(on_cpu.lr_scale)

