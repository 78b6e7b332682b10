"""A trained Transformer prepared for beam search: a cached one-token decoder step and a fast encoder.

For speed only; ``aiayn.model`` is the paper and the reference these equal (tests/speed/test_incremental.py).
``InferenceModel`` wraps a model and offers what ``aiayn.search`` drives: ``encode``, ``init_cache`` and
``decode_step``; the cache it returns (``aiayn.speed.decoder_cache.DecoderCache``) reorders itself. Each
layer runs the model's own layer code (``EncoderLayer.forward``, ``DecoderLayer.forward``) over sub-layers
computed for inference (``InferenceEncoderLayer``, ``CachedDecoderLayer``): no dropout, linear maps packed
once for oneDNN on the CPU in float32 (``aiayn.speed.packed``), and the decoder's attention reading the cache.

The contract with the model: those stand-ins carry exactly the parts named in ``ENCODER_LAYER_PARTS`` and
``DECODER_LAYER_PARTS``. ``InferenceModel`` refuses a model whose layers have other parts, and
tests/speed/test_incremental.py fails when a layer of ``aiayn.model`` gains one, so a new part cannot be
dropped silently at decoding time.

Make one ``InferenceModel`` per loaded model and reuse it: it keeps the packed weights, which it
repacks only when the model's weights change.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.model import (DecoderLayer, EncoderLayer, ModelConfig, Transformer, key_padding_mask,
                         scaled_dot_product_attention)
from aiayn.speed.cpu_attention import key_padding_bias, matmul_attention
from aiayn.speed.decoder_cache import DecoderCache, ScratchBuffers
from aiayn.speed.packed import PackedWeights, StepLinears, packs_for_onednn

# The contract between the model's layers and this cached path: every parameter of an EncoderLayer /
# DecoderLayer, by name, that the stand-ins below carry (the linear maps through ``StepLinears``, the
# norms as they are), plus the residual dropout, which inference leaves out.
ATTENTION_PARAMETERS = tuple(f"{linear}.{kind}" for linear in ("query", "key", "value", "output")
                             for kind in ("weight", "bias"))
ENCODER_LAYER_PARTS = {
    "self_attention": ATTENTION_PARAMETERS,
    "self_attention_norm": ("weight", "bias"),
    "feed_forward": ("inner.weight", "inner.bias", "outer.weight", "outer.bias"),
    "feed_forward_norm": ("weight", "bias"),
    "dropout": (),
}
DECODER_LAYER_PARTS = {
    **ENCODER_LAYER_PARTS,
    "cross_attention": ATTENTION_PARAMETERS,
    "cross_attention_norm": ("weight", "bias"),
}


def layer_parts(layer: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """A layer's parts as the contract names them: each child module and its parameters' names."""
    parts = {name: tuple(parameter for parameter, _ in child.named_parameters())
             for name, child in layer.named_children()}
    own = tuple(name for name, _ in layer.named_parameters(recurse=False))
    return {**parts, **({"": own} if own else {})}


def check_contract(model: Transformer) -> None:
    """Refuses a model whose layers have parts the cached path does not carry (or lack parts it uses)."""
    for layers, declared in ((model.encoder, ENCODER_LAYER_PARTS), (model.decoder, DECODER_LAYER_PARTS)):
        for layer in layers:
            found = layer_parts(layer)
            if found != declared:
                raise TypeError(
                    f"{type(layer).__name__} has parts {sorted(found.items())}, but aiayn.speed.incremental carries "
                    f"{sorted(declared.items())}: teach the cached path the change (and update the declaration)"
                )


class InferenceModel:
    """A Transformer for inference, with its packed weights (not part of the model's state dict)."""

    def __init__(self, model: Transformer) -> None:
        check_contract(model)
        self.model = model
        self.packed = PackedWeights()

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """``Transformer.encode``; without gradients in eval mode on the CPU with packed weights."""
        model = self.model
        if torch.is_grad_enabled() or model.training or not packs_for_onednn(model.embedding.weight):
            return model.encode(src)
        src_pad = src.eq(model.config.pad_id)
        src_mask = key_padding_mask(src_pad)
        x = model.embed(src)
        for index, layer in enumerate(model.encoder):
            packed = InferenceEncoderLayer(layer, StepLinears.of(layer, f"encoder.{index}", self.packed))
            x = EncoderLayer.forward(packed, x, src_mask)
        return x, src_pad

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
        model = self.model
        keys, values = zip(*(layer.cross_attention.keys_values(memory) for layer in model.decoder))
        if memory.device.type == "cpu":
            # (layers, sources, heads, src_len, d_head), stored d_head-major: the CPU step multiplies
            # queries by the transposed keys, which are then contiguous (`matmul_attention`).
            memory_keys = torch.stack([layer_keys.transpose(-1, -2) for layer_keys in keys]).transpose(-1, -2)
        else:
            memory_keys = torch.stack(keys)  # (layers, sources, heads, src_len, d_head), for SDPA
        memory_values = torch.stack(values)  # (layers, sources, heads, src_len, d_value)
        layers, sources, heads = memory_keys.shape[:3]
        rows = sources * group
        # Not zeroed: a step reads only the positions written before it, and zeroing costs a pass
        # over buffers of tens of megabytes per batch.
        shapes = {
            "keys": (layers, max_len, max(rows, capacity), heads, model.config.head_dim),
            "values": (layers, max_len, max(rows, capacity), heads, model.config.value_dim),
        }
        scratch = ScratchBuffers() if scratch is None else scratch  # a fresh one: newly allocated memory
        key_buffer, value_buffer = (scratch.take(name, shape, memory_keys) for name, shape in shapes.items())
        return DecoderCache(
            memory_keys=memory_keys,
            memory_values=memory_values,
            key_buffer=key_buffer,
            value_buffer=value_buffer,
            fed=src_pad.new_empty((max_len, max(rows, capacity)), dtype=torch.long),
            rows=rows,
            src_pad=src_pad,
            group=group,
            linears=[StepLinears.of(layer, f"decoder.{index}", self.packed)
                     for index, layer in enumerate(model.decoder)],
            project=self.packed.linear("project", [model.embedding]),
        )

    def decode_step(self, tokens: Tensor, position: int, cache: DecoderCache) -> Tensor:
        """Feed the tokens (rows,) at target position `position` and return logits (rows, vocab), not log-probs.

        Positions must be fed in order 0, 1, ...; the result equals `project(decode(...))[:, position]`
        of the model for each row's source. Meant for inference (under torch.no_grad or
        inference_mode): it writes into the cache in place.
        """
        if not 0 <= position < cache.max_len:
            raise ValueError(f"position {position} is outside the cache of max_len {cache.max_len}")
        if tokens.shape[0] != cache.rows:
            raise ValueError(f"{tokens.shape[0]} tokens for a cache of {cache.rows} rows")
        x = self.model.embed(tokens[:, None], offset=position)  # (rows, 1, d_model)
        if cache.src_pad.device.type == "cpu":  # (sources, 1, 1, src_len)
            src_mask = key_padding_bias(cache.src_pad, cache.memory_keys.dtype)
        else:
            src_mask = key_padding_mask(cache.src_pad)
        for index, layer in enumerate(self.model.decoder):
            x = DecoderLayer.forward(CachedDecoderLayer(layer, cache, index, position), x, None, src_mask)
        cache.fed[position, : cache.rows] = tokens
        cache.filled = position + 1
        return cache.project(x[:, 0])


class RowCounting(InferenceModel):
    """An InferenceModel that counts the decoder steps it runs and the rows (sentences x beams) they
    decode: the work a stopping rule saves, for the tests of the search and bench.decode.ct2."""

    steps = 0
    rows = 0

    def decode_step(self, tokens: Tensor, position: int, cache: DecoderCache) -> Tensor:
        self.steps += 1
        self.rows += tokens.shape[0]
        return super().decode_step(tokens, position, cache)


class InferenceEncoderLayer:
    """An encoder layer's sub-layers as inference computes them, under the names of the model's layer,
    for the model's own ``EncoderLayer.forward``: no dropout, the linear maps packed."""

    def __init__(self, layer: EncoderLayer | DecoderLayer, linears: StepLinears) -> None:
        self.layer, self.linears = layer, linears
        self.self_attention_norm = layer.self_attention_norm
        self.feed_forward_norm = layer.feed_forward_norm
        self.dropout = _no_dropout

    def self_attention(self, x: Tensor, source: Tensor, key_mask: Tensor | None = None,
                       causal: bool = False) -> Tensor:
        """``MultiHeadAttention.forward`` for self-attention, Q, K and V in one packed product."""
        attention = self.layer.self_attention
        queries, keys, values = attention.split_self_projections(self.linears.self_qkv(x))
        heads = scaled_dot_product_attention(queries, keys, values, key_mask, causal)
        return self.linears.self_output(attention.merge_heads(heads))

    def feed_forward(self, x: Tensor) -> Tensor:
        """Eq. 2, the ReLU fused into the first product."""
        return self.linears.feed_forward_outer(self.linears.feed_forward_inner(x))


class CachedDecoderLayer(InferenceEncoderLayer):
    """A decoder layer's sub-layers for one position, x: (rows, 1, d_model), attending to the cache of
    earlier positions, for the model's own ``DecoderLayer.forward``.

    rows = sources * cache.group: the `group` rows of one source (the beams of a sentence) share
    that source's encoder-decoder keys and values, so their queries attend to them together.
    """

    def __init__(self, layer: DecoderLayer, cache: DecoderCache, index: int, position: int) -> None:
        super().__init__(layer, cache.linears[index])
        self.cross_attention_norm = layer.cross_attention_norm
        self.cache, self.index, self.position = cache, index, position

    def self_attention(self, x: Tensor, source: Tensor, key_mask: Tensor | None = None,
                       causal: bool = False) -> Tensor:
        """Adds this position's key and value to the cache; its one query attends to the positions so
        far, which is what the causal mask leaves it."""
        attention, cache, index = self.layer.self_attention, self.cache, self.index
        queries, key, value = attention.split_self_projections(self.linears.self_qkv(x))
        # The cache keeps the dtype init_cache gave it (bf16 under autocast).
        cache.key_buffer[index, self.position, : cache.rows] = key[:, :, 0]  # (rows, heads, d_head)
        cache.value_buffer[index, self.position, : cache.rows] = value[:, :, 0]
        keys, values = cache.layer_keys_values(index, self.position + 1)  # (rows, heads, position + 1, d)
        heads = _step_attention(queries.to(keys.dtype), keys, values, None)
        return self.linears.self_output(attention.merge_heads(heads))

    def cross_attention(self, x: Tensor, memory: Tensor | None, key_mask: Tensor) -> Tensor:
        """Attends to the encoder-decoder keys and values computed once by init_cache (`memory` unused)."""
        attention, cache = self.layer.cross_attention, self.cache
        memory_keys, memory_values = cache.memory_keys[self.index], cache.memory_values[self.index]
        # (rows, 1, d) -> (sources, group, d): a source's rows are its queries, so the encoder-decoder
        # keys and values are read once per source, not copied to every beam.
        grouped = x.view(memory_keys.shape[0], cache.group, -1)
        queries = attention.split_heads(self.linears.cross_query(grouped), attention.head_dim)
        heads = _step_attention(queries.to(memory_keys.dtype), memory_keys, memory_values, key_mask)
        return self.linears.cross_output(attention.merge_heads(heads)).view_as(x)


def _no_dropout(x: Tensor) -> Tensor:
    return x


def _step_attention(queries: Tensor, keys: Tensor, values: Tensor, key_mask: Tensor | None) -> Tensor:
    """Eq. 1 for the decoder step: two matrix multiplies on the CPU (faster there for a few queries),
    the model's SDPA elsewhere."""
    if queries.device.type == "cpu":
        return matmul_attention(queries, keys, values, key_mask)
    return scaled_dot_product_attention(queries, keys, values, key_mask)
