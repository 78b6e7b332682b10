"""`aiayn compare`: the runs of an experiment read back from MLflow, one row a run."""

from __future__ import annotations

import pandas as pd
import pytest

from aiayn.average_dev import reported_model
from aiayn.compare import compare_runs, main, model_only

DEV = {"averaged_steps": [20, 25, 30], "last_steps": [30], "dev_ppl_averaged": 5.5, "dev_ppl_last": 5.25,
       "averaged_worse": True}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A tracking store with three training runs of experiment "mine": one that reports its average, one its last
    checkpoint (both tagged by the average stage, as `aiayn average --log-to-run` does), one not averaged yet."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('store')}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("mine")
    for preset, reported in (("base", reported_model({**DEV, "averaged_worse": False}, "averaged")),
                             ("big", reported_model(DEV, "last")), ("tiny", None)):
        run = client.create_run(experiment, tags={"stage": "train", "preset": preset, "seed": "1"})
        client.log_metric(run.info.run_id, "test_bleu_tok", 27.3)
        if reported is not None:
            client.set_tag(run.info.run_id, "reported_model", reported)
        client.set_terminated(run.info.run_id)
    with pytest.MonkeyPatch.context() as environment:
        environment.delenv("MLFLOW_TRACKING_URI", raising=False)  # which would win over the store given
        yield uri


def test_each_run_says_which_model_its_test_bleu_comes_from(store):
    table = compare_runs("mine", store).set_index("preset")
    assert table.loc["base", "reported_model"] == "averaged, steps 20-30"
    assert table.loc["big", "reported_model"] == "last checkpoint, step 30"
    assert pd.isna(table.loc["tiny", "reported_model"])  # not averaged yet
    columns = list(table.columns)
    assert columns.index("reported_model") == columns.index("test_length_ratio") + 1  # beside the test figures


def test_the_printed_table_has_the_reported_model_column(store, capsys):
    assert main(["--experiment", "mine", "--tracking-uri", store]) == 0
    printed = capsys.readouterr().out
    assert "reported_model" in printed.splitlines()[0]
    assert "last checkpoint, step 30" in printed and "averaged, steps 20-30" in printed


def test_the_column_keeps_the_model_and_leaves_out_the_dev_figures_that_chose_it():
    assert model_only(reported_model(DEV, "last")) == "last checkpoint, step 30"
    assert model_only(reported_model(DEV, "averaged")) == "averaged, steps 20-30"  # kept though worse (paper)
    assert model_only(reported_model({**DEV, "averaged_steps": [30]}, "averaged")) == "averaged, step 30"
    assert model_only(None) is None
