"""Eq. 1 on the CPU where torch's SDPA is slower: bf16 training and the cached decoder step.

``aiayn.model.scaled_dot_product_attention`` is Eq. 1; ``matmul_attention`` computes the same as two
matrix multiplies and a softmax in the inputs' dtype (tests/speed/test_cpu_attention.py holds it to the
model's), for two callers:

- Training in bf16. Under bf16 autocast on the CPU, SDPA (its math kernel, which the trainer uses
  there: the CPU flash kernel is slower in bf16) casts queries, keys and values to fp32, multiplies and
  takes the softmax in fp32 and casts the result back, and its backward pass does the same: six casts
  and fp32 products per attention, where the products around it run in bf16. Here the two products
  take bf16 operands (accumulating in fp32, rounding their outputs to bf16), the softmax accumulates in
  fp32 and returns bf16 probabilities, as a GPU's fused bf16 attention multiplies them by V; unlike it,
  the scores are rounded to bf16 before the softmax. ``cpu_attention`` makes a model's attention
  modules use it; they keep their parameters, so checkpoints are unchanged.
- The cached decoder step (``aiayn.speed.incremental``): with one to a few queries a row, SDPA's CPU
  kernel (flash attention, blocked for long queries) is slower than this, and slower with 2 threads
  than with 1.

What it saves is in BENCHMARKS.md. Everything else (fp32 training, a GPU) keeps the model's SDPA.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from aiayn.model import MultiHeadAttention


def matmul_attention(queries: Tensor, keys: Tensor, values: Tensor, key_mask: Tensor | None = None,
                     causal: bool = False) -> Tensor:
    """softmax(Q K^T / sqrt(d_k)) V of (batch, heads, len, d) tensors, in their dtype.

    key_mask is boolean, True where a key may be attended to (a query with no key to attend to, a row
    of padding, gets the mean of the values, not NaN), or an additive bias of 0 and -inf
    (``key_padding_bias``): the scale and the bias then go into the query-key product itself
    (baddbmm), with no pass over the scores; the decoder step uses it for the encoder-decoder
    attention, whose keys it stores transposed, so that the product reads them in place. causal hides
    later keys.
    """
    scale = queries.shape[-1] ** -0.5
    if key_mask is not None and key_mask.is_floating_point():
        batch, heads, length, dim = queries.shape
        keys_length = keys.shape[-2]
        scores = torch.baddbmm(
            key_mask.expand(batch, heads, length, keys_length).reshape(-1, length, keys_length),
            queries.reshape(-1, length, dim), keys.transpose(-1, -2).reshape(-1, dim, keys_length), alpha=scale,
        )
        attended = torch.bmm(scores.softmax(dim=-1), values.reshape(-1, keys_length, values.shape[-1]))
        return attended.view(batch, heads, length, -1)
    if key_mask is None and not causal and queries.shape[-2] == 1 and keys.shape[-2] * keys.shape[-1] < 400:
        # One query over a few keys (a decoder's first positions): torch multiplies matrices this small
        # with a plain loop, and products and sums are faster.
        scores = (keys * queries).sum(dim=-1, keepdim=True).mul_(scale)  # (..., keys, 1)
        return (scores.softmax(dim=-2) * values).sum(dim=-2, keepdim=True)
    scores = torch.matmul(queries, keys.transpose(-2, -1)).mul_(scale)
    hidden = torch.finfo(scores.dtype).min  # finite, so that a row with nothing to attend to stays finite
    if key_mask is not None:
        scores.masked_fill_(~key_mask, hidden)
    if causal:
        later = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu_(1)
        scores.masked_fill_(later, hidden)
    return torch.matmul(scores.softmax(dim=-1), values)


def key_padding_bias(src_pad: Tensor, dtype: torch.dtype) -> Tensor:
    """(batch, src_len) True at pad -> (batch, 1, 1, src_len): -inf at pad, 0 elsewhere, to add to the scores."""
    return torch.zeros(src_pad.shape, dtype=dtype, device=src_pad.device).masked_fill_(src_pad, -math.inf)[
        :, None, None, :]


class BF16CPUAttention(MultiHeadAttention):
    """The paper's MultiHeadAttention, with Eq. 1 computed by ``matmul_attention`` when its inputs are
    bf16 on the CPU (under the trainer's autocast) and by the paper's module otherwise."""

    def attend(self, queries: Tensor, keys: Tensor, values: Tensor, key_mask: Tensor | None = None,
               causal: bool = False) -> Tensor:
        if queries.device.type != "cpu" or queries.dtype != torch.bfloat16:
            return super().attend(queries, keys, values, key_mask, causal)
        return self.output(self.merge_heads(matmul_attention(queries, keys, values, key_mask, causal)))


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
