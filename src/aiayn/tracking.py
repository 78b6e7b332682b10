"""MLflow tracking for every run, with a plain JSONL copy of the metrics beside the checkpoints.

MLflow is imported lazily: training on a bare GPU image without it still writes
``metrics.jsonl`` (and says so once). The run id is written to ``<run_dir>/mlflow_run_id``
so that a resumed job continues the same run and later stages (averaging, decoding,
scoring) log into it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from aiayn.errors import UserError
from aiayn.writing import write_text_atomic
from aiayn.layout import METRICS, MLFLOW_LOGGED_STEP, MLFLOW_RUN_ID
from aiayn.tracking_view import EXPERIMENT_KIND, experiment_description, runs_view_tag


def resolve_tracking_uri(configured: str | None) -> str:
    """``MLFLOW_TRACKING_URI`` from the environment wins over the config's value."""
    return os.environ.get("MLFLOW_TRACKING_URI") or configured or "sqlite:///results/mlflow.db"


def git_commit(folder: str | Path | None = None) -> str:
    """The commit (``-dirty`` with uncommitted changes) of the repository the run happens in: the one
    holding ``folder``, the working directory by default. "unknown" outside a repository or without git."""
    try:
        def git(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(["git", *args], cwd=folder or Path.cwd(), capture_output=True, text=True, timeout=10)

        out = git("rev-parse", "HEAD")
        commit = out.stdout.strip() if out.returncode == 0 else ""
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip() if commit else ""
        return (commit + ("-dirty" if dirty else "")) if commit else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def flatten(prefix: str, value: Any, out: dict[str, str]) -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``: MLflow params are flat strings."""
    if isinstance(value, dict):
        for key, item in value.items():
            flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    else:
        out[prefix] = json.dumps(value) if isinstance(value, (list, tuple, bool)) or value is None else str(value)
    return out


def _retry(action: Callable[[], Any], what: str, tries: int = 8) -> Any:
    """SQLite stores answer "database is locked" when several jobs write at once: wait and retry."""
    delay = 0.2
    for attempt in range(tries):
        try:
            return action()
        except Exception as error:  # MlflowException wraps the driver's OperationalError
            transient = "locked" in str(error).lower() or "busy" in str(error).lower()
            if not transient or attempt == tries - 1:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
    return None


# MLflow retries an HTTP request that gets no answer 7 times with backoff factor 2: about four
# minutes before a wrong tracking_uri is reported, and as long for each flush while a server is
# away. Bounded (a value set in the environment wins): about 8 s when nothing listens.
HTTP_REQUEST_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                       "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


def limit_http_retries() -> None:
    for name, value in HTTP_REQUEST_LIMITS.items():
        os.environ.setdefault(name, value)


def set_global_tracking_uri(uri: str) -> None:
    """``mlflow.set_tracking_uri`` without its side effect: MLflow 3 also exports the URI as
    MLFLOW_TRACKING_URI, which resolve_tracking_uri would then prefer over the configured URI of
    every later run in this process and in the processes it starts."""
    import mlflow

    exported = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    if exported is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = exported


def open_client(uri: str):
    """An MlflowClient whose store is ready, created at most once however many jobs start together.

    A new sqlite store is created by running its schema migrations on first use; two jobs doing
    that at the same moment fail ("table _alembic_tmp_tags already exists"). A file lock beside
    the database makes the first use one job at a time.
    """
    import fcntl

    from mlflow.tracking import MlflowClient

    limit_http_retries()
    if not uri.startswith("sqlite:///"):
        return MlflowClient(uri)
    database = Path(uri[len("sqlite:///"):])
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(database.with_name(database.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            client = MlflowClient(uri)
            _retry(lambda: client.search_experiments(max_results=1), "open store")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return client


def experiment_id_for(client, name: str) -> str:
    """Get or create, marked as model training, described, and with the runs table's saved view (each
    written when missing or changed, so that an older experiment gets them too). Jobs that start together
    all find no experiment and all create it; the losers get RESOURCE_ALREADY_EXISTS and read the winner's."""
    from mlflow.exceptions import MlflowException

    found = _retry(lambda: client.get_experiment_by_name(name), "experiment")
    if found is None:
        try:
            experiment_id = _retry(lambda: client.create_experiment(name), "create experiment")
        except MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            experiment_id = _retry(lambda: client.get_experiment_by_name(name), "experiment").experiment_id
        tags = {}
    else:
        experiment_id, tags = found.experiment_id, found.tags
    view_key, view = runs_view_tag()
    wanted = {"mlflow.experimentKind": EXPERIMENT_KIND, "mlflow.note.content": experiment_description(name),
              view_key: view}
    for key, value in wanted.items():
        if tags.get(key) != value:
            _retry(lambda: client.set_experiment_tag(experiment_id, key, value), "experiment tag")
    return experiment_id


