"""Tracking that several machines share: a real MLflow server over HTTP, an unreachable one,
eight writers on one SQLite store, and a training job stopped by a signal and resumed."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path

import pytest
from conftest import tiny_preset, train_settings

from aiayn.config import section_defaults
from aiayn.tracking import Tracker, experiment_id_for, git_tags, open_client

# the schema's defaults, with a small batch and frequent logging
TRAIN_SECTION = {**section_defaults("train"), "tokens_per_step": 600, "device_tokens": 600, "log_every": 2,
                 "dev_every": 0, "precision": "fp32"}


def environment() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_command(prepared: Path, run_dir: Path, preset: dict, *extra: str) -> list[str]:
    return [sys.executable, "-m", "aiayn.train", *train_settings(Path(run_dir).parent, preset, TRAIN_SECTION),
            "--seed", "1", "--train-data", str(prepared / "bin" / "train"),
            "--spm-model", str(prepared / "bpe" / "spm.model"), "--run-dir", str(run_dir), "--device", "cpu",
            "--threads", "1", "--experiment", "tests", *extra]


# --- a shared MLflow server --------------------------------------------------------------

@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``mlflow server`` on a free local port with a SQLite backend; its URL."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(root / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--artifacts-destination", str(root / "artifacts"),
         "--allowed-hosts", f"127.0.0.1:{port},localhost:{port}"],
        stdout=log, stderr=subprocess.STDOUT, env=environment(), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not come up:\n{(root / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        # the server runs its workers as children: stop the whole session it leads
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=2)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.close()


@pytest.fixture
def tracking_uri_unset():
    """No MLFLOW_TRACKING_URI during the test, and none left behind: MLflow 3's set_tracking_uri
    (which Tracker.start calls) exports it into os.environ, where it would outrank the
    configured URI of every later run in this process and its children."""
    saved = os.environ.pop("MLFLOW_TRACKING_URI", None)
    yield
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    if saved is not None:
        os.environ["MLFLOW_TRACKING_URI"] = saved


def test_a_training_run_reaches_an_mlflow_server_and_compare_reads_it_back(prepared, tmp_path, mlflow_server,
                                                                          tracking_uri_unset):
    from mlflow.tracking import MlflowClient

    from aiayn.train.trainer import TrainJob, train

    job = TrainJob(tiny_preset(name="served"), TRAIN_SECTION, 1, prepared / "bin" / "train", prepared / "bin" / "dev",
                   prepared / "bpe" / "spm.model", tmp_path / "run", "over-http", mlflow_server, True, "cpu",
                   progress_bar=False)
    summary = train(job)
    assert summary["tracking_uri"] == mlflow_server
    run = MlflowClient(mlflow_server).get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["preset"] == "served"
    # the saved view's knobs are parameters of every training run (tests above check the rest of the view)
    from aiayn.tracking_view import RUNS_VIEW_PARAMS

    assert set(RUNS_VIEW_PARAMS) <= set(run.data.params)
    assert run.data.tags["mlflow.source.name"].endswith(" aiayn train")
    assert [m.step for m in MlflowClient(mlflow_server).get_metric_history(run.info.run_id, "train_loss")] == [2, 4, 6]

    compare = subprocess.run([sys.executable, "-m", "aiayn.cli", "compare", "--experiment", "over-http",
                              "--tracking-uri", mlflow_server], capture_output=True, text=True, env=environment(),
                             timeout=120)
    assert compare.returncode == 0, compare.stderr
    header, row = compare.stdout.splitlines()[:2]
    assert header.split()[:2] == ["preset", "seed"]
    assert row.split()[:2] == ["served", "1"] and "FINISHED" in row


def test_an_unreachable_tracking_server_stops_training_before_it_starts_and_at_once(prepared, tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"  # bound and released: nothing listens there
    started = time.monotonic()
    try:
        result = subprocess.run(train_command(prepared, tmp_path / "run", tiny_preset(), "--tracking-uri", uri),
                                capture_output=True, text=True, env=environment(), timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"training still waited for {uri} after 90 s (MLflow's own retries of an unanswered "
                    "HTTP request take about four minutes)")
    seconds = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-2000:]
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: ") and uri in message and "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "final.json").exists()
    assert seconds < 60, f"{seconds:.0f} s to give up on {uri}"


# --- what the MLflow UI shows first ------------------------------------------------------

def saved_view(experiment) -> tuple[str, dict]:
    """The experiment's saved runs view read as the UI reads it: the envelope, then its state (JSON)."""
    from aiayn.tracking_view import RUNS_VIEW_ID, SAVED_VIEW_TAG_PREFIX

    envelope = json.loads(experiment.tags[SAVED_VIEW_TAG_PREFIX + RUNS_VIEW_ID])
    assert isinstance(envelope["createdAt"], int) and isinstance(envelope["state"], str)
    return envelope["name"], json.loads(envelope["state"])


