"""The schedule fitted to a time budget (aiayn.train.budget_schedule), played on faked step times."""

import pytest

from aiayn.train.budget_schedule import MEASURE_STEPS, BudgetSchedule, decay_shape, played
from aiayn.train.schedule import learning_rate

PEAK = 1.26e-3


def schedule(budget=900.0, shape="linear", floor=0.0, share=0.1, warmup=500, decay_share=0.2, mode="share",
             tokens=4000, min_steps=0, min_tokens=1000):
    return BudgetSchedule(peak=PEAK, floor=floor, preset_warmup=warmup, warmup_share=share, shape=shape,
                          budget=budget, decay_share=decay_share, warmup_mode=mode, tokens_per_step=tokens,
                          min_steps=min_steps, min_tokens=min_tokens)


def decay_began(fitted: BudgetSchedule, lrs: list[tuple[int, float]]) -> int:
    """The last step at the peak before the learning rate first fell below it, after the warmup."""
    return next(step for step, lr in lrs if step > fitted.warmup and lr < PEAK) - 1


def test_a_steady_pace_gives_the_stated_projection_warmup_and_decay():
    fitted = schedule()
    lrs = dict(played(fitted, [1.5]))
    # the first fit, at step 10: 10 steps have taken 15 s, 885 s at 1.5 s a step hold 590 more
    first = fitted.revisions[0]
    assert first["step"] == MEASURE_STEPS and first["projected_steps"] == 600
    assert fitted.warmup == 60  # 10% of 600, under the preset's 500
    # before the fit, the preset's slope; then on to the peak at the fitted warmup's end
    assert lrs[5] == pytest.approx(PEAK * 5 / 500)
    assert lrs[30] < lrs[31] < lrs[60] == pytest.approx(PEAK) and max(lrs.values()) == pytest.approx(PEAK)
    # the peak held until the last 20% of the steps the budget holds (480 of 600), then linear to the floor
    assert len(lrs) == 600
    assert all(lrs[step] == PEAK for step in range(60, 481))
    assert lrs[540] == pytest.approx(PEAK * (600 - 540) / (600 - 480), rel=1e-6)
    assert lrs[600] == pytest.approx(0.0, abs=1e-12)


def test_the_slope_warmup_keeps_the_presets_slope_and_is_cut_where_the_decay_begins():
    # 2 s a step: about 450 steps in 900 s, the decay over the last 90; the preset's warmup (500) is cut at 360
    fitted = schedule(mode="slope", floor=PEAK / 10)
    lrs = dict(played(fitted, [2.0]))
    assert fitted.end_step == 450 and fitted.warmup == 360
    assert all(lrs[step] == pytest.approx(PEAK * step / 500) for step in (5, 10, 11, 200, 360))  # never steeper
    assert fitted.peak == pytest.approx(PEAK * 360 / 500) and fitted.floor == pytest.approx(fitted.peak / 10)
    assert lrs[405] == pytest.approx(fitted.floor + (fitted.peak - fitted.floor) * 0.5)
    assert lrs[450] == pytest.approx(fitted.floor)
    # a budget that holds the whole warmup reaches the paper's peak, and holds it until the decay
    long = schedule(mode="slope", budget=1800.0)
    lrs = dict(played(long, [1.0]))
    assert long.warmup == 500 and long.peak == PEAK and lrs[1000] == PEAK and lrs[1800] == pytest.approx(0.0)


def test_the_slope_warmups_cut_follows_the_projection_while_it_climbs():
    # slow first steps (3 s: new shapes) project about 300 steps and a cut at 240; at 2 s a step from then on the
    # budget holds about 440, and the cut moves out with it, the ramp still at the preset's slope
    fitted = schedule(mode="slope")
    lrs = played(fitted, [3.0] * 10 + [2.0] * 1000)
    assert fitted.revisions[0]["projected_steps"] == 300
    assert 340 <= fitted.warmup <= 360 and fitted.peak == pytest.approx(PEAK * fitted.warmup / 500)
    lr = dict(lrs)
    assert all(lr[step] == pytest.approx(PEAK * step / 500) for step in range(1, fitted.warmup + 1))
    values = [value for _, value in lrs]
    assert max(values) == pytest.approx(fitted.peak)
    assert lr[len(lr)] <= fitted.peak / 20  # and it still decays to the floor at the budget's end
    # a projection that falls while it climbs cuts it sooner, but never behind the step already made
    falling = schedule(mode="slope")
    played(falling, [1.0] * 100 + [4.0] * 1000)
    assert 100 <= falling.warmup < 400 and falling.peak == pytest.approx(PEAK * falling.warmup / 500)


