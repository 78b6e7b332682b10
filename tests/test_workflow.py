"""The real Snakemake DAG on a shrunken demo config, in a temporary folder: every stage, every output."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch
from aiayn import layout
from conftest import REPO, write_text_corpus

OVERRIDE = """
data: {demo: {seed: 3, train: 1500, dev: 40, test: 40}}
bpe: {vocab_size: 400}
train: {tokens_per_step: 1500, device_tokens: 1500, log_every: 5, dev_every: 10}
decode: {beam_size: 2, tokens_per_batch: 2000, max_len_b: 10}
models: [demo_base, demo_nopos]
presets:
  demo_base: {steps: 20, warmup_steps: 5, checkpoint_steps: 5, d_model: 64, d_ff: 128, n_layers: 1}
  demo_nopos: {max_minutes: 0.001}   # a time budget that ends training after a step or two
"""


def snakemake_command(*args):
    return [sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "config/config.yaml", "override.yaml",
            *args]


def snakemake_environment():
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def snakemake(workdir, *args):
    return subprocess.run(snakemake_command(*args), cwd=workdir, env=snakemake_environment(), capture_output=True,
                          text=True, timeout=900)


def copy_workflow(workdir):
    for name in ("Snakefile", "workflow", "config"):
        source = REPO / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, workdir / name)
    # the profiles a test names; the workflow profile, profiles/default, stays out (tests/test_config.py runs it)
    shutil.copytree(REPO / "profiles", workdir / "profiles", ignore=shutil.ignore_patterns("default"))
    (workdir / "override.yaml").write_text(OVERRIDE)
    return workdir


@pytest.fixture(scope="module")
def demo_result(tmp_path_factory):
    """The whole DAG run once on the test's config: its folder, and what the terminal showed."""
    workdir = copy_workflow(tmp_path_factory.mktemp("workflow"))
    result = snakemake(workdir)
    if result.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in (workdir / "results").rglob("*.log"))
        pytest.fail(f"snakemake failed:\n{result.stderr[-4000:]}\n{logs}")
    return workdir, result.stdout + result.stderr


@pytest.fixture(scope="module")
def demo_run(demo_result):
    return demo_result[0]


def test_every_stage_writes_its_outputs(demo_run):
    results = demo_run / "results" / "demo"
    for split in ("train", "dev", "test"):
        assert (results / "data" / f"{split}.en").stat().st_size > 0
        assert (results / "bin" / split / "meta.json").exists() if split != "test" else True
    for model in ("demo_base", "demo_nopos"):
        run = results / "train" / model / "seed1"
        final = json.loads((run / "final.json").read_text())
        assert final["step"] == 20 if model == "demo_base" else final["stopped_by"] == "max_minutes"
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
    tokens = "tokens per step, real src + tgt"
    for column in ("dev_ppl", "dev_bleu_tok", "dev_sacrebleu", "dev_length_ratio", "params", "paper_ppl_dev",
                   "paper_bleu_dev", tokens):
        assert column in table3, column
    for column in ("test_bleu_tok", "test_sacrebleu", "test_length_ratio", "train_flops_analytic",
                   "train_cost_gpu_hours_x_peak", "paper_bleu_test", tokens):
        assert column in table2, column
    src, tgt = (float(side) for side in table2.loc[0, tokens].split(" + "))
    assert 1000 < src and 1000 < tgt  # tokens_per_step 1500 padded per side, real a little under
    assert table2["test_length_ratio"].between(0, 3).all()


def test_a_run_that_spends_its_time_budget_ends_normally_and_the_dag_completes(demo_run):
    results = demo_run / "results" / "demo"
    final = json.loads((results / "train" / "demo_nopos" / "seed1" / "final.json").read_text())
    assert final["stopped_by"] == "max_minutes" and final["step"] < final["planned_steps"]
    averaged = torch.load(results / "average" / "demo_nopos" / "seed1" / "model.pt", weights_only=True)
    assert averaged["averaged_steps"][-1] == final["step"]
    comparison = json.loads((results / "average" / "demo_nopos" / "seed1" / "average.json").read_text())
    assert comparison["averaged_steps"][-1] == final["step"] and comparison["dev_ppl_last"] > 1
    table3 = pd.read_csv(results / "report" / "table3.csv")
    assert table3["dev_ppl_averaged"].notna().all() and table3["dev_ppl_last"].notna().all()


