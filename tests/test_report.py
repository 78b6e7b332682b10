"""The report: tables from hand-made result folders, the paired bootstrap column, the pictures, MLflow."""

from __future__ import annotations

import json
import math
import random

import pytest
from conftest import make_pairs

from aiayn.errors import UserError

from aiayn.report import RunFiles, base_preset, build_report, dev_perplexity_curves, main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SEGMENTS = 40

# Two presets x two seeds: (dev BLEU tok, dev sacreBLEU, test BLEU tok, dev ppl, parameters)
RESULTS = {
    ("base", 1): (25.0, 24.0, 27.0, 5.0, 63_000_000),
    ("base", 2): (26.0, 25.0, 28.0, 4.8, 63_000_000),
    ("A_heads_1", 1): (23.0, 22.0, 25.0, 5.5, 63_000_000),
    ("A_heads_1", 2): (24.5, 23.0, 26.0, 5.3, 63_000_000),
}
PRESETS = {
    # A_heads_1 first: the base is found by its paper row, not by its place.
    "A_heads_1": {"name": "A_heads_1", "paper": {"table": "table3", "row": "A h=1", "ppl_dev": 5.29, "bleu_dev": 24.9}},
    "base": {"name": "base", "paper": {"table": "table3", "row": "base", "ppl_dev": 4.92, "bleu_dev": 25.8,
                                       "bleu_test": 27.3, "params": 65e6, "train_flops": 3.3e18}},
}


def degrade(lines: list[str], share: float, seed: int) -> list[str]:
    """Replace a share of the words by a token that is in no reference: a worse translation."""
    rng = random.Random(seed)
    return [" ".join(word if rng.random() > share else "xx" for word in line.split()) for line in lines]


def write_run(results, preset, seed, history=True):
    dev_bleu, dev_sacre, test_bleu, ppl, params = RESULTS[(preset, seed)]
    run = results / "train" / preset / f"seed{seed}"
    run.mkdir(parents=True)
    dev_history = [{"step": step, "dev_loss": math.log(p) + 0.3, "dev_nll": math.log(p), "dev_ppl": p}
                   for step, p in ((100, 3 * ppl), (200, 1.5 * ppl), (300, ppl))]
    final = {"preset": preset, "seed": seed, "step": 300, "epochs": 2, "parameters": params, "train_hours": 0.5,
             "train_flops": 1e15, "world_size": 8, "device_peak_flops": 1e12, "real_src_tokens_per_step": 24000.4,
             "real_tgt_tokens_per_step": 24500.6, "dev_loss": math.log(ppl) + 0.3, "dev_nll": math.log(ppl), "dev_ppl": ppl,
             "dev_history": dev_history if history else [], "mlflow_run_id": None}
    (run / "final.json").write_text(json.dumps(final))
    scores = results / "score" / preset / f"seed{seed}"
    scores.mkdir(parents=True)
    signature = "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0"
    for split, bleu_tok, sacre in (("dev", dev_bleu, dev_sacre), ("test", test_bleu, test_bleu - 1)):
        (scores / f"{split}.json").write_text(json.dumps(
            {"bleu_tok": bleu_tok, "sacrebleu": sacre, "chrf": 50.0, "sacrebleu_signature": signature}))
    return dev_history


def files_of(results, runs=tuple(RESULTS)) -> list[RunFiles]:
    """The files of each (preset, seed) run, laid out as the workflow lays them out."""
    return [RunFiles(final=results / "train" / preset / f"seed{seed}" / "final.json",
                     dev_score=results / "score" / preset / f"seed{seed}" / "dev.json",
                     test_score=results / "score" / preset / f"seed{seed}" / "test.json",
                     dev_translations=results / "decode" / preset / f"seed{seed}" / "dev.de")
            for preset, seed in runs]


def report_of(results, out, **options):
    return build_report(PRESETS, files_of(results), out, dev_references=results / "data" / "dev.de", **options)


def config_of(folder) -> str:
    """A config of the two presets the runs train, the paper's, two seeds each: what the report rule passes."""
    path = folder / "c.yaml"
    path.write_text("models: [A_heads_1, base]\nseeds: [1, 2]\n")
    return str(path)