def test_a_budget_that_holds_too_few_steps_trains_smaller_ones():
    # 2 s a step of 4000 tokens: about 450 steps in 900 s, fewer than budget_min_steps (1600); at the first fit
    # (step 10, 20 s) the 880 s left hold 1590 steps of 1106 tokens, each taking its share of the time
    fitted = schedule(mode="slope", min_steps=1600)
    lrs = dict(played(fitted, [2.0]))
    first = fitted.revisions[0]
    assert fitted.tokens_per_step == 1106 and first["preset_tokens"] == 4000
    assert first["projected_steps"] == 1601 and abs(len(lrs) - 1600) <= 2
    # the whole preset warmup fits now: its peak, held until the last 20%, then to the floor at the end
    assert fitted.warmup == 500 and fitted.peak == PEAK and lrs[1200] == PEAK
    assert lrs[len(lrs)] <= PEAK / 100
    assert fitted.summary()["budget_tokens_per_step"] == 1106


def test_the_fitted_step_has_a_floor_and_a_budget_that_holds_enough_keeps_the_presets():
    short = schedule(budget=300.0, min_steps=1600)  # 145 steps of 4000: 1600 would need steps under 1000
    lrs = played(short, [2.0])
    assert short.tokens_per_step == 1000 and 560 <= len(lrs) <= 590  # 290 s at 0.5 s a step
    enough = schedule(budget=900.0, min_steps=400)
    played(enough, [2.0])
    assert enough.tokens_per_step == 4000 and "preset_tokens" not in enough.revisions[0]
    off = schedule(budget=300.0)  # budget_min_steps left out: the step stays the preset's
    played(off, [2.0])
    assert off.tokens_per_step == 4000


def test_a_decay_share_of_one_decays_from_the_warmups_end():
    fitted = schedule(decay_share=1.0)
    lrs = dict(played(fitted, [1.5]))
    assert fitted.warmup == 60 and fitted.end_step == 600
    assert lrs[330] == pytest.approx(PEAK * (600 - 330) / (600 - 60), rel=1e-6)
    assert lrs[600] == pytest.approx(0.0, abs=1e-12)


def test_a_slowdown_that_moves_the_decay_before_the_current_step_starts_it_there_without_a_jump():
    fitted = schedule(budget=900.0)
    # 1 s a step (about 900 steps, the decay from about 720), then four times as slow from step 600:
    # the projection falls below 700 and the decay's start before the step already made
    lrs = played(fitted, [1.0] * 599 + [4.0] * 2000)
    decay_from = decay_began(fitted, lrs)
    assert decay_from > 600 and fitted.end_step < 700  # the peak held until the slowdown's revision
    steps = [lr for step, lr in lrs if step >= fitted.warmup]
    drops = [earlier - later for earlier, later in zip(steps, steps[1:])]
    assert min(drops) >= -1e-15  # never up
    assert max(drops) <= 1.5 * PEAK / (fitted.end_step - decay_from)  # no jump: one step of the decay
    assert lrs[-1][1] <= PEAK / 20


def test_the_warmup_is_capped_by_the_presets():
    fitted = schedule(budget=6000.0, warmup=200)
    played(fitted, [1.0])
    assert fitted.revisions[0]["projected_steps"] == 6000 and fitted.warmup == 200


def test_dev_evaluations_count_as_overhead_not_as_a_slowdown():
    fitted = schedule(budget=1200.0)
    lrs = played(fitted, [1.0], overhead_every=100, overhead_seconds=20.0)
    # 1.2 s a step on average: about 1000 steps; the projection never swings by a dev evaluation's 20 s
    ends = [revision["projected_steps"] for revision in fitted.revisions[10:]]
    assert max(ends) - min(ends) <= 20
    assert abs(len(lrs) - fitted.end_step) <= 20  # within a dev evaluation's time, which may fall at the end


