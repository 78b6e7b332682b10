"""A run's data: its binarized train and dev splits, checked against the vocabulary, and the step cut.

The model's vocabulary size comes from here (the split binarize wrote), so the model's config is built
here too; the dev pairs a model can read (``dev_rows``) and the step source follow from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aiayn.binarize import TokenizedSplit, load_split
from aiayn.bpe import vocab_fingerprint
from aiayn.config import model_fields
from aiayn.errors import UserError
from aiayn.model import ModelConfig
from aiayn.tokens import PAD_ID
from aiayn.train.steps import StepSource, TrainSettings, dev_rows


@dataclass
class RunData:
    """The splits a run trains and evaluates on, and the fingerprints its checkpoints and MLflow record."""

    train: TokenizedSplit
    dev: TokenizedSplit | None
    vocab_fingerprint: str
    data_fingerprint: str

    @classmethod
    def load(cls, train_data: Path, dev_data: Path | None, spm_model: Path) -> "RunData":
        """The splits, refused where they were binarized with another vocabulary than ``spm_model``."""
        train = load_split(train_data)
        dev = load_split(dev_data) if dev_data else None
        if vocab_fingerprint(spm_model) != train.meta["vocab_fingerprint"]:
            raise UserError(f"{train_data} was binarized with another vocabulary than {spm_model}; "
                            "rerun the binarize stage")
        return cls(train, dev, train.meta["vocab_fingerprint"], train.meta["data_fingerprint"])

    def model_config(self, preset: dict) -> ModelConfig:
        """The preset's model over this vocabulary (binarize read its size from the vocabulary just checked)."""
        return ModelConfig(vocab_size=self.train.meta["vocab_size"], pad_id=PAD_ID, **model_fields(preset))

    def dev_rows(self, config: ModelConfig, dev_data: Path | None, warn: bool) -> np.ndarray | None:
        """The dev pairs ``config``'s model can read (``aiayn.train.steps.dev_rows``); None without a dev split."""
        return dev_rows(self.dev, config, dev_data, warn) if self.dev is not None else None

    def step_source(self, settings: TrainSettings, epoch: int, train_data: Path) -> StepSource:
        """The micro-batches of each step; a split with no pairs to train on is refused here, before a run starts."""
        source = StepSource(self.train, settings)
        if not source.steps_of(epoch):
            raise UserError(f"{train_data}: no training pairs")
        return source
