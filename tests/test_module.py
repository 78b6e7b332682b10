"""The workflow as a Snakemake module: a user's own repository runs the DAG with its own config, and the
results land in that repository's folder.

The user's Snakefile is the few lines of docs/elsewhere.md. PATH holds no virtual environment, as for a user who
runs `.venv/bin/snakemake` without activating it: the jobs find `aiayn` because the workflow puts the
bin folder of the Python that runs Snakemake first on their PATH.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.workflow

USER_SNAKEFILE = """\
configfile: "config.yaml"


module aiayn:
    snakefile:
        "{snakefile}"
    config:
        config


use rule * from aiayn as aiayn_*
"""

USER_CONFIG = """\
experiment: mine
data: {source: demo, demo: {seed: 3, train: 300, dev: 10, test: 10}}
bpe: {vocab_size: 200, input_sentence_size: 0}
train: {tokens_per_step: 800, device_tokens: 800, log_every: 5, dev_every: 0, precision: fp32, threads: 1}
decode: {beam_size: 2, max_len_b: 10, tokens_per_batch: 2000}
models: [tiny]
presets:
  tiny: {inherit: base, n_layers: 1, d_model: 32, d_ff: 64, n_heads: 2, steps: 4, warmup_steps: 2,
         checkpoint_steps: 2, average_last: 2, checkpoint_minutes: null, gpus: 0, runtime_minutes: 5}
"""


def snakemake(repository, *args) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in {"VIRTUAL_ENV", "MLFLOW_TRACKING_URI"}}
    env.update(PATH="/usr/bin:/bin", OMP_NUM_THREADS="1")  # no venv on PATH: the workflow must find aiayn
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", *args], cwd=repository, env=env,
                          capture_output=True, text=True, timeout=900)


def test_a_users_repository_runs_the_dag_through_the_module_to_the_report(tmp_path):
    repository = tmp_path / "my-translation"
    repository.mkdir()
    (repository / "Snakefile").write_text(USER_SNAKEFILE.format(snakefile=REPO / "Snakefile"))
    (repository / "config.yaml").write_text(USER_CONFIG)
    run = snakemake(repository)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "aiayn_train" in run.stderr
    report = repository / "results" / "mine" / "report"
    assert "tiny" in (report / "table2.md").read_text()
    assert (repository / "results" / "mine" / "train" / "tiny" / "seed1" / "final.pt").is_file()
    assert (repository / "results" / "mlflow.db").is_file()
    assert not (REPO / "results" / "mine").exists()
    html = snakemake(repository, "--report", "report.html")  # captions found beside the module's rules
    assert html.returncode == 0, html.stderr[-3000:]
    assert (repository / "report.html").stat().st_size > 0
