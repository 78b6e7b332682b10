"""What the training loop keeps between steps: the stop flag, the time budget, the progress bar, the window
of steps since the last log line, and when the last checkpoint was written; and what every process makes of
a step (``agreed_outcome``)."""

from __future__ import annotations

import math
import signal
import sys
from dataclasses import dataclass, field

import torch

from aiayn.train.steps import LogWindow, Progress, StepOutcome, TrainSettings
from aiayn.train.window import in_window


class StopFlag:
    """Set by SIGTERM or SIGUSR1 (what SLURM sends before a kill or requeue)."""

    def __init__(self):
        self.signal: int | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal = signum


@dataclass
class LoopState:
    """One ``Trainer.run``'s state beyond ``Progress`` (which a checkpoint saves)."""

    stop: StopFlag
    bar: object  # a tqdm bar
    start_step: int
    budget: float  # seconds: train.max_minutes (inf without a budget)
    last_checkpoint_time: float
    window: LogWindow = field(default_factory=LogWindow)

    @classmethod
    def open(cls, name: str, settings: TrainSettings, progress: Progress, show_bar: bool, now: float) -> "LoopState":
        """Listening for SLURM's signals, with a progress bar (``show_bar``) named ``name``."""
        from tqdm import tqdm

        stop = StopFlag()
        stop.install()
        bar = tqdm(total=settings.steps, initial=progress.step, desc=name, unit="step", disable=not show_bar,
                   mininterval=1.0, file=sys.stderr)
        budget = settings.max_minutes * 60 if settings.max_minutes else math.inf
        return cls(stop, bar, progress.step, budget, now)

    def rolled_back_to(self, step: int) -> None:
        """The run went back to step ``step``'s checkpoint (``aiayn.train.divergence``): count from there."""
        self.bar.n, self.window = step, LogWindow()

    def show(self, metrics: dict[str, float], lr: float) -> None:
        self.bar.set_postfix(loss=f"{metrics['train_loss']:.3f}", lr=f"{lr:.2e}",
                             tok_s=f"{metrics['target_tokens_per_second']:.0f}")

    def checkpoint_due(self, settings: TrainSettings, step: int, outcome: StepOutcome, now: float) -> tuple[bool, bool]:
        """(a window checkpoint, any checkpoint) for step ``step``: in the averaging window, every
        train.checkpoint_minutes, or on a stop."""
        # a run that ends at its time budget ends normally: its last step joins the window
        window_step = in_window(settings, step, outcome)
        due_time = settings.checkpoint_minutes and now - self.last_checkpoint_time >= settings.checkpoint_minutes * 60
        return window_step, bool(window_step or due_time or outcome.stopping)


def agreed_outcome(sums: torch.Tensor, grad_norm: torch.Tensor, world: int, *, stopping: bool, over_budget: bool,
                   window: bool, last_step: bool, clock: float = 0.0) -> StepOutcome:
    """What every process makes of a step, from one all-reduce of its votes: the loss sums and gradient norm
    (summed over processes), a stop (a signal, --stop-after-steps), the end (the last step, or the time budget
    spent: so that all stop at the same step), a window checkpoint (rank 0's vote) and the run's clock (rank 0's:
    ``clock`` is 0 elsewhere), which a budget schedule reads alike on every process."""
    votes = torch.zeros(7, dtype=torch.float64, device=sums.device)
    votes[:2] = sums
    votes[2] = grad_norm
    votes[3], votes[4], votes[5], votes[6] = float(stopping), float(over_budget), float(window), clock
    if world > 1:
        torch.distributed.all_reduce(votes)
    loss_sum, nll_sum, grad_norm_sum, stop_votes, budget_votes, window_votes, run_clock = votes.tolist()
    return StepOutcome(loss_sum, nll_sum, grad_norm_sum, stopping=stop_votes > 0,
                       last=last_step or budget_votes > 0, window=window_votes > 0, clock=run_clock)