def test_decode_reads_the_model_the_average_stage_chose_on_dev_and_the_report_names_it(demo_run):
    """average.choose: dev (the schema's default): model.pt, which decodes the test split, is the last checkpoint
    where the average was worse on dev, else the average; both tables name it (unit cases: test_average.py)."""
    results = demo_run / "results" / "demo"
    tables = [pd.read_csv(results / "report" / f"{name}.csv").set_index("preset") for name in ("table2", "table3")]
    for model in ("demo_base", "demo_nopos"):
        comparison = json.loads((results / "average" / model / "seed1" / "average.json").read_text())
        reported = torch.load(results / "average" / model / "seed1" / "model.pt", weights_only=True)
        last = torch.load(results / "train" / model / "seed1" / "final.pt", weights_only=True)
        assert comparison["choose"] == "dev"
        assert comparison["reported"] == ("last" if comparison["averaged_worse"] else "averaged")
        if comparison["reported"] == "last":
            assert reported["averaged_steps"] == comparison["last_steps"] == last["averaged_steps"]
            assert all(torch.equal(reported["model"][key], tensor) for key, tensor in last["model"].items())
        else:
            assert reported["averaged_steps"] == comparison["averaged_steps"]
        for table in tables:
            assert table.loc[model, "reported_model"] == comparison["reported_model"]
    assert (results / "score" / "demo_nopos" / "seed1" / "test.json").exists()
    assert (demo_run / "results" / "demo" / "report" / "table3.md").read_text().startswith("# Table 3")


def test_the_end_of_the_run_names_the_model_each_run_reports(demo_result):
    """One line a run in the terminal, as the average stage chose it (its average.json), with the dev figures."""
    workdir, terminal = demo_result
    for model in ("demo_base", "demo_nopos"):
        comparison = json.loads((workdir / "results" / "demo" / "average" / model / "seed1" / "average.json").read_text())
        line = re.search(rf"^  {model} seed 1: (.*)$", terminal, re.M)
        assert line and line.group(1).startswith(comparison["reported_model"]), terminal[-3000:]
        assert f"{comparison['dev_ppl_last']:.2f}" in line.group(1)


def test_the_jobs_read_the_resolved_config_written_before_the_first_job(demo_run):
    import yaml

    resolved = yaml.safe_load((demo_run / "results" / "demo" / "config" / "resolved.yaml").read_text())
    assert resolved["models"] == ["demo_base", "demo_nopos"] and resolved["decode"]["beam_size"] == 2
    assert resolved["average"]["choose"] == "dev"  # a key the config files leave out: the schema's default


def files_under(folder) -> set[str]:
    """Every file under ``folder`` but Snakemake's own state (.snakemake/, which it keeps for any command)."""
    return {str(path.relative_to(folder)) for path in folder.rglob("*")
            if path.is_file() and ".snakemake" not in path.relative_to(folder).parts}


@pytest.mark.workflow
def test_a_dry_run_writes_nothing_whether_its_plan_holds_or_fails(tmp_path):
    workdir = copy_workflow(tmp_path)
    before = files_under(workdir)
    planned = snakemake(workdir, "-n")
    assert planned.returncode == 0 and "This was a dry-run" in planned.stdout + planned.stderr, planned.stderr[-3000:]
    missing = {"data": {"source": "local", "local": {split: {"src": f"raw/{split}.en", "tgt": f"raw/{split}.de"}
                                                     for split in ("train", "dev", "test")}}}
    (workdir / "missing.yaml").write_text(json.dumps(missing))
    before.add("missing.yaml")
    failed = snakemake(workdir, "-n", "--configfile", "config/config.yaml", "missing.yaml")
    assert failed.returncode != 0 and "raw/train.en" in failed.stdout + failed.stderr, failed.stderr[-3000:]
    assert files_under(workdir) == before
    assert not (workdir / "results").exists()


