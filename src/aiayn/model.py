"""The Transformer of "Attention Is All You Need", read as the paper's Figure 1.

Top-down: the config, then multi-head attention (Section 3.2), the position-wise feed-forward network
(3.3), embeddings with positions (3.4, 3.5), the encoder and decoder layers (3.1), and the
``Transformer`` that stacks them, with the cached one-token step the beam search drives.

Imports torch alone, so that it runs on a bare GPU image with ``PYTHONPATH=src``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.errors import UserError

POSITIONAL_KINDS = ("sinusoidal", "learned", "none")


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape, with the paper's names; the defaults are the base model (Table 3, first row)."""

    vocab_size: int
    n_layers: int = 6
    d_model: int = 512
    d_ff: int = 2048
    n_heads: int = 8
    d_head: int | None = None  # d_k, query/key size per head; None means d_model // n_heads
    d_value: int | None = None  # d_v, value size per head; None means d_head (Table 3 row B changes d_k alone)
    dropout: float = 0.1
    positional: str = "sinusoidal"  # one of POSITIONAL_KINDS; "learned" is Table 3 row E
    max_positions: int = 1024  # rows of the learned table; initial length of the sinusoid table, which grows
    pad_id: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layers", "d_model", "d_ff", "n_heads", "max_positions"):
            _require_int(name, getattr(self, name), minimum=1)
        for name in ("d_head", "d_value"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name), minimum=1)
        _require_int("pad_id", self.pad_id, minimum=0)
        if self.pad_id >= self.vocab_size:
            raise UserError(
                f"pad_id = {self.pad_id} is not a token of a vocabulary of vocab_size = {self.vocab_size} "
                f"(pad_id must be below vocab_size)"
            )
        if self.d_head is None and self.d_model % self.n_heads:
            divisors = [n for n in range(1, self.d_model + 1) if self.d_model % n == 0]
            choices = ", ".join(str(n) for n in divisors[:5]) + (", ..." if len(divisors) > 5 else "")
            raise UserError(
                f"n_heads = {self.n_heads} does not divide d_model = {self.d_model} "
                f"(set d_head explicitly, or choose n_heads in {choices})"
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise UserError(f"dropout = {self.dropout!r} must be a number in [0, 1)")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"dropout = {self.dropout} must be in [0, 1) (the paper uses 0.1 for base, 0.3 for big)")
        if self.positional not in POSITIONAL_KINDS:
            raise UserError(
                f"positional = {self.positional!r} is unknown (choose one of {', '.join(POSITIONAL_KINDS)})"
            )

    @property
    def head_dim(self) -> int:
        """d_k: the query and key size of one head."""
        return self.d_head if self.d_head is not None else self.d_model // self.n_heads

    @property
    def value_dim(self) -> int:
        """d_v: the value size of one head."""
        return self.d_value if self.d_value is not None else self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ModelConfig:
        known = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise UserError(
                f"unknown model setting(s): {', '.join(unknown)} (known: {', '.join(known)})"
            )
        if "vocab_size" not in values:
            raise UserError("vocab_size is missing from the model settings (it comes from the vocabulary)")
        return cls(**values)


def _require_int(name: str, value: Any, minimum: int) -> None:
    # bool is an int subclass, but `n_layers: true` in a config file is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{name} = {value!r} must be a whole number (at least {minimum})")
    if value < minimum:
        raise UserError(f"{name} = {value} must be at least {minimum}")


