"""Progress and resume: a run's checkpoints written at its steps, and the newest that loads read back.

A checkpoint holds the model state (``aiayn.train.model_state``), where the run is (``Progress``), the torch
RNG, and what fixed its batches, so that a resumed run takes the steps an uninterrupted one would.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from aiayn.checkpoint import CHECKPOINT_FORMAT, checkpoint_path, list_checkpoints, load_checkpoint, save_model
from aiayn.errors import UserError
from aiayn.layout import CHECKPOINTS
from aiayn.memory import resumed_device_tokens
from aiayn.model import ModelConfig
from aiayn.train.budget_schedule import fitted_batch
from aiayn.train.model_state import ModelState
from aiayn.train.run_data import RunData
from aiayn.train.schedule import schedule_record
from aiayn.train.steps import Progress, TrainSettings


@dataclass
class Resumed:
    """What a run takes from the checkpoint it resumes from."""

    path: Path
    settings: TrainSettings  # its device_tokens as the checkpoint recorded (aiayn.memory.resumed_device_tokens)
    progress: Progress


class Checkpoints:
    """A run's ``checkpoints/`` folder: the window checkpoints averaging needs, and a safety checkpoint
    only while it is the newest."""

    def __init__(self, run_dir: Path, config: dict, model_config: ModelConfig, data: RunData):
        """Of the run in ``run_dir`` (``config``: its preset, train section and seed, as ``TrainJob.recorded_config``
        gives them), training ``model_config`` on ``data``: what every checkpoint records besides the step."""
        self.run_dir, self.folder = run_dir, run_dir / CHECKPOINTS
        self.preset_name, self.model_config = config["preset"]["name"], model_config
        self.run = {"config": config, "vocab_fingerprint": data.vocab_fingerprint,
                    "data_fingerprint": data.data_fingerprint}

    def newest(self, warn: bool) -> tuple[dict, Path] | tuple[None, None]:
        """The newest checkpoint that loads (window or safety), and its path. A damaged newest file (a job
        killed while the file system was writing it) is skipped, saying so where ``warn``."""
        for _, candidate in reversed(list_checkpoints(self.folder, safety=True)):
            try:
                return load_checkpoint(candidate), candidate
            except UserError as error:
                if warn:
                    print(f"warning: skipping {candidate.name}, which does not load ({error}); resuming from an "
                          "older checkpoint", file=sys.stderr)
        return None, None

    def resume(self, state: ModelState, settings: TrainSettings, warn: bool) -> Resumed | None:
        """Load the newest checkpoint into ``state`` and the torch RNG, after checking that it is this run's;
        None where there is none."""
        checkpoint, path = self.newest(warn)
        if checkpoint is None:
            return None
        if checkpoint.get("format") != CHECKPOINT_FORMAT:
            raise UserError(f"{path}: not a training checkpoint; move it out of {self.folder}")
        if checkpoint["model_config"] != self.model_config.to_dict():
            raise UserError(f"{path}: its model_config differs from preset {self.preset_name!r}; "
                            f"the preset changed since this run started: delete {self.run_dir} to start afresh")
        # a budget schedule's fitted step size is the run's, as it was before it stopped
        settings = fitted_batch(settings, (checkpoint["progress"].get("budget_schedule") or {}).get("tokens_per_step"))
        settings.check_batch_rule(checkpoint.get("batch_rule"), path, self.run_dir)  # not for device_tokens
        state.load(checkpoint)
        torch.set_rng_state(checkpoint["rng"]["torch"])
        settings = resumed_device_tokens(settings, self.run["config"]["train"]["device_tokens"], checkpoint, warn)
        return Resumed(path, settings, Progress(**checkpoint["progress"]))

    def save(self, state: ModelState, progress: Progress, settings: TrainSettings, window: bool) -> Path:
        """Write the checkpoint of ``progress``' step; keep the last train.keep_checkpoints window checkpoints,
        and a safety checkpoint only while it is the newest."""
        d_model = self.model_config.d_model
        path = checkpoint_path(self.folder, progress.step, window)
        save_model({
            "format": CHECKPOINT_FORMAT, "step": progress.step, "model_config": self.model_config.to_dict(),
            **state.saved(), "schedule": schedule_record(d_model, settings.warmup_steps, settings.lr_scale),
            "progress": vars(progress).copy(), "rng": {"torch": torch.get_rng_state()},
            "batch_rule": settings.batch_rule(), "window": window, **self.run,
        }, path)
        for _, old in list_checkpoints(self.folder)[:-settings.keep_checkpoints]:
            old.unlink(missing_ok=True)
        for _, old in list_checkpoints(self.folder, safety=True):
            if old.name.startswith("safety_") and old != path:
                old.unlink(missing_ok=True)
        return path

    def written(self, step: int) -> bool:
        """Whether step ``step``'s window checkpoint is on disk."""
        return checkpoint_path(self.folder, step).exists()