def test_a_slowdown_mid_run_revises_the_projection_and_never_raises_the_learning_rate():
    fitted = schedule(budget=900.0)
    # 1 s a step, then twice as slow from step 300 (another job starts on the machine), back to 1 s at 500
    pace = [1.0] * 299 + [2.0] * 200 + [1.0] * 2000
    lrs = played(fitted, pace)
    before = [r["projected_steps"] for r in fitted.revisions if r["step"] < 300]
    during = [r["projected_steps"] for r in fitted.revisions if 350 <= r["step"] < 500]
    assert min(before) > max(during)  # fewer steps projected once the machine slows down
    decay = [lr for step, lr in lrs if step > fitted.warmup]
    assert all(later <= earlier + 1e-15 for earlier, later in zip(decay, decay[1:]))
    assert decay[-1] <= PEAK / 100


@pytest.mark.parametrize("shape", ["linear", "cosine"])
def test_the_floor_is_reached_at_the_budgets_end_within_one_step(shape):
    floor = PEAK / 20
    fitted = schedule(budget=900.0, shape=shape, floor=floor)
    lrs = played(fitted, [1.3, 1.7, 1.5])
    step, last = lrs[-1]
    start = decay_began(fitted, lrs)
    one_step = PEAK / (fitted.end_step - start) * (1.0 if shape == "linear" else 3.2)  # cosine: pi/2 at most
    assert floor <= last <= floor + one_step
    assert abs(step - fitted.end_step) <= 1


def test_a_resumed_schedule_continues_the_fitted_one():
    whole = schedule()
    expected = played(whole, [1.5])
    first = schedule()
    clock = 0.0
    for step in range(1, 301):
        clock += 1.5
        first.observe(step, clock)
    resumed = BudgetSchedule.from_state(first.state_dict())
    assert resumed == first
    rest = []
    for step in range(301, 601):
        rest.append((step, resumed.lr(step)))
        clock += 1.5
        resumed.observe(step, clock)
    assert rest == expected[300:]


def test_a_tiny_budget_has_a_warmup_no_shorter_than_its_measurement():
    fitted = schedule(budget=30.0)
    lrs = dict(played(fitted, [1.0]))
    assert fitted.warmup == MEASURE_STEPS and lrs[MEASURE_STEPS + 1] == pytest.approx(PEAK)
    assert lrs[max(lrs)] <= PEAK / 4  # and it still decays over the budget's last steps


def test_decay_shapes():
    assert decay_shape("linear", 0.25) == pytest.approx(0.75)
    assert decay_shape("cosine", 0.5) == pytest.approx(0.5)
    assert decay_shape("cosine", 1.2) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        decay_shape("step", 0.5)


# --- in the trainer, on a fake clock ---------------------------------------------------------------

FITTED = {"steps": 10_000, "max_minutes": 0.2, "schedule": "budget", "warmup_steps": 4000, "checkpoint_steps": 50,
          "budget_intervals": 5, "average_last": 2, "keep_checkpoints": 2}


def lrs_of(run_dir) -> dict[int, float]:
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {entry["step"]: entry["lr"] for entry in map(json.loads, lines) if "lr" in entry}


@pytest.fixture(scope="module")
def fitted_run(prepared, tmp_path_factory):
    from test_budget_window import train_with_clock

    run_dir = tmp_path_factory.mktemp("fitted") / "run"
    return run_dir, train_with_clock(prepared, run_dir, 0.05, **FITTED)  # 0.1 s a step: 120 steps in 12 s


def test_the_trainer_fits_its_schedule_to_the_steps_the_budget_holds(fitted_run):
    run_dir, summary = fitted_run
    assert summary["stopped_by"] == "max_minutes"
    assert abs(summary["budget_projected_steps"] - summary["step"]) <= 2
    # budget_warmup: slope (left out): the preset's warmup of 4000 cut where the last 20% of the steps begin
    projected = summary["budget_projected_steps"]
    assert summary["budget_warmup"] == projected - round(0.2 * projected)
    assert summary["budget_peak_lr"] == pytest.approx(
        learning_rate(4000, 32, 4000, 1.0) * summary["budget_warmup"] / 4000)  # the tiny preset: d_model 32
    assert summary["budget_logged_revisions"][0]["step"] == MEASURE_STEPS
    lrs = lrs_of(run_dir)
    peak = summary["budget_peak_lr"]
    assert max(lrs.values()) <= peak * (1 + 1e-9)
    last = max(lrs)
    assert last == summary["step"] and lrs[last] <= peak / 20  # near the floor (0) at the budget's end


