"""Dropout for training on the CPU whose random mask costs a quarter of a 64-bit draw per element.

torch's CPU dropout draws its mask with ``bernoulli_``, at about twice the cost of the random numbers
themselves, and a base model applies it 32 times a step. This one draws uniform 16-bit integers (four
from each 64-bit draw of the generator) and keeps an element where the draw is at least
round(p * 2^16), scaling kept elements by 2^16 / (2^16 - that threshold), so that the expectation is
unchanged and p is rounded to a multiple of 1/65536 (0.1 becomes 0.1000061). The mask is kept as
booleans for the backward pass. ``cpu_dropout`` puts it in place of a model's ``nn.Dropout`` modules
when training on the CPU; on a GPU torch's fused dropout stays. What it saves is in BENCHMARKS.md.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

LEVELS = 1 << 16  # the values a 16-bit draw takes
LOWEST = -(1 << 15)  # int16's smallest value: draws run from LOWEST to LOWEST + LEVELS - 1


class MaskDropout(nn.Module):
    """Zeroes each element with probability p (to 1/65536) in training, scales the rest by 1 / (1 - p)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability {p} is not in [0, 1)")
        self.p = p
        self.dropped_levels = round(p * LEVELS)  # draws below LOWEST + this are dropped

    @property
    def rounded_p(self) -> float:
        """The probability this module really drops with."""
        return self.dropped_levels / LEVELS

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.dropped_levels == 0:
            return x
        return _MaskAndScale.apply(x, self.dropped_levels)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class _MaskAndScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dropped_levels):
        keep = _draws(x.shape, x.device) >= LOWEST + dropped_levels
        ctx.scale = LEVELS / (LEVELS - dropped_levels)
        ctx.save_for_backward(keep)
        return x.mul(keep).mul_(ctx.scale)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad.mul(keep).mul_(ctx.scale), None


def _draws(shape: torch.Size, device: torch.device) -> Tensor:
    """Uniform int16 draws of ``shape``: the four quarters of uniform 64-bit draws. (torch's CPU
    generator serves any integer range of 2^32 or more, a full int32 one included, from one 64-bit
    draw, so 64-bit values cost no more each than 32-bit ones.) The range is all of int64 but its
    largest value, which a draw misses with probability 2^-64."""
    count = shape.numel()
    quarters = torch.randint(-(1 << 63), (1 << 63) - 1, ((count + 3) // 4,), dtype=torch.int64, device=device)
    return quarters.view(torch.int16)[:count].view(shape)


def cpu_dropout(model: nn.Module, device: torch.device) -> int:
    """On the CPU, every ``nn.Dropout`` of ``model`` becomes a ``MaskDropout`` of the same p (no
    parameters, so checkpoints are unchanged); elsewhere nothing changes. Returns how many changed."""
    if device.type != "cpu":
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout:
                setattr(parent, name, MaskDropout(child.p))
                replaced += 1
    return replaced
