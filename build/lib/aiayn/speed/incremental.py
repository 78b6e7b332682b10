"""A trained Transformer prepared for beam search: a cached one-token decoder step and a fast encoder.

For speed only; ``aiayn.model`` is the paper and the reference these equal (tests/speed/test_incremental.py).
``InferenceModel`` wraps a model and offers what ``aiayn.search`` drives: ``encode``, ``init_cache``,
``decode_step``, ``reorder_cache`` and ``copy_lengths``. Each layer runs the model's own layer code
(``EncoderLayer.forward``, ``DecoderLayer.forward``) over sub-layers computed for inference
(``InferenceEncoderLayer``, ``CachedDecoderLayer``): no dropout, linear maps packed once for oneDNN on
the CPU in float32 (``aiayn.speed.packed``), and the decoder's attention reading a cache. The
encoder-decoder keys and values are computed once per sentence; the decoder's self-attention keys and
values are written one position per step into buffers allocated once (``DecoderCache``), which also
keep the tokens fed, so that a reorder copies only the positions where a row's new history differs.

Make one ``InferenceModel`` per loaded model and reuse it: it keeps the packed weights, which it
repacks only when the model's weights change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from aiayn.model import (DecoderLayer, EncoderLayer, ModelConfig, Transformer, key_padding_mask,
                         scaled_dot_product_attention)
from aiayn.speed.cpu_attention import key_padding_bias, matmul_attention
from aiayn.speed.packed import PackedWeights, StepLinears, packs_for_onednn


class InferenceModel:
    """A Transformer for inference, with its packed weights (not part of the model's state dict)."""

    def __init__(self, model: Transformer) -> None:
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

    def reorder_cache(
        self, cache: DecoderCache, index: Tensor, sources: Tensor | None = None, copied: int | None = None,
    ) -> DecoderCache:
        """Keep decoder rows `index` (beam search: the hypotheses that survive), in that order.

        Without `sources`, the sources stay and rows move among the rows of their source; a cache of
        one row per source (group 1) lets the sources follow their rows instead (`index` may repeat
        rows, to grow a batch into beams). With `sources`, new source j is old source sources[j], and
        each keeps len(index) // len(sources) rows, new row i belonging to new source i // that
        group; beam search decodes its first step with one row per sentence and so grows it into beams.

        Only the positions fed so far are copied, and of a row only those from ``copy_starts`` on (the
        positions before it already hold the same keys and values). `copied`, when the caller knows it,
        is the sum of ``copy_lengths``: given it, the copy reads nothing from the device (a
        synchronisation on a GPU). Updates `cache` in place and returns it.
        """
        filled, rows = cache.filled, index.shape[0]
        if sources is not None and (rows < sources.shape[0] or rows % sources.shape[0]):
            raise ValueError(f"{rows} rows do not divide among {sources.shape[0]} sources")
        starts = self.copy_starts(cache, index, sources)
        if sources is not None:
            cache.group = rows // sources.shape[0]
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
        fed = cache.fed[:filled, : cache.rows].index_select(1, index)
        if rows > cache.key_buffer.shape[2]:  # past the capacity: larger buffers, positions >= filled unwritten
            for name in ("key_buffer", "value_buffer"):
                old = getattr(cache, name)
                new = old.new_empty(old.shape[0], old.shape[1], rows, *old.shape[3:])
                new[:, :filled] = old[:, :filled, : cache.rows].index_select(2, index)
                setattr(cache, name, new)
            cache.fed = cache.fed.new_empty((cache.max_len, rows))
        else:
            _copy_cache_rows(cache, index, starts, filled, copied)
        cache.fed[:filled, :rows] = fed
        cache.rows = rows
        return cache

    def copy_starts(self, cache: DecoderCache, index: Tensor, sources: Tensor | None = None) -> Tensor:
        """(new rows,) the first position that ``reorder_cache(cache, index, sources)`` copies into row i
        from old row index[i]; the positions before it need no copy, because old row i belongs to the
        same source and was fed the same tokens there (beam search: hypotheses of one sentence that
        share their first tokens share the keys and values of those positions). A row that stays copies
        nothing; a row past the old rows, or of another source, copies all."""
        filled, old_rows, rows = cache.filled, cache.rows, index.shape[0]
        if filled == 0:
            return torch.zeros_like(index)
        both = min(rows, old_rows)
        differs = cache.fed[:filled, :both].ne(cache.fed[:filled, :old_rows].index_select(1, index[:both]))
        first = torch.where(differs.any(dim=0), differs.int().argmax(dim=0), filled)  # (both,)
        row = torch.arange(both, device=index.device)
        if sources is not None:  # new row i belongs to old source sources[i // group]
            same_source = sources[row // (rows // sources.shape[0])].eq(row // cache.group)
        elif cache.group == 1:  # the sources follow their rows
            same_source = index[:both].eq(row)
        else:
            same_source = torch.ones_like(row, dtype=torch.bool)
        first = torch.where(same_source, first, 0)
        return torch.cat([first, first.new_zeros(rows - both)])

    def copy_lengths(self, cache: DecoderCache, index: Tensor, sources: Tensor | None = None) -> Tensor:
        """(new rows,) how many positions ``reorder_cache(cache, index, sources)`` copies into each new row:
        a caller that must not read the device adds up those of the rows it keeps and passes it as `copied`."""
        return (cache.filled - self.copy_starts(cache, index, sources)).clamp(min=0)


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
    # (max_len, capacity) the token fed at each position of each row: rows of one source fed the same
    # tokens up to a position hold the same keys and values there (``InferenceModel.copy_starts``).
    fed: Tensor
    rows: int  # decoder rows in use
    src_pad: Tensor  # (sources, src_len), True at pad
    # Per decoder layer, its linear maps prepared once for the step (Q, K and V in one matrix multiply).
    linears: list[StepLinears]
    # The pre-softmax layer (the shared embedding, transposed) prepared the same way.
    project: Callable[[Tensor], Tensor]
    group: int = 1  # decoder rows per source
    filled: int = 0  # the positions fed so far

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


class ScratchBuffers:
    """Memory that one thread's successive searches reuse for their self-attention caches.

    A fresh cache is tens of megabytes that the operating system maps and zeroes page by page as
    the first steps write it; reusing the last search's memory skips that. One search at a time may use it.
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