def test_a_resumed_fitted_run_trains_as_the_uninterrupted_one(prepared, fitted_run, tmp_path):
    from test_budget_window import FakeClock, job, train_with_clock

    from aiayn.checkpoint import load_checkpoint
    from aiayn.layout import FINAL_MODEL
    from aiayn.train.trainer import Preempted, Trainer

    trainer = Trainer(job(prepared, tmp_path / "run", **FITTED))
    trainer.clock = FakeClock(0.05)
    trainer.job.stop_after_steps = 60
    with pytest.raises(Preempted):
        trainer.run()
    saved = load_checkpoint(tmp_path / "run" / "checkpoints" / "safety_00000060.pt")["progress"]["budget_schedule"]
    assert saved["warmup"] is not None and saved["revisions"]  # the fit travels with the checkpoint
    summary = train_with_clock(prepared, tmp_path / "run", 0.05, **FITTED)
    whole_dir, whole = fitted_run
    assert summary["step"] == whole["step"]
    assert lrs_of(tmp_path / "run") == lrs_of(whole_dir)
    resumed, uninterrupted = (load_checkpoint(path / FINAL_MODEL)["model"] for path in (tmp_path / "run", whole_dir))
    assert all(resumed[key].equal(uninterrupted[key]) for key in uninterrupted)


# budget_min_steps beyond what 12 s hold at 0.1 s a step: steps of the smallest size after the first fit
SMALLER = {**FITTED, "budget_min_steps": 400, "budget_min_tokens": 200}


@pytest.fixture(scope="module")
def smaller_run(prepared, tmp_path_factory):
    from test_budget_window import train_with_clock

    run_dir = tmp_path_factory.mktemp("smaller") / "run"
    return run_dir, train_with_clock(prepared, run_dir, 0.05, **SMALLER)


def test_the_trainer_cuts_smaller_steps_after_the_fit_and_a_resumed_run_keeps_them(prepared, smaller_run, fitted_run,
                                                                                   tmp_path):
    import json

    from test_budget_window import FakeClock, job, train_with_clock

    from aiayn.checkpoint import load_checkpoint
    from aiayn.layout import FINAL_MODEL
    from aiayn.train.trainer import Preempted, Trainer

    run_dir, summary = smaller_run
    assert summary["budget_tokens_per_step"] == 200 and summary["budget_min_steps"] == 400
    tokens = {entry["step"]: entry["real_tgt_tokens_per_step"] for entry in
              map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "real_tgt_tokens_per_step" in entry}
    # padded steps of 600 tokens a side until the fit at step 10, of 200 after it (the tiny corpus' real share)
    assert min(tokens[step] for step in tokens if step <= 10) > 2 * max(tokens[step] for step in tokens if step > 12)
    assert summary["real_tgt_tokens_per_step"] < fitted_run[1]["real_tgt_tokens_per_step"]
    trainer = Trainer(job(prepared, tmp_path / "run", **SMALLER))
    trainer.clock = FakeClock(0.05)
    trainer.job.stop_after_steps = 60
    with pytest.raises(Preempted):
        trainer.run()
    checkpoint = load_checkpoint(tmp_path / "run" / "checkpoints" / "safety_00000060.pt")
    assert checkpoint["batch_rule"]["tokens_per_step"] == 200
    resumed = train_with_clock(prepared, tmp_path / "run", 0.05, **SMALLER)
    assert resumed["step"] == summary["step"] and lrs_of(tmp_path / "run") == lrs_of(run_dir)
    models = [load_checkpoint(path / FINAL_MODEL)["model"] for path in (tmp_path / "run", run_dir)]
    assert all(models[0][key].equal(models[1][key]) for key in models[1])


def test_a_budget_schedule_without_a_budget_is_refused_before_any_step(prepared, tmp_path):
    from test_budget_window import job

    from aiayn.errors import UserError
    from aiayn.train.trainer import Trainer

    with pytest.raises(UserError, match="schedule: budget fits the learning-rate schedule to a time budget"):
        Trainer(job(prepared, tmp_path / "run", **{**FITTED, "max_minutes": None}))
    assert not (tmp_path / "run" / "checkpoints").exists()
