"""A time-budgeted run's averaging window: at the paper's share of the run wherever the budget stops it.

The trainer's clock is a fake one here (``Trainer.clock``), so the positions follow from a step rate, not
from how fast this machine is.
"""

from __future__ import annotations

import pytest
from conftest import tiny_preset

from aiayn.checkpoint import last_checkpoints, list_checkpoints, load_checkpoint
from aiayn.config import section_defaults
from aiayn.train.trainer import Trainer, TrainJob
from aiayn.train.window import budget_window_due, budget_window_steps

TRAIN_SECTION = {**section_defaults("train"), "tokens_per_step": 600, "device_tokens": 600, "log_every": 2,
                 "dev_every": 0, "precision": "fp32", "device": "cpu"}
PAPER_SHARE = 4 / 72  # the base model's last 5 checkpoints, 10 minutes apart, of 12 hours


@pytest.mark.parametrize("seconds_a_step, stopped_at", [(1800 / 1375, 1376), (1800 / 668, 668), (7.0, 258)])
def test_a_budgeted_run_averages_the_papers_share_wherever_the_budget_stops_it(seconds_a_step, stopped_at):
    # the 30-minute recipe on an idle box, on a busy one (BENCHMARKS.md's 1375 and issue 37's 668 steps), slower
    window = budget_window_steps([seconds_a_step], budget=1800, steps=100_000, intervals=72, count=5)
    assert window[-1] == stopped_at
    assert len(window) == 6  # average_last and one spare, never the whole run
    averaged = window[-5:]
    assert (averaged[-1] - averaged[0]) / stopped_at == pytest.approx(PAPER_SHARE, abs=2 / stopped_at)
    gaps = [later - earlier for earlier, later in zip(averaged, averaged[1:])]
    assert max(gaps) - min(gaps) <= 1  # evenly spaced, as the paper's 10-minute checkpoints


def test_a_budgeted_run_that_reaches_its_step_ceiling_first_still_averages_the_share():
    window = budget_window_steps([1.0], budget=10_000, steps=1000, intervals=72, count=5)
    assert window == [931, 945, 959, 973, 987, 1000]


def test_an_uneven_step_rate_keeps_the_share_of_the_run():
    window = budget_window_steps([1.0, 3.0], budget=1800, steps=100_000, intervals=72, count=5)
    assert window[-1] == 900
    assert (window[-1] - window[-5]) / 900 == pytest.approx(PAPER_SHARE, abs=2 / 900)


def test_a_short_budget_still_averages_average_last_checkpoints_one_step_apart():
    # the demo given train.max_minutes: 0.5 stopped at step 41 and averaged step 41 alone (issue 37)
    window = budget_window_steps([0.73], budget=30, steps=100_000, intervals=72, count=3)
    assert window == [39, 40, 41, 42]


def test_the_big_models_share_is_504_intervals():
    window = budget_window_steps([1.0], budget=50_400, steps=10**9, intervals=504, count=20)
    assert len(window) == 21 and window[-1] == 50_400
    assert window[-20:] == list(range(48_500, 50_401, 100))


def test_no_window_checkpoint_before_the_window_nor_twice_in_one_interval():
    common = {"step": 100, "steps": 10**6, "budget": 720.0, "intervals": 72, "count": 5}
    assert not budget_window_due(600.0, None, **common)      # window times 670 ... 710: too early
    assert budget_window_due(671.0, None, **common)          # 670 passed
    assert not budget_window_due(675.0, 671.0, **common)     # 670 again: already written
    assert budget_window_due(680.0, 671.0, **common)         # 680 passed


def job(prepared, run_dir, **preset) -> TrainJob:
    return TrainJob(tiny_preset(**preset), TRAIN_SECTION, 1, prepared / "bin" / "train", prepared / "bin" / "dev",
                    prepared / "bpe" / "spm.model", run_dir, "tests", None, False, "cpu", None, False)


class FakeClock:
    """time.monotonic that moves ``tick`` seconds each time it is read: a fixed step rate."""

    def __init__(self, tick: float):
        self.now, self.tick = 1000.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def train_with_clock(prepared, run_dir, tick: float, **preset) -> dict:
    trainer = Trainer(job(prepared, run_dir, **preset))
    trainer.clock = FakeClock(tick)
    return trainer.run()


# 1.5 s of budget in 5 intervals of 0.3 s: window times 0.6, 0.9 and 1.2 s (the first the spare)
BUDGETED = {"steps": 10_000, "max_minutes": 0.025, "budget_intervals": 5, "average_last": 3, "keep_checkpoints": 3,
            "checkpoint_steps": 2}


@pytest.fixture(scope="module")
def budgeted_run(prepared, tmp_path_factory):
    """A budgeted run whose clock is read three times a step, 0.05 s apart: 0.1 s a step."""
    run_dir = tmp_path_factory.mktemp("budgeted") / "run"
    return run_dir, train_with_clock(prepared, run_dir, 0.05, **BUDGETED)


def test_a_budgeted_trainer_writes_its_window_by_its_clock_not_by_checkpoint_steps(budgeted_run):
    run_dir, summary = budgeted_run
    assert (summary["stopped_by"], summary["step"]) == ("max_minutes", 16)
    steps = [step for step, _ in list_checkpoints(run_dir / "checkpoints")]
    assert steps == [10, 13, 16]  # 7 was the spare, dropped by keep_checkpoints


def test_the_average_of_a_budgeted_run_uses_only_checkpoints_in_its_window(budgeted_run):
    from aiayn.average import average_checkpoints

    run_dir, summary = budgeted_run
    averaged = average_checkpoints(last_checkpoints(run_dir / "checkpoints", 3))
    # the last 2 of the run's 5 intervals: steps 10 to 16 of 16, not the learning curve before them
    assert averaged["averaged_steps"] == [10, 13, 16]


def test_a_resumed_budgeted_run_keeps_its_window_spacing(prepared, tmp_path):
    from aiayn.train.trainer import Preempted

    trainer = Trainer(job(prepared, tmp_path / "run", **BUDGETED))
    trainer.clock = FakeClock(0.05)
    trainer.job.stop_after_steps = 11
    with pytest.raises(Preempted):
        trainer.run()
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "safety_00000011.pt")["progress"]["window_clock"] \
        == pytest.approx(0.95)
    train_with_clock(prepared, tmp_path / "run", 0.05, **BUDGETED)
    assert [step for step, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [10, 13, 16]


def test_a_step_planned_run_keeps_its_step_window(prepared, tmp_path):
    train_with_clock(prepared, tmp_path / "run", 0.05, steps=8, checkpoint_steps=3, average_last=3,
                     keep_checkpoints=3)
    assert [step for step, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [2, 5, 8]
