"""Reference curves: made from runs, read back, a run placed against their seed band, and the trainer saying so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_preset

from aiayn.config import section_defaults
from aiayn.errors import UserError
from aiayn.reference import (FORMAT, band_at, band_position, choose_reference, main, paper_end_points,
                             read_references, reference_from_runs, shipped_references)
from aiayn.train.trainer import TrainJob, train

TRAIN_SECTION = {**section_defaults("train"), "tokens_per_step": 600, "device_tokens": 600, "log_every": 2,
                 "dev_every": 3, "precision": "fp32", "device": "cpu"}


def final(seed, curve, preset="demo_base", fingerprint="f1", step=None):
    """A final.json as the trainer writes it, with the parts a reference reads."""
    last = step or curve[-1][0]
    return {"preset": preset, "seed": seed, "step": last, "planned_steps": last, "target_tokens": 100 * last,
            "experiment": "demo", "data_fingerprint": fingerprint, "vocab_fingerprint": "v1",
            "dev_history": [{"step": s, "dev_ppl": p, "dev_loss": 1.0} for s, p in curve]}


def write_runs(tmp_path, finals):
    folders = []
    for index, summary in enumerate(finals):
        folder = tmp_path / f"run{index}"
        folder.mkdir()
        (folder / "final.json").write_text(json.dumps(summary))
        folders.append(folder)
    return folders


SEEDS = [final(1, [(100, 50.0), (200, 10.0), (300, 5.0)]),
         final(2, [(100, 60.0), (200, 12.0), (300, 5.5)]),
         final(3, [(100, 55.0), (200, 11.0), (300, 6.0)])]


def test_aiayn_reference_writes_the_seed_band_of_finished_runs(tmp_path):
    out = tmp_path / "ref.json"
    assert main(["--runs", *map(str, write_runs(tmp_path, SEEDS)), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["format"] == FORMAT
    [reference] = data["references"]
    assert (reference["preset"], reference["seeds"], reference["kind"]) == ("demo_base", [1, 2, 3], "curve")
    assert [point["step"] for point in reference["points"]] == [100, 200, 300]
    assert reference["points"][0]["dev_ppl"] == {"low": 50.0, "mean": 55.0, "high": 60.0}
    assert reference["points"][2]["target_tokens"] == 30000
    assert read_references(out) == data["references"]


@pytest.mark.parametrize("key, value", [("preset", "demo_learned"), ("data_fingerprint", "other")])
def test_runs_of_another_preset_or_other_data_are_refused_with_exit_2(tmp_path, capsys, key, value):
    other = {**SEEDS[1], key: value}
    assert main(["--runs", *map(str, write_runs(tmp_path, [SEEDS[0], other])), "--out", str(tmp_path / "r.json")]) == 2
    assert f"{key} {value!r} differs" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_one_run_is_refused_unless_a_zero_width_band_is_asked_for(tmp_path, capsys):
    runs = list(map(str, write_runs(tmp_path, SEEDS[:1])))
    assert main(["--runs", *runs, "--out", str(tmp_path / "r.json")]) == 2
    assert "one run makes no seed band" in capsys.readouterr().err
    assert main(["--runs", *runs, "--out", str(tmp_path / "r.json"), "--allow-single"]) == 0
    point = read_references(tmp_path / "r.json")[0]["points"][0]
    assert point["dev_ppl"]["low"] == point["dev_ppl"]["high"] == 50.0


def test_band_position_is_inside_above_or_below_the_band_interpolated_in_step():
    reference = reference_from_runs(SEEDS, ["a", "b", "c"])
    assert band_at(reference, 150) == pytest.approx((30.0, 36.0))  # halfway between (50, 60) and (10, 12)
    assert band_position(reference, 150, 33.0) == 0
    assert band_position(reference, 150, 37.0) == 1    # above: a worse perplexity
    assert band_position(reference, 150, 29.0) == -1   # below: better
    assert band_position(reference, 300, float("nan")) == 1
    assert band_position(reference, 50, 33.0) is None  # before the reference's first point: no band
    assert band_position({**reference, "tolerance": 0.1}, 150, 37.0) == 0


def test_the_paper_presets_have_table3s_end_points_at_their_last_step():
    references = {ref["preset"]: ref for ref in paper_end_points()}
    assert len(references) == 20  # base, big and Table 3's rows A to E
    assert references["base"]["points"] == [{"step": 100000, "target_tokens": None,
                                             "dev_ppl": {"low": 4.92, "mean": 4.92, "high": 4.92},
                                             "dev_bleu": {"low": 25.8, "mean": 25.8, "high": 25.8}}]
    assert references["big"]["points"][0]["step"] == 300000
    assert all(ref["kind"] == "end_point" and "an end point only" in ref["note"] for ref in references.values())
    assert band_position(references["base"], 50000, 6.0) is None


def test_auto_picks_the_shipped_curve_for_the_demo_and_table3_for_a_paper_preset():
    demo = shipped_references("demo")
    assert {ref["preset"] for ref in demo} == {"demo_base", "demo_learned", "demo_nopos", "demo_heads_1"}
    reference, about = choose_reference("auto", "demo_base", "demo", demo[0]["data_fingerprint"])
    assert reference["preset"] == "demo_base" and reference["seeds"] == [1, 2, 3]
    assert choose_reference("auto", "demo_base", "demo", "other data")[0] is None
    assert choose_reference("auto", "C_layers_2", "wmt14_en_de", "x")[0]["points"][0]["dev_ppl"]["mean"] == 6.11
    assert choose_reference("none", "base", "wmt14_en_de", "x") == (None, "no reference (train.reference: none)")


def test_a_reference_file_serves_its_preset_and_other_presets_fall_back_to_auto(tmp_path):
    assert main(["--runs", *map(str, write_runs(tmp_path, SEEDS)), "--out", str(tmp_path / "ref.json")]) == 0
    reference, about = choose_reference(str(tmp_path / "ref.json"), "demo_base", "demo", "f1")
    assert reference["seeds"] == [1, 2, 3] and about.startswith(str(tmp_path / "ref.json"))
    reference, about = choose_reference(str(tmp_path / "ref.json"), "base", "wmt14_en_de", "x")
    assert reference["kind"] == "end_point" and "no reference of preset base; auto: " in about


def test_a_reference_setting_that_is_no_reference_file_is_a_user_error(tmp_path):
    (tmp_path / "bad.json").write_text("{}")
    for path in (tmp_path / "missing.json", tmp_path / "bad.json"):
        with pytest.raises(UserError, match="reference"):
            choose_reference(str(path), "demo_base", "demo", "f1")


def test_the_report_draws_each_presets_runs_over_its_reference(tmp_path):
    from aiayn.reference import band_figures

    runs = [*SEEDS, final(1, [(100, 40.0), (300, 4.0)], preset="demo_learned")]
    folders = write_runs(tmp_path, runs)
    finals = {(run["preset"], run["seed"]): folder / "final.json" for run, folder in zip(runs, folders)}
    written = band_figures(finals, "auto", tmp_path / "report")
    assert [path.name for path in written] == ["dev_ppl_band_demo_base.png", "dev_ppl_band_demo_learned.png"]
    assert all(path.read_bytes()[:4] == b"\x89PNG" for path in written)


# --- the trainer says it ----------------------------------------------------------------------

def tiny_job(prepared, run_dir, reference="none", tracking_uri=None, section=None, **overrides):
    section = {**TRAIN_SECTION, "reference": reference, **(section or {})}
    return TrainJob(tiny_preset(steps=12, warmup_steps=4, **overrides), section, 1, prepared / "bin" / "train",
                    prepared / "bin" / "dev", prepared / "bpe" / "spm.model", run_dir, "tests", tracking_uri,
                    tracking_uri is not None, "cpu", None, False)


def metrics_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_rerun_is_inside_its_references_band_and_a_10x_learning_rate_is_above_it(prepared, tmp_path, capsys):
    """The reference: one tiny run (a band of zero width); the same run again stays inside it at every dev
    evaluation, and a run with lr_scale 10 (a learning rate 10x too high; 100x makes the
    loss non-finite here) is above it (worse) from its first dev evaluation (step 3) on."""
    train(tiny_job(prepared, tmp_path / "first"))
    assert main(["--runs", str(tmp_path / "first"), "--out", str(tmp_path / "ref.json"), "--allow-single"]) == 0
    capsys.readouterr()
    train(tiny_job(prepared, tmp_path / "again", reference=str(tmp_path / "ref.json")))
    bands = [record["dev_ppl_band"] for record in metrics_of(tmp_path / "again") if "dev_ppl_band" in record]
    assert bands == [0, 0, 0, 0]  # steps 3, 6, 9, 12
    err = capsys.readouterr().err
    assert "dev step 3: ppl" in err and "inside the reference band" in err
    train(tiny_job(prepared, tmp_path / "broken", reference=str(tmp_path / "ref.json"), lr_scale=10.0))
    bands = [record["dev_ppl_band"] for record in metrics_of(tmp_path / "broken") if "dev_ppl_band" in record]
    assert bands == [1, 1, 1, 1]
    assert "above the reference band" in capsys.readouterr().err
    projected = [record for record in metrics_of(tmp_path / "broken") if "dev_ppl_projected" in record][-1]
    reference_end = read_references(tmp_path / "ref.json")[0]["points"][-1]["dev_ppl"]["high"]
    assert projected["dev_ppl_projected"] > reference_end  # its projection is worse than the reference's end


def test_mlflow_gets_the_band_position_the_projection_and_the_figure(prepared, tmp_path):
    from mlflow.tracking import MlflowClient

    train(tiny_job(prepared, tmp_path / "first"))
    assert main(["--runs", str(tmp_path / "first"), "--out", str(tmp_path / "ref.json"), "--allow-single"]) == 0
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    summary = train(tiny_job(prepared, tmp_path / "run", reference=str(tmp_path / "ref.json"), tracking_uri=uri))
    client = MlflowClient(uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert [metric.step for metric in client.get_metric_history(run.info.run_id, "dev_ppl_band")] == [3, 6, 9, 12]
    assert run.data.tags["dev_ppl_band"] == "inside"
    projected = [record for record in metrics_of(tmp_path / "run") if "dev_ppl_projected" in record]
    assert [record["step"] for record in projected] == [3, 6, 9, 12]  # by the reference: from the first on
    assert run.data.tags["dev_ppl_projected_by"] == "reference"
    assert projected[0]["dev_ppl_projected_low"] <= projected[0]["dev_ppl_projected"] <= \
        projected[0]["dev_ppl_projected_high"]
    assert (tmp_path / "run" / "dev_ppl_band.png").read_bytes()[:4] == b"\x89PNG"
    assert "dev_ppl_band.png" in [item.path for item in client.list_artifacts(run.info.run_id)]


def test_a_demo_run_with_a_10x_learning_rate_is_above_the_band_from_step_100_and_projected_worse():
    """Recorded (tests/data/demo_lr10_curve.json): demo_base with lr_scale 5.0 instead of 0.5, seed 1, a dev
    evaluation every 20 steps. It falls faster at first, then stalls near perplexity 180: above the shipped band
    (worse) at every dev evaluation from step 100 on, the first of the demo's default dev_every: 100. Its
    projection (the power law from the warmup's end; by the reference from step 140) is worse than the whole
    reference band at the last step."""
    from aiayn.projection import project, projection_for

    [curve] = json.loads((Path(__file__).parent / "data" / "demo_lr10_curve.json").read_text()).values()
    [reference] = [ref for ref in shipped_references("demo") if ref["preset"] == "demo_base"]
    positions = {step: band_position(reference, step, ppl) for step, ppl in curve}
    assert [positions[step] for step in positions if step >= 100] == [1] * 14
    projection = project([{"step": step, "dev_ppl": ppl} for step, ppl in curve if step <= 200], 360, 200)
    assert projection.low > band_at(reference, 360)[1]
    # by the reference, as the trainer projects: its whole interval is above the band's end from step 140 on,
    # once the last 3 dev evaluations (the ratio's) are all of the stalled run
    for upto in range(140, 360, 20):
        projection = projection_for([{"step": step, "dev_ppl": ppl} for step, ppl in curve if step <= upto], 360, 200,
                                    reference)
        assert projection.method == "reference" and projection.low > band_at(reference, 360)[1], upto


# --- off course -------------------------------------------------------------------------------

def test_off_course_is_a_streak_of_dev_evaluations_above_the_band_by_more_than_the_margin():
    from aiayn.train.monitor import OffCourseRule

    reference = reference_from_runs(SEEDS, ["1", "2", "3"])  # band tops: 60 at 100, 12 at 200, 6 at 300
    rule = OffCourseRule("warn", 0.5, 2)
    history = [{"step": 100, "dev_ppl": 85.0}, {"step": 200, "dev_ppl": 19.0}, {"step": 300, "dev_ppl": 9.5}]
    assert [entry["step"] for entry in rule.streak(reference, history)] == [200, 300]  # 85 <= 1.5 x 60
    assert rule.streak(reference, history[:2] + [{"step": 300, "dev_ppl": 8.9}]) == []  # 8.9 <= 1.5 x 6
    assert len(rule.streak(reference, history[:2] + [{"step": 300, "dev_ppl": float("nan")}])) == 2
    assert rule.streak(reference, [{"step": 400, "dev_ppl": 1e9}]) == []  # beyond the reference: no band


def test_off_course_warns_once_a_streak_by_default_and_asks_to_stop_where_told(tmp_path, capsys):
    from aiayn.train.monitor import DevMonitor, OffCourseRule

    class Tracker:
        def log_metrics(self, metrics, step): pass
        def set_tags(self, tags): self.tags = tags

    reference = reference_from_runs(SEEDS, ["1", "2", "3"])
    history = [{"step": 100, "dev_ppl": 95.0}, {"step": 200, "dev_ppl": 19.0}, {"step": 300, "dev_ppl": 9.5}]
    warn = DevMonitor(reference, "three seeds", 300, 50, "demo_base", 1, tmp_path, OffCourseRule("warn", 0.5, 2))
    tracker = Tracker()
    for upto in (1, 2, 3):
        warn.after_dev(history[upto - 1]["step"], history[:upto], tracker)
    err = capsys.readouterr().err
    assert err.count("warning: demo_base seed 1 is off course") == 1
    assert "at 2 dev evaluations in a row (steps 100, 200)" in err and "lr_scale" in err
    assert warn.stop_reason is None and tracker.tags["off_course"] == "step 300"
    stop = DevMonitor(reference, "three seeds", 300, 50, "demo_base", 1, tmp_path, OffCourseRule("stop", 0.5, 2))
    stop.after_dev(100, history[:1], tracker)
    assert stop.stop_reason is None
    stop.after_dev(200, history[:2], tracker)
    assert "off course" in stop.stop_reason and "warning" not in capsys.readouterr().err


def test_a_run_off_course_with_stop_ends_at_exit_2_at_the_next_step_with_its_checkpoints_kept(prepared, tmp_path):
    """A learning rate 10x too high against a reference of the run done right: above the band at its dev
    evaluations 3 and 6, so with 2 in a row it stops at step 7, which is written as a checkpoint."""
    from aiayn.train.monitor import TrainingOffCourse

    train(tiny_job(prepared, tmp_path / "first"))
    assert main(["--runs", str(tmp_path / "first"), "--out", str(tmp_path / "ref.json"), "--allow-single"]) == 0
    job = tiny_job(prepared, tmp_path / "broken", reference=str(tmp_path / "ref.json"), lr_scale=10.0,
                   section={"off_course": "stop", "off_course_margin": 0.01, "off_course_evaluations": 2})
    with pytest.raises(TrainingOffCourse) as stopped:
        train(job)
    assert isinstance(stopped.value, UserError)  # the command's exit 2, one paragraph
    text = str(stopped.value)
    assert "steps 3, 6" in text and "It stopped at step 7" in text and "checkpoints are kept" in text
    written = sorted(path.name.split("_")[1] for path in (tmp_path / "broken" / "checkpoints").glob("*.pt"))
    assert written[-1] == "00000007.pt", written  # the run resumes from step 7


@pytest.mark.parametrize("experiment", ["demo", "multi30k"])
def test_each_shipped_seed_left_out_stays_inside_the_band_of_the_others_widened_by_the_shipped_tolerance(experiment):
    """The shipped references' runs (tests/data/<experiment>_dev_curves.json, recorded with the code that made
    them): each seed, left out, is inside the band of its preset's other seeds, widened by the tolerance shipped
    with the reference, at every dev evaluation; so a rerun of the recipe is judged inside, as the demo with 3 seeds
    is inside its own reference."""
    recorded = json.loads((Path(__file__).parent / "data" / f"{experiment}_dev_curves.json").read_text())
    shipped = {ref["preset"]: ref for ref in shipped_references(experiment)}
    assert set(shipped) == set(recorded)
    for preset, seeds in recorded.items():
        assert len(seeds) == 3 and shipped[preset]["seeds"] == sorted(int(seed) for seed in seeds)
        for seed, curve in seeds.items():
            others = [final(int(other), [tuple(point) for point in rest], preset)
                      for other, rest in seeds.items() if other != seed]
            reference = {**reference_from_runs(others, [str(other["seed"]) for other in others]),
                         "tolerance": shipped[preset]["tolerance"]}
            assert [band_position(reference, step, ppl) for step, ppl in curve] == [0] * len(curve), (preset, seed)