def arguments(results, runs=tuple(RESULTS)) -> list[str]:
    """The report command's input arguments, as the report rule passes them."""
    files = files_of(results, runs)
    return (["--runs", *(str(run.final) for run in files), "--dev-scores", *(str(run.dev_score) for run in files),
             "--test-scores", *(str(run.test_score) for run in files),
             "--dev-translations", *(str(run.dev_translations) for run in files),
             "--dev-references", str(results / "data" / "dev.de")])


@pytest.fixture()
def results(tmp_path):
    results = tmp_path / "results" / "exp"
    references = [de for _, de in make_pairs(SEGMENTS, seed=5)]
    (results / "data").mkdir(parents=True)
    (results / "data" / "dev.de").write_text("".join(line + "\n" for line in references), encoding="utf-8")
    for (preset, seed) in RESULTS:
        write_run(results, preset, seed)
        # the base translates well, the one-head row much worse: the test must tell them apart
        hypotheses = degrade(references, 0.05 if preset == "base" else 0.6, seed)
        decode = results / "decode" / preset / f"seed{seed}"
        decode.mkdir(parents=True)
        (decode / "dev.de").write_text("".join(line + "\n" for line in hypotheses), encoding="utf-8")
    return results


def test_tables_have_every_preset_with_mean_std_and_the_difference_to_the_paper(results, tmp_path):
    report = report_of(results, tmp_path / "report", bootstrap_samples=50, figures=False)
    table3 = report["table3"].set_index("preset")
    table2 = report["table2"].set_index("preset")
    assert list(table3.index) == list(table2.index) == ["A_heads_1", "base"]
    assert list(table3["seeds"]) == [2, 2]
    assert table3.loc["base", "dev_bleu_tok"] == pytest.approx(25.5)
    assert table3.loc["base", "dev_bleu_tok_std"] == pytest.approx(math.sqrt(0.5))  # sample std of 25 and 26
    assert table3.loc["base", "dev_bleu_tok_diff"] == pytest.approx(25.5 - 25.8)
    assert table3.loc["A_heads_1", "dev_ppl"] == pytest.approx(5.4)
    assert table3.loc["A_heads_1", "dev_ppl_diff"] == pytest.approx(5.4 - 5.29)
    assert table3.loc["base", "params_diff"] == pytest.approx(63e6 - 65e6)
    assert math.isnan(table3.loc["A_heads_1", "params_diff"])  # the paper gives no count for that row
    assert table2.loc["base", "test_bleu_tok"] == pytest.approx(27.5)
    assert table2.loc["base", "test_bleu_tok_diff"] == pytest.approx(27.5 - 27.3)
    # the paper's cost is GPU-hours x a rate, and so is ours: 0.5 h x 8 GPUs x 1e12 FLOP/s
    assert table2.loc["base", "train_cost_gpu_hours_x_peak"] == pytest.approx(0.5 * 3600 * 8 * 1e12)
    assert table2.loc["base", "train_cost_gpu_hours_x_peak_diff"] == pytest.approx(0.5 * 3600 * 8 * 1e12 - 3.3e18)
    assert table2.loc["base", "train_flops_analytic"] == 1e15
    assert table2.loc["base", "tokens per step, real src + tgt"] == "24000 + 24501"

    import pandas as pd

    written = pd.read_csv(tmp_path / "report" / "table3.csv")
    assert list(written.columns) == list(report["table3"].columns)
    for column in ("row", "seeds", "dev_ppl", "dev_ppl_std", "dev_bleu_tok", "dev_sacrebleu", "params",
                   "paper_ppl_dev", "paper_bleu_dev", "paper_params", "bootstrap_p_vs_base",
                   "dev_sacrebleu_bootstrap_mean", "dev_sacrebleu_bootstrap_ci95"):
        assert column in written, column
    markdown = (tmp_path / "report" / "table3.md").read_text()
    assert markdown.startswith("# Table 3") and "paired bootstrap" in markdown and "`base`" in markdown


def markdown_header(path) -> list[str]:
    """The column names of the table in a report's .md file."""
    header = next(line for line in path.read_text().splitlines() if line.startswith("|"))
    return [cell.strip() for cell in header.strip("|").split("|")]


