"""The ``Trainer``: one run set up (or resumed) once, then the paper's step repeated in its named parts.

docs/PAPER.md, Training: Adam(0.9, 0.98, 1e-9), the schedule of ``aiayn.train.schedule``, label smoothing,
about 25000 source + 25000 target tokens a step (the same micro-batches on any number of devices, see
``aiayn.train.steps``), window checkpoints for averaging at the paper's step interval (with a time
budget, at the paper's share of the budget: ``aiayn.train.window``), ``final.pt`` and ``final.json`` at
the end.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from aiayn.batching import StepShape
from aiayn.binarize import load_split
from aiayn.bpe import vocab_fingerprint as bpe_fingerprint
from aiayn.checkpoint import (CHECKPOINT_FORMAT, MODEL_FORMAT, checkpoint_path, list_checkpoints,
                              load_checkpoint, save_model)
from aiayn.config import schema_default
from aiayn.device import choose_device
from aiayn.errors import UserError
from aiayn.writing import write_json_atomic
from aiayn.layout import CHECKPOINTS, FINAL_MODEL, FINAL_SUMMARY
from aiayn.loss import TrainingObjective
from aiayn.memory import agreed_device_tokens, fit_step, resumed_device_tokens
from aiayn.model import ModelConfig
from aiayn.tokens import PAD_ID
from aiayn.speed.shapes import ShapeLog
from aiayn.train.dev_bleu import DevBleu
from aiayn.train.divergence import DivergenceGuard, TrainingDiverged  # noqa: F401 (TrainingDiverged: the stage's)
from aiayn.train.hardware import (Distributed, adam, autocast_context, compiled, load_optimizer_state, loss_chunk_tokens,
                                  model_for_training, peak_flops, resolved_precision)
from aiayn.train.monitor import DevMonitor
from aiayn.train.precision import LossScaling
from aiayn.train.rendezvous import check_layout
from aiayn.train.schedule import forward_flops, learning_rate, schedule_record
from aiayn.train.steps import (LogWindow, Progress, StepOutcome, StepSource, TrainSettings, dev_rows, evaluate,
                               micro_batch_seed)
from aiayn.train.window import in_window, window_vote


class Preempted(Exception):
    """Stopped on request (SIGTERM/SIGUSR1 or --stop-after-steps) after writing a checkpoint."""


class StopFlag:
    """Set by SIGTERM or SIGUSR1 (what SLURM sends before a kill or requeue)."""

    def __init__(self):
        self.signal: int | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal = signum


# --- one run -----------------------------------------------------------------------------

@dataclass
class TrainJob:
    # The resolved preset as it came through the config door, kept as the dict a run records (MLflow's params,
    # final.json, the checkpoints' check), byte for byte; Trainer builds TrainSettings and ModelConfig from it.
    preset: dict
    train_section: dict
    seed: int
    train_data: Path
    dev_data: Path | None
    spm_model: Path
    run_dir: Path
    experiment: str = field(default_factory=lambda: schema_default("experiment"))  # the schema's, as the CLI's
    tracking_uri: str | None = None
    track: bool = True
    device: str = "auto"
    stop_after_steps: int | None = None
    progress_bar: bool = True

    @property
    def requested_device(self) -> str:
        """--device, unless it is auto: then train.device (``aiayn.device.choose_device`` resolves auto)."""
        return self.device if self.device != "auto" else self.train_section["device"]


class Trainer:
    """One run: set up (or resumed) once, then ``run`` repeats the named parts of a step."""

    def __init__(self, job: TrainJob):
        self.job = job
        self.clock = time.monotonic  # the run's clock (for max_minutes and its window); tests give a fake one
        self.dist = Distributed.from_environment()
        self.device = choose_device(job.requested_device, job.preset["gpus"], self.dist.local_rank,
                                    job.train_section["share_gpus"])
        self.dist.init(self.device)
        self.world = self.dist.world_size
        check_layout(self.world, job.preset)
        self.train_split = load_split(job.train_data)
        self.dev_split = load_split(job.dev_data) if job.dev_data else None
        self.vocab_fingerprint = self.train_split.meta["vocab_fingerprint"]
        if bpe_fingerprint(job.spm_model) != self.vocab_fingerprint:
            raise UserError(f"{job.train_data} was binarized with another vocabulary than {job.spm_model}; "
                            "rerun the binarize stage")
        self.data_fingerprint = self.train_split.meta["data_fingerprint"]
        self.checkpoint_dir = job.run_dir / CHECKPOINTS
        self.model_config = self._model_config()
        self.settings = agreed_device_tokens(TrainSettings.from_config(
            job.preset, job.train_section, job.seed, self.device, self.model_config), self.world, self.device)
        self.dev_rows = (dev_rows(self.dev_split, self.model_config, job.dev_data, self.dist.is_main)
                         if self.dev_split is not None else None)
        torch.manual_seed(self.settings.seed)
        self.model = model_for_training(self.model_config, self.device)
        self.optimizer = adam(self.model.parameters(), self.device, lr=0.0, betas=self.settings.adam_betas,
                              eps=self.settings.adam_eps)
        self.precision = resolved_precision(self.settings.precision, self.device)  # what `auto` became here
        self.scaling = LossScaling(self.precision, self.device)  # fp16's loss scale; a no-op otherwise
        self.progress = Progress()
        self.resumed_from = self._resume()
        self.training_model = self._wrap()
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.peak = peak_flops(self.device, self.precision)
        self.source = StepSource(self.train_split, self.settings)
        self.shape_log = ShapeLog()
        if not self.source.steps_of(self.progress.epoch):  # before tracking starts: no run is left open
            raise UserError(f"{job.train_data}: no training pairs")
        self.dev_bleu = DevBleu.from_section(job.train_section, self.dev_split, self.dev_rows, job.spm_model, self.device)
        self.guard = DivergenceGuard.from_section(job.train_section)
        self.monitor = DevMonitor.for_run(job, self.data_fingerprint)  # train.reference: a wrong file stops here
        self.tracker = self._start_tracking() if self.dist.is_main else None

    # --- set-up ---------------------------------------------------------------------------

    def _model_config(self) -> ModelConfig:
        from aiayn.config import model_fields

        # binarize read the vocabulary size from the vocabulary whose fingerprint was just checked
        return ModelConfig(vocab_size=self.train_split.meta["vocab_size"], pad_id=PAD_ID,
                           **model_fields(self.job.preset))

    def _resume(self) -> Path | None:
        """Load the newest checkpoint that loads (window or safety), after checking that it is this run's.

        A damaged newest file (a job killed while the file system was writing it) is skipped, saying so.
        """
        state = path = None
        for _, candidate in reversed(list_checkpoints(self.checkpoint_dir, safety=True)):
            try:
                state, path = load_checkpoint(candidate), candidate
                break
            except UserError as error:
                if self.dist.is_main:
                    print(f"warning: skipping {candidate.name}, which does not load ({error}); resuming from an "
                          "older checkpoint", file=sys.stderr)
        if state is None:
            return None
        if state.get("format") != CHECKPOINT_FORMAT:
            raise UserError(f"{path}: not a training checkpoint; move it out of {self.checkpoint_dir}")
        if state["model_config"] != self.model_config.to_dict():
            raise UserError(f"{path}: its model_config differs from preset {self.job.preset['name']!r}; "
                            f"the preset changed since this run started: delete {self.job.run_dir} to start afresh")
        self.settings = resumed_device_tokens(self.settings, self.job.train_section["device_tokens"], state,
                                              self.dist.is_main)
        self.settings.check_batch_rule(state.get("batch_rule"), path, self.job.run_dir)
        self.model.load_state_dict(state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.scaling.load_state_dict(state.get("loss_scaling", {}))
        self.progress = Progress(**state["progress"])
        torch.set_rng_state(state["rng"]["torch"])
        return path

    def _wrap(self) -> torch.nn.Module:
        """The model and its loss (``TrainingObjective``), under DDP when there are several processes
        and compiled when train.compile is set: (src, tgt_in, tgt_out) -> (loss sum, NLL sum)."""
        chunk = loss_chunk_tokens(self.device, self.model_config.vocab_size, 2 * self.settings.device_tokens)
        objective: torch.nn.Module = TrainingObjective(self.model, self.settings.label_smoothing, chunk)
        if self.world > 1:
            # the sinusoid table is the only buffer and never changes: nothing to send each step
            # (torch 2.13 renamed the switch; the GPU image's torch has the old name only)
            ddp = torch.nn.parallel.DistributedDataParallel
            no_buffer_sync = ({"forward_sync_buffers": False}
                              if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters
                              else {"broadcast_buffers": False})
            objective = ddp(objective, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                            **no_buffer_sync)
        if self.settings.compile:
            objective = compiled(objective)
        return objective

    def _start_tracking(self):
        from aiayn.tracking import Tracker, flatten, forget_unresumed_attempt, git_commit, git_tags

        job = self.job
        if self.resumed_from is None:  # a fresh start: what an earlier attempt logged is not this run's
            forget_unresumed_attempt(job.run_dir)
        tracker = Tracker(job.run_dir, job.tracking_uri, job.experiment,
                          run_name=f"{job.preset['name']}-seed{job.seed}", enabled=job.track)
        params = flatten("", {"preset": job.preset, "train": job.train_section, "seed": job.seed}, {})
        params.update({"model.parameters": str(self.model.num_parameters()), "world_size": str(self.world),
                       "device_tokens": str(self.settings.device_tokens)})
        commit = git_commit()
        tags = {"preset": job.preset["name"], "seed": str(job.seed), "git_commit": commit,
                "data_fingerprint": self.data_fingerprint, "vocab_fingerprint": self.vocab_fingerprint,
                "device": self.device_name, "precision": self.precision,
                "table": job.preset.get("paper", {}).get("table", ""), "stage": "train", **git_tags(commit)}
        datasets = [("train", self.data_fingerprint, str(job.train_data), "training")]
        if self.dev_split is not None:
            datasets.append(("dev", self.dev_split.meta.get("data_fingerprint", ""), str(job.dev_data), "validation"))
        tracker.start(params, tags, datasets)
        if self.resumed_from:
            print(f"resuming from {self.resumed_from} (step {self.progress.step}) on {self.world} process(es)",
                  file=sys.stderr)
        return tracker

    # --- one step, in its named parts -----------------------------------------------------

    def forward_backward(self, step: int, micro: list[np.ndarray], shape: StepShape) -> torch.Tensor:
        """This process's micro-batches (``index % world == rank``): gradients summed, loss sums returned. On a
        GPU one autocast region spans the step: each weight is cast to bf16 or fp16 once a step, not a
        micro-batch."""
        world, settings, device = self.world, self.settings, self.device
        mine = [(index, rows) for index, rows in enumerate(micro) if index % world == self.dist.rank]
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, nll
        step_region = autocast_context(device, settings.precision) if device.type == "cuda" else contextlib.nullcontext()
        with step_region:
            for position, (index, rows) in enumerate(mine):
                batch = self.source.batch(rows, shape, index).to(device)
                sums += self._micro_step(step, index, batch, shape, last=position == len(mine) - 1)
        return sums

    def _micro_step(self, step: int, index: int, batch, shape: StepShape, last: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch; its (loss sum, nll sum)."""
        world, settings = self.world, self.settings
        torch.manual_seed(micro_batch_seed(settings.seed, step, index))
        sync = contextlib.nullcontext() if (world == 1 or last) else self.training_model.no_sync()
        with sync:
            with autocast_context(self.device, settings.precision, settings.attention):
                loss, nll = self.training_model(batch.src, batch.tgt_in, batch.tgt_out, batch.tgt_real)
            # DDP averages gradients over processes; scale so that the result is the sum over the whole
            # step's target tokens divided by their number.
            self.scaling.scale(loss * (world / shape.real_tgt)).backward()
        return torch.stack([loss.detach(), nll.detach()]).double()

    def agree(self, step: int, sums: torch.Tensor, stop: StopFlag, start_step: int, loop_start: float,
              budget: float) -> StepOutcome:
        """The step's one host-device synchronisation: loss, gradient norm, and every process's
        vote to stop (a signal) or to end (the last step, the time budget), and rank 0's decision on a
        budgeted run's window checkpoint, so that every process knows it."""
        votes = torch.zeros(6, dtype=torch.float64, device=self.device)
        votes[:2] = sums
        self.scaling.unscale(self.optimizer)  # fp16: the gradients as Adam will read them
        # measured, not clipped (the paper does not clip, so no pass scales the gradients); the same on
        # every process after DDP
        gradients = [p.grad for p in self.model.parameters() if p.grad is not None]
        votes[2] = torch.nn.utils.get_total_norm(gradients).double() / self.world
        job = self.job
        votes[3] = float(stop.signal is not None or (job.stop_after_steps is not None
                                                     and step - start_step >= job.stop_after_steps))
        clock = self.progress.wall_seconds + self.clock() - loop_start
        votes[4] = float(clock >= budget)
        votes[5] = float(self.dist.is_main and window_vote(self.settings, self.progress, step, clock))
        if self.world > 1:
            torch.distributed.all_reduce(votes)
        loss_sum, nll_sum, grad_norm, stop_votes, budget_votes, window_votes = votes.tolist()
        if window_votes > 0:
            self.progress.window_clock = clock  # saved with the checkpoint: a resumed run spaces from it
        return StepOutcome(loss_sum, nll_sum, grad_norm, stopping=stop_votes > 0,
                           last=step == self.settings.steps or budget_votes > 0, window=window_votes > 0)

    def optimizer_step(self, step: int, grad_norm: float) -> float:
        lr = learning_rate(step, self.model_config.d_model, self.settings.warmup_steps, self.settings.lr_scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.scaling.step(self.optimizer, grad_norm)  # fp16: none where the gradients overflowed
        self.optimizer.zero_grad(set_to_none=True)
        return lr

    def evaluate_dev(self, step: int) -> None:
        dev = evaluate(self.model, self.dev_split, self.device, self.settings.precision, self.settings.device_tokens,
                       self.settings.label_smoothing, self.dev_rows)
        dev.update(self.dev_bleu.score(self.model))
        self.progress.dev_history.append({"step": step, **dev})
        self.tracker.log_metrics(dev, step)
        self.monitor.after_dev(step, self.progress.dev_history, self.tracker)  # the reference band, the projection

    def save_checkpoint(self, window: bool) -> Path:
        """Write this step's checkpoint; keep the window checkpoints averaging needs, and a safety
        checkpoint only while it is the newest."""
        progress, settings = self.progress, self.settings
        path = checkpoint_path(self.checkpoint_dir, progress.step, window)
        save_model({
            "format": CHECKPOINT_FORMAT, "step": progress.step, "model_config": self.model_config.to_dict(),
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "schedule": schedule_record(self.model_config.d_model, settings.warmup_steps, settings.lr_scale),
            "progress": vars(progress).copy(), "rng": {"torch": torch.get_rng_state()},
            "batch_rule": settings.batch_rule(), "window": window, "loss_scaling": self.scaling.state_dict(),
            "config": {"preset": self.job.preset, "train": self.job.train_section, "seed": self.job.seed},
            "vocab_fingerprint": self.vocab_fingerprint, "data_fingerprint": self.data_fingerprint,
        }, path)
        for _, old in list_checkpoints(self.checkpoint_dir)[:-settings.keep_checkpoints]:
            old.unlink(missing_ok=True)
        for _, old in list_checkpoints(self.checkpoint_dir, safety=True):
            if old.name.startswith("safety_") and old != path:
                old.unlink(missing_ok=True)
        return path

    # --- the loop and its end -------------------------------------------------------------

    def run(self) -> dict:
        """Train until the last step or the time budget; returns the summary written to ``final.json``."""
        from tqdm import tqdm

        settings, progress, main = self.settings, self.progress, self.dist.is_main
        stop = StopFlag()
        stop.install()
        bar = tqdm(total=settings.steps, initial=progress.step, desc=self.job.preset["name"], unit="step",
                   disable=not (main and self.job.progress_bar), mininterval=1.0, file=sys.stderr)
        window = LogWindow()
        start_step = progress.step
        budget = settings.max_minutes * 60 if settings.max_minutes else math.inf
        last_checkpoint_time = self.clock()
        status = "FAILED"
        try:
            self.training_model.train()
            # within the loop the budget ends a run only through the vote (outcome.last), so that every
            # process stops at the same step and that step is written as a window checkpoint
            spent_before = progress.wall_seconds >= budget  # a rerun of a run that spent its budget
            while progress.step < settings.steps and not spent_before:
                loop_start, step_start = self.clock(), time.perf_counter()
                step = progress.step + 1
                micro, shape = self.source.next(progress)
                micro, shape, sums = fit_step(self, step, micro, shape)  # split anew if memory runs out
                # every process knows the whole step's sizes: no communication before the forward pass
                flops = 3.0 * sum(forward_flops(self.model_config, *dims) for dims in shape.shapes)  # backward ~ 2x
                outcome = self.agree(step, sums, stop, start_step, loop_start, budget)
                if self.guard.rolled_back(self, step, outcome, shape.real_tgt):  # aiayn.train.divergence
                    bar.n, window = progress.step, LogWindow()  # the steps from the checkpoint again
                    continue
                lr = self.optimizer_step(step, outcome.grad_norm)
                seconds = time.perf_counter() - step_start
                progress.account(step, shape, flops, seconds)
                self.shape_log.step(shape.shapes[self.dist.rank::self.world], progress, seconds)
                window.add(outcome, shape, seconds, flops)
                bar.update(1)
                if main and (step % settings.log_every == 0 or outcome.last):
                    metrics = window.metrics(self.peak, self.world)
                    metrics.update({"lr": lr, "grad_norm": outcome.grad_norm, "train_flops": progress.train_flops,
                                    "epoch": progress.epoch, **progress.shape_costs(), **self.scaling.metrics()})
                    self.tracker.log_metrics(metrics, step)
                    bar.set_postfix(loss=f"{metrics['train_loss']:.3f}", lr=f"{lr:.2e}",
                                    tok_s=f"{metrics['target_tokens_per_second']:.0f}")
                if main and self.dev_split is not None and settings.dev_every and step % settings.dev_every == 0:
                    self.evaluate_dev(step)
                progress.wall_seconds += self.clock() - loop_start
                # a run that ends at its time budget ends normally: its last step joins the window
                window_step = in_window(settings, step, outcome)
                due_time = settings.checkpoint_minutes and \
                    self.clock() - last_checkpoint_time >= settings.checkpoint_minutes * 60
                if main and (window_step or due_time or outcome.stopping):
                    self.save_checkpoint(window=window_step)
                    last_checkpoint_time = self.clock()
                if outcome.last:
                    break
                if outcome.stopping:
                    status = "KILLED"
                    raise Preempted(f"stopped at step {step}; checkpoint written to {self.checkpoint_dir}")
            bar.close()
            if main and not checkpoint_path(self.checkpoint_dir, progress.step).exists() and progress.step:
                self.save_checkpoint(window=True)  # the run's end is always in the averaging window
            summary = self.finish() if main else {}
            status = "FINISHED"
            return summary
        finally:
            bar.close()
            if self.tracker is not None:
                self.tracker.end(status)
            if self.world > 1 and torch.distributed.is_initialized():
                self.leave_process_group(everyone_here=status in ("FINISHED", "KILLED"))

    def leave_process_group(self, everyone_here: bool) -> None:
        """Take the process group down while every peer still holds its own. DDP's reducer keeps the
        group alive past ``destroy_process_group``; freed later, once a peer had exited, gloo's
        destructor waited for its threads for ever (seen as a hang at the end of a finished run)."""
        if everyone_here:  # the end and a preemption are agreed by a vote: all processes are here
            torch.distributed.barrier()
        self.training_model = None
        gc.collect()
        torch.distributed.destroy_process_group()

    def finish(self) -> dict:
        """The final dev evaluation, ``final.pt`` and ``final.json`` (rank 0)."""
        progress, settings, job = self.progress, self.settings, self.job
        final_dev = {}
        if self.dev_split is not None:
            if progress.dev_history and progress.dev_history[-1]["step"] == progress.step:  # the loop's, of this model
                final_dev = {key: value for key, value in progress.dev_history[-1].items() if key != "step"}
            else:
                final_dev = evaluate(self.model, self.dev_split, self.device, settings.precision,
                                     settings.device_tokens, settings.label_smoothing, self.dev_rows)
                final_dev.update(self.dev_bleu.score(self.model))
                progress.dev_history.append({"step": progress.step, **final_dev})
                self.tracker.log_metrics(final_dev, progress.step)
            self.monitor.finish(progress.dev_history, self.tracker)
        save_model({"format": MODEL_FORMAT, "model_config": self.model_config.to_dict(),
                    "model": self.model.state_dict(), "vocab_fingerprint": self.vocab_fingerprint,
                    "data_fingerprint": self.data_fingerprint, "averaged_steps": [progress.step],
                    "averaged_from": [checkpoint_path(self.checkpoint_dir, progress.step).name]},
                   job.run_dir / FINAL_MODEL)
        summary = {
            "preset": job.preset["name"], "seed": job.seed, "step": progress.step, "epochs": progress.epoch,
            "parameters": self.model.num_parameters(), "target_tokens": progress.target_tokens,
            "source_tokens": progress.source_tokens, **progress.per_step(), "train_flops": progress.train_flops,
            "train_hours": progress.elapsed_seconds / 3600, "wall_hours": progress.wall_seconds / 3600,
            "planned_steps": settings.steps,
            "stopped_by": "steps" if progress.step >= settings.steps else "max_minutes",
            "world_size": self.world, "device": self.device_name, "device_peak_flops": self.peak,
            "precision": self.precision, **self.scaling.record(), "device_tokens": settings.device_tokens,
            **progress.shape_costs(),
            "mlflow_run_id": self.tracker.run_id, "tracking_uri": self.tracker.uri, "experiment": job.experiment,
            **final_dev, "dev_history": progress.dev_history, "vocab_fingerprint": self.vocab_fingerprint,
            "data_fingerprint": self.data_fingerprint,
        }
        if self.dev_split is not None:
            summary["dev_pairs_skipped"] = len(self.dev_split) - len(self.dev_rows)
        self.tracker.log_metrics({"train_hours": summary["train_hours"], "parameters": summary["parameters"],
                                  **progress.per_step()}, progress.step)
        write_json_atomic(job.run_dir / FINAL_SUMMARY, summary)
        return summary


def train(job: TrainJob) -> dict:
    """Train (or resume) one run; returns the summary written to ``final.json`` (empty off rank 0)."""
    return Trainer(job).run()

