"""Linear maps for inference on the CPU with weights packed once into oneDNN's layout.

For speed only (``BENCHMARKS.md``): F.linear goes through MKL, which repacks its weight on every call;
a weight reordered once into oneDNN's blocked layout is multiplied by oneDNN directly, with a ReLU
fused into the same call. ``aiayn.speed.incremental`` applies these maps in the cached decoder step
and in the encoder when it runs without gradients in eval mode. Elsewhere (CUDA,
autocast, a torch without oneDNN) each map is F.linear, so the same code runs on every device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.model import DecoderLayer, EncoderLayer


def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and all(
        hasattr(torch.ops.mkldnn, name) for name in ("_reorder_linear_weight", "_linear_pointwise"))


def packs_for_onednn(weight: Tensor) -> bool:
    """Whether inference linear maps with this weight run on oneDNN with a packed weight (CPU, float32,
    no autocast, oneDNN present)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu") \
        and _onednn_linear_available()


def pack_for_onednn(weight: Tensor) -> Tensor:
    """W reordered into oneDNN's blocked layout. The reorder takes the expected row count as a hint;
    speeds did not depend on it over the row counts of a search, so every weight is packed for 256."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 256)


def stacked(tensors: Sequence[Tensor]) -> Tensor:
    """Weights (or biases) of linear maps stacked along their outputs, for one matrix multiply."""
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors))


def step_linear(
    weight: Tensor, bias: Tensor | None, relu: bool = False, packed: Tensor | None = None,
) -> Callable[[Tensor], Tensor]:
    """x -> x W^T + b (then ReLU if relu) for inference.

    On the CPU in float32 (where torch has oneDNN) W is reordered into oneDNN's blocked layout (or
    `packed` is that already) and each call multiplies by it with oneDNN, ReLU fused, with the same
    float32 arithmetic as F.linear up to summation order. Elsewhere (CUDA, autocast, no oneDNN) it is F.linear.
    """
    if packed is not None or packs_for_onednn(weight):
        packed = pack_for_onednn(weight) if packed is None else packed
        if relu:
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "relu", [None], "")
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if relu:
        return lambda x: F.relu(F.linear(x, weight, bias))
    return lambda x: F.linear(x, weight, bias)


class PackedWeights:
    """A model's weights in oneDNN's layout for inference on the CPU, packed once and reused by every
    search and worker thread until they change.

    A weight is repacked when a parameter it is made of is another tensor or has been updated in
    place (an optimizer step, load_state_dict), which moves the tensor's version.
    """

    def __init__(self) -> None:
        self._packed: dict[str, tuple[tuple[tuple[int, int, int], ...], Tensor]] = {}

    def linear(self, name: str, parts: Sequence[nn.Module], relu: bool = False) -> Callable[[Tensor], Tensor]:
        """The maps `parts` (modules with a weight and maybe a bias) stacked along their outputs, as
        one step_linear (Q, K and V: one product); `name` identifies the stack in this model."""
        weights = [part.weight for part in parts]
        bias = None if getattr(parts[0], "bias", None) is None else stacked([part.bias for part in parts])
        if not packs_for_onednn(weights[0]):
            return step_linear(stacked(weights), bias, relu)
        version = tuple((id(weight), weight.data_ptr(), weight._version) for weight in weights)
        entry = self._packed.get(name)
        if entry is None or entry[0] != version:  # two threads may both pack: either result is the same
            entry = self._packed[name] = (version, pack_for_onednn(stacked(weights)))
        return step_linear(weights[0], bias, relu, packed=entry[1])


@dataclass(frozen=True)
class StepLinears:
    """A layer's linear maps as inference applies them (`step_linear`, weights from `PackedWeights`):
    the cached decoder step, and the encoder without gradients in eval mode on the CPU."""

    self_qkv: Callable[[Tensor], Tensor]  # Q, K and V stacked (MultiHeadAttention.self_projections)
    self_output: Callable[[Tensor], Tensor]
    feed_forward_inner: Callable[[Tensor], Tensor]  # with the ReLU of Eq. 2
    feed_forward_outer: Callable[[Tensor], Tensor]
    cross_query: Callable[[Tensor], Tensor] | None = None  # decoder layers only
    cross_output: Callable[[Tensor], Tensor] | None = None

    @classmethod
    def of(cls, layer: EncoderLayer | DecoderLayer, name: str, packed: PackedWeights) -> StepLinears:
        attention, feed_forward = layer.self_attention, layer.feed_forward
        cross = getattr(layer, "cross_attention", None)
        return cls(
            self_qkv=packed.linear(f"{name}.qkv", [attention.query, attention.key, attention.value]),
            self_output=packed.linear(f"{name}.self_output", [attention.output]),
            feed_forward_inner=packed.linear(f"{name}.inner", [feed_forward.inner], relu=True),
            feed_forward_outer=packed.linear(f"{name}.outer", [feed_forward.outer]),
            cross_query=None if cross is None else packed.linear(f"{name}.cross_query", [cross.query]),
            cross_output=None if cross is None else packed.linear(f"{name}.cross_output", [cross.output]),
        )