def test_the_markdown_leaves_out_columns_empty_in_every_row_and_the_csv_keeps_them(results, tmp_path):
    import pandas as pd

    # the demo's presets: a paper table and row, no paper numbers
    presets = {name: {"name": name, "paper": {"table": "table3", "row": preset["paper"]["row"]}}
               for name, preset in PRESETS.items()}
    build_report(presets, files_of(results), tmp_path / "demo", bootstrap_samples=0, figures=False)
    for name, paper_columns in (("table3", ["paper_ppl_dev", "paper_bleu_dev", "paper_params", "dev_ppl_diff",
                                            "dev_bleu_tok_diff", "params_diff"]),
                                ("table2", ["paper_bleu_test", "paper_train_flops", "test_bleu_tok_diff"])):
        shown = markdown_header(tmp_path / "demo" / f"{name}.md")
        assert "dev_bleu_tok" in shown or "test_bleu_tok" in shown
        assert not set(paper_columns) & set(shown), name
        assert set(paper_columns) <= set(pd.read_csv(tmp_path / "demo" / f"{name}.csv").columns), name
        assert "Left out here, empty in every row" in (tmp_path / "demo" / f"{name}.md").read_text()
    # the paper's presets have numbers: their columns stay, though a row without one is empty there
    report_of(results, tmp_path / "paper", bootstrap_samples=0, figures=False)
    shown = markdown_header(tmp_path / "paper" / "table3.md")
    assert {"paper_ppl_dev", "paper_bleu_dev", "paper_params", "dev_bleu_tok_diff", "params_diff"} <= set(shown)


def test_the_bootstrap_tells_a_much_worse_row_from_the_base(results, tmp_path):
    table3 = report_of(results, tmp_path, bootstrap_samples=200, figures=False)["table3"]
    table3 = table3.set_index("preset")
    p_value = table3.loc["A_heads_1", "bootstrap_p_vs_base"]
    assert 0.0 <= p_value <= 1.0
    assert p_value < 0.05
    assert math.isnan(table3.loc["base", "bootstrap_p_vs_base"])  # not tested against itself
    # the markdown: the base's cell empty, not "nan"; the note under Table 3 only, which has the column
    table3_md = (tmp_path / "table3.md").read_text()
    base_row = next(line for line in table3_md.splitlines() if line.startswith("| base "))
    assert "nan" not in base_row
    assert "`bootstrap_p_vs_base`" in table3_md
    assert "bootstrap_p_vs_base" not in (tmp_path / "table2.md").read_text()
    means = table3["dev_sacrebleu_bootstrap_mean"]
    assert means["base"] > means["A_heads_1"]
    assert (table3["dev_sacrebleu_bootstrap_ci95"] > 0).all()


def test_a_row_as_good_as_the_base_gets_a_larger_p_value_than_a_worse_one(results, tmp_path):
    def p_value_vs_base(out):
        table3 = report_of(results, out, bootstrap_samples=100, figures=False)["table3"]
        return table3.set_index("preset").loc["A_heads_1", "bootstrap_p_vs_base"]

    worse = p_value_vs_base(tmp_path / "worse")
    references = (results / "data" / "dev.de").read_text(encoding="utf-8").splitlines()
    for seed in (1, 2):
        # the base's error rate, other errors: a difference much more of which resampling explains
        hypotheses = degrade(references, 0.05, seed + 100)
        (results / "decode" / "A_heads_1" / f"seed{seed}" / "dev.de").write_text(
            "".join(line + "\n" for line in hypotheses), encoding="utf-8")
    # sacreBLEU's test (Moses' bootstrap-hypothesis-difference-significance.pl) compares the centred
    # resampled differences with the observed one, so even equal systems rarely reach large p-values.
    assert p_value_vs_base(tmp_path / "as_good") > worse


def test_the_base_is_the_paper_base_row_else_the_first_preset():
    assert base_preset(PRESETS) == "base"
    assert base_preset({"x": {"paper": {"row": "A h=1"}}, "y": {"paper": {}}}) == "x"


def test_the_pictures_are_png_files(results, tmp_path):
    report = report_of(results, tmp_path / "report", bootstrap_samples=20)
    for name in ("dev_ppl.png", "table3_bleu.png"):
        data = (tmp_path / "report" / name).read_bytes()
        assert data.startswith(PNG_MAGIC), name
        assert len(data) > 5000, name  # axes, lines and labels, not an empty canvas
    assert {path.name for path in report["files"]} >= {"dev_ppl.png", "table3_bleu.png", "table3.csv", "table2.md"}