def test_the_experiment_holds_a_saved_runs_view_of_bleu_and_the_table3_knobs(tmp_path, tracking_uri_unset):
    client = open_client(f"sqlite:///{tmp_path}/mlflow.db")
    experiment_id = experiment_id_for(client, "demo")
    experiment = client.get_experiment(experiment_id)
    name, state = saved_view(experiment)
    assert name == "BLEU and Table 3 knobs"
    columns = state["selectedColumns"]
    assert columns[0] == "attributes.`Source`"
    for metric in ("dev_bleu_tok", "dev_sacrebleu", "test_bleu_tok", "test_sacrebleu", "dev_ppl"):
        assert f"metrics.`{metric}`" in columns
    for knob in ("n_layers", "d_model", "d_ff", "n_heads", "d_head", "dropout", "label_smoothing", "positional",
                 "steps"):
        assert f"params.`preset.{knob}`" in columns
    assert (state["orderByKey"], state["orderByAsc"]) == ("metrics.`dev_bleu_tok`", False)  # best first
    # the description, whose first line the page shows, says where to find the view
    assert "Views → BLEU and Table 3 knobs" in experiment.tags["mlflow.note.content"][:200]
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"


def test_an_existing_experiment_gets_the_saved_view_and_a_changed_one_is_rewritten(tmp_path, tracking_uri_unset):
    from aiayn.tracking_view import RUNS_VIEW_ID, SAVED_VIEW_TAG_PREFIX

    client = open_client(f"sqlite:///{tmp_path}/mlflow.db")
    experiment_id = client.create_experiment("older")  # made before the view existed
    assert experiment_id_for(client, "older") == experiment_id
    assert saved_view(client.get_experiment(experiment_id))[1]["selectedColumns"]
    client.set_experiment_tag(experiment_id, SAVED_VIEW_TAG_PREFIX + RUNS_VIEW_ID,
                              json.dumps({"name": "old", "createdAt": 0, "state": "{}"}))
    experiment_id_for(client, "older")
    assert saved_view(client.get_experiment(experiment_id))[0] == "BLEU and Table 3 knobs"


def test_the_views_bleu_columns_are_the_metrics_the_score_stage_logs(tmp_path, tracking_uri_unset):
    from aiayn.score import main as score
    from aiayn.tracking_view import RUNS_VIEW_METRICS

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = open_client(uri)
    run = client.create_run(experiment_id_for(client, "scored"))
    final = tmp_path / "final.json"
    final.write_text(json.dumps({"mlflow_run_id": run.info.run_id, "step": 10}))
    (tmp_path / "hyp.txt").write_text("Das Haus ist klein .\n")
    (tmp_path / "ref.txt").write_text("Das Haus ist klein .\n")
    for split in ("dev", "test"):
        score(["--hyp", str(tmp_path / "hyp.txt"), "--ref", str(tmp_path / "ref.txt"), "--log-to-run", str(final),
               "--split", split, "--tracking-uri", uri])
    logged = client.get_run(run.info.run_id).data.metrics
    assert {name for name in RUNS_VIEW_METRICS if name != "dev_ppl"} <= set(logged)  # dev_ppl: the training's


def test_the_source_column_names_the_commit():
    commit = "d65b50188b98df0e19ff9e0ab2acfebffab3a01b"
    tags = git_tags(commit)
    # the UI's Source column shows the last /-part of mlflow.source.name, its start when the column is narrow
    assert tags["mlflow.source.name"].split("/")[-1] == "d65b5018 aiayn train"
    assert tags["mlflow.source.git.commit"] == commit
    assert git_tags(commit + "-dirty")["mlflow.source.name"] == "d65b5018-dirty aiayn train"
    assert git_tags("unknown")["mlflow.source.name"] == "unknown commit aiayn train"


def test_the_screenshot_script_opens_the_saved_view_the_experiment_holds():
    from aiayn.tracking_view import RUNS_VIEW_ID
    from conftest import REPO

    # docs/mlflow_screenshot.py runs without aiayn (a venv with playwright), so it spells the id out
    assert f'RUNS_VIEW_ID = "{RUNS_VIEW_ID}"' in (REPO / "docs" / "mlflow_screenshot.py").read_text()


