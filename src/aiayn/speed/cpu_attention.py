"""Eq. 1 in bf16 for training on the CPU, where SDPA computes attention in fp32.

Under bf16 autocast on the CPU, ``scaled_dot_product_attention`` (its math kernel, which the trainer
uses there: the CPU flash kernel is slower in bf16) casts queries, keys and values to fp32, multiplies
and takes the softmax in fp32 and casts the result back, and its backward pass does the same: six
casts and fp32 products per attention, where the products around it run in bf16. Here the two
products take bf16 operands (accumulating in fp32, rounding their outputs to bf16), the softmax
accumulates in fp32 and returns bf16 probabilities, as a GPU's fused bf16 attention multiplies them
by V; unlike it, the scores are rounded to bf16 before the softmax. Everything else (fp32 inputs, a
GPU) goes to the paper's module unchanged. ``cpu_attention`` makes a model's attention modules use
it; they keep their parameters, so checkpoints are unchanged. What it saves is in BENCHMARKS.md.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from aiayn.model import MultiHeadAttention


def bf16_attention(queries: Tensor, keys: Tensor, values: Tensor, key_mask: Tensor | None = None,
                   causal: bool = False) -> Tensor:
    """softmax(Q K^T / sqrt(d_k)) V of (batch, heads, len, d) bf16 tensors, in bf16.

    key_mask (batch, 1, 1, src_len) is True where a key may be attended to; causal hides later keys.
    A query with no key to attend to (a row of padding) gets the mean of the values, not NaN."""
    scores = torch.matmul(queries, keys.transpose(-2, -1)).mul_(1.0 / math.sqrt(queries.size(-1)))
    hidden = torch.finfo(scores.dtype).min  # finite, so that a row with nothing to attend to stays finite
    if key_mask is not None:
        scores.masked_fill_(~key_mask, hidden)
    if causal:
        later = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu_(1)
        scores.masked_fill_(later, hidden)
    return torch.matmul(scores.softmax(dim=-1), values)


class BF16CPUAttention(MultiHeadAttention):
    """The paper's MultiHeadAttention, with Eq. 1 computed by ``bf16_attention`` when its inputs are
    bf16 on the CPU (under the trainer's autocast) and by the paper's module otherwise."""

    def attend(self, queries: Tensor, keys: Tensor, values: Tensor, key_mask: Tensor | None = None,
               causal: bool = False) -> Tensor:
        if queries.device.type != "cpu" or queries.dtype != torch.bfloat16:
            return super().attend(queries, keys, values, key_mask, causal)
        return self.output(self.merge_heads(bf16_attention(queries, keys, values, key_mask, causal)))


def cpu_attention(model: nn.Module, device: torch.device) -> int:
    """On the CPU, every ``MultiHeadAttention`` of ``model`` becomes a ``BF16CPUAttention`` with the same
    parameters (its class changes, nothing else); elsewhere nothing changes. Returns how many changed."""
    if device.type != "cpu":
        return 0
    changed = 0
    for module in model.modules():
        if type(module) is MultiHeadAttention:
            module.__class__ = BF16CPUAttention
            changed += 1
    return changed
