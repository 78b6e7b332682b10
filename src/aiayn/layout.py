"""The names of the files inside each stage's folder: each written here once.

The workflow names a stage's outputs with these (``workflow/rules/*.smk``, through ``common.smk``) and the
stage writes and reads the same names, so a rename here renames both sides. Where the folders themselves
live (``results/<experiment>/...``) is the workflow's, in ``common.smk``.
"""

from __future__ import annotations

import re

# download: results/<experiment>/data/
SPLITS = ("train", "dev", "test")  # a corpus's splits, in the order the stages write them


def text_name(split: str, lang: str) -> str:
    """A split's plain text, one sentence a line."""
    return f"{split}.{lang}"


DATA_STATS = "stats.json"  # pairs read, written and dropped, per split

# bpe: results/<experiment>/bpe/
SPM_PREFIX = "spm"  # SentencePiece writes <prefix>.model and <prefix>.vocab
SPM_MODEL = f"{SPM_PREFIX}.model"
SPM_VOCAB = f"{SPM_PREFIX}.vocab"
BPE_INFO = "bpe.json"

# binarize: results/<experiment>/bin/<split>/, each array as <name>.npy
SPLIT_META = "meta.json"
SPLIT_ARRAYS = ("src.ids", "src.offsets", "tgt.ids", "tgt.offsets", "lines")

# train: results/<experiment>/train/<model>/seed<seed>/
FINAL_SUMMARY = "final.json"  # the run's summary: what later stages read and log into
FINAL_MODEL = "final.pt"
CHECKPOINTS = "checkpoints"  # the folder of checkpoint_name()s
METRICS = "metrics.jsonl"
MLFLOW_RUN_ID = "mlflow_run_id"  # a resumed job continues its MLflow run
MLFLOW_LOGGED_STEP = "mlflow_logged_step"
RUN_LOCK = ".lock"  # one trainer per run folder
DEV_PPL_BAND_FIGURE = "dev_ppl_band.png"  # the run's dev curve over its reference's band (aiayn.train.monitor)

CHECKPOINT_NAME = re.compile(r"(step|safety)_(\d+)\.pt")  # the names checkpoint_name() gives


def checkpoint_name(step: int, window: bool = True) -> str:
    """A window checkpoint (averaged) or a safety one (for resuming only), in the CHECKPOINTS folder."""
    return f"{'step' if window else 'safety'}_{step:08d}.pt"


# average: results/<experiment>/average/<model>/seed<seed>/
AVERAGED_MODEL = "model.pt"  # the window's average (or the last checkpoint, where average.choose: dev finds the
                             # average worse on dev), which decode, the report and export read
AVERAGE_SUMMARY = "average.json"  # the averaged model and the last checkpoint on dev (aiayn.average_dev)

# report: results/<experiment>/report/
TABLE2, TABLE3 = "table2", "table3"  # each as <name>.csv and <name>.md
TABLES = (TABLE2, TABLE3)
DEV_PPL_FIGURE = "dev_ppl.png"
TABLE3_BLEU_FIGURE = "table3_bleu.png"


def band_figure_name(preset: str) -> str:
    """A preset's runs over its reference's seed band, one figure per preset (aiayn.reference)."""
    return f"dev_ppl_band_{preset}.png"
ATTENTION_LONG_DISTANCE_FIGURE = "attention_long_distance.png"
ATTENTION_ANAPHORA_FIGURE = "attention_anaphora.png"
ATTENTION_EXPLORER = "attention_explorer.html"  # aiayn explore's page of the same model
