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
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from aiayn.batching import StepShape
from aiayn.config import schema_default
from aiayn.device import choose_device
from aiayn.memory import agreed_device_tokens, fit_step
from aiayn.speed.shapes import ShapeLog
from aiayn.train.dev_evaluation import DevEvaluation
from aiayn.train.budget_schedule import fitted_batch, revise, run_schedule
from aiayn.train.divergence import DivergenceGuard, TrainingDiverged  # noqa: F401 (TrainingDiverged: the stage's)
from aiayn.train.final import write_final
from aiayn.train.hardware import Distributed, peak_flops
from aiayn.speed.precision import autocast_context
from aiayn.train.loop import LoopState, StopFlag, agreed_outcome
from aiayn.train.model_state import ModelState
from aiayn.train.monitor import DevMonitor, TrainingOffCourse
from aiayn.train.rendezvous import check_layout
from aiayn.train.resume import Checkpoints
from aiayn.train.run_data import RunData
from aiayn.train.run_tracking import RunFacts, start_tracking
from aiayn.train.schedule import forward_flops
from aiayn.train.steps import Progress, StepOutcome, TrainSettings, micro_batch_seed
from aiayn.train.window import window_vote


class Preempted(Exception):
    """Stopped on request (SIGTERM/SIGUSR1 or --stop-after-steps) after writing a checkpoint."""


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
    def recorded_config(self) -> dict:
        """The config as the run records it: in every checkpoint (a resume checks it) and as MLflow's params."""
        return {"preset": self.preset, "train": self.train_section, "seed": self.seed}

    @property
    def requested_device(self) -> str:
        """--device, unless it is auto: then train.device (``aiayn.device.choose_device`` resolves auto)."""
        return self.device if self.device != "auto" else self.train_section["device"]


