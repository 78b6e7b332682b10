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


# --- by the reference -------------------------------------------------------------------------

def recorded_demo_curves():
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parent / "data" / "demo_dev_curves.json").read_text())


def reference_of(curves: dict[str, list]) -> dict:
    """A reference as `aiayn reference` makes it from runs with these (step, ppl) curves."""
    from aiayn.reference import reference_from_runs

    finals = [{"preset": "p", "seed": int(seed), "step": curve[-1][0], "planned_steps": curve[-1][0],
               "target_tokens": 0, "dev_history": [{"step": step, "dev_ppl": ppl} for step, ppl in curve]}
              for seed, curve in curves.items()]
    return reference_from_runs(finals, [str(final["seed"]) for final in finals])


def test_by_a_reference_of_the_other_seeds_each_recorded_demo_runs_end_is_held_from_30_percent_of_its_steps():
    """Each demo run held against a reference of its preset's other two seeds (left out of it), from the dev
    evaluations of the first 30% of its 360 steps (inside warmup, where the power law projects nothing): the
    interval holds the measured end, and the projection is off by less than 20%."""
    from aiayn.projection import project_by_reference

    for preset, seeds in recorded_demo_curves().items():
        for seed, curve in seeds.items():
            reference = reference_of({other: rest for other, rest in seeds.items() if other != seed})
            values = dict(map(tuple, curve))
            projection = project_by_reference(history([step for step in values if step <= 108], values.get),
                                              reference, 360)
            assert projection.method == "reference" and projection.points == 3
            assert projection.covers(values[360]), (preset, seed, projection, values[360])
            assert abs(math.log(projection.ppl / values[360])) < math.log(1.2)


def test_the_trainer_projects_by_a_curve_that_ends_at_its_last_step_else_by_the_power_law():
    from aiayn.projection import projection_for

    curves = recorded_demo_curves()["demo_base"]
    reference = reference_of({seed: curves[seed] for seed in ("2", "3")})
    run = dict(map(tuple, curves["1"]))
    early = history([20, 40, 60], run.get)
    assert projection_for(early, 360, 200, reference).method == "reference"
    assert projection_for(early, 720, 200, reference) is None  # another plan, and in warmup
    assert projection_for(early, 360, 200, None) is None
    late = history(range(200, 301, 20), run.get)
    assert projection_for(late, 720, 200, reference).method == "power law"
    end_point = {"kind": "end_point", "points": [{"step": 360, "dev_ppl": {"low": 2.0, "mean": 2.0, "high": 2.0}}]}
    assert projection_for(late, 360, 200, end_point).method == "power law"
