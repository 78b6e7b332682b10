"""A training run's MLflow run: the resolved config as params, the tags that find it, the data it used.

Rank 0 only. A fresh start forgets what an earlier attempt of the run logged; a resumed one reopens its run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from aiayn.tracking import Tracker, flatten, forget_unresumed_attempt, git_commit, git_tags
from aiayn.train.run_data import RunData


@dataclass(frozen=True)
class RunFacts:
    """What the run is, beyond its config: the model's size and where and how it trains."""

    parameters: int
    world: int
    device_tokens: int
    device_name: str
    precision: str


def start_tracking(job, data: RunData, facts: RunFacts, resumed_from: Path | None, step: int) -> Tracker:
    """Open (or, resuming from ``resumed_from`` at ``step``, reopen) the MLflow run of ``job``, a ``TrainJob``."""
    tags, datasets, params = run_tags(job, data, facts), run_datasets(job, data), run_params(job, facts)
    if resumed_from is None:  # a fresh start: what an earlier attempt logged is not this run's
        forget_unresumed_attempt(job.run_dir)
    tracker = Tracker(job.run_dir, job.tracking_uri, job.experiment,
                      run_name=f"{job.preset['name']}-seed{job.seed}", enabled=job.track)
    tracker.start(params, tags, datasets)
    if resumed_from:
        print(f"resuming from {resumed_from} (step {step}) on {facts.world} process(es)", file=sys.stderr)
    return tracker


def run_params(job, facts: RunFacts) -> dict[str, str]:
    """The resolved preset, train section and seed, flattened, with what the run made of them."""
    params = flatten("", job.recorded_config, {})
    params.update({"model.parameters": str(facts.parameters), "world_size": str(facts.world),
                   "device_tokens": str(facts.device_tokens)})
    return params


def run_tags(job, data: RunData, facts: RunFacts) -> dict[str, str]:
    """The tags that find the run: preset, seed, commit, fingerprints, device and its Table 3 row."""
    commit = git_commit()
    return {"preset": job.preset["name"], "seed": str(job.seed), "git_commit": commit,
            "data_fingerprint": data.data_fingerprint, "vocab_fingerprint": data.vocab_fingerprint,
            "device": facts.device_name, "precision": facts.precision,
            "table": job.preset["paper"].get("table", ""), "stage": "train", **git_tags(commit)}


def run_datasets(job, data: RunData) -> list[tuple[str, str, str, str]]:
    """(name, fingerprint, source, context) of the splits trained and evaluated on."""
    datasets = [("train", data.data_fingerprint, str(job.train_data), "training")]
    if data.dev is not None:  # a dev split binarized before fingerprints were recorded has none
        datasets.append(("dev", data.dev.meta.get("data_fingerprint", ""), str(job.dev_data), "validation"))
    return datasets