class Trainer:
    """One run: its parts set up (or resumed) once, then ``run`` repeats the named parts of a step.

    The parts, each built and tested on its own: the data and its step cut (``RunData``, ``StepSource``), the
    model and its optimiser state (``ModelState``), progress and resume (``Progress``, ``Checkpoints``), the dev
    evaluations (``DevEvaluation``), and tracking (``start_tracking``), which ``run`` opens and closes.
    """

    def __init__(self, job: TrainJob):
        self.job = job  # its stop_after_steps is read at each step; tests change it on a built Trainer
        self.clock = time.monotonic  # the run's clock (for max_minutes and its window); tests give a fake one
        self.dist = Distributed.from_environment()
        self.world = self.dist.world_size
        preset = job.preset  # the parts take these values, not the job
        section = job.train_section
        check_layout(self.world, preset)
        self.guard = DivergenceGuard.from_section(section)
        self.data = RunData.load(job.train_data, job.dev_data, job.spm_model)
        self.device = choose_device(job.requested_device, preset["gpus"], self.dist.local_rank, section["share_gpus"])
        self.model_config = self.data.model_config(preset)
        self.settings = TrainSettings.from_config(preset, section, job.seed, self.device, self.model_config)
        self.dist.init(self.device)
        self.state = ModelState.build(self.model_config, self.settings, self.device)
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.peak = peak_flops(self.device, self.precision)
        self.checkpoints = Checkpoints(job.run_dir, job.recorded_config, self.model_config, self.data)
        self.progress = Progress()
        self.resumed_from = self._resume()
        self.schedule = run_schedule(self.settings, self.model_config.d_model, self.progress.budget_schedule)
        # every process splits its steps alike (a resumed run's size is its checkpoint's, the same on all)
        self.settings = agreed_device_tokens(self.settings, self.world, self.device)
        self.dev = DevEvaluation.for_run(self.data, self.model_config, self.device, section, job.spm_model,
                                         job.dev_data, DevMonitor.for_run(
                                             section, preset, job.experiment, job.seed, job.run_dir,
                                             self.data.data_fingerprint),
                                         warn=self.dist.is_main)
        # a split with nothing to train on is refused here, before run() opens the MLflow run
        self.source = self.data.step_source(self.settings, self.progress.epoch, job.train_data)
        self.shape_log = ShapeLog()
        self.training_model = self.tracker = None  # what lives while run() runs: opened there, closed at its end

    # the model state's parts, by the names the step and its helpers (aiayn.memory, aiayn.train.divergence) use
    model = property(lambda self: self.state.model)
    optimizer = property(lambda self: self.state.optimizer)
    scaling = property(lambda self: self.state.scaling)
    precision = property(lambda self: self.state.precision)  # what `auto` became here
    checkpoint_dir = property(lambda self: self.checkpoints.folder)

    def _resume(self) -> Path | None:
        """Load the newest checkpoint that loads into the model state, settings and progress; its path."""
        resumed = self.checkpoints.resume(self.state, self.settings, warn=self.dist.is_main)
        if resumed is None:
            return None
        self.settings, self.progress = resumed.settings, resumed.progress
        return resumed.path

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
        """The step's one host-device synchronisation (``aiayn.train.loop.agreed_outcome``): its loss, gradient
        norm and every process's votes, with rank 0's decision on a budgeted run's window checkpoint."""
        self.scaling.unscale(self.optimizer)  # fp16: the gradients as Adam will read them
        # measured, not clipped (the paper does not clip, so no pass scales the gradients); the same on
        # every process after DDP
        gradients = [p.grad for p in self.model.parameters() if p.grad is not None]
        stop_after, clock = self.job.stop_after_steps, self.progress.wall_seconds + self.clock() - loop_start
        outcome = agreed_outcome(
            sums, torch.nn.utils.get_total_norm(gradients).double() / self.world, self.world,
            stopping=(stop.signal is not None or (stop_after is not None and step - start_step >= stop_after)
                      or self.dev.monitor.stop_reason is not None),
            over_budget=clock >= budget, last_step=step == self.settings.steps,
            window=self.dist.is_main and window_vote(self.settings, self.progress, step, clock),
            clock=clock if self.dist.is_main else 0.0)
        if outcome.window:
            self.progress.window_clock = clock  # saved with the checkpoint: a resumed run spaces from it
        return outcome

    def optimizer_step(self, step: int, grad_norm: float) -> float:
        lr = self.schedule.lr(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.scaling.step(self.optimizer, grad_norm)  # fp16: none where the gradients overflowed
        self.optimizer.zero_grad(set_to_none=True)
        return lr

    def save_checkpoint(self, window: bool) -> Path:
        """Write this step's checkpoint (``aiayn.train.resume.Checkpoints.save``)."""
        self.progress.budget_schedule = self.schedule.state_dict()
        return self.checkpoints.save(self.state, self.progress, self.settings, window)

    # --- the loop and its end -------------------------------------------------------------

    def run(self) -> dict:
        """Train until the last step or the time budget; returns the summary written to ``final.json``."""
        settings, main = self.settings, self.dist.is_main
        facts = RunFacts(self.model.num_parameters(), self.world, settings.device_tokens, self.device_name,
                         self.precision)
        self.tracker = (start_tracking(self.job, self.data, facts, self.resumed_from, self.progress.step)
                        if main else None)
        self.loop = loop = LoopState.open(self.job.preset["name"], settings, self.progress,
                                          main and self.job.progress_bar, self.clock())
        status, agreed_stop = "FAILED", False
        try:
            self.training_model = self.state.training_objective(settings, self.world, self.device)
            self.training_model.train()
            # within the loop the budget ends a run only through the vote (outcome.last), so that every
            # process stops at the same step and that step is written as a window checkpoint
            spent_before = self.progress.wall_seconds >= loop.budget  # a rerun of a run that spent its budget
            while self.progress.step < settings.steps and not spent_before:
                outcome = self.train_step(self.progress.step + 1)
                if outcome is None:  # rolled back: the steps from the checkpoint again
                    continue
                if outcome.last:
                    break
                if outcome.stopping:  # agreed: every process stops here, its checkpoint written
                    agreed_stop, error = True, stop_error(self)
                    status = "KILLED" if isinstance(error, Preempted) else status
                    raise error
            loop.bar.close()
            if main and not self.checkpoints.written(self.progress.step) and self.progress.step:
                self.save_checkpoint(window=True)  # the run's end is always in the averaging window
            # rank 0: the final dev evaluation, final.pt and final.json
            summary = (write_final(self, self.dev.final(self.model, settings, self.progress, self.tracker))
                       if main else {})
            status = "FINISHED"
            return summary
        finally:
            loop.bar.close()
            if self.tracker is not None:
                self.tracker.end(status)
            if self.world > 1 and torch.distributed.is_initialized():
                leave_process_group(self, everyone_here=agreed_stop or status == "FINISHED")

    def train_step(self, step: int) -> StepOutcome | None:
        """Step ``step`` from its batches to its checkpoint; its outcome, or None where it diverged and the run
        went back to its last checkpoint (``aiayn.train.divergence``)."""
        progress, loop, main = self.progress, self.loop, self.dist.is_main
        loop_start, step_start = self.clock(), time.perf_counter()
        micro, shape = self.source.next(progress)
        micro, shape, sums = fit_step(self, step, micro, shape)  # split anew if memory runs out
        # every process knows the whole step's sizes: no communication before the forward pass
        flops = 3.0 * sum(forward_flops(self.model_config, *dims) for dims in shape.shapes)  # backward ~ 2x
        outcome = self.agree(step, sums, loop.stop, loop.start_step, loop_start, loop.budget)
        if self.guard.rolled_back(self, step, outcome, shape.real_tgt):
            loop.rolled_back_to(self.progress.step)
            return None
        lr = self.optimizer_step(step, outcome.grad_norm)
        revise_schedule(self, step, outcome.clock)
        seconds = time.perf_counter() - step_start
        progress.account(step, shape, flops, seconds)
        self.shape_log.step(shape.shapes[self.dist.rank::self.world], progress, seconds)
        loop.window.add(outcome, shape, seconds, flops)
        loop.bar.update(1)
        if main and (step % self.settings.log_every == 0 or outcome.last):
            self.log_step(step, outcome, lr)
        if main and self.dev.enabled and self.settings.dev_every and step % self.settings.dev_every == 0:
            self.dev.during_training(step, self.model, self.settings, progress, self.tracker)
        progress.wall_seconds += self.clock() - loop_start
        window_step, due = loop.checkpoint_due(self.settings, step, outcome, self.clock())
        if main and due:
            self.save_checkpoint(window=window_step)
            loop.last_checkpoint_time = self.clock()
        return outcome

    def log_step(self, step: int, outcome: StepOutcome, lr: float) -> None:
        """The means of the steps since the last log line, to MLflow and the progress bar."""
        progress = self.progress
        metrics = self.loop.window.metrics(self.peak, self.world)
        metrics.update({"lr": lr, "grad_norm": outcome.grad_norm, "train_flops": progress.train_flops,
                        "epoch": progress.epoch, **progress.shape_costs(), **self.scaling.metrics()})
        self.tracker.log_metrics(metrics, step)
        self.loop.show(metrics, lr)


def revise_schedule(trainer: Trainer, step: int, clock: float) -> None:
    """The schedule's revision after step ``step`` (``aiayn.train.budget_schedule.revise``); where a budget
    schedule's first fit chose smaller steps (``budget_min_steps``), the steps to come are cut at that size, from
    the same place in the epoch: alike on every process, which all fit on the same agreed clock."""
    revise(trainer.schedule, step, clock, trainer.tracker if trainer.dist.is_main else None)
    settings = fitted_batch(trainer.settings, trainer.schedule.tokens_per_step)
    if settings is not trainer.settings:
        trainer.settings, trainer.source = settings, trainer.source.recut(settings, trainer.progress)


def stop_error(trainer: Trainer) -> Exception:
    """What an agreed stop raises: ``TrainingOffCourse`` where rank 0's monitor asked for it (train.off_course:
    stop), else ``Preempted`` (a signal, --stop-after-steps)."""
    where = f"step {trainer.progress.step}"
    if trainer.dev.monitor.stop_reason is not None:
        return TrainingOffCourse(f"{trainer.dev.monitor.stop_reason}. It stopped at {where} (train.off_course: "
                                 f"stop; warn lets such a run go on); its checkpoints are kept in "
                                 f"{trainer.checkpoint_dir}")
    return Preempted(f"stopped at {where}; checkpoint written to {trainer.checkpoint_dir}")


def leave_process_group(trainer: Trainer, everyone_here: bool) -> None:
    """Take the process group down while every peer still holds its own. DDP's reducer (in the trainer's
    objective) keeps the group alive past ``destroy_process_group``; freed later, once a peer had exited,
    gloo's destructor waited for its threads for ever (seen as a hang at the end of a finished run)."""
    if everyone_here:  # the end and a preemption are agreed by a vote: all processes are here
        torch.distributed.barrier()
    trainer.training_model = None
    gc.collect()
    torch.distributed.destroy_process_group()


def train(job: TrainJob) -> dict:
    """Train (or resume) one run; returns the summary written to ``final.json`` (empty off rank 0)."""
    return Trainer(job).run()