def test_the_final_perplexities_are_written_beside_the_axes_without_overlapping():
    from aiayn.plots import dev_perplexity_figure

    # the demo's shape: from about 80 down to values close together between the decades 1 and 10
    finals = {"base": 1.66, "learned": 1.70, "nopos": 1.9, "heads_1": 4.9}
    curves = {name: {1: [(100, 80.0 - index), (200, 7.0), (360, final)]}
              for index, (name, final) in enumerate(finals.items())}
    figure = dev_perplexity_figure(curves)
    axes = figure.axes[0]
    renderer = figure.canvas.get_renderer()
    figure.draw(renderer)
    texts = {text.get_text(): text for text in axes.texts}
    assert {f"{final:.3g}" for final in finals.values()} <= set(texts)
    boxes = [texts[f"{final:.3g}"].get_window_extent(renderer) for final in finals.values()]
    for index, box in enumerate(boxes):
        assert figure.bbox.contains(box.x0, box.y0) and figure.bbox.contains(box.x1, box.y1)
        for other in boxes[index + 1:]:
            assert not box.overlaps(other)
    # and the axis itself is labelled between the decades where the final values lie
    labelled = [tick.get_loc() for tick in axes.yaxis.get_minor_ticks() + axes.yaxis.get_major_ticks()
                if tick.label1.get_visible() and tick.label1.get_text()
                and axes.get_ylim()[0] <= tick.get_loc() <= axes.get_ylim()[1]]
    assert any(1.5 <= value < 10 for value in labelled), labelled


def test_dev_curves_come_from_the_history_else_from_metrics_jsonl(tmp_path):
    results = tmp_path / "results"
    history = write_run(results, "base", 1)
    write_run(results, "A_heads_1", 1, history=False)
    records = [{"step": 50, "train_loss": 3.0}, {"step": 100, "dev_ppl": 9.0}, {"step": 200, "dev_ppl": 7.0}]
    (results / "train" / "A_heads_1" / "seed1" / "metrics.jsonl").write_text(
        "".join(json.dumps(record) + "\n" for record in records))
    import pandas as pd

    curves = dev_perplexity_curves({(run.final.parent.parent.name, 1): run
                                    for run in files_of(results, [("base", 1), ("A_heads_1", 1)])})
    assert curves["base"][1] == [(entry["step"], entry["dev_ppl"]) for entry in history]
    assert curves["A_heads_1"][1] == [(100, 9.0), (200, 7.0)]