def test_the_commit_is_the_one_of_the_repository_the_run_happens_in(tmp_path, monkeypatch):
    from aiayn.tracking import git_commit

    outside = tmp_path / "outside"
    outside.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no repository above tmp_path counts
    assert git_commit(outside) == "unknown"
    repo = tmp_path / "theirs"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "config.yaml").write_text("models: [base]\n")
    subprocess.run([*git, "add", "config.yaml"], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.chdir(repo)
    assert git_commit() == head
    (repo / "config.yaml").write_text("models: [big]\n")
    assert git_commit() == head + "-dirty"
    monkeypatch.setenv("PATH", str(tmp_path / "no-git-here"))
    assert git_commit() == "unknown"


# --- eight writers at once ----------------------------------------------------------------

WRITERS, STEPS, PARAMS = 8, 200, 150


def write_run(index: int, uri: str, experiment: str, run_dir: str, barrier) -> None:
    """One writer process: a run with PARAMS params and two metrics over STEPS steps."""
    captured = io.StringIO()
    sys.stderr = captured  # Tracker reports lost MLflow writes as warnings on stderr
    try:
        tracker = Tracker(run_dir, uri, experiment, run_name=f"writer-{index}", system_metrics=False)
        barrier.wait(timeout=120)  # all start together, as the training jobs of one DAG do
        tracker.start({f"param{k:03d}": f"{index}-{k}" for k in range(PARAMS)}, {"writer": str(index)})
        for step in range(1, STEPS + 1):
            tracker.log_metrics({"loss": index + step / 1000, "lr": step * 1e-4}, step)
        tracker.end("FINISHED")
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        Path(run_dir, "stderr.txt").write_text(captured.getvalue())


def test_eight_processes_writing_to_one_sqlite_store_lose_nothing(tmp_path, tracking_uri_unset):
    from mlflow.tracking import MlflowClient

    # a fresh store: creating its schema is part of the race
    uri, experiment = f"sqlite:///{tmp_path}/store/mlflow.db", "concurrent"
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(WRITERS)
    writers = [context.Process(target=write_run, args=(i, uri, experiment, str(tmp_path / f"run{i}"), barrier))
               for i in range(WRITERS)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=180)
    assert [writer.exitcode for writer in writers] == [0] * WRITERS, \
        "\n".join((tmp_path / f"run{i}" / "stderr.txt").read_text()[-1500:] for i in range(WRITERS))
    for i in range(WRITERS):  # Tracker's warnings when MLflow refused a write
        assert "MLflow logging failed" not in (tmp_path / f"run{i}" / "stderr.txt").read_text()
        assert "could not mark MLflow run" not in (tmp_path / f"run{i}" / "stderr.txt").read_text()

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id], max_results=100)
    assert sorted(run.data.tags["writer"] for run in runs) == [str(i) for i in range(WRITERS)]
    for run in runs:
        index = int(run.data.tags["writer"])
        assert run.info.status == "FINISHED"
        assert run.data.params == {f"param{k:03d}": f"{index}-{k}" for k in range(PARAMS)}
        loss = client.get_metric_history(run.info.run_id, "loss")
        assert sorted((m.step, m.value) for m in loss) == [(s, index + s / 1000) for s in range(1, STEPS + 1)]
        assert len(client.get_metric_history(run.info.run_id, "lr")) == STEPS


# --- a signal mid-run --------------------------------------------------------------------

def test_sigusr1_checkpoints_exits_75_and_the_rerun_ends_as_an_uninterrupted_run(prepared, tmp_path):
    import torch

    from aiayn.checkpoint import list_checkpoints
    from aiayn.train.launch import EXIT_PREEMPTED

    # long enough that the signal lands mid-run, with checkpoints far apart so that the
    # one written on the signal is recognisable
    preset = tiny_preset(steps=150, warmup_steps=20, checkpoint_steps=50, keep_checkpoints=5)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = environment()
    straight = subprocess.Popen(train_command(prepared, tmp_path / "straight", preset, "--no-tracking"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    stopped_dir = tmp_path / "stopped"
    command = train_command(prepared, stopped_dir, preset, "--tracking-uri", uri)
    stopped = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    metrics = stopped_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert stopped.poll() is None and time.monotonic() < deadline, stopped.communicate()[1][-2000:]
        time.sleep(0.05)
    stopped.send_signal(signal.SIGUSR1)
    _, stderr = stopped.communicate(timeout=120)
    assert stopped.returncode == EXIT_PREEMPTED == 75, stderr[-2000:]
    steps = [step for step, _ in list_checkpoints(stopped_dir / "checkpoints", safety=True)]
    assert steps and steps[-1] % 50 != 0 and steps[-1] < 150, steps  # written on the signal, mid-run
    assert f"stopped at step {steps[-1]}" in stderr
    assert not (stopped_dir / "final.pt").exists()

    rerun = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"resuming from {stopped_dir / 'checkpoints'}" in rerun.stderr
    assert straight.wait(timeout=300) == 0, straight.stderr.read()[-2000:]
    a = torch.load(tmp_path / "straight" / "final.pt", weights_only=True)["model"]
    b = torch.load(stopped_dir / "final.pt", weights_only=True)["model"]
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name

    # one MLflow run across the stop and the rerun, each logged step once
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run((stopped_dir / "mlflow_run_id").read_text().strip())
    assert run.info.status == "FINISHED"
    history = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert sorted(history) == list(range(2, 151, 2))
