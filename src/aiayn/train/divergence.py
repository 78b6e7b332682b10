"""A diverged run stops early, with its reason, after one retry from its last checkpoint.

Checked at every step before the optimizer step, so that a diverged step never reaches the weights:

- ``non-finite``: the training loss, or the gradient norm, is NaN or infinite. Under fp16 a gradient
  overflow is a skipped step, not divergence (``aiayn.train.precision``), while the loss scale lasts.
- ``spike``: the step's training loss per target token is above mean + ``train.spike_sigmas`` x std of
  the last ``train.spike_window`` steps' losses and above ``SPIKE_RATIO`` x their mean (a run with a
  steady loss, whose std is tiny, is not stopped by noise). It is checked once the window is full, counted
  from this process's start (a resumed run fills it again).

Where one fires, the run goes back to its newest checkpoint that loads (window or safety: what a
resume would take) and takes the steps again. Its batches and dropout follow from (seed, step)
(``aiayn.train.steps``), so the retry computes the same steps: a passing fault (a flipped bit, a
kernel that is not deterministic) is gone and the run ends as an uninterrupted one would, while the
run's own divergence comes back. If a rule fires again before the run has passed the step where it
first fired, the run stops with ``TrainingDiverged`` (exit 2): the step, the loss, the learning rate,
the rule, and the settings most often at fault. Its checkpoints are kept. Without a checkpoint yet it
stops at once, saying so.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import deque

from aiayn.checkpoint import list_checkpoints
from aiayn.errors import UserError

SPIKE_RATIO = 1.5


class TrainingDiverged(UserError):
    """The loss or the gradient norm became NaN or infinite, or the loss spiked, again after a retry."""


class DivergenceGuard:
    """The rules above for one ``Trainer``; ``rolled_back`` is called once a step."""

    def __init__(self, window: int, sigmas: float):
        self.window, self.sigmas = window, sigmas
        self.losses: deque[tuple[int, float]] = deque(maxlen=window or None)  # (step, loss per token)
        self.retrying_until: int | None = None  # the step whose rule fired, while its retry runs

    @classmethod
    def from_section(cls, train_section: dict) -> "DivergenceGuard":
        """With ``train.spike_window`` and ``train.spike_sigmas`` of a section the config door filled."""
        return cls(train_section["spike_window"], train_section["spike_sigmas"])

    def fired(self, step: int, loss: float, grad_norm: float, skipped: bool) -> tuple[str, str] | None:
        """What happened and the rule that fired, in words, or None (then the loss joins the window)."""
        for what, value in (("training loss", loss), ("gradient norm", grad_norm)):
            if not math.isfinite(value) and not (skipped and what == "gradient norm"):
                return f"the {what} became {value}", "non-finite (a NaN or infinite loss or gradient norm)"
        if self.window and len(self.losses) == self.window:
            recent = [value for _, value in self.losses]
            mean, std = statistics.fmean(recent), statistics.pstdev(recent)
            if loss > mean + self.sigmas * std and loss > SPIKE_RATIO * mean:
                return (f"the training loss spiked to {loss:.4g}",
                        f"spike (above mean + {self.sigmas:g} std = {mean:.4g} + {self.sigmas:g} x {std:.4g}, and "
                        f"above {SPIKE_RATIO:g} x the mean, of the last {self.window} steps' losses: "
                        "train.spike_window, train.spike_sigmas)")
        self.losses.append((step, loss))
        if self.retrying_until is not None and step > self.retrying_until:
            self.retrying_until = None  # past the step that fired: the retry is over
        return None

    def rolled_back(self, trainer, step: int, outcome, tokens: int) -> bool:
        """Whether step ``step`` diverged and ``trainer`` went back to its last checkpoint (then the
        caller starts the loop again from there); raises ``TrainingDiverged`` where it may not."""
        loss = outcome.loss_sum / max(tokens, 1)
        fired = self.fired(step, loss, outcome.grad_norm, trainer.scaling.skips(outcome.grad_norm))
        if fired is None:
            return False
        what, rule = fired
        settings, preset = trainer.settings, trainer.job.preset
        lr = trainer.schedule.lr(step)
        start = f"{what} at step {step} (preset {preset['name']})"
        if self.retrying_until is None:
            checkpoint = roll_back(trainer)
            if checkpoint is not None:
                self.retrying_until = step
                self.losses = deque(((s, value) for s, value in self.losses if s <= trainer.progress.step),
                                    maxlen=self.losses.maxlen)
                if trainer.dist.is_main:
                    print(f"warning: {start}; going back to {checkpoint.name} (step {trainer.progress.step}) to "
                          "take the steps again once", file=sys.stderr)
                return True
            where = "; no checkpoint was written before it, so there is none to go back to"
        else:
            where = (f"; the last good checkpoint is kept in {trainer.checkpoint_dir}, and the run went back to "
                     f"it and took the steps again: they are deterministic, so this is the run's own divergence, "
                     "not a passing fault")
        raise TrainingDiverged(
            f"{start}{where}. The rule that fired: {rule}. The loss per target token was {loss:.4g} and the "
            f"learning rate {lr:.3g}. The settings most often at fault: lr_scale = {settings.lr_scale:g} (lower "
            f"it), warmup_steps = {settings.warmup_steps} (raise it), train.precision = {trainer.precision}"
            f"{'' if trainer.precision == 'fp32' else ' (fp32 has the most range)'}{trainer.scaling.advice()}; then rerun to resume from the last checkpoint")


def roll_back(trainer):
    """Load ``trainer``'s newest checkpoint as a resume would (``Trainer._resume``), keeping the clock
    spent so far; the checkpoint's path, or None where there is none."""
    progress, optimizer = trainer.progress, trainer.optimizer
    if not list_checkpoints(trainer.checkpoint_dir, safety=True):
        return None
    if trainer.scaling.enabled:  # fp16: close the step the gradients were unscaled for, changing nothing
        trainer.scaling.step(optimizer, math.inf)
    optimizer.zero_grad(set_to_none=True)
    spent = progress.wall_seconds, progress.elapsed_seconds
    path = trainer._resume()
    if path is None:
        return None
    vars(progress).update(vars(trainer.progress))  # the loop's Progress, now the checkpoint's
    progress.wall_seconds, progress.elapsed_seconds = spent
    trainer.progress = progress
    return path