def test_the_command_writes_everything_and_logs_it_to_the_base_run(results, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("exp", artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(experiment).info.run_id
    final = results / "train" / "base" / "seed1" / "final.json"
    final.write_text(json.dumps({**json.loads(final.read_text()), "mlflow_run_id": run_id}))

    out = tmp_path / "report"
    status = main(["--config", config_of(tmp_path), *arguments(results), "--out-dir", str(out),
                   "--bootstrap-samples", "20", "--tracking-uri", uri])
    assert status == 0
    logged = {artifact.path for artifact in client.list_artifacts(run_id, "report")}
    assert {"report/table3.csv", "report/table2.md", "report/dev_ppl.png", "report/table3_bleu.png"} <= logged


def test_the_command_reports_the_presets_of_its_config_files_as_the_python_api(results, tmp_path):
    from aiayn.config import load_config, resolve_presets

    config = config_of(tmp_path)
    common = [*arguments(results), "--no-tracking", "--no-figures", "--bootstrap-samples", "0"]
    assert main(["--config", config, *common, "--out-dir", str(tmp_path / "files")]) == 0
    build_report(resolve_presets(load_config([config])), files_of(results), tmp_path / "api",
                 dev_references=results / "data" / "dev.de", bootstrap_samples=0, figures=False)
    for table in ("table2.csv", "table3.csv"):
        assert (tmp_path / "files" / table).read_text() == (tmp_path / "api" / table).read_text()
    assert "A h=1" in (tmp_path / "files" / "table3.csv").read_text()


def test_missing_dev_translations_are_a_user_error(results, tmp_path, capsys):
    (results / "decode" / "A_heads_1" / "seed2" / "dev.de").unlink()
    status = main(["--config", config_of(tmp_path), *arguments(results), "--out-dir", str(tmp_path),
                   "--no-tracking", "--no-figures"])
    assert status == 2
    assert "dev.de: missing" in capsys.readouterr().err


def test_the_report_reads_only_the_files_it_is_given(results, tmp_path):
    # a run of the results folder that is not passed is not reported; lists of another length are refused
    report = build_report(PRESETS, files_of(results, [("base", 1), ("A_heads_1", 1)]), tmp_path / "report",
                          dev_references=results / "data" / "dev.de", bootstrap_samples=0, figures=False)
    assert list(report["table3"]["seeds"]) == [1, 1]
    options = arguments(results, [("base", 1), ("A_heads_1", 1)])
    cut = options.index("--test-scores") + 1
    status = main(["--config", config_of(tmp_path), *options[:cut], *options[cut + 1:], "--out-dir",
                   str(tmp_path / "other"), "--no-tracking", "--no-figures"])
    assert status == 2
    assert not (tmp_path / "other").exists()


def test_a_run_given_twice_or_of_another_preset_is_refused(results, tmp_path, capsys):
    twice = files_of(results, [("base", 1), ("base", 1)])
    with pytest.raises(UserError, match="given twice"):
        build_report(PRESETS, twice, tmp_path, bootstrap_samples=0, figures=False)
    with pytest.raises(UserError, match="not one of the reported presets"):
        build_report({"base": PRESETS["base"]}, files_of(results), tmp_path, bootstrap_samples=0, figures=False)


def test_table3_shows_last_vs_averaged_from_each_runs_average_json(results, tmp_path):
    from dataclasses import replace

    files = []
    for run, (preset, seed) in zip(files_of(results), RESULTS):
        average = results / "average" / preset / f"seed{seed}" / "average.json"
        average.parent.mkdir(parents=True)
        averaged = 4.9 + seed / 10 if preset == "base" else 6.0
        average.write_text(json.dumps({"dev_ppl_last": 5.0, "dev_ppl_averaged": averaged,
                                       "averaged_steps": [200, 250, 300]}))
        files.append(replace(run, average=average))
    report = build_report(PRESETS, files, tmp_path / "report", bootstrap_samples=0, figures=False)
    table3 = report["table3"].set_index("preset")
    assert table3.loc["base", "dev_ppl_last"] == pytest.approx(5.0)
    assert table3.loc["base", "dev_ppl_averaged"] == pytest.approx(5.05)  # the mean of the seeds' 5.0 and 5.1
    assert table3.loc["A_heads_1", "dev_ppl_averaged"] == pytest.approx(6.0)
    assert table3.loc["base", "averaged_steps"] == "200 250 300"
    markdown = (tmp_path / "report" / "table3.md").read_text()
    assert "dev_ppl_averaged" in markdown and "averaged_steps" in markdown and "Last vs averaged" in markdown


def test_both_tables_say_which_model_each_run_is(results, tmp_path):
    """The average stage's choice, as average.json records it: base seed 1 reports its last checkpoint (its
    average was worse on dev), every other run its average."""
    from dataclasses import replace

    from aiayn.average_dev import chosen, reported_model

    files, said = [], {}
    for run, (preset, seed) in zip(files_of(results), RESULTS):
        worse = (preset, seed) == ("base", 1)
        summary = {"dev_ppl_last": 5.0, "dev_ppl_averaged": 5.6 if worse else 4.9, "averaged_worse": worse,
                   "averaged_steps": [206, 209, 212, 215, 219], "last_steps": [219]}
        reported = chosen(summary, "dev")
        said[(preset, seed)] = summary["reported_model"] = reported_model(summary, reported)
        average = results / "average" / preset / f"seed{seed}" / "average.json"
        average.parent.mkdir(parents=True)
        average.write_text(json.dumps({**summary, "reported": reported}))
        files.append(replace(run, average=average))
    assert said[("base", 1)] == ("last checkpoint, step 219: the average (steps 206-219) was worse on dev by 0.60 "
                                 "perplexity (5.60 against 5.00)")
    assert said[("base", 2)] == "averaged, steps 206-219"
    report = build_report(PRESETS, files, tmp_path / "report", bootstrap_samples=0, figures=False)
    for name in ("table2", "table3"):
        table = report[name].set_index("preset")
        assert table.loc["base", "reported_model"] == f"seed 1: {said[('base', 1)]}; seed 2: {said[('base', 2)]}"
        assert table.loc["A_heads_1", "reported_model"] == "averaged, steps 206-219"  # both seeds alike: once
        markdown = (tmp_path / "report" / f"{name}.md").read_text()
        assert said[("base", 1)] in markdown and "`reported_model`" in markdown
    assert list(report["table2"].columns[:4]) == ["preset", "row", "seeds", "reported_model"]