def test_mlflow_holds_one_finished_run_per_preset_with_bleu_and_translations(demo_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{demo_run}/results/mlflow.db")
    experiment = client.get_experiment_by_name("demo")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(run.data.tags["preset"] for run in runs) == ["demo_base", "demo_nopos"]
    for run in runs:
        assert run.info.status == "FINISHED"
        assert run.data.tags["averaged_steps"]
        assert run.data.params["reported_model"].startswith(("averaged, step", "last checkpoint, step"))
        for metric in ("dev_bleu_tok", "dev_sacrebleu", "test_bleu_tok", "test_sacrebleu", "test_chrf", "dev_ppl",
                       "test_length_ratio", "dev_length_ratio", "real_src_tokens_per_step"):
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
    from aiayn.explore import read_page_data

    explorer = read_page_data((report / "attention_explorer.html").read_text(encoding="utf-8"))
    assert explorer["model"]["name"].endswith("demo_base/seed1/model.pt")
    assert len(explorer["sentences"]) == 5  # the paper's two and the first three dev sentences
    assert explorer["search"]["beam_size"] == 2  # the run's decode settings


def test_the_report_is_logged_to_the_base_run_in_mlflow(demo_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{demo_run}/results/mlflow.db")
    run_id = json.loads((demo_run / "results" / "demo" / "train" / "demo_base" / "seed1" / "final.json").read_text())[
        "mlflow_run_id"]
    logged = {artifact.path for artifact in client.list_artifacts(run_id, "report")}
    assert {"report/table3.csv", "report/table2.md", "report/dev_ppl.png", "report/attention_anaphora.png",
            "report/attention_explorer.html"} <= logged


def test_a_second_run_has_nothing_to_do(demo_run):
    result = snakemake(demo_run, "-n")
    assert result.returncode == 0
    assert "Nothing to be done" in result.stdout + result.stderr


def test_snakemake_builds_an_html_report_with_the_tables_and_pictures(demo_run):
    result = snakemake(demo_run, "--report", "report.html")
    assert result.returncode == 0, result.stderr[-3000:]
    html = (demo_run / "report.html").read_text(encoding="utf-8")
    for text in ("Tables", "Figures", "Attention", "table3.csv", "dev_ppl.png", "attention_long_distance.png",
                 "attention_explorer.html"):
        assert text in html, text


def training_processes(workdir, run_dir: str) -> list[int]:
    """Pids of `aiayn train` processes of this workflow folder writing to run_dir (from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        words = [word.decode(errors="replace") for word in argv]
        if "train" in words and "--run-dir" in words and run_dir in words and cwd == str(workdir):
            if any(word.endswith("aiayn") for word in words):
                pids.append(int(entry))
    return pids


def test_a_run_killed_midway_and_restarted_gives_the_tables_of_an_uninterrupted_run(demo_run, tmp_path):
    """The local profile, a training job killed with SIGKILL (no chance to save: an OOM kill, a lost
    node) after its first periodic checkpoint; the same command again resumes it and finishes the DAG."""
    workdir = copy_workflow(tmp_path)
    run_dir = "results/demo/train/demo_base/seed1"
    command = snakemake_command("--profile", "profiles/local", "--retries", "0")
    with open(tmp_path / "first.out", "w") as out:
        first = subprocess.Popen(command, cwd=workdir, env=snakemake_environment(), stdout=out,
                                 stderr=subprocess.STDOUT)
        killed = False
        deadline = time.monotonic() + 600
        while first.poll() is None and time.monotonic() < deadline:
            if not killed and list((workdir / run_dir / "checkpoints").glob("step_*.pt")):
                for pid in training_processes(workdir, run_dir):
                    os.kill(pid, signal.SIGKILL)
                    killed = True
            time.sleep(0.02)
        first.wait(timeout=max(1.0, deadline - time.monotonic()))
    output = (tmp_path / "first.out").read_text()
    assert killed, "the training job ended before it could be killed"
    assert first.returncode != 0, output[-3000:]
    assert not (workdir / run_dir / "final.pt").exists()

    second = subprocess.run(command, cwd=workdir, env=snakemake_environment(), capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    log = (workdir / "results/demo/logs/train/demo_base/seed1.log").read_text()
    assert re.search(r"resuming from \S+(step|safety)_\d+\.pt \(step \d+\)", log), log[-2000:]

    restarted, uninterrupted = workdir / "results" / "demo", demo_run / "results" / "demo"
    weights = [torch.load(root / "train/demo_base/seed1/final.pt", weights_only=True)["model"]
               for root in (uninterrupted, restarted)]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name
    # demo_nopos trains to a time budget, so how many steps it makes depends on the clock, not on the
    # interruption: its rows and files are left out of the comparison
    for table, columns in (("table2", ["preset", "test_bleu_tok", "test_sacrebleu"]),
                           ("table3", ["preset", "params", "dev_ppl", "dev_bleu_tok", "dev_sacrebleu",
                                       "bootstrap_p_vs_base"])):
        frames = [pd.read_csv(root / "report" / f"{table}.csv")[columns] for root in (uninterrupted, restarted)]
        frames = [frame[frame["preset"] != TIME_BUDGETED].reset_index(drop=True) for frame in frames]
        assert list(frames[0]["preset"]) == ["demo_base"]
        pd.testing.assert_frame_equal(frames[0], frames[1])
    # Every other output has the bytes of the uninterrupted run's, but for what records time or
    # identity by design (docs/results.md).
    differing = different_outputs(uninterrupted, restarted)
    assert [name for name in differing if f"/{TIME_BUDGETED}/" not in f"/{name}" and name not in EVERY_PRESET] == []


TIME_BUDGETED = "demo_nopos"  # the preset of the shared override with a time budget (max_minutes)
# figures that draw the time-budgeted preset too: the shared ones, and its own band figure
EVERY_PRESET = (f"report/{layout.DEV_PPL_FIGURE}", f"report/{layout.TABLE3_BLEU_FIGURE}",
                f"report/{layout.band_figure_name(TIME_BUDGETED)}")


# What two runs of the DAG may write differently (docs/results.md): logs, the training
# run's clock and MLflow identity (checkpoints carry both, for resuming), and the report tables' train_hours.
RUN_TO_RUN_EXCEPTIONS = ("logs/*", "train/*/seed*/checkpoints/*", "train/*/seed*/final.json",
                         "train/*/seed*/metrics.jsonl", "train/*/seed*/mlflow_*", "train/*/seed*/.lock",
                         "report/table*")


def different_outputs(first, second) -> list[str]:
    """The files under two results folders whose bytes (or existence) differ, outside the exceptions."""
    import fnmatch

    def files(root):
        return {str(path.relative_to(root)) for path in root.rglob("*") if path.is_file()}

    names = sorted(files(first) | files(second))
    return [name for name in names if not any(fnmatch.fnmatch(name, pattern) for pattern in RUN_TO_RUN_EXCEPTIONS)
            and (not (first / name).is_file() or not (second / name).is_file()
                 or (first / name).read_bytes() != (second / name).read_bytes())]


def broken_local_input(workdir):
    """A config whose training source is a folder, not a file: the download job fails with a user error."""
    local = write_text_corpus(workdir / "raw", (("train", 100), ("dev", 10), ("test", 10)))
    (workdir / "raw" / "texts").mkdir()
    local["train"]["src"] = str(workdir / "raw" / "texts")
    (workdir / "broken.yaml").write_text(json.dumps({"data": {"source": "local", "local": local}}))
    return "data.local.train.src: " + str(workdir / "raw" / "texts") + " is a directory"


@pytest.mark.workflow
def test_a_failing_jobs_error_message_is_printed_in_the_terminal(tmp_path):
    """A plain `snakemake --cores N` (what `make demo` runs): the job's own message, not only "check the log"."""
    workdir = copy_workflow(tmp_path)
    message = broken_local_input(workdir)
    result = snakemake(workdir, "--configfile", "config/config.yaml", "broken.yaml")
    terminal = result.stdout + result.stderr
    assert result.returncode != 0
    assert terminal.count(message) == 1, terminal[-4000:]
    assert "results/demo/logs/download.log:\nerror: " + message in terminal


@pytest.mark.workflow
def test_a_user_error_is_not_retried_under_the_local_profile(tmp_path):
    """The profile retries failed jobs (retries: 2); Snakemake starts the job three times, but the stage runs
    once: the retries see that attempt 1 ended with a user error and end at once. The message shows once."""
    workdir = copy_workflow(tmp_path)
    message = broken_local_input(workdir)
    result = snakemake(workdir, "--profile", "profiles/local", "--configfile", "config/config.yaml",
                       "broken.yaml")
    terminal = result.stdout + result.stderr
    assert result.returncode != 0
    assert terminal.count("Trying to restart job") == 2, terminal[-4000:]
    for attempt in (2, 3):
        assert f"attempt {attempt} of this command not run: attempt 1 ended with a user error" in terminal
    assert terminal.count(message) == 1, terminal[-4000:]
    log = (workdir / "results/demo/logs/download.log").read_text()
    assert log.count("error: ") == 1 and log.count("not run") == 2, log


@pytest.mark.workflow
def test_every_failing_job_of_a_keep_going_run_shows_its_message_at_the_end(demo_run, tmp_path):
    """Both training jobs fail (an MLflow store that does not answer) while the run goes on: both messages."""
    workdir = copy_workflow(tmp_path)
    for stage in ("data", "bpe", "bin"):  # done already: only the training jobs run (and fail)
        shutil.copytree(demo_run / "results" / "demo" / stage, workdir / "results" / "demo" / stage)
    result = snakemake(workdir, "--keep-going", "--config", "tracking_uri=http://127.0.0.1:9")
    terminal = result.stdout + result.stderr
    assert result.returncode != 0
    for model in ("demo_base", "demo_nopos"):
        assert re.search(rf"logs/train/{model}/seed1\.log:\nerror: cannot use the MLflow tracking store", terminal), \
            terminal[-4000:]
    assert "rule download" not in terminal and "rule bpe" not in terminal


def with_config(workdir, overlay: str, *args) -> subprocess.CompletedProcess:
    """snakemake with the test's config and `overlay` (YAML) merged over it into one config file."""
    import yaml

    from aiayn.config import merge

    config = merge(yaml.safe_load(OVERRIDE), yaml.safe_load(overlay) or {})
    (workdir / "changed.yaml").write_text(yaml.safe_dump(config))
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", *args,
                           "--configfile", "config/config.yaml", "changed.yaml"],
                          cwd=workdir, env=snakemake_environment(), capture_output=True, text=True, timeout=600)


