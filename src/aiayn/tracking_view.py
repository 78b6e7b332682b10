"""The experiment's page in MLflow's UI: its kind, its description, and the saved view of its runs table (the
BLEU columns and Table 3's knobs), written with the experiment by ``aiayn.tracking.experiment_id_for``."""

from __future__ import annotations

import json
from typing import Any


EXPERIMENT_KIND = "custom_model_development"  # MLflow 3's kind for training (3.17's UI follows its GenAI /
# Model training switch instead, GenAI by default)

# The runs table's columns. MLflow's UI opens every experiment on the same hard-coded columns (Source,
# Models, Dataset) and has no per-experiment default; what it offers (3.15 and later) is a saved view: an
# experiment tag `mlflow.sharedViewState.<id>` holding the table's state, listed in the runs page's Views
# menu and opened directly by `#/experiments/<id>/runs?workflowType=machine_learning&viewStateShareKey=<view
# id>` (a fresh page load; 3.17 ignores the key when the link is followed from the experiment's own page).
# One such view is written with the experiment: the score stage's BLEU, dev perplexity, the Table 3 knobs.
SAVED_VIEW_TAG_PREFIX = "mlflow.sharedViewState."  # the UI's prefix for saved and shared views
RUNS_VIEW_ID = "aiayn-bleu"
RUNS_VIEW_NAME = "BLEU and Table 3 knobs"
# the score stage's BLEU (aiayn.score --log-to-run), the training's last dev perplexity
RUNS_VIEW_METRICS = ("dev_bleu_tok", "dev_sacrebleu", "test_bleu_tok", "test_sacrebleu", "dev_ppl")
RUNS_VIEW_PARAMS = ("preset.n_layers", "preset.d_model", "preset.d_ff", "preset.n_heads", "preset.d_head",
                    "preset.dropout", "preset.label_smoothing", "preset.positional", "preset.steps",
                    "model.parameters")  # Table 3's columns N, d_model, d_ff, h, d_k, P_drop, eps_ls, steps, params


def column_key(kind: str, name: str) -> str:
    """The UI's name of a runs-table column: ``metrics.`dev_bleu_tok```, ``attributes.`Source```."""
    return f"{kind}.`{name}`"


def runs_view_state() -> dict[str, Any]:
    """The saved view's table state: Source (it names the commit), the BLEU columns, then the knobs in
    Table 3's order (the UI would sort them by name); best dev BLEU first; Source wide enough for its
    commit and the rest narrow enough to fit a wide screen. Keys the UI does not find here keep its defaults."""
    source = column_key("attributes", "Source")
    columns = ([source] + [column_key("metrics", name) for name in RUNS_VIEW_METRICS]
               + [column_key("params", name) for name in RUNS_VIEW_PARAMS])
    widths = {source: 190, **{column: 110 if column.startswith("metrics.") else 100 for column in columns[1:]}}
    return {"selectedColumns": columns, "columnOrder": columns, "columnWidths": widths,
            "orderByKey": column_key("metrics", "dev_bleu_tok"), "orderByAsc": False}


def runs_view_tag() -> tuple[str, str]:
    """The experiment tag of the saved view, in the UI's envelope: {name, createdAt, updatedAt, state}, the
    state as a JSON string. The times are fixed (0) so that the tag's value changes only with the view."""
    envelope = {"name": RUNS_VIEW_NAME, "createdAt": 0, "updatedAt": 0,
                "state": json.dumps(runs_view_state(), separators=(",", ":"))}
    return SAVED_VIEW_TAG_PREFIX + RUNS_VIEW_ID, json.dumps(envelope, separators=(",", ":"))


def experiment_description(name: str) -> str:
    return (f"aiayn: \"Attention Is All You Need\" (Vaswani et al., 2017) reproduced; experiment `{name}`. "
            f"**Views → {RUNS_VIEW_NAME}** (above the runs table) shows dev and test BLEU, dev perplexity and the "
            "presets' Table 3 knobs as columns, best dev BLEU first. One run per trained preset and seed (tags "
            "`preset`, `seed`, `attempt`), holding the resolved config as parameters, training curves, and the BLEU "
            "of the later stages. Made by `snakemake --configfile config/<file>.yaml` (the config's `experiment` key "
            f"is `{name}`); compare runs with `aiayn compare --experiment {name}` or this page's chart view (BLEU "
            "against a Table 3 parameter).")
