"""The model a run trains and its optimiser's state: built from the seed, saved into a checkpoint, loaded back.

docs/PAPER.md, Training: Adam(0.9, 0.98, 1e-9) from a learning rate of 0 (the schedule sets it each step);
fp16's loss scale travels with the optimiser (``aiayn.train.precision``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from aiayn.loss import TrainingObjective
from aiayn.model import ModelConfig, Transformer
from aiayn.speed.precision import resolved_precision
from aiayn.train.hardware import adam, compiled, load_optimizer_state, loss_chunk_tokens, model_for_training
from aiayn.train.precision import LossScaling
from aiayn.train.steps import TrainSettings


@dataclass
class ModelState:
    """The weights, Adam's moments and fp16's loss scale: what a checkpoint holds beyond where the run is."""

    model: Transformer
    optimizer: torch.optim.Optimizer
    precision: str  # what train.precision's auto became on this device
    scaling: LossScaling  # fp16's loss scale; a no-op otherwise

    @classmethod
    def build(cls, config: ModelConfig, settings: TrainSettings, device: torch.device) -> "ModelState":
        """A fresh model, initialised from the run's seed, and its optimiser."""
        torch.manual_seed(settings.seed)
        model = model_for_training(config, device)
        optimizer = adam(model.parameters(), device, lr=0.0, betas=settings.adam_betas, eps=settings.adam_eps)
        precision = resolved_precision(settings.precision, device)
        return cls(model, optimizer, precision, LossScaling(precision, device))

    def saved(self) -> dict:
        """The checkpoint's entries for this state."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "loss_scaling": self.scaling.state_dict()}

    def load(self, checkpoint: dict) -> None:
        """Take the state a checkpoint saved (one written before fp16's loss scale was saved has none)."""
        self.model.load_state_dict(checkpoint["model"])
        load_optimizer_state(self.optimizer, checkpoint["optimizer"])
        self.scaling.load_state_dict(checkpoint.get("loss_scaling", {}))

    def training_objective(self, settings: TrainSettings, world: int, device: torch.device) -> torch.nn.Module:
        """The model and its loss (``TrainingObjective``), under DDP when there are several processes
        and compiled when train.compile is set: (src, tgt_in, tgt_out) -> (loss sum, NLL sum)."""
        chunk = loss_chunk_tokens(device, self.model.config.vocab_size, 2 * settings.device_tokens)
        objective: torch.nn.Module = TrainingObjective(self.model, settings.label_smoothing, chunk)
        if world > 1:
            # the sinusoid table is the only buffer and never changes: nothing to send each step
            # (torch 2.13 renamed the switch; the GPU image's torch has the old name only)
            ddp = torch.nn.parallel.DistributedDataParallel
            no_buffer_sync = ({"forward_sync_buffers": False}
                              if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters
                              else {"broadcast_buffers": False})
            objective = ddp(objective, device_ids=[device.index] if device.type == "cuda" else None, **no_buffer_sync)
        if settings.compile:
            objective = compiled(objective)
        return objective
