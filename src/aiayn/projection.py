"""Where a run's dev perplexity will end, with an interval: by its reference, else by a power law.

By the reference (``project_by_reference``), where the run's reference is a curve of the same preset that ends at
the run's last step: the run's ratio to the reference's mean (in log perplexity, over its last
``REFERENCE_POINTS`` dev evaluations) is carried to the reference's end. It holds from the first dev
evaluation on, warmup included, where a fit to the curve alone does not. Its interval: the reference's seed band
at the end, widened either side by ``REFERENCE_FLOOR`` in log perplexity (calibrated on the demo's runs, each
against a reference of its other two seeds: bench/train/projection.py, BENCHMARKS.md).

Else the power law, below.

The fit (``fit_power_law``): ``ppl = floor + b * x^-c`` with ``x`` the area under the paper's learning-rate
schedule up to the step (``lr_area``, Section 5.3's shape; its scale cancels into ``b``). After warmup the
area grows as the square root of the step, so this is a power law in steps; during warmup it follows how far
the weights have been moved, which steps alone do not. Least squares on ``log ppl``: for each floor on a grid
below the lowest point, ``log(ppl - floor)`` is linear in ``log x``, and the floor with the smallest squared
error in ``log ppl`` wins. Fitted on the later half of the curve so far (the dev evaluations from half the
current step on), and only from the warmup's end on; the projection is never above the last point.

The interval (``project``): the projections of the fits that leave out one point each (a jackknife) give a
spread in log perplexity; the interval is the projection times ``exp(+-(INTERVAL_Z * spread + INTERVAL_FLOOR))``.
The two constants were calibrated on this project's runs (``bench/train/projection.py``, BENCHMARKS.md): every
projection the demo's runs make after warmup, and a recorded Multi30k run's, holds the measured end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

MIN_POINTS = 4  # fewer points than this (3 parameters, and one to spare) give no projection
FLOOR_GRID = 64  # floors tried between 1 and just below the lowest perplexity seen
INTERVAL_Z = 2.0
INTERVAL_FLOOR = 0.30  # the interval is never narrower than this in log perplexity: x/÷ 1.35
REFERENCE_POINTS = 3  # the last dev evaluations whose mean ratio to the reference is carried to its end
REFERENCE_FLOOR = 0.32  # in log perplexity, beyond the reference's own end band: x/÷ 1.38 more


@dataclass(frozen=True)
class Projection:
    """The dev perplexity projected to ``step``, with its interval, from ``points`` dev evaluations."""

    step: int
    ppl: float
    low: float
    high: float
    points: int
    method: str = "power law"  # or "reference"

    def covers(self, measured: float) -> bool:
        return self.low <= measured <= self.high

    def metrics(self) -> dict[str, float]:
        return {"dev_ppl_projected": self.ppl, "dev_ppl_projected_low": self.low, "dev_ppl_projected_high": self.high}


def lr_area(steps: Sequence[int], warmup_steps: int):
    """The sum of ``min(t^-0.5, t * warmup^-1.5)`` over t = 1..step, for each step (the schedule's shape)."""
    import numpy as np

    steps = np.asarray(steps, dtype=np.int64)
    t = np.arange(1, int(steps.max()) + 1, dtype=np.float64)
    rate = np.minimum(t ** -0.5, t * max(warmup_steps, 1) ** -1.5)
    return np.cumsum(rate)[steps - 1]


def fit_power_law(x: Sequence[float], ppl: Sequence[float]) -> tuple[float, float, float]:
    """``(floor, b, c)`` of ``ppl = floor + b * x^-c``, least squares on log perplexity over a grid of floors."""
    import numpy as np

    x, ppl = np.asarray(x, dtype=np.float64), np.asarray(ppl, dtype=np.float64)
    log_x, log_ppl = np.log(x), np.log(ppl)
    best = None
    lowest = float(ppl.min())
    for floor in np.linspace(1.0, 1.0 + (lowest - 1.0) * 0.98, FLOOR_GRID) if lowest > 1.0 else [0.0]:
        slope, intercept = np.polyfit(log_x, np.log(ppl - floor), 1)
        if slope >= 0:  # a curve that does not fall: no power law to extrapolate
            continue
        predicted = np.log(floor + np.exp(intercept) * x ** slope)
        error = float(np.sum((predicted - log_ppl) ** 2))
        if best is None or error < best[0]:
            best = (error, float(floor), float(np.exp(intercept)), float(-slope))
    if best is None:
        return lowest, 0.0, 0.0  # flat or rising: the best guess is where it is
    return best[1:]


def _at(fit: tuple[float, float, float], x: float) -> float:
    floor, b, c = fit
    return floor + b * x ** -c


def project(history: Sequence[dict], final_step: int, warmup_steps: int) -> Projection | None:
    """The dev perplexity at ``final_step`` projected from ``history`` (dev evaluations: ``step``, ``dev_ppl``),
    or None with fewer than ``MIN_POINTS`` finite points or before the warmup's end: while the learning rate still
    rises, the curve has not shown its course (bench/train/projection.py measures what a fit there misses by)."""
    import numpy as np

    points = sorted((int(entry["step"]), float(entry["dev_ppl"])) for entry in history
                    if entry.get("dev_ppl") is not None and math.isfinite(entry["dev_ppl"]) and entry["step"] > 0)
    if len(points) < MIN_POINTS or points[-1][0] < warmup_steps:
        return None
    # the later half of the curve so far (at least MIN_POINTS points): the steep fall of the first steps
    # follows another course than the end does
    later = [point for point in points if point[0] >= points[-1][0] / 2]
    points = later if len(later) >= MIN_POINTS else points[-MIN_POINTS:]
    steps = [step for step, _ in points]
    areas = lr_area(steps + [max(final_step, steps[-1])], warmup_steps)
    x, x_final, ppl = areas[:-1], float(areas[-1]), np.array([value for _, value in points])
    centre = min(_at(fit_power_law(x, ppl), x_final), points[-1][1])  # never projected to rise
    left_out = [math.log(_at(fit_power_law(np.delete(x, i), np.delete(ppl, i)), x_final)) for i in range(len(points))]
    spread = float(np.sqrt((len(points) - 1) / len(points) * np.sum((np.array(left_out) - np.mean(left_out)) ** 2)))
    width = INTERVAL_Z * spread + INTERVAL_FLOOR
    return Projection(step=final_step, ppl=centre, low=centre * math.exp(-width), high=centre * math.exp(width),
                      points=len(points))


def follows_reference(reference: dict | None, final_step: int) -> bool:
    """Whether ``reference`` is a curve that ends at ``final_step`` (the same plan), so a run can be projected by it."""
    return bool(reference and reference.get("kind") == "curve" and reference.get("points")
                and reference["points"][-1]["step"] == final_step)


def project_by_reference(history: Sequence[dict], reference: dict | None, final_step: int) -> Projection | None:
    """The dev perplexity at ``final_step`` as the reference's mean there times the run's ratio to that mean over
    its last ``REFERENCE_POINTS`` dev evaluations; None where the reference does not end at ``final_step``, or
    the run has no dev evaluation within the reference's steps."""
    from aiayn.reference import mean_at

    if not follows_reference(reference, final_step):
        return None
    means = [(float(entry["dev_ppl"]), mean_at(reference, int(entry["step"]))) for entry in history
             if entry.get("dev_ppl") is not None and math.isfinite(entry["dev_ppl"]) and entry["step"] > 0]
    ratios = [math.log(ppl / mean) for ppl, mean in means if mean is not None][-REFERENCE_POINTS:]
    if not ratios:
        return None
    end = reference["points"][-1]["dev_ppl"]
    centre = end["mean"] * math.exp(sum(ratios) / len(ratios))
    width = math.log(end["high"] / end["low"]) + REFERENCE_FLOOR
    return Projection(step=final_step, ppl=centre, low=centre * math.exp(-width), high=centre * math.exp(width),
                      points=len(ratios), method="reference")


def projection_for(history: Sequence[dict], final_step: int, warmup_steps: int,
                   reference: dict | None = None) -> Projection | None:
    """What the trainer says at a dev evaluation: by the reference where it can (``follows_reference``), else the
    power law (after warmup)."""
    return project_by_reference(history, reference, final_step) or project(history, final_step, warmup_steps)
