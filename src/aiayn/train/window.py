"""Which steps write the window checkpoints that the average stage averages.

The paper averaged the last 5 checkpoints written at 10-minute intervals of a 12-hour run (base: 720 / 10
= 72 intervals of the run) and the last 20 of a 3.5-day run (big: 504 intervals), so the average spans
the same share of training whatever the hardware. A step-planned run keeps that share in steps: a window
checkpoint every ``checkpoint_steps`` counted back from the last step (``aiayn.checkpoint.is_window_step``).

A run with a time budget (``train.max_minutes``, or a preset's own) does not know its last step. It
writes a window checkpoint each time its clock (``Progress.wall_seconds``, summed over resumes) passes
one of the times ``end - k * interval``, k = 1 .. ``average_last``: ``end`` is the run's expected end
(the budget, or sooner if the step ceiling comes first at the mean step time so far), ``interval`` is
``end / budget_intervals`` but never less than the mean step time. With the run's last step these are
``average_last`` + 1 checkpoints (one spare, for an end that comes sooner than expected), and the last
``average_last`` of them span the paper's share of what the run trained wherever the budget stops it;
a short budget, whose interval would be under a step, writes them one step apart.
"""

from __future__ import annotations

import math

from aiayn.checkpoint import is_window_step


def expected_end(budget: float, clock: float, step: int, steps: int) -> float:
    """Seconds of the run's clock at which it will end: the budget, or the step ceiling (``steps``) at
    the mean time of the ``step`` steps taken by ``clock`` seconds, whichever comes first."""
    return min(budget, clock + (steps - step) * clock / max(step, 1))


def window_interval(end: float, intervals: int, mean_step: float) -> float:
    """The paper's interval for a run of ``end`` seconds, but at least one mean step."""
    return max(end / intervals, mean_step)


def budget_window_due(clock: float, last_window: float | None, step: int, steps: int, budget: float,
                      intervals: int, count: int) -> bool:
    """Whether step ``step``, the run's clock at ``clock`` seconds, writes a window checkpoint: the newest
    window time passed (``end - k * interval`` <= ``clock``, 1 <= k <= ``count``) is later than the clock
    of the last window checkpoint (``last_window``; None before the first), and the two are at least
    half an interval apart (the expected end moves a little from step to step). The run's last step
    (the budget spent or ``steps`` reached) is always in the window and is not decided here."""
    mean_step = clock / max(step, 1)
    end = expected_end(budget, clock, step, steps)
    interval = window_interval(end, intervals, mean_step)
    k = math.ceil((end - clock) / interval - 1e-9)  # the smallest k whose time has come
    if k < 1:
        k = 1
    if k > count:
        return False  # too early: this window time would fall out of the average
    newest = end - k * interval
    if newest > clock:
        return False
    return last_window is None or (newest > last_window and clock - last_window >= interval / 2)


def budget_window_steps(step_seconds: list[float], budget: float, steps: int, intervals: int,
                        count: int) -> list[int]:
    """The window steps of a budgeted run whose steps take ``step_seconds`` (repeated, on the run's clock):
    what the trainer writes, played on a given step rate (for tests and for planning)."""
    clock, last_window, window = 0.0, None, []
    for step in range(1, steps + 1):
        clock += step_seconds[(step - 1) % len(step_seconds)]
        if clock >= budget or step == steps:
            return window + [step]
        if budget_window_due(clock, last_window, step, steps, budget, intervals, count):
            window.append(step)
            last_window = clock
    return window


def window_vote(settings, progress, step: int, clock: float) -> bool:
    """``budget_window_due`` for the trainer's step ``step`` at ``clock`` seconds of its run (its
    ``TrainSettings`` and ``Progress``); always False for a step-planned run (no time budget)."""
    if not settings.max_minutes:
        return False
    return budget_window_due(clock, progress.window_clock, step, settings.steps, settings.max_minutes * 60,
                             settings.budget_intervals, settings.average_last)


def in_window(settings, step: int, outcome) -> bool:
    """Whether step ``step``'s checkpoint enters the averaging window: the run's last step always; before
    it, a budgeted run's by its clock (``outcome.window``), a step-planned run's every ``checkpoint_steps``
    counted back from its last step."""
    if outcome.last:
        return True
    if settings.max_minutes:
        return outcome.window
    return is_window_step(step, settings.steps, settings.checkpoint_steps)