def git_tags(commit: str) -> dict[str, str]:
    """MLflow's standard source tags. The runs table's Source column (one of the three it shows by default)
    shows the last ``/``-part of ``mlflow.source.name`` and nothing else, cut to its width (the commit has
    a column of its own, Version, not shown by default), so the name starts with the short commit:
    ``d65b5018 aiayn train`` (``-dirty`` for uncommitted changes). The full commit stays in
    ``mlflow.source.git.commit``."""
    sha, dirty = commit.partition("-dirty")[:2]
    short = sha[:8] + dirty if sha != "unknown" else "unknown commit"
    return {"mlflow.source.type": "LOCAL", "mlflow.source.name": f"{short} aiayn train",
            "mlflow.source.git.commit": commit}


def _mlflow_installed() -> bool:
    """Whether MLflow imports; without it, says once that metrics go to ``metrics.jsonl`` only."""
    try:
        import mlflow  # noqa: F401
    except ImportError:
        print("warning: mlflow is not installed; metrics go to metrics.jsonl only", file=sys.stderr)
        return False
    return True


class Tracker:
    """One MLflow run per trained model (rank 0 only), and ``metrics.jsonl`` always.

    A resumed run recomputes the steps between its checkpoint and the kill; their metrics were
    logged already, so each sink skips the steps it holds (``metrics.jsonl``'s last step, and the
    last step flushed to MLflow, kept in ``mlflow_logged_step``): every step is logged once.
    """

    def __init__(self, run_dir: str | Path, tracking_uri: str | None, experiment: str, run_name: str,
                 enabled: bool = True, system_metrics: bool = True):
        self.run_dir = Path(run_dir)
        self.uri = resolve_tracking_uri(tracking_uri)
        self.experiment = experiment
        self.run_name = run_name
        self.enabled = enabled
        self.system_metrics = system_metrics
        self.client = None
        self.run_id: str | None = None
        self._pending: list = []
        self._jsonl = None
        self._logged_step = -1  # the last step each sink holds from an earlier process of this run
        self._mlflow_logged_step = -1

    # lifecycle ---------------------------------------------------------------------------
    def start(self, params: dict[str, str], tags: dict[str, str],
              datasets: Sequence[tuple[str, str, str, str]] = ()) -> str | None:
        """Open (or, resuming, reopen) the run. ``datasets``: (name, fingerprint, source, context) of
        each split trained or evaluated on, logged as MLflow dataset inputs of a new run."""
        new_metrics = self._open_jsonl()
        if not self.enabled or not _mlflow_installed():
            self.enabled = False
            return None
        set_global_tracking_uri(self.uri)  # the system-metrics monitor logs through it
        try:
            self.client = open_client(self.uri)
            experiment_id = experiment_id_for(self.client, self.experiment)
            if (self.run_dir / MLFLOW_RUN_ID).exists():
                self._reopen_run()
            else:
                self._create_run(experiment_id, tags)
                self._log_params(params)
                self._log_datasets(datasets)
        except Exception as error:
            self._abandon(new_metrics, error)
        if self.system_metrics:
            self._start_system_metrics()
        return self.run_id

    def _open_jsonl(self) -> bool:
        """Open ``metrics.jsonl`` to append, noting the last step each sink holds; whether the file is new."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / METRICS
        new_metrics = not path.exists()
        self._logged_step = _last_logged_step(path)
        marker = self.run_dir / MLFLOW_LOGGED_STEP
        self._mlflow_logged_step = int(marker.read_text()) if marker.exists() else -1
        self._jsonl = open(path, "a", encoding="utf-8")
        if self._jsonl.tell() and not path.read_bytes().endswith(b"\n"):
            self._jsonl.write("\n")  # end a line a kill cut short, so the next record starts its own
        return new_metrics

    def _reopen_run(self) -> None:
        """A resumed job continues the run ``mlflow_run_id`` names."""
        self.run_id = (self.run_dir / MLFLOW_RUN_ID).read_text().strip()
        _retry(lambda: self.client.update_run(self.run_id, status="RUNNING"), "resume run")

    def _create_run(self, experiment_id: str, tags: dict[str, str]) -> None:
        """A new run, its id written to ``mlflow_run_id`` for a resumed job and the later stages."""
        run_name, tags = self._attempt(experiment_id, tags)
        run = _retry(lambda: self.client.create_run(experiment_id, run_name=run_name, tags=tags), "run")
        self.run_id = run.info.run_id
        (self.run_dir / MLFLOW_RUN_ID).write_text(self.run_id + "\n")

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in sorted(params.items())]
        for start in range(0, len(items), 100):
            _retry(lambda: self.client.log_batch(self.run_id, params=items[start:start + 100]), "params")

    def _log_datasets(self, datasets: Sequence[tuple[str, str, str, str]]) -> None:
        if not datasets:
            return
        from mlflow.entities import Dataset, DatasetInput, InputTag

        inputs = [DatasetInput(Dataset(name, digest, "local", json.dumps({"uri": source})),
                               [InputTag("mlflow.data.context", context)])
                  for name, digest, source, context in datasets]
        _retry(lambda: self.client.log_inputs(self.run_id, datasets=inputs), "dataset inputs")

    def _abandon(self, new_metrics: bool, error: Exception) -> None:
        """A store that cannot be used stops the run before it trains, as a UserError naming the store."""
        if new_metrics:  # a run that never started leaves nothing it created (its folder goes at exit)
            self._jsonl.close()
            (self.run_dir / METRICS).unlink(missing_ok=True)
        if isinstance(error, UserError):
            raise error
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(
            f"cannot use the MLflow tracking store at {self.uri} ({reason}); "
            "start it or point tracking_uri (or MLFLOW_TRACKING_URI) at one that answers. Nothing was trained."
        ) from None

    def _start_system_metrics(self) -> None:
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._monitor = SystemMetricsMonitor(self.run_id, resume_logging=True)
            self._monitor.start()
        except Exception as error:  # system metrics are a nicety; training goes on without them
            print(f"warning: no system metrics ({error})", file=sys.stderr)
            self._monitor = None

    def _attempt(self, experiment_id: str, tags: dict[str, str]) -> tuple[str, dict[str, str]]:
        """Reruns of a preset and seed are told apart: ``<preset>-seed<N>-a<attempt>`` and an attempt tag.

        (A resumed job is not a rerun: it continues its run, found through ``mlflow_run_id``.)
        """
        if "preset" not in tags or "seed" not in tags:
            return self.run_name, tags
        query = f"tags.preset = '{tags['preset']}' and tags.seed = '{tags['seed']}'"
        earlier = _retry(lambda: self.client.search_runs([experiment_id], filter_string=query, max_results=10000),
                         "earlier runs")
        attempt = len(earlier) + 1
        return f"{self.run_name}-a{attempt}", {**tags, "attempt": str(attempt)}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
        if self._jsonl is not None and step > self._logged_step:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self.enabled and self.client is not None and step > self._mlflow_logged_step:
            from mlflow.entities import Metric

            stamp = int(record["time"] * 1000)
            self._pending += [Metric(k, float(v), stamp, step) for k, v in metrics.items()]
            if len(self._pending) >= 200:
                self.flush()

    def flush(self) -> None:
        if not (self.enabled and self.client is not None and self._pending):
            return
        pending, self._pending = self._pending, []
        try:
            for start in range(0, len(pending), 1000):
                _retry(lambda: self.client.log_batch(self.run_id, metrics=pending[start:start + 1000]), "metrics")
            write_text_atomic(self.run_dir / MLFLOW_LOGGED_STEP, f"{max(metric.step for metric in pending)}\n")
        except Exception as error:
            # a store that goes away must not stop training: the JSONL copy has every metric
            print(f"warning: MLflow logging failed ({error}); metrics kept in metrics.jsonl", file=sys.stderr)

    def set_tags(self, tags: dict[str, str]) -> None:
        if self.enabled and self.client is not None:
            for key, value in tags.items():
                _retry(lambda: self.client.set_tag(self.run_id, key, value), "tag")

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.enabled and self.client is not None:
            _retry(lambda: self.client.log_artifact(self.run_id, str(path), artifact_path), "artifact")

    def end(self, status: str = "FINISHED") -> None:
        self.flush()
        monitor = getattr(self, "_monitor", None)
        if monitor is not None:
            try:
                monitor.finish()
            except Exception:
                pass
        if self.enabled and self.client is not None:
            try:
                _retry(lambda: self.client.set_terminated(self.run_id, status), "end run")
            except Exception as error:
                print(f"warning: could not mark MLflow run {self.run_id} {status} ({error})", file=sys.stderr)
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


def forget_unresumed_attempt(run_dir: str | Path) -> None:
    """Remove what an earlier attempt of a run logged when this one starts afresh (no checkpoint to resume:
    it failed or was killed before its first). Its steps are trained again, perhaps with a fixed config,
    and must be logged again, not skipped as held; into a new MLflow run, as the earlier run has them."""
    for name in (METRICS, MLFLOW_LOGGED_STEP, MLFLOW_RUN_ID):
        (Path(run_dir) / name).unlink(missing_ok=True)


def _last_logged_step(path: Path) -> int:
    """The highest step in a ``metrics.jsonl`` (-1 if none); a line cut short by a kill is ignored."""
    last = -1
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                last = max(last, int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue
    return last


def read_run_file(run_file: str | Path) -> dict:
    """A training run's ``final.json`` (what ``--log-to-run`` names), read before a stage does its work,
    so that a wrong path costs nothing and leaves nothing behind; a UserError says what it is instead."""
    from aiayn.reading import check_input_path

    path = check_input_path(run_file)
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"--log-to-run {path}: not a training run's final.json (not JSON: {error}); give the "
                        "final.json that `aiayn train` wrote in the run folder") from None
    if not isinstance(info, dict):
        raise UserError(f"--log-to-run {path}: not a training run's final.json (JSON, but not an object); give the "
                        "final.json that `aiayn train` wrote in the run folder")
    return info


def log_to_existing_run(run_file: str | Path, tracking_uri: str | None, metrics: dict[str, float],
                        artifacts: list[str | Path] = (), artifact_path: str | None = None,
                        params: dict[str, str] | None = None, tags: dict[str, str] | None = None) -> str | None:
    """Log metrics/artifacts/tags of a later stage into the training run named by ``final.json``."""
    info = read_run_file(run_file)
    run_id = info.get("mlflow_run_id")
    if not run_id:
        print(f"warning: {run_file} names no MLflow run; metrics not tracked", file=sys.stderr)
        return None
    try:
        from mlflow.entities import Metric, Param, RunTag
    except ImportError:
        print("warning: mlflow is not installed; metrics not tracked", file=sys.stderr)
        return None
    client = open_client(resolve_tracking_uri(tracking_uri))
    stamp = int(time.time() * 1000)
    batch = [Metric(k, float(v), stamp, int(info.get("step", 0))) for k, v in metrics.items()]
    params = {key: str(value) for key, value in (params or {}).items()}
    if params:  # MLflow never changes a param: one logged before (an earlier attempt) with another value stays
        logged = _retry(lambda: client.get_run(run_id), "run").data.params
        for key in [key for key in params if logged.get(key, params[key]) != params[key]]:
            print(f"warning: MLflow run {run_id} keeps its param {key} = {logged[key]!r} from before (MLflow never "
                  f"changes a param); {params.pop(key)!r} is not logged as a param", file=sys.stderr)
    param_items = [Param(k, v) for k, v in params.items()]
    tag_items = [RunTag(k, str(v)) for k, v in (tags or {}).items()]
    _retry(lambda: client.log_batch(run_id, metrics=batch, params=param_items, tags=tag_items), "metrics")
    for path in artifacts:
        _retry(lambda: client.log_artifact(run_id, str(path), artifact_path), "artifact")
    return run_id
