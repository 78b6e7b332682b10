"""The real Snakemake DAG on a shrunken demo config, in a temporary folder: every stage, every output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest
from conftest import REPO

OVERRIDE = """
data: {demo: {seed: 3, train: 1500, dev: 40, test: 40}}
bpe: {vocab_size: 400}
train: {tokens_per_step: 1500, device_tokens: 1500, log_every: 5, dev_every: 10}
decode: {beam_size: 2, tokens_per_batch: 2000, max_len_b: 10}
models: [demo_base, demo_nopos]
presets:
  demo_base: {steps: 20, warmup_steps: 5, checkpoint_steps: 5, d_model: 64, d_ff: 128, n_layers: 1}
"""


def snakemake(workdir, *args):
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "override.yaml", *args],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("workflow")
    for name in ("Snakefile", "workflow", "config"):
        source = REPO / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, workdir / name)
    (workdir / "override.yaml").write_text(OVERRIDE)
    result = snakemake(workdir)
    if result.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in (workdir / "results").rglob("*.log"))
        pytest.fail(f"snakemake failed:\n{result.stderr[-4000:]}\n{logs}")
    return workdir


def test_every_stage_writes_its_outputs(demo_run):
    results = demo_run / "results" / "demo"
    for split in ("train", "dev", "test"):
        assert (results / "data" / f"{split}.en").stat().st_size > 0
        assert (results / "bin" / split / "meta.json").exists() if split != "test" else True
    for model in ("demo_base", "demo_nopos"):
        run = results / "train" / model / "seed1"
        assert json.loads((run / "final.json").read_text())["step"] == 20
        assert (results / "average" / model / "seed1" / "model.pt").exists()
        for split in ("dev", "test"):
            hypotheses = (results / "decode" / model / "seed1" / f"{split}.de").read_text(encoding="utf-8")
            assert len(hypotheses.split("\n")) - 1 == 40
            scores = json.loads((results / "score" / model / "seed1" / f"{split}.json").read_text())
            assert {"sacrebleu", "sacrebleu_signature", "bleu_tok", "bleu_tok_method", "chrf"} <= set(scores)


def test_the_report_has_a_row_per_preset_with_the_paper_columns(demo_run):
    table3 = pd.read_csv(demo_run / "results" / "demo" / "report" / "table3.csv")
    table2 = pd.read_csv(demo_run / "results" / "demo" / "report" / "table2.csv")
    assert list(table3["preset"]) == list(table2["preset"]) == ["demo_base", "demo_nopos"]
    for column in ("dev_ppl", "dev_bleu_tok", "dev_sacrebleu", "params", "paper_ppl_dev", "paper_bleu_dev"):
        assert column in table3, column
    for column in ("test_bleu_tok", "test_sacrebleu", "train_flops", "paper_bleu_test"):
        assert column in table2, column
    assert (demo_run / "results" / "demo" / "report" / "table3.md").read_text().startswith("# Table 3")


def test_mlflow_holds_one_finished_run_per_preset_with_bleu_and_translations(demo_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{demo_run}/results/mlflow.db")
    experiment = client.get_experiment_by_name("demo")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(run.data.tags["preset"] for run in runs) == ["demo_base", "demo_nopos"]
    for run in runs:
        assert run.info.status == "FINISHED"
        for metric in ("dev_bleu_tok", "dev_sacrebleu", "test_bleu_tok", "test_sacrebleu", "test_chrf", "dev_ppl"):
            assert metric in run.data.metrics, metric
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "translations/test")}
        assert "translations/test/test.de" in artifacts


def test_the_report_tests_every_row_against_the_base_and_draws_the_pictures(demo_run):
    report = demo_run / "results" / "demo" / "report"
    table3 = pd.read_csv(report / "table3.csv").set_index("preset")
    assert pd.isna(table3.loc["demo_base", "bootstrap_p_vs_base"])  # the base row, not tested against itself
    assert 0.0 <= table3.loc["demo_nopos", "bootstrap_p_vs_base"] <= 1.0
    for name in ("dev_ppl.png", "table3_bleu.png", "attention_long_distance.png", "attention_anaphora.png"):
        data = (report / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000, name


def test_the_report_is_logged_to_the_base_run_in_mlflow(demo_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{demo_run}/results/mlflow.db")
    run_id = json.loads((demo_run / "results" / "demo" / "train" / "demo_base" / "seed1" / "final.json").read_text())[
        "mlflow_run_id"]
    logged = {artifact.path for artifact in client.list_artifacts(run_id, "report")}
    assert {"report/table3.csv", "report/table2.md", "report/dev_ppl.png", "report/attention_anaphora.png"} <= logged


def test_a_second_run_has_nothing_to_do(demo_run):
    result = snakemake(demo_run, "-n")
    assert result.returncode == 0
    assert "Nothing to be done" in result.stdout + result.stderr


def test_snakemake_builds_an_html_report_with_the_tables_and_pictures(demo_run):
    result = snakemake(demo_run, "--report", "report.html")
    assert result.returncode == 0, result.stderr[-3000:]
    html = (demo_run / "report.html").read_text(encoding="utf-8")
    for text in ("Tables", "Figures", "Attention", "table3.csv", "dev_ppl.png", "attention_long_distance.png"):
        assert text in html, text