def dry_run(workdir, overlay: str, *targets) -> str:
    """What `snakemake -n` would run and why, with `overlay` merged over the test's config."""
    result = with_config(workdir, overlay, "-n", *targets)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result.stdout + result.stderr


def test_a_setting_that_changes_no_output_reruns_nothing_and_one_that_does_reruns_its_stage(demo_run):
    quiet = dry_run(demo_run, "train: {log_every: 7, threads: 1}\ndecode: {workers: 2}\nbinarize: {workers: 1}")
    assert "Nothing to be done" in quiet, quiet[-3000:]
    changed = dry_run(demo_run, "decode: {beam_size: 3}")
    assert "params have changed since last execution" in changed.lower(), changed[-3000:]
    assert re.search(r"^decode\s+4$", changed, re.M) and not re.search(r"^train\s+\d", changed, re.M), changed[-3000:]


@pytest.mark.workflow
def test_editing_a_local_input_file_reruns_the_download_and_what_follows(tmp_path):
    workdir = copy_workflow(tmp_path)
    local = write_text_corpus(workdir / "raw", (("train", 200), ("dev", 20), ("test", 20)))
    overlay = json.dumps({"data": {"source": "local", "local": local}})
    target = "results/demo/data/stats.json"
    first = with_config(workdir, overlay, target)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    assert "Nothing to be done" in dry_run(workdir, overlay, target)
    time.sleep(1.1)  # a later modification time on any file system
    for name, line in (("train.de", "noch ein Satz .\n"), ("train.en", "one more sentence .\n")):
        with open(workdir / "raw" / name, "a", encoding="utf-8") as handle:
            handle.write(line)
    edited = dry_run(workdir, overlay, target)
    assert "Updated input files" in edited and "raw/train.en" in edited, edited[-3000:]
