"""A run's dev evaluations: dev loss, perplexity and BLEU every train.dev_every steps and at the end, each
logged to MLflow and held against the run's reference (``aiayn.train.monitor``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from aiayn.model import ModelConfig
from aiayn.train.dev_bleu import DevBleu
from aiayn.train.monitor import DevMonitor
from aiayn.train.run_data import RunData
from aiayn.train.steps import Progress, TrainSettings, evaluate


class DevEvaluation:
    """The dev split, the pairs of it the model can read, its BLEU sample and the monitor; ``enabled`` with a split."""

    def __init__(self, split, rows: np.ndarray | None, bleu: DevBleu, monitor: DevMonitor, device: torch.device):
        self.split, self.rows, self.bleu, self.monitor, self.device = split, rows, bleu, monitor, device

    @classmethod
    def for_run(cls, data: RunData, config: ModelConfig, device: torch.device, train_section: dict, spm_model: Path,
                dev_data: Path | None, monitor: DevMonitor, warn: bool) -> "DevEvaluation":
        """Of a run's data and model (train.dev_bleu_* pick the BLEU sample); ``warn``: say which pairs are left out."""
        rows = data.dev_rows(config, dev_data, warn)
        bleu = DevBleu.from_section(train_section, data.dev, rows, spm_model, device)
        return cls(data.dev, rows, bleu, monitor, device)

    @property
    def enabled(self) -> bool:
        return self.split is not None

    @property
    def pairs_skipped(self) -> int:
        """Dev pairs left out of the dev loss (longer than a learned positional table)."""
        return len(self.split) - len(self.rows)

    def scores(self, model: torch.nn.Module, settings: TrainSettings) -> dict[str, float]:
        """Dev loss, NLL and perplexity of ``model`` as it is now, and its dev BLEU where train.dev_bleu_sentences."""
        dev = evaluate(model, self.split, self.device, settings.precision, settings.device_tokens,
                       settings.label_smoothing, self.rows)
        dev.update(self.bleu.score(model))
        return dev

    def at_step(self, step: int, model, settings: TrainSettings, progress: Progress, tracker) -> dict[str, float]:
        """Evaluate ``model`` at ``step``: into ``progress``' dev history and ``tracker``; returns the scores."""
        dev = self.scores(model, settings)
        progress.dev_history.append({"step": step, **dev})
        tracker.log_metrics(dev, step)
        return dev

    def during_training(self, step: int, model, settings: TrainSettings, progress: Progress, tracker) -> None:
        """The evaluation every train.dev_every steps: ``at_step``, then the reference band and the projection."""
        self.at_step(step, model, settings, progress, tracker)
        self.monitor.after_dev(step, progress.dev_history, tracker)

    def final(self, model, settings: TrainSettings, progress: Progress, tracker) -> dict[str, float]:
        """The last step's scores (the loop's, where it evaluated that step: the same model), and the monitor's
        closing word; {} without a dev split."""
        if not self.enabled:
            return {}
        history = progress.dev_history
        if history and history[-1]["step"] == progress.step:
            final = {key: value for key, value in history[-1].items() if key != "step"}
        else:
            final = self.at_step(progress.step, model, settings, progress, tracker)
        self.monitor.finish(history, tracker)
        return final
