"""``aiayn compare``: the runs of an experiment, from MLflow alone, as one table.

Each row's ``reported_model`` is the model its test BLEU comes from: the average of the last checkpoints,
or the last checkpoint where the average was worse on dev (the average stage's tag, ``average.choose``).
Works against any tracking store (the local sqlite file, or an ``mlflow server`` that a cluster
shares), so runs from different machines and reruns can be compared side by side.
"""

from __future__ import annotations

import argparse
import re
import urllib.parse
from pathlib import Path

from aiayn.errors import UserError, cli

COLUMNS = {
    "tags.preset": "preset", "tags.seed": "seed", "tags.attempt": "attempt",
    "metrics.parameters": "params", "metrics.epoch": "epochs",
    "metrics.dev_ppl": "dev_ppl", "metrics.dev_bleu_tok": "dev_bleu_tok", "metrics.dev_sacrebleu": "dev_sacrebleu",
    "metrics.dev_length_ratio": "dev_length_ratio",
    "metrics.test_bleu_tok": "test_bleu_tok", "metrics.test_sacrebleu": "test_sacrebleu",
    "metrics.test_length_ratio": "test_length_ratio", "tags.reported_model": "reported_model",
    "metrics.train_hours": "train_hours", "metrics.train_flops": "train_flops", "status": "status",
    "start_time": "started", "run_id": "run_id",
}


def local_store(uri: str) -> Path | None:
    """The file or folder of a tracking URI that names a local store (sqlite, file:, a plain path), else None."""
    if uri.startswith("sqlite:"):
        path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
        return Path(path.split("?")[0]) if path and path != ":memory:" else None
    if uri == "databricks":  # MLflow's one bare word that is not a path
        return None
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "file":
        return Path(urllib.parse.unquote(parsed.path))
    return Path(uri) if parsed.scheme == "" else None


def check_store_exists(uri: str) -> None:
    """Reading runs never creates a store: MLflow would make an empty one at a mistyped path and then
    report that the experiment is missing. A UserError says the store is not there, or how to name a file."""
    path = local_store(uri)
    if path is None:
        return
    if not path.exists():
        raise UserError(f"no MLflow store at {uri}: {path} does not exist (nothing was created); give --tracking-uri "
                        "(or MLFLOW_TRACKING_URI, which wins over it) the store the runs were tracked in, as the "
                        "config's tracking_uri names it (by default sqlite:///results/mlflow.db, relative to the "
                        "folder the workflow ran in)")
    if uri.startswith("sqlite:") and not path.is_file():
        raise UserError(f"no MLflow store at {uri}: {path} is a folder, not an sqlite database file; give the "
                        "database file itself (e.g. sqlite:///results/mlflow.db)")
    if not uri.startswith("sqlite:") and path.is_file():
        raise UserError(f"--tracking-uri {uri} names a file, which MLflow would read as a folder of runs; an sqlite "
                        f"database is named sqlite:///{path}")


def compare_runs(experiment: str, tracking_uri: str | None = None, latest_only: bool = False):
    """A pandas table with one row per training run of ``experiment`` (newest first)."""
    from aiayn.tracking import resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    check_store_exists(uri)  # before importing mlflow: a local store must be there already

    import mlflow

    from aiayn.tracking import limit_http_retries, set_global_tracking_uri

    limit_http_retries()
    set_global_tracking_uri(uri)  # not exported to the environment, where it would win over later runs' URIs
    try:
        found = mlflow.get_experiment_by_name(experiment)
    except Exception as error:
        raise UserError(f"cannot read the MLflow store at {uri} ({str(error).splitlines()[0]})") from None
    if found is None:
        names = ", ".join(e.name for e in mlflow.search_experiments()) or "none"
        raise UserError(f"no MLflow experiment {experiment!r} at {uri} (experiments there: {names})")
    runs = mlflow.search_runs([found.experiment_id], filter_string="tags.stage = 'train'",
                              order_by=["attributes.start_time DESC"])
    if runs.empty:
        return runs
    for column in COLUMNS:
        if column not in runs:
            runs[column] = None
    table = runs[list(COLUMNS)].rename(columns=COLUMNS)
    table["reported_model"] = [model_only(text) for text in table["reported_model"]]
    table["steps"] = [_last_step(mlflow, run_id) for run_id in table["run_id"]]
    if latest_only:
        finished = table[table["status"] == "FINISHED"]
        table = finished.drop_duplicates(subset=["preset", "seed"], keep="first")
    return table.reset_index(drop=True)


def model_only(reported_model) -> str | None:
    """A run's ``reported_model`` tag without the dev figures that chose it, to keep the table narrow:
    "averaged, steps 206-219" or "last checkpoint, step 219"; None for a run the average stage has not tagged."""
    return re.split(r": | \(", reported_model, maxsplit=1)[0] if isinstance(reported_model, str) else None


def _last_step(mlflow, run_id: str) -> int | None:
    history = mlflow.tracking.MlflowClient().get_metric_history(run_id, "lr")
    return max((m.step for m in history), default=None)


@cli
def main(argv=None):
    from aiayn.config import config_from_arguments

    parser = argparse.ArgumentParser(prog="aiayn compare", description=__doc__.splitlines()[0])
    parser.add_argument("--config", nargs="+", metavar="FILE",
                        help="config files (merged in order, validated once): their experiment and tracking_uri")
    parser.add_argument("--experiment", help="MLflow experiment (the config's `experiment`)")
    parser.add_argument("--tracking-uri", default=None, help="default: MLFLOW_TRACKING_URI or sqlite:///results/mlflow.db")
    parser.add_argument("--latest", action="store_true", help="only the newest finished run of each preset and seed")
    parser.add_argument("--csv", help="also write the table to this CSV file")
    args = parser.parse_args(argv)
    if args.experiment is None and not args.config:
        raise UserError("aiayn compare: name the runs' experiment, --experiment NAME (the config's `experiment`), "
                        "or give the config: --config FILE...")
    config = config_from_arguments(args, {"experiment": ("--experiment", "experiment"),
                                          "tracking_uri": ("--tracking-uri", "tracking_uri")})
    experiment, tracking_uri = config["experiment"], config["tracking_uri"]
    if args.csv:
        from aiayn.writing import refuse_overwriting_inputs
        from aiayn.tracking import resolve_tracking_uri

        store = local_store(resolve_tracking_uri(tracking_uri))
        refuse_overwriting_inputs({"--csv": args.csv}, {"--tracking-uri": store, "--config": args.config})
    table = compare_runs(experiment, tracking_uri, args.latest)
    if table.empty:
        print(f"no training runs in experiment {experiment!r}")
        return 0
    if args.csv:
        from aiayn.writing import atomic_path

        with atomic_path(args.csv) as tmp:
            table.to_csv(tmp, index=False)
    print(table.drop(columns=["run_id"]).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
