"""The projection of the final dev perplexity: its fit recovers a power law, and its interval is stated."""

from __future__ import annotations

import math

import pytest

from aiayn.projection import MIN_POINTS, fit_power_law, lr_area, project


def history(steps, law):
    return [{"step": step, "dev_ppl": law(step)} for step in steps]


def test_the_fit_recovers_a_power_law_in_the_schedules_area():
    x = lr_area(range(100, 3001, 100), 400)
    floor, b, c = fit_power_law(x, [3.0 + 40.0 * value ** -0.8 for value in x])
    assert (floor, b, c) == pytest.approx((3.0, 40.0, 0.8), rel=0.03)


@pytest.mark.parametrize("warmup", [0, 400, 4000])
def test_a_power_law_in_steps_after_warmup_is_projected_within_its_interval_from_30_percent(warmup):
    final_step = 20000
    law = (lambda step: 4.5 + 300.0 * step ** -0.6)
    steps = range(max(warmup, 200), int(0.3 * final_step) + 1, 200)  # the first 30% of the steps, after warmup
    projection = project(history(steps, law), final_step, warmup)
    assert projection.covers(law(final_step))
    assert abs(math.log(projection.ppl / law(final_step))) < 0.1


def test_the_end_point_of_a_power_law_in_the_schedules_area_is_recovered_within_its_interval():
    area = dict(zip(range(1, 10001), lr_area(range(1, 10001), 1000)))
    law = (lambda step: 2.0 + 500.0 * area[step] ** -1.2)
    projection = project(history(range(100, 3001, 100), law), 10000, 1000)
    assert projection.covers(law(10000))
    assert projection.ppl == pytest.approx(law(10000), rel=0.02)


def test_fewer_than_4_points_project_nothing():
    assert MIN_POINTS == 4
    assert project(history([100, 200, 300], lambda step: 10.0), 1000, 100) is None
    assert project(history([100, 200, 300, 400], lambda step: 100.0 / step), 1000, 100) is not None
