"""A run's steps: its settings, where it is, which micro-batches make each step, and what it measures.

The batches of every step follow from (seed, epoch, cursor) alone (``aiayn.batching.step_batches``), and
each micro-batch's dropout from (seed, step, index), so a resumed run and N processes take the same steps
as one uninterrupted process. The dev evaluation and the logged means of a window of steps are here too.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

from aiayn.batching import (Batch, StepShape, collate, length_batches, padded_to_multiple, padded_to_shape, split_step,
                            step_batches)
from aiayn.config import preset_default
from aiayn.errors import UserError
from aiayn.loss import teacher_forced_loss
from aiayn.memory import resolve_device_tokens
from aiayn.model import ModelConfig, Transformer
from aiayn.speed.shapes import bucketed_lengths
from aiayn.train.rendezvous import devices
from aiayn.train.hardware import COMPILE_MULTIPLE
from aiayn.speed.precision import autocast_context


@dataclass(frozen=True)
class TrainSettings:
    """A resolved preset plus the shared `train` section (see config/README.md)."""

    steps: int
    warmup_steps: int
    lr_scale: float
    label_smoothing: float
    tokens_per_step: int
    device_tokens: int  # a number: train.device_tokens as set, or what auto gave (aiayn.memory)
    adam_betas: tuple[float, float]
    adam_eps: float
    keep_checkpoints: int
    average_last: int
    checkpoint_steps: int
    budget_intervals: int
    checkpoint_minutes: float | None
    max_minutes: float | None
    layout: int
    log_every: int
    dev_every: int
    compile: bool
    precision: str
    seed: int
    shape_buckets: bool  # steps cut on bucketed lengths (aiayn.speed.shapes): train.shape_buckets here
    attention: str
    schedule: str = "paper"      # or "budget": fitted to a time budget (aiayn.train.budget_schedule)
    budget_warmup_share: float = 0.1
    budget_floor: float = 0.0
    budget_decay: str = "linear"
    budget_decay_share: float = 0.2
    budget_warmup: str = "slope"
    budget_min_steps: int = 0
    budget_min_tokens: int = 1000

    @classmethod
    def from_config(cls, preset: dict, train: dict, seed: int, device: torch.device | None = None,
                    model: ModelConfig | None = None) -> "TrainSettings":
        """``device``: where the run trains, which ``auto`` settings depend on (the CPU without one); ``model``:
        what it trains, which device_tokens: auto on a GPU depends on too."""
        buckets = train["shape_buckets"]
        return cls(
            steps=preset["steps"], warmup_steps=preset["warmup_steps"], lr_scale=preset["lr_scale"],
            label_smoothing=preset["label_smoothing"], tokens_per_step=train["tokens_per_step"],
            device_tokens=resolve_device_tokens(train["device_tokens"], device, model, train["precision"],
                                                ceiling=train["tokens_per_step"]),
            adam_betas=tuple(train["adam_betas"]), adam_eps=train["adam_eps"],
            # averaging needs the last K checkpoints on disk
            keep_checkpoints=max(preset["keep_checkpoints"], preset["average_last"]),
            average_last=preset["average_last"], checkpoint_steps=preset["checkpoint_steps"],
            # not filled into presets by the reader (x-fill: false), so read with the schema's default here
            budget_intervals=preset.get("budget_intervals", preset_default("budget_intervals")),
            checkpoint_minutes=preset["checkpoint_minutes"],
            layout=devices(preset),  # every node's gpus: a step is laid out for the job's devices (rendezvous.py)
            # a preset's own budget wins over the train section's
            max_minutes=preset["max_minutes"] if "max_minutes" in preset else train["max_minutes"],
            log_every=train["log_every"], dev_every=train["dev_every"], compile=train["compile"],
            precision=train["precision"], seed=seed,
            shape_buckets=buckets is True or (buckets == "auto" and device is not None and device.type == "cuda"),
            attention=train["attention"],
            # not filled into presets (x-fill: false): a preset without them keeps its params, and its runs
            **{key: preset.get(key, preset_default(key))
               for key in ("schedule", "budget_warmup_share", "budget_floor", "budget_decay",
                             "budget_decay_share", "budget_warmup", "budget_min_steps", "budget_min_tokens")},
        ).checked(preset.get("name"))

    def checked(self, preset_name: str | None) -> "TrainSettings":
        """Refuse a budget schedule without a budget (a user mistake: exit 2, before any step)."""
        if self.schedule == "budget" and not self.max_minutes:
            raise UserError(
                f"presets.{preset_name}.schedule: budget fits the learning-rate schedule to a time budget, and this "
                f"run has none. Set train.max_minutes (or the preset's max_minutes), or leave schedule out (paper: "
                f"warmup_steps, then the inverse square root)")
        return self


    def batch_rule(self) -> dict:
        """What fixes the batches and their order: a resumed run must find the same."""
        return {"tokens_per_step": self.tokens_per_step, "device_tokens": self.device_tokens,
                "gpus": self.layout, "seed": self.seed, "shape_buckets": self.shape_buckets}

    def check_batch_rule(self, saved: dict | None, path, run_dir) -> None:
        """Refuse to resume from the checkpoint at ``path`` where its ``batch_rule`` (None: an old run's, which had
        none) chose a step's sentences otherwise. Not for device_tokens, which only splits a step (the resumed
        run's is ``aiayn.memory.resumed_device_tokens``'s choice)."""
        if saved is None:
            return
        rule = self.batch_rule()
        saved = {"shape_buckets": False, **saved, "device_tokens": self.device_tokens}  # older runs had no buckets
        if saved != rule:
            changed = ", ".join(f"{key} {saved.get(key)} -> {value}" for key, value in rule.items()
                                if saved.get(key) != value)
            raise UserError(
                f"{path}: this run's batches were drawn with other settings ({changed}); resuming would "
                f"change which sentences make a step. Put the settings back to resume exactly, or delete "
                f"{run_dir} to start afresh")


@dataclass
class Progress:
    """Where training is: everything beyond the model and optimizer needed to resume exactly."""

    step: int = 0
    epoch: int = 0
    cursor: int = 0  # next batch of this epoch's batch list
    target_tokens: int = 0
    source_tokens: int = 0
    train_flops: float = 0.0
    elapsed_seconds: float = 0.0  # in training steps
    wall_seconds: float = 0.0     # the whole loop: steps, dev evaluations, checkpoints (for max_minutes)
    padded_source_tokens: int = 0
    padded_target_tokens: int = 0
    dev_history: list = field(default_factory=list)
    window_clock: float | None = None  # wall_seconds when a budgeted run last decided a window checkpoint
    budget_schedule: dict | None = None  # schedule: budget's fitted schedule (aiayn.train.budget_schedule), to resume it
    distinct_shapes: int = 0      # micro-batch shapes met for the first time by a process (aiayn.speed.shapes)
    new_shape_steps: int = 0      # steps that met one
    new_shape_seconds: float = 0.0  # and their seconds

    def account(self, step: int, shape: StepShape, flops: float, seconds: float) -> None:
        """Step ``step`` done: its tokens (``shape``), FLOPs and seconds added."""
        self.step = step
        self.target_tokens += shape.real_tgt
        self.source_tokens += shape.real_src
        self.padded_target_tokens += shape.padded_tgt
        self.padded_source_tokens += shape.padded_src
        self.train_flops += flops
        self.elapsed_seconds += seconds

    def shape_costs(self) -> dict[str, float]:
        """What first-seen shapes cost so far (aiayn.speed.shapes.ShapeLog), for final.json and MLflow."""
        return {"distinct_shapes": self.distinct_shapes, "new_shape_steps": self.new_shape_steps,
                "new_shape_seconds": self.new_shape_seconds}

    def per_step(self) -> dict[str, float]:
        """Mean tokens of one optimizer step so far: what the run really trained on."""
        steps = max(self.step, 1)
        return {"real_src_tokens_per_step": self.source_tokens / steps,
                "real_tgt_tokens_per_step": self.target_tokens / steps,
                "padded_src_tokens_per_step": self.padded_source_tokens / steps,
                "padded_tgt_tokens_per_step": self.padded_target_tokens / steps}


def micro_batch_seed(seed: int, step: int, index: int) -> int:
    """Dropout seed of one micro-batch, from its place in the global step.

    Seeding by (step, micro-batch) instead of carrying one RNG stream makes resuming exact
    and makes N processes draw the same dropout masks as one process accumulating N.
    """
    return (seed * 1_000_003 + step * 4099 + index) % (2 ** 63 - 1)


class StepSource:
    """The micro-batches of each optimizer step, in order, from (seed, epoch, cursor) alone."""

    def __init__(self, split, settings: TrainSettings):
        self.split = split
        self.src_lengths, self.tgt_lengths = split.src_lengths, split.tgt_lengths  # computed once
        # what the step cut sees: the lengths, or with shape buckets their bucketed sizes
        self.cut = ((bucketed_lengths(self.src_lengths), bucketed_lengths(self.tgt_lengths))
                    if settings.shape_buckets else (self.src_lengths, self.tgt_lengths))
        self.settings = settings
        self._epoch, self._steps = None, []

    def steps_of(self, epoch: int) -> list[np.ndarray]:
        if epoch != self._epoch:
            self._epoch = epoch
            self._steps = step_batches(*self.cut, self.settings.tokens_per_step, self.settings.seed, epoch)
        return self._steps

    def recut(self, settings: TrainSettings, progress: Progress) -> "StepSource":
        """The steps cut at ``settings``' size from here on, ``progress``' cursor moved to the same share of its
        epoch (a budget schedule's fitted step: ``aiayn.train.budget_schedule``)."""
        source = StepSource(self.split, settings)
        before, after = len(self.steps_of(progress.epoch)), len(source.steps_of(progress.epoch))
        progress.cursor = min(round(progress.cursor * after / before), after)
        return source

    def next(self, progress: Progress) -> tuple[list[np.ndarray], StepShape]:
        """The next step's micro-batches (advancing ``progress``' epoch and cursor) and its sizes."""
        if progress.cursor >= len(self.steps_of(progress.epoch)):
            progress.epoch += 1
            progress.cursor = 0
        rows = self.steps_of(progress.epoch)[progress.cursor]
        progress.cursor += 1
        return self.micro_batches(rows)

    def micro_batches(self, rows: np.ndarray, device_tokens: int | None = None) -> tuple[list[np.ndarray], StepShape]:
        """A step's sentences (in length order) as micro-batches of at most ``device_tokens`` (default: the
        settings') a side, and its sizes."""
        micro = split_step(*self.cut, rows, device_tokens or self.settings.device_tokens, self.settings.layout)
        padded = self.cut if self.settings.shape_buckets else None
        return micro, StepShape.of(self.src_lengths, self.tgt_lengths, micro, padded)

    def batch(self, rows: np.ndarray, shape: StepShape, index: int) -> Batch:
        """The tensors of a step's micro-batch ``index`` (its ``rows``): grown to the step's bucketed shape
        with shape buckets (which every process computed alike), and to multiples of COMPILE_MULTIPLE
        under train.compile."""
        batch = collate(self.split, rows)
        if self.settings.shape_buckets:
            batch = padded_to_shape(batch, *shape.shapes[index])
        if self.settings.compile:
            batch = padded_to_multiple(batch, COMPILE_MULTIPLE)
        return batch


def dev_rows(split, config: ModelConfig, name="the dev split", warn: bool = True) -> np.ndarray:
    """The pairs of an evaluation split the model can read: all, except with a learned positional table
    (Table 3 row E) those longer than it (source + EOS or BOS + target), which are left out of the dev
    loss with a warning (``warn``: rank 0) and counted, where they would end the run at its first dev
    evaluation. None left is refused before training starts."""
    rows = np.arange(len(split))
    if config.positional != "learned":
        return rows
    rows = rows[np.maximum(split.src_lengths, split.tgt_lengths) + 1 <= config.max_positions]
    if len(rows) < len(split):
        left_out = np.setdiff1d(np.arange(len(split)), rows)
        lines = ", ".join(str(int(split.lines[row]) + 1) for row in left_out[:5])
        more = ", ..." if len(left_out) > 5 else ""
        where = (f"{len(left_out)} of the {len(split)} dev pairs of {name} (lines {lines}{more} of "
                 f"{split.meta.get('src_file', 'its text')}) are longer than the learned positional table "
                 f"(max_positions = {config.max_positions})")
        if not len(rows):
            raise UserError(f"{where}: all of them, so there is no dev loss to compute; raise max_positions "
                            "or give shorter dev text")
        if warn:
            print(f"warning: {where}; they are left out of the dev loss (counted in final.json as "
                  "dev_pairs_skipped); raise max_positions to include them", file=sys.stderr)
    return rows


def evaluate(model: Transformer, split, device: torch.device, precision: str, max_tokens: int,
             epsilon: float, rows: np.ndarray | None = None) -> dict[str, float]:
    """Dev loss (label-smoothed), NLL and per-token perplexity (Table 3's PPL) over a whole split
    (or its ``rows``: ``dev_rows``)."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, nll: read once, at the end
    tokens = 0
    rows = np.arange(len(split)) if rows is None else rows
    with torch.inference_mode():
        for batch_rows in length_batches(split.src_lengths[rows], split.tgt_lengths[rows], max_tokens):
            batch = collate(split, rows[batch_rows]).to(device)
            with autocast_context(device, precision):
                sums += torch.stack(teacher_forced_loss(model, batch.src, batch.tgt_in, batch.tgt_out, epsilon,
                                                        tgt_real=batch.tgt_real)).double()
            tokens += batch.tgt_tokens
    model.train(was_training)
    loss_total, nll_total = sums.tolist()
    nll = nll_total / max(tokens, 1)
    return {"dev_loss": loss_total / max(tokens, 1), "dev_nll": nll, "dev_ppl": math.exp(min(nll, 50.0))}


@dataclass
class StepOutcome:
    """What every process agrees on after a step's one synchronisation."""

    loss_sum: float
    nll_sum: float
    grad_norm: float
    stopping: bool  # a signal or --stop-after-steps: checkpoint and exit 75
    last: bool      # the schedule's last step, or the time budget is spent: end normally
    window: bool = False  # a budgeted run's window checkpoint is due (aiayn.train.window)
    clock: float = 0.0    # the run's clock at the synchronisation, rank 0's (for a budget schedule)


class LogWindow:
    """Sums over the steps since the last log line, turned into the logged means."""

    KEYS = ("loss", "nll", "tokens", "src_tokens", "padded", "real", "time", "flops", "steps")

    def __init__(self):
        self.sums = dict.fromkeys(self.KEYS, 0.0)

    def add(self, outcome: StepOutcome, shape: StepShape, seconds: float, flops: float) -> None:
        for key, value in (("loss", outcome.loss_sum), ("nll", outcome.nll_sum), ("tokens", shape.real_tgt),
                           ("src_tokens", shape.real_src), ("padded", shape.padded_src + shape.padded_tgt),
                           ("real", shape.real_src + shape.real_tgt), ("time", seconds), ("flops", flops),
                           ("steps", 1)):
            self.sums[key] += value

    def metrics(self, peak: float | None, world: int) -> dict[str, float]:
        window = self.sums
        self.sums = dict.fromkeys(self.KEYS, 0.0)
        nll = window["nll"] / window["tokens"]
        metrics = {
            "train_loss": window["loss"] / window["tokens"], "train_nll": nll,
            "train_ppl": math.exp(min(nll, 50.0)),
            "target_tokens_per_second": window["tokens"] / max(window["time"], 1e-9),
            "tokens_per_step": window["tokens"] / window["steps"],
            "real_src_tokens_per_step": window["src_tokens"] / window["steps"],
            "real_tgt_tokens_per_step": window["tokens"] / window["steps"],
            "padding_efficiency": window["real"] / max(window["padded"], 1),
        }
        if peak:
            metrics["mfu"] = window["flops"] / max(window["time"], 1e-9) / (peak * world)
        return metrics
