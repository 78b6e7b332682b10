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


def test_within_warmup_nothing_is_projected():
    assert project(history(range(20, 181, 20), lambda step: 1000.0 / step), 360, 200) is None


def test_from_every_dev_evaluation_after_warmup_the_interval_holds_each_recorded_demo_runs_end():
    """The demo's runs (tests/data/demo_dev_curves.json: 360 steps, warmup 200, a dev evaluation every 20 steps):
    each projection the trainer makes, from step 200 on, holds the measured step-360 perplexity (what
    INTERVAL_Z was calibrated on; the first 30% of the steps lies within warmup and projects nothing)."""
    import json
    from pathlib import Path

    curves = json.loads((Path(__file__).parent / "data" / "demo_dev_curves.json").read_text())
    for preset, seeds in curves.items():
        for seed, curve in seeds.items():
            values = dict(map(tuple, curve))
            assert project(history([step for step in values if step <= 108], values.get), 360, 200) is None
            for upto in range(200, 360, 20):
                projection = project(history([step for step in values if step <= upto], values.get), 360, 200)
                assert projection.covers(values[360]), (preset, seed, upto, projection, values[360])
