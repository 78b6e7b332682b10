"""A time-budgeted run's learning-rate schedule, fitted to the steps its budget will hold.

A step-planned schedule (warmup, then the paper's inverse square root) is a different schedule on every machine
when a clock ends the run: a slow box spends its budget climbing, a fast one decays for most of it. With
``schedule: budget`` a run with a time budget (``train.max_minutes``) measures its own pace and fits:

- the warmup (``budget_warmup``): ``share``: ``budget_warmup_share`` of the projected steps, at most the preset's
  ``warmup_steps``, climbing to the paper's peak (the formula at the preset's ``warmup_steps`` and ``lr_scale``),
  so more steeply than the preset where it is shorter; ``slope``: the preset's own warmup, at its slope, cut
  where the decay must begin, its peak the learning rate it reached there (the paper's peak where the budget
  holds the whole warmup), the cut revised with the projection while the ramp climbs. Until the first
  ``MEASURE_STEPS`` steps have given a pace, the ramp climbs at the preset's slope;
- the stable phase: the peak held until the decay ("warmup-stable-decay"), so a young run keeps its learning rate;
- the decay: over the last ``budget_decay_share`` of the projected steps, from the peak to ``budget_floor`` x peak
  at the projected last step, ``linear`` or ``cosine``. A share of 1 decays from the warmup's end on;
- the step (``budget_min_steps``): a budget that would hold fewer steps trains smaller ones from the first fit on
  (at least ``budget_min_tokens``), sized so that it holds about that many: a short budget learns more from
  more updates of fewer tokens than from a few large ones (BENCHMARKS.md).

The pace is the median seconds a step over the last ``RATE_WINDOW`` steps, plus the run's overhead per step (the
time of dev evaluations and checkpoints beyond a step, over the steps up to the last of them), so a dev evaluation
does not read as a slowdown while a second job on the machine does. Every ``REVISE_EVERY`` steps the projection is revised; in the
decay (or when a revision moves the decay's start to a step already made) a revision restarts the shape from the
current step and learning rate towards the new end, so it never raises the learning rate. The state is plain
data, saved with each checkpoint: a resumed run continues it.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field, replace

from aiayn.train.schedule import learning_rate

MEASURE_STEPS = 10  # steps timed before the first fit (the first ones also allocate and warm caches)
SKIP_STEPS = 2      # the first steps, left out of the pace
RATE_WINDOW = 50    # the recent steps the pace is measured on
REVISE_EVERY = 10   # steps between revisions of the projection
SHAPES = ("linear", "cosine")
NOTEWORTHY = 0.05   # a revision that moves the projection by this share is logged (every one is in final.json)


def decay_shape(shape: str, fraction: float) -> float:
    """The share of the way from the floor to the start left at ``fraction`` (0..1) of a decay."""
    fraction = min(max(fraction, 0.0), 1.0)
    if shape == "linear":
        return 1.0 - fraction
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * fraction))
    raise ValueError(f"unknown decay shape {shape!r} (one of {', '.join(SHAPES)})")


@dataclass
class BudgetSchedule:
    """The fitted schedule and what it has measured (``state_dict`` / ``from_state``: the checkpoint's copy)."""

    peak: float
    floor: float            # the learning rate at the budget's end
    preset_warmup: int
    warmup_share: float
    shape: str
    budget: float           # seconds on the run's clock
    decay_share: float = 1.0            # the decay runs over this share of the projected steps, at the end
    warmup_mode: str = "share"          # or "slope": the preset's warmup, cut where the decay begins
    warmup: int | None = None           # fitted at step MEASURE_STEPS
    ramp_from: list = field(default_factory=list)   # [step, lr] where the fitted ramp starts
    anchor: list = field(default_factory=list)      # [step, lr] where the current decay starts
    end_step: int | None = None         # the projected last step
    marks: list = field(default_factory=list)       # [step, clock] of the recent steps: the pace
    overhead: list = field(default_factory=lambda: [0, 0.0])  # [step, seconds]: beyond the pace, to the last one
    revisions: list = field(default_factory=list)   # {step, projected_steps, lr, seconds_per_step}
    tokens_per_step: int = 0            # the step's tokens: the preset's, or what the first fit chose
    min_steps: int = 0                  # budget_min_steps: fewer projected trains smaller steps (0: never)
    min_tokens: int = 0                 # budget_min_tokens: the smallest step the fit chooses

    def lr(self, step: int) -> float:
        """The learning rate of step ``step``."""
        if self.warmup is None:
            return self.peak * step / self.preset_warmup
        if step <= self.warmup:
            ramp_step, ramp_lr = self.ramp_from
            if self.warmup <= ramp_step:
                return self.peak
            return ramp_lr + (self.peak - ramp_lr) * (step - ramp_step) / (self.warmup - ramp_step)
        start, start_lr = self.anchor if self.anchor else (self.decay_start(self.end_step), self.peak)
        if step <= start:
            return self.peak  # the stable phase
        span = max(self.end_step - start, 1)
        return self.floor + (start_lr - self.floor) * decay_shape(self.shape, (step - start) / span)

    def decay_start(self, end_step: int) -> int:
        """The step after which the decay to a projected last step ``end_step`` begins."""
        return max(self.warmup, end_step - round(self.decay_share * end_step))

    def cut_warmup(self, step: int, projected: int) -> None:
        """``slope``: the warmup cut where the decay to ``projected`` steps must begin (never before ``step``, never
        beyond the preset's), its peak and floor what the preset's slope reaches there."""
        end = max(projected, step + 1)
        warmup = max(min(end - round(self.decay_share * end), self.preset_warmup), step)
        self.peak *= warmup / self.warmup
        self.floor *= warmup / self.warmup
        self.warmup = warmup

    def fit_batch(self, step: int, clock: float, pace: float, projected: int) -> int:
        """At the first fit: where the budget holds fewer than ``min_steps`` steps, smaller steps (at least
        ``min_tokens``), sized on a pace in proportion to a step's tokens, so that it holds about ``min_steps``;
        the projected steps at the step chosen. The pace is measured afresh on the new steps."""
        tokens = self.tokens_per_step
        if not self.min_steps or projected >= self.min_steps or tokens <= self.min_tokens:
            return projected
        left = max(self.budget - clock, 0.0)
        fitted = max(self.min_tokens, min(tokens, int(tokens * left / (pace * max(self.min_steps - step, 1)))))
        self.tokens_per_step = fitted
        self.marks = [[step, clock]]  # the recent steps' pace was the old step's
        return step + int(left / max(pace * fitted / tokens, 1e-9))

    def observe(self, step: int, clock: float) -> dict | None:
        """Step ``step`` is done, the run's clock (summed over resumes, the same on every process) at ``clock``
        seconds. Returns the revision made, if any."""
        previous = self.marks[-1] if self.marks else None
        self.marks = (self.marks + [[step, clock]])[-(RATE_WINDOW + 1):]
        gaps = [b[1] - a[1] for a, b in zip(self.marks, self.marks[1:]) if b[0] == a[0] + 1 and a[0] >= SKIP_STEPS]
        if not gaps:
            return None  # the first steps, or just resumed
        step_pace = sorted(gaps)[len(gaps) // 2]  # the median: a dev evaluation is not the pace
        if previous is not None and previous[0] == step - 1 and clock - previous[1] > 2 * step_pace:
            # a dev evaluation or a checkpoint: its time beyond a step, spread over the steps so far
            self.overhead = [step, self.overhead[1] + clock - previous[1] - step_pace]
        due = step == MEASURE_STEPS if self.warmup is None else step % REVISE_EVERY == 0
        if not due:
            return None
        pace = step_pace + (self.overhead[1] / self.overhead[0] if self.overhead[0] else 0.0)
        projected = step + max(int((self.budget - clock) / max(pace, 1e-9)), 0)
        lr_now = self.lr(step)
        first = self.warmup is None
        tokens = self.tokens_per_step
        if first:
            projected = self.fit_batch(step, clock, pace, projected)
            if self.warmup_mode == "slope":
                self.warmup = self.preset_warmup  # the preset's peak, cut just below
                self.cut_warmup(step, projected)
            else:
                self.warmup = max(min(round(self.warmup_share * projected), self.preset_warmup), step)
            self.ramp_from = [step, lr_now]
        elif self.warmup_mode == "slope" and step < self.warmup:
            self.cut_warmup(step, projected)  # still climbing at the preset's slope: the cut follows the projection
        end_step = max(projected, self.warmup + 1)
        if step > self.warmup and (self.anchor or step >= self.decay_start(end_step)):
            self.anchor = [step, lr_now]  # the decay goes on (or starts) from here: never back up
        self.end_step = end_step
        revision = {"step": step, "projected_steps": self.end_step, "lr": lr_now, "seconds_per_step": pace,
                    "tokens_per_step": self.tokens_per_step}
        if first and tokens != self.tokens_per_step:
            revision["preset_tokens"] = tokens
        self.revisions.append(revision)
        return revision

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> "BudgetSchedule":
        return cls(**state)

    def summary(self) -> dict:
        """What final.json and MLflow record of the fit."""
        first = self.revisions[0] if self.revisions else {}
        return {"budget_projected_steps": first.get("projected_steps"), "budget_final_projection": self.end_step,
                "budget_warmup": self.warmup, "budget_peak_lr": self.peak, "budget_floor_lr": self.floor,
                "budget_revisions": len(self.revisions), "budget_decay": self.shape,
                "budget_decay_share": self.decay_share, "budget_warmup_mode": self.warmup_mode,
                "budget_tokens_per_step": self.tokens_per_step, "budget_min_steps": self.min_steps,
                "budget_logged_revisions": [r for r in self.revisions if r.get("logged")]}


@dataclass(frozen=True)
class PaperSchedule:
    """The paper's schedule in steps (``aiayn.train.schedule.learning_rate``): nothing to measure or fit."""

    d_model: int
    warmup_steps: int
    lr_scale: float
    tokens_per_step: int = 0  # no step size chosen: the run's own

    def lr(self, step: int) -> float:
        return learning_rate(step, self.d_model, self.warmup_steps, self.lr_scale)

    def observe(self, step: int, clock: float) -> None:
        return None

    def state_dict(self) -> None:
        return None

    def summary(self) -> dict:
        return {}


def run_schedule(settings, d_model: int, saved: dict | None) -> PaperSchedule | BudgetSchedule:
    """The run's schedule: the paper's, or (``TrainSettings``' ``schedule: budget``) one fitted to the budget, or
    the fitted one its checkpoint saved (``saved``), which a resumed run goes on with."""
    if settings.schedule != "budget":
        return PaperSchedule(d_model, settings.warmup_steps, settings.lr_scale)
    if saved:
        return BudgetSchedule.from_state(saved)
    peak = learning_rate(settings.warmup_steps, d_model, settings.warmup_steps, settings.lr_scale)
    return BudgetSchedule(peak=peak, floor=settings.budget_floor * peak, preset_warmup=settings.warmup_steps,
                          warmup_share=settings.budget_warmup_share, shape=settings.budget_decay,
                          decay_share=settings.budget_decay_share, warmup_mode=settings.budget_warmup,
                          budget=settings.max_minutes * 60, tokens_per_step=settings.tokens_per_step,
                          min_steps=settings.budget_min_steps, min_tokens=settings.budget_min_tokens)


def fitted_batch(settings, tokens: int | None):
    """``settings`` with the step size ``tokens`` a budget schedule chose (None or 0: none chosen, ``settings``
    themselves): what the steps after its first fit, and a resumed run's, are cut at."""
    return settings if not tokens or tokens == settings.tokens_per_step else replace(settings, tokens_per_step=tokens)


def noteworthy(schedule: BudgetSchedule, revision: dict) -> bool:
    """Whether ``revision`` is the first fit, or moves the projection by ``NOTEWORTHY`` from the last logged."""
    logged = [r for r in schedule.revisions[:-1] if r.get("logged")]
    if not logged or abs(revision["projected_steps"] / logged[-1]["projected_steps"] - 1) >= NOTEWORTHY:
        revision["logged"] = True
        return True
    return False


def describe(schedule: BudgetSchedule, revision: dict) -> str:
    """The log's line for a logged revision."""
    if revision is schedule.revisions[0]:
        smaller = ""
        if "preset_tokens" in revision:
            smaller = (f"steps of {schedule.tokens_per_step} tokens from here on (at {revision['preset_tokens']} the "
                       f"budget would hold fewer than budget_min_steps, {schedule.min_steps}), so ")
        return (f"budget schedule: {revision['seconds_per_step']:.3f} s a step over the first steps; {smaller}about "
                f"{revision['projected_steps']} steps in {schedule.budget / 60:g} minutes: warmup {schedule.warmup} "
                f"steps to {schedule.peak:.3g}, held to step {schedule.decay_start(revision['projected_steps'])}, "
                f"then {schedule.shape} to {schedule.floor:.3g} at the budget's end")
    return (f"budget schedule revised at step {revision['step']}: {revision['seconds_per_step']:.3f} s a step, "
            f"the budget now ends at about step {revision['projected_steps']} (learning rate {revision['lr']:.3g}, "
            f"never raised)")


def revise(schedule: PaperSchedule | BudgetSchedule, step: int, clock: float, tracker) -> None:
    """The schedule's pace and projection after step ``step``; a noteworthy revision to the log and, on the process
    that tracks (``tracker``; None elsewhere), to MLflow."""
    revision = schedule.observe(step, clock)
    if revision is not None and tracker is not None and noteworthy(schedule, revision):
        print(describe(schedule, revision), file=sys.stderr)
        tracker.log_metrics({"budget_projected_steps": revision["projected_steps"]}, step)


def played(schedule: BudgetSchedule, step_seconds: list[float], overhead_every: int = 0,
           overhead_seconds: float = 0.0) -> list[tuple[int, float]]:
    """(step, lr) of every step of a run whose steps take ``step_seconds`` (repeated; a step the fit made smaller,
    its share of that), with ``overhead_seconds`` more on the clock every ``overhead_every`` steps (dev
    evaluations), until the budget is spent: what the trainer does, played on a given pace (for tests, planning)."""
    clock = 0.0
    out = []
    step = 0
    tokens = schedule.tokens_per_step  # a step fitted smaller takes its share of the time (as on a CPU)
    while clock < schedule.budget:
        step += 1
        out.append((step, schedule.lr(step)))
        clock += step_seconds[(step - 1) % len(step_seconds)] * (schedule.tokens_per_step / tokens if tokens else 1.0)
        schedule.observe(step, clock)
        if overhead_every and step % overhead_every == 0:
            clock += overhead_seconds  # after the step, as the trainer's dev evaluation
    return out