class MultiHeadAttention(nn.Module):
    """Section 3.2.2: h heads of scaled dot-product attention (Eq. 1), concatenated and projected by W^O.

    The projections are split into queries, keys-and-values and attend, so that the cached decoder can
    compute encoder-decoder keys and values once and append one self-attention key and value per step.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.value_dim = config.value_dim
        self.query = nn.Linear(config.d_model, config.n_heads * config.head_dim)
        self.key = nn.Linear(config.d_model, config.n_heads * config.head_dim)
        self.value = nn.Linear(config.d_model, config.n_heads * config.value_dim)
        self.output = nn.Linear(config.n_heads * config.value_dim, config.d_model)  # W^O

    def forward(
        self, x: Tensor, source: Tensor, key_mask: Tensor | None = None, causal: bool = False,
        project: Callable[[Tensor], Tensor] | None = None, output: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:
        """project and output (self-attention only): the stacked Q, K, V map and W^O as inference
        applies them (`StepLinears`); by default the module's own layers."""
        if source is x:
            return self.attend(*self._self_projections(x, project), key_mask, causal, output=output)
        keys, values = self.keys_values(source)
        return self.attend(self.queries(x), keys, values, key_mask, causal)

    def fused_self_weights(self) -> tuple[Tensor, Tensor]:
        """The Q, K and V weights and biases stacked for one matrix multiply."""
        parts = (self.query, self.key, self.value)
        return stacked([part.weight for part in parts]), stacked([part.bias for part in parts])

    def _self_projections(
        self, x: Tensor, project: Callable[[Tensor], Tensor] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K and V of self-attention in one matrix multiply (one GEMM three times as wide is
        faster than three); the weights stay three Linear layers, so checkpoints are unchanged.
        The cached decoder passes the projection it made once from the stacked weights (`StepLinears`)."""
        if project is None:
            projected = F.linear(x, *self.fused_self_weights())
        else:
            projected = project(x)
        key_size = self.n_heads * self.head_dim
        queries, keys, values = projected.split([key_size, key_size, self.n_heads * self.value_dim], dim=-1)
        return (self._split_heads(queries, self.head_dim), self._split_heads(keys, self.head_dim),
                self._split_heads(values, self.value_dim))

    def queries(self, x: Tensor, project: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        return self._split_heads((project or self.query)(x), self.head_dim)  # (batch, heads, tgt_len, d_head)

    def keys_values(self, source: Tensor) -> tuple[Tensor, Tensor]:
        keys = self._split_heads(self.key(source), self.head_dim)  # (batch, heads, src_len, d_head)
        values = self._split_heads(self.value(source), self.value_dim)  # (batch, heads, src_len, d_value)
        return keys, values

    def attend(
        self, queries: Tensor, keys: Tensor, values: Tensor, key_mask: Tensor | None = None, causal: bool = False,
        decoding: bool = False, output: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:
        # Eq. 1, softmax(Q K^T / sqrt(d_k)) V: SDPA's default scale is 1/sqrt of the query size, d_k.
        # No dropout on the attention weights: the paper drops only sub-layer outputs and embedding
        # sums (Section 5.4); the attention-dropout of some t2t hparams sets is not in the paper.
        if decoding and queries.device.type == "cpu":
            heads = _few_query_attention(queries, keys, values, key_mask)
        else:
            heads = F.scaled_dot_product_attention(queries, keys, values, attn_mask=key_mask, is_causal=causal)
        batch, _, length, _ = heads.shape  # (batch, heads, tgt_len, d_value)
        concatenated = heads.transpose(1, 2).reshape(batch, length, self.n_heads * self.value_dim)
        return (output or self.output)(concatenated)  # (batch, tgt_len, d_model)

    def _split_heads(self, projected: Tensor, size: int) -> Tensor:
        batch, length, _ = projected.shape
        return projected.view(batch, length, self.n_heads, size).transpose(1, 2)


def _few_query_attention(queries: Tensor, keys: Tensor, values: Tensor, key_mask: Tensor | None) -> Tensor:
    """Eq. 1 as two matrix multiplies and a softmax, for the cached decoder step on the CPU (no causal mask).

    With one to a few queries a row, SDPA's CPU kernel (flash attention, blocked for long queries) was
    1.3 times slower than this on the encoder-decoder attention of a beam-search step with 1 thread and
    3.4 times with 2, where it got slower than with 1 (torch 2.13, bench/decode_cpu.py's sizes, 4
    queries a sentence). Training and CUDA keep SDPA.

    A floating key_mask is an additive bias (0 or -inf, `key_padding_bias`): the scale and the mask then
    go into the query-key product itself (baddbmm), with no pass over the scores. The cached step
    uses it for the encoder-decoder attention, whose keys init_cache stores transposed, so the
    product reads them in place; the two together were 16 to 20% faster on that attention (bench sizes).
    """
    if key_mask is not None and key_mask.is_floating_point():
        batch, heads, length, dim = queries.shape
        keys_length = keys.shape[-2]
        scores = torch.baddbmm(
            key_mask.expand(batch, heads, length, keys_length).reshape(-1, length, keys_length),
            queries.reshape(-1, length, dim), keys.transpose(-1, -2).reshape(-1, dim, keys_length), alpha=dim**-0.5,
        )
        attended = torch.bmm(scores.softmax(dim=-1), values.reshape(-1, keys_length, values.shape[-1]))
        return attended.view(batch, heads, length, -1)
    if queries.shape[-2] == 1 and keys.shape[-2] * keys.shape[-1] < 400:
        # One query over a few keys (a decoder's first positions): torch multiplies matrices this small
        # with a plain loop, and products and sums were 1.3 to 2 times faster over 6 layers (1 to 6 keys).
        scores = (keys * queries).sum(dim=-1, keepdim=True).mul_(queries.shape[-1] ** -0.5)  # (..., keys, 1)
        if key_mask is not None:
            scores.masked_fill_(~key_mask.transpose(-1, -2), -math.inf)
        return (scores.softmax(dim=-2) * values).sum(dim=-2, keepdim=True)
    scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(queries.shape[-1] ** -0.5)
    if key_mask is not None:
        scores.masked_fill_(~key_mask, -math.inf)
    return torch.matmul(scores.softmax(dim=-1), values)


def key_padding_bias(src_pad: Tensor, dtype: torch.dtype) -> Tensor:
    """(batch, src_len) True at pad -> (batch, 1, 1, src_len): -inf at pad, 0 elsewhere, to add to the scores."""
    return torch.zeros(src_pad.shape, dtype=dtype, device=src_pad.device).masked_fill_(src_pad, -math.inf)[
        :, None, None, :]


def key_padding_mask(src_pad: Tensor) -> Tensor:
    """(batch, src_len) True at pad -> (batch, 1, 1, src_len) True where a query may attend.

    Broadcast over heads and queries by SDPA, so no (batch, heads, tgt_len, src_len) mask is built.
    """
    return ~src_pad[:, None, None, :]


class FeedForward(nn.Module):
    """Eq. 2: FFN(x) = max(0, x W1 + b1) W2 + b2, the same at every position."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inner = nn.Linear(config.d_model, config.d_ff)
        self.outer = nn.Linear(config.d_ff, config.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.outer(F.relu(self.inner(x)))


def sinusoid_table(length: int, d_model: int) -> Tensor:
    """Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(the same angle).

    Computed in float64 so that positions in the thousands keep their low-order bits, then cast to float32.
    """
    positions = torch.arange(length, dtype=torch.float64)[:, None]  # (length, 1)
    even = torch.arange(0, d_model, 2, dtype=torch.float64)  # the 2i of the formula
    angles = positions / torch.pow(10000.0, even / d_model)  # (length, ceil(d_model / 2))
    table = torch.empty(length, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : d_model // 2])
    return table.float()


class PositionalEncoding(nn.Module):
    """Adds position information to the scaled embeddings: sinusoids (Section 3.5), a learned table
    (Table 3 row E) or nothing (an ablation that makes the encoder blind to order)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.kind = config.positional
        self.max_positions = config.max_positions
        if self.kind == "sinusoidal":
            # Not persistent: it is a function of the config, so checkpoints need not carry it.
            self.register_buffer("table", sinusoid_table(config.max_positions, config.d_model), persistent=False)
        elif self.kind == "learned":
            self.learned = nn.Embedding(config.max_positions, config.d_model)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        end = offset + x.shape[1]  # x: (batch, len, d_model), positions offset .. end - 1
        if self.kind == "sinusoidal":
            if end > self.table.shape[0]:
                # The sinusoids extrapolate to any length (Section 3.5), so the table grows instead of failing.
                grown = sinusoid_table(max(end, 2 * self.table.shape[0]), self.table.shape[1])
                self.table = grown.to(self.table)
            return x + self.table[offset:end]
        if self.kind == "learned":
            if end > self.max_positions:
                raise UserError(
                    f"a sequence reaches position {end - 1}, past the learned table of "
                    f"max_positions = {self.max_positions} (raise max_positions, or use positional = sinusoidal)"
                )
            return x + self.learned.weight[offset:end]
        return x


class EncoderLayer(nn.Module):
    """Section 3.1: self-attention then feed-forward, each as LayerNorm(x + Dropout(Sublayer(x)))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attention = MultiHeadAttention(config)
        self.self_attention_norm = nn.LayerNorm(config.d_model)
        self.feed_forward = FeedForward(config)
        self.feed_forward_norm = nn.LayerNorm(config.d_model)
        self.dropout = nn.Dropout(config.dropout)  # residual dropout, Section 5.4

    def forward(self, x: Tensor, src_mask: Tensor, linears: StepLinears | None = None) -> Tensor:
        # Post-norm, as the paper (the Annotated Transformer and later t2t are pre-norm).
        if linears is None:
            x = self.self_attention_norm(x + self.dropout(self.self_attention(x, x, src_mask)))
            return self.feed_forward_norm(x + self.dropout(self.feed_forward(x)))
        # Inference with packed weights (Transformer.encode, in eval mode: no dropout): the same maps in
        # the same order. The feed-forward's residual sum is fused into its second map; the attention's
        # stays outside the module call, whose hooks (aiayn.attention) see the attention's own output.
        x = self.self_attention_norm(
            x + self.self_attention(x, x, src_mask, project=linears.self_qkv, output=linears.self_output))
        return self.feed_forward_norm(linears.feed_forward_outer(linears.feed_forward_inner(x), x))


class DecoderLayer(nn.Module):
    """Section 3.1: masked self-attention, encoder-decoder attention, feed-forward; each post-norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attention = MultiHeadAttention(config)
        self.self_attention_norm = nn.LayerNorm(config.d_model)
        self.cross_attention = MultiHeadAttention(config)
        self.cross_attention_norm = nn.LayerNorm(config.d_model)
        self.feed_forward = FeedForward(config)
        self.feed_forward_norm = nn.LayerNorm(config.d_model)
        self.dropout = nn.Dropout(config.dropout)  # residual dropout, Section 5.4

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        # Section 3.2.3: position t sees only positions <= t. Targets are right-padded, so a real token
        # never sees a pad, and the causal mask alone is exact for every non-pad output.
        x = self.self_attention_norm(x + self.dropout(self.self_attention(x, x, causal=True)))
        x = self.cross_attention_norm(x + self.dropout(self.cross_attention(x, memory, src_mask)))
        return self.feed_forward_norm(x + self.dropout(self.feed_forward(x)))

    def step(self, x: Tensor, layer: int, position: int, cache: DecoderCache, src_mask: Tensor) -> Tensor:
        """One target position, x: (rows, 1, d_model), attending to the cache of earlier positions.

        rows = sources * cache.group: the `group` rows of one source (the beams of a sentence) share
        that source's encoder-decoder keys and values, so their queries attend to them together.
        Inference only: no dropout, and each residual sum is fused into the linear map before it.
        """
        attention = self.self_attention
        linears = cache.linears[layer]
        queries, key, value = attention._self_projections(x, linears.self_qkv)
        # The cache keeps the dtype init_cache gave it (bf16 under autocast).
        cache.key_buffer[layer, position, : cache.rows] = key[:, :, 0]  # (rows, heads, d_head)
        cache.value_buffer[layer, position, : cache.rows] = value[:, :, 0]
        keys, values = cache.layer_keys_values(layer, position + 1)  # (rows, heads, position + 1, d)
        # One query over the positions so far: no causal mask is needed.
        residual = x
        x = self.self_attention_norm(attention.attend(
            queries.to(keys.dtype), keys, values, decoding=True,
            output=lambda heads: linears.self_output(heads, residual)))

        attention = self.cross_attention
        memory_keys, memory_values = cache.memory_keys[layer], cache.memory_values[layer]
        # (rows, 1, d) -> (sources, group, d): a source's rows are its queries, so the encoder-decoder
        # keys and values are read once per source, not copied to every beam.
        grouped = x.view(memory_keys.shape[0], cache.group, -1)
        queries = attention.queries(grouped, linears.cross_query)
        x = self.cross_attention_norm(attention.attend(
            queries.to(memory_keys.dtype), memory_keys, memory_values, src_mask, decoding=True,
            output=lambda heads: linears.cross_output(heads, grouped)).view_as(x))
        return self.feed_forward_norm(linears.feed_forward_outer(linears.feed_forward_inner(x), x))


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
    speeds at 62 to 420 rows did not depend on it on BENCHMARKS.md's CPU, so every weight is packed
    for 256."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 256)


def stacked(tensors: Sequence[Tensor]) -> Tensor:
    """Weights (or biases) of linear maps stacked along their outputs, for one matrix multiply."""
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors))


def step_linear(
    weight: Tensor, bias: Tensor | None, relu: bool = False, packed: Tensor | None = None,
) -> Callable[..., Tensor]:
    """x -> x W^T + b (then ReLU if relu) for inference: the cached decoder step applies it to its rows
    once per position of a search, the encoder to a batch's tokens. Called as f(x, residual), it
    returns x W^T + b + residual (a post-norm sub-layer's residual sum; not with relu).

    On the CPU in float32 (where torch has oneDNN) W is reordered into oneDNN's blocked layout (or
    `packed` is that already) and each call multiplies by it with oneDNN, ReLU or the residual sum
    fused: F.linear would go through MKL, which repacks W on every call. For one step's linear layers
    at 248 rows (62 sentences x 4 beams) that was 18% faster with 2 threads on the AVX2 CPU of
    BENCHMARKS.md (no faster with 1), and 53 to 64 GFLOP/s became 66 to 71 for the encoder's at 1984
    tokens (1 thread), with the same float32 arithmetic up to summation order. The fused sum gives
    the bits of the separate one and saves its pass over the rows. Elsewhere (CUDA, autocast, no
    oneDNN) it is F.linear.
    """
    if packed is not None or packs_for_onednn(weight):
        packed = pack_for_onednn(weight) if packed is None else packed
        if relu:
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "relu", [None], "")

        def onednn(x: Tensor, residual: Tensor | None = None) -> Tensor:
            if residual is None:
                return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")

        return onednn

    def linear(x: Tensor, residual: Tensor | None = None) -> Tensor:
        y = F.linear(x, weight, bias)
        return y if residual is None else y + residual

    return (lambda x: F.relu(linear(x))) if relu else linear


class PackedWeights:
    """A model's weights in oneDNN's layout for inference on the CPU, packed once and reused by every
    search and worker thread until they change.

    A weight is repacked when a parameter it is made of is another tensor or has been updated in
    place (an optimizer step, load_state_dict), which moves the tensor's version. Packing the 37
    step weights of bench/decode_cpu.py's model took 18 ms a batch.
    """

    def __init__(self) -> None:
        self._packed: dict[str, tuple[tuple[tuple[int, int, int], ...], Tensor]] = {}

    def linear(self, name: str, parts: Sequence[nn.Module], relu: bool = False) -> Callable[..., Tensor]:
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

    self_qkv: Callable[[Tensor], Tensor]  # Q, K and V stacked (MultiHeadAttention.fused_self_weights)
    self_output: Callable[..., Tensor]  # (x) or (x, residual), as the maps of step_linear
    feed_forward_inner: Callable[[Tensor], Tensor]  # with the ReLU of Eq. 2
    feed_forward_outer: Callable[..., Tensor]
    cross_query: Callable[[Tensor], Tensor] | None = None  # decoder layers only
    cross_output: Callable[..., Tensor] | None = None

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


class ScratchBuffers:
    """Memory that one thread's successive searches reuse for their self-attention caches.

    A fresh cache is tens of megabytes that the operating system maps and zeroes page by page as
    the first steps write it; reusing the last search's memory skips that (about 2 us a 4 KiB page on
    BENCHMARKS.md's CPU, 46 ms of a 3 s batch). One search at a time may use it.
    """

    def __init__(self) -> None:
        self._flat: dict[str, Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """An uninitialised tensor of `shape` with like's dtype and device, in the memory kept as `name`."""
        size = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.numel() < size or flat.dtype != like.dtype or flat.device != like.device:
            flat = self._flat[name] = like.new_empty(size)
        return flat[:size].view(shape)


@dataclass
class DecoderCache:
    """What incremental decoding keeps between steps.

    The decoder has rows = sources * group rows: row r belongs to source r // group (beam search puts
    the beams of a sentence in one group). Encoder-decoder keys and values are kept once per source.
    """

    memory_keys: Tensor  # (layers, sources, heads, src_len, d_head), encoder-decoder keys, computed once
    memory_values: Tensor  # (layers, sources, heads, src_len, d_value)
    # The self-attention buffers, (layers, max_len, capacity, heads, d_head / d_value), position-major:
    # a step writes one contiguous (rows, heads, d) slab, and a row's keys at a position are one
    # contiguous heads x d block that a reorder copies whole. Rows are kept in place in the first
    # `rows` of the capacity, so a batch that shrinks (sentences that end) or grows up to its capacity
    # (one row per sentence into beams) moves rows without allocating.
    key_buffer: Tensor
    value_buffer: Tensor
    rows: int  # decoder rows in use
    src_pad: Tensor  # (sources, src_len), True at pad
    # Per decoder layer, its linear maps prepared once for the step (Q, K and V in one matrix multiply).
    linears: list[StepLinears]
    # The pre-softmax layer (the shared embedding, transposed) prepared the same way.
    project: Callable[[Tensor], Tensor]
    group: int = 1  # decoder rows per source

    def layer_keys_values(self, layer: int, length: int) -> tuple[Tensor, Tensor]:
        """A layer's self-attention keys and values at positions 0 .. length - 1, as views of shape
        (rows, heads, length, d_head / d_value)."""
        return (self.key_buffer[layer, :length, : self.rows].permute(1, 2, 0, 3),
                self.value_buffer[layer, :length, : self.rows].permute(1, 2, 0, 3))

    @property
    def self_keys(self) -> Tensor:
        """(layers, rows, heads, max_len, d_head), filled one position per step."""
        return self.key_buffer[:, :, : self.rows].permute(0, 2, 3, 1, 4)

    @property
    def self_values(self) -> Tensor:
        """(layers, rows, heads, max_len, d_value)."""
        return self.value_buffer[:, :, : self.rows].permute(0, 2, 3, 1, 4)

    @property
    def max_len(self) -> int:
        return self.key_buffer.shape[1]


def _copy_cache_rows(
    cache: DecoderCache, index: Tensor, copy_from: Tensor, filled: int, copied: int | None = None,
) -> None:
    """Row i of the self-attention buffers takes old row index[i]'s keys and values at positions
    copy_from[i] .. filled - 1, for all layers at once.

    Each (layer, position, row) is one contiguous block of heads x d values in the position-major
    buffers, so the copy is one gather and one scatter of blocks per buffer, whatever the rows and
    positions. The gather reads every block before the scatter writes any, so rows that swap read
    their old values. The copy's size is read from the device unless `copied` gives it.
    """
    lengths = (filled - copy_from).clamp(min=0)
    if copied is None:
        rows = lengths.nonzero().squeeze(1)  # the rows that copy anything
        lengths = lengths.index_select(0, rows)
        total = int(lengths.sum()) if rows.numel() else 0
    else:  # every row: the ones with nothing to copy add no blocks
        rows, total = torch.arange(lengths.shape[0], device=lengths.device), copied
    if total == 0:
        return
    targets = rows.repeat_interleave(lengths, output_size=total)
    origins = index.index_select(0, rows).repeat_interleave(lengths, output_size=total)
    # The positions copy_from[i], copy_from[i] + 1, ... of each row, as one flat run.
    offsets = torch.arange(total, device=index.device) - (lengths.cumsum(0) - lengths).repeat_interleave(
        lengths, output_size=total)
    positions = copy_from.index_select(0, rows).repeat_interleave(lengths, output_size=total) + offsets
    layers, max_len, capacity = cache.key_buffer.shape[:3]
    base = (torch.arange(layers, device=index.device)[:, None] * max_len + positions) * capacity  # (layers, n)
    to, of = (base + targets).reshape(-1), (base + origins).reshape(-1)
    for buffer in (cache.key_buffer, cache.value_buffer):
        blocks = buffer.view(layers * max_len * capacity, -1)  # the buffers are contiguous (init_cache)
        blocks.index_copy_(0, to, blocks.index_select(0, of))


class Transformer(nn.Module):
    """The encoder-decoder of Figure 1, with one embedding matrix for source, target and output (Section 3.4)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Section 3.4: this one matrix embeds source tokens, embeds target tokens, and (transposed) is the
        # pre-softmax linear layer; `project` uses it directly, with no bias and no separate parameter.
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.embedding_scale = math.sqrt(config.d_model)  # Section 3.4: embeddings times sqrt(d_model)
        self.positional = PositionalEncoding(config)
        self.embedding_dropout = nn.Dropout(config.dropout)  # on embedding + position sums, Section 5.4
        self.encoder = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_layers))
        self.decoder = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layers))
        self._init_weights()
        self.packed_weights = PackedWeights()  # for inference on the CPU; not part of the state dict

    def _init_weights(self) -> None:
        # The paper gives no initialisation; these are tensor2tensor's and fairseq's choices.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        # Std d_model^-0.5: after the sqrt(d_model) scale the inputs have unit variance, and the tied
        # pre-softmax layer starts with small logits (t2t and fairseq, for the shared, scaled embedding).
        nn.init.normal_(self.embedding.weight, mean=0.0, std=self.config.d_model**-0.5)
        with torch.no_grad():
            self.embedding.weight[self.config.pad_id].zero_()
        if self.config.positional == "learned":
            nn.init.normal_(self.positional.learned.weight, mean=0.0, std=self.config.d_model**-0.5)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher forcing: src (batch, src_len), tgt_in (batch, tgt_len) -> logits (batch, tgt_len, vocab)."""
        memory, src_pad = self.encode(src)
        return self.project(self.decode(tgt_in, memory, src_pad))

    def embed(self, tokens: Tensor, offset: int = 0) -> Tensor:
        """(batch, len) token ids at positions offset.. -> (batch, len, d_model) stack inputs."""
        scaled = self.embedding(tokens) * self.embedding_scale
        return self.embedding_dropout(self.positional(scaled, offset))

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (batch, src_len) -> memory (batch, src_len, d_model) and src_pad (batch, src_len), True at pad."""
        src_pad = src.eq(self.config.pad_id)
        src_mask = key_padding_mask(src_pad)
        x = self.embed(src)
        # Without gradients in eval mode (decoding, validation) on the CPU the linear maps use packed weights.
        inference = not torch.is_grad_enabled() and not self.training and packs_for_onednn(self.embedding.weight)
        for index, layer in enumerate(self.encoder):
            linears = StepLinears.of(layer, f"encoder.{index}", self.packed_weights) if inference else None
            x = layer(x, src_mask, linears)
        return x, src_pad

    def decode(self, tgt_in: Tensor, memory: Tensor, src_pad: Tensor) -> Tensor:
        """tgt_in (batch, tgt_len) -> hidden (batch, tgt_len, d_model); `project` turns it into logits."""
        src_mask = key_padding_mask(src_pad)
        x = self.embed(tgt_in)
        for layer in self.decoder:
            x = layer(x, memory, src_mask)
        return x

    def project(self, hidden: Tensor) -> Tensor:
        """(..., d_model) -> logits (..., vocab): the pre-softmax layer is the shared embedding, no bias."""
        return F.linear(hidden, self.embedding.weight)

    def init_cache(
        self, memory: Tensor, src_pad: Tensor, max_len: int, group: int = 1, capacity: int = 0,
        scratch: ScratchBuffers | None = None,
    ) -> DecoderCache:
        """Start incremental decoding of at most max_len target positions, with `group` decoder rows per
        source sentence (beam search: the beam size; the rows of source i are i * group .. i * group + group - 1).

        The encoder-decoder keys and values are computed once here, once per source; the self-attention
        buffers are allocated once, for max(capacity, rows) rows (in `scratch`'s memory if given), and
        written in place by `decode_step`, so a step costs no concatenation. Call it and `decode_step`
        under the same autocast setting: the cache keeps the dtype of this call.
        """
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise ValueError(f"group = {group!r} must be a whole number of at least 1")
        keys, values = zip(*(layer.cross_attention.keys_values(memory) for layer in self.decoder))
        if memory.device.type == "cpu":
            # (layers, sources, heads, src_len, d_head), stored d_head-major: the CPU step multiplies
            # queries by the transposed keys, which are then contiguous (`_few_query_attention`).
            memory_keys = torch.stack([layer_keys.transpose(-1, -2) for layer_keys in keys]).transpose(-1, -2)
        else:
            memory_keys = torch.stack(keys)  # (layers, sources, heads, src_len, d_head), for SDPA
        memory_values = torch.stack(values)  # (layers, sources, heads, src_len, d_value)
        layers, sources, heads = memory_keys.shape[:3]
        rows = sources * group
        # Not zeroed: a step reads only the positions written before it (1.7% of a CPU search was
        # zeroing 2 x 47 MB per batch at bench/decode_cpu.py's sizes).
        shapes = {
            "keys": (layers, max_len, max(rows, capacity), heads, self.config.head_dim),
            "values": (layers, max_len, max(rows, capacity), heads, self.config.value_dim),
        }
        scratch = ScratchBuffers() if scratch is None else scratch  # a fresh one: newly allocated memory
        key_buffer, value_buffer = (scratch.take(name, shape, memory_keys) for name, shape in shapes.items())
        return DecoderCache(
            memory_keys=memory_keys,
            memory_values=memory_values,
            key_buffer=key_buffer,
            value_buffer=value_buffer,
            rows=rows,
            src_pad=src_pad,
            group=group,
            linears=[StepLinears.of(layer, f"decoder.{index}", self.packed_weights)
                     for index, layer in enumerate(self.decoder)],
            project=self.packed_weights.linear("project", [self.embedding]),
        )

    def decode_step(self, tokens: Tensor, position: int, cache: DecoderCache) -> Tensor:
        """Feed the tokens (rows,) at target position `position` and return logits (rows, vocab), not log-probs.

        Positions must be fed in order 0, 1, ...; the result equals `project(decode(...))[:, position]`
        for each row's source. Meant for inference (under torch.no_grad or inference_mode): it writes
        into the cache in place.
        """
        if not 0 <= position < cache.max_len:
            raise ValueError(f"position {position} is outside the cache of max_len {cache.max_len}")
        if tokens.shape[0] != cache.rows:
            raise ValueError(f"{tokens.shape[0]} tokens for a cache of {cache.rows} rows")
        x = self.embed(tokens[:, None], offset=position)  # (rows, 1, d_model)
        if cache.src_pad.device.type == "cpu":  # (sources, 1, 1, src_len)
            src_mask = key_padding_bias(cache.src_pad, cache.memory_keys.dtype)
        else:
            src_mask = key_padding_mask(cache.src_pad)
        for layer_index, layer in enumerate(self.decoder):
            x = layer.step(x, layer_index, position, cache, src_mask)
        return cache.project(x[:, 0])

    def reorder_cache(
        self, cache: DecoderCache, index: Tensor, sources: Tensor | None = None, filled: int | None = None,
        group: int | None = None, copy_from: Tensor | None = None, copied: int | None = None,
    ) -> DecoderCache:
        """Keep decoder rows `index` (beam search: the hypotheses that survive), in that order.

        With group = 1 the sources follow their rows (`index` may repeat rows, to grow a batch into
        beams). With group > 1 rows move among the rows of their source unless `sources` says which
        sources are kept (new source j is old source sources[j]; row i of the new cache must then
        belong to new source i // group). A `group` other than the cache's regroups it: the sources
        stay (or are `sources`), and the new rows, `group` per source, are the old rows `index`;
        beam search decodes its first step with one row per sentence and then grows it into beams.

        Only positions below `filled` (default: all) are copied. `copy_from` (rows,) gives, for each
        new row i, the first position to copy from old row index[i]: the positions before it must
        already hold the same keys and values in row i (beam search: hypotheses of one sentence that
        share their first tokens share the keys and values of those positions). By default a row that
        stays where it is copies nothing and any other row copies all. `copied`, when the caller knows
        it, is the number of (row, position) pairs that copy, the sum of (filled - copy_from) over the
        rows where that is positive: given it, the copy reads nothing from the device (a
        synchronisation on a GPU). Updates `cache` in place and returns it.
        """
        filled = cache.max_len if filled is None else filled
        if group is not None and group != cache.group:
            kept = cache.memory_keys.shape[1] if sources is None else sources.shape[0]
            if index.shape[0] != kept * group:
                raise ValueError(f"{index.shape[0]} rows for {kept} sources of {group} rows each")
            cache.group = group
        elif cache.group == 1:
            sources = index
        if sources is not None:
            # Kept in its memory layout (d_head-major on the CPU, see init_cache).
            transposed = cache.memory_keys.stride(-1) != 1
            keys = cache.memory_keys.transpose(-1, -2) if transposed else cache.memory_keys
            keys = keys.index_select(1, sources)
            cache.memory_keys = keys.transpose(-1, -2) if transposed else keys
            cache.memory_values = cache.memory_values.index_select(1, sources)
            cache.src_pad = cache.src_pad.index_select(0, sources)
        rows = index.shape[0]
        if rows > cache.key_buffer.shape[2]:  # past the capacity: larger buffers, positions >= filled unwritten
            for name in ("key_buffer", "value_buffer"):
                old = getattr(cache, name)
                new = old.new_empty(old.shape[0], old.shape[1], rows, *old.shape[3:])
                new[:, :filled] = old[:, :filled, : cache.rows].index_select(2, index)
                setattr(cache, name, new)
        else:
            if copy_from is None:
                copy_from = torch.where(index.eq(torch.arange(rows, device=index.device)), filled, 0)
            _copy_cache_rows(cache, index, copy_from, filled, copied)
        cache.rows = rows
        return cache

    def num_parameters(self) -> int:
        """Distinct parameters; the shared embedding counts once (it is one Parameter)."""
        return sum(parameter.numel() for parameter in self.parameters())
