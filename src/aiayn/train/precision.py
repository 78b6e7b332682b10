"""Dynamic loss scaling for fp16 training (Micikevicius et al. 2018, "Mixed Precision Training"; fairseq's
recipe, Ott et al. 2018), with ``torch.amp.GradScaler``.

fp16 holds values down to about 6e-8, and many gradients of a step's mean loss are smaller: the loss is
multiplied by a scale before the backward pass, and the gradients divided by it again before their norm
is measured and Adam reads them. A step whose gradients overflowed (their norm is not finite) is skipped,
weights and Adam's moments untouched, and the scale halved; after 2000 steps without one it doubles. The
step still counts (its batches are used, the learning rate schedule moves on), as in torch's recipe; the
skipped steps are counted for ``final.json`` and MLflow. The scale is part of every checkpoint, so that
a resumed run goes on with it.

The loss itself is fp32 and unscaled, so a non-finite loss is a diverged run in every precision
(``aiayn.train.divergence``); so are gradients that still overflow with the scale below ``MIN_LOSS_SCALE``.

bf16 and fp32 need none: ``LossScaling`` is then a no-op, so that the trainer reads the same for every
precision, and their steps are the same as without it.
"""

from __future__ import annotations

import math

import torch

# Below this scale an overflow is no longer a scale too large: the gradients themselves are not finite
# (fairseq's min_loss_scale is 1e-4). The run then ends as one diverged.
MIN_LOSS_SCALE = 2.0 ** -14


class LossScaling:
    """The loss scale of a run in ``precision`` (resolved: ``aiayn.speed.precision.resolved_precision``)
    on ``device``; a no-op unless that is fp16."""

    def __init__(self, precision: str, device: torch.device):
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self.skipped_steps = 0

    @property
    def enabled(self) -> bool:
        return self.scaler is not None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on: multiplied by the scale."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale, before their norm is measured."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def skips(self, grad_norm: float) -> bool:
        """Whether a step with this (unscaled) gradient norm is skipped: under fp16 where the norm is not
        finite, the gradients overflowed, while the scale is at least ``MIN_LOSS_SCALE``. Below it they
        overflow whatever the scale: the run has diverged. Reads the scale on such steps only."""
        return (self.scaler is not None and not math.isfinite(grad_norm)
                and self.scaler.get_scale() >= MIN_LOSS_SCALE)

    def step(self, optimizer: torch.optim.Optimizer, grad_norm: float) -> None:
        """``optimizer.step()``; under fp16 none where the gradient norm is not finite, and the scale
        updated (halved after an overflow)."""
        if self.scaler is None:
            optimizer.step()
            return
        # The norm is every process's (DDP's all-reduce leaves them the same gradients): the overflow
        # GradScaler acts on is set to it, so that all processes skip the same steps by construction.
        overflowed = not math.isfinite(grad_norm)
        for found in self.scaler._found_inf_per_device(optimizer).values():
            found.fill_(float(overflowed))
        self.scaler.step(optimizer)
        self.scaler.update()
        self.skipped_steps += int(overflowed)

    def advice(self) -> str:
        """What the message of a diverged run adds under fp16."""
        if self.scaler is None:
            return ""
        return (f". The run trains in fp16, whose values overflow above 65504 (loss scale now "
                f"{self.scaler.get_scale():g}): train.precision fp32, or bf16 where the GPU has it, has more range")

    def record(self) -> dict:
        """The loss scale now and the steps skipped so far (``loss_scale`` None without loss scaling)."""
        return {"loss_scale": self.scaler.get_scale() if self.scaler is not None else None,
                "skipped_steps": self.skipped_steps}

    def metrics(self) -> dict[str, float]:
        """``record`` for MLflow at a log step: nothing without loss scaling."""
        return self.record() if self.scaler is not None else {}

    def state_dict(self) -> dict:
        """For a checkpoint: the scaler's state (scale, steps since the last overflow) and the skipped steps."""
        if self.scaler is None:
            return {}
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's state; one saved without loss scaling (another precision) leaves a fresh scale."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state["scaler"])
            self.skipped_steps = state["skipped_steps"]
