"""A trained Transformer prepared for beam search: a cached one-token decoder step and a fast encoder.

For speed only; ``aiayn.model`` is the paper and the reference these equal (tests/test_incremental.py).
``InferenceModel`` wraps a model and offers what ``aiayn.search`` drives: ``encode``, ``init_cache``,
``decode_step`` and ``reorder_cache``. The encoder-decoder keys and values are computed once per
sentence; the decoder's self-attention keys and values are written one position per step into
buffers allocated once (``DecoderCache``). On the CPU in float32 the linear maps use weights packed
once for oneDNN (``aiayn.speed.packed``), and attention over a few queries is two matrix multiplies.

Make one ``InferenceModel`` per loaded model and reuse it: it keeps the packed weights, which it
repacks only when the model's weights change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.model import DecoderLayer, EncoderLayer, ModelConfig, MultiHeadAttention, Transformer, key_padding_mask
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
            x = _encoder_layer(layer, x, src_mask, StepLinears.of(layer, f"encoder.{index}", self.packed))
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
            # queries by the transposed keys, which are then contiguous (`_few_query_attention`).
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
        for layer_index, layer in enumerate(self.model.decoder):
            x = _decoder_layer_step(layer, x, layer_index, position, cache, src_mask)
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


def _encoder_layer(layer: EncoderLayer, x: Tensor, src_mask: Tensor, linears: StepLinears) -> Tensor:
    """``EncoderLayer.forward`` in eval mode (no dropout) with the packed maps, in the same order; the
    feed-forward's residual sum is fused into its second map."""
    attention = layer.self_attention
    queries, keys, values = attention.split_self_projections(linears.self_qkv(x))
    heads = F.scaled_dot_product_attention(queries, keys, values, attn_mask=src_mask)
    x = layer.self_attention_norm(x + linears.self_output(attention.merge_heads(heads)))
    return layer.feed_forward_norm(linears.feed_forward_outer(linears.feed_forward_inner(x), x))


def _decoder_layer_step(
    layer: DecoderLayer, x: Tensor, index: int, position: int, cache: DecoderCache, src_mask: Tensor,
) -> Tensor:
    """``DecoderLayer.forward`` for one target position, x: (rows, 1, d_model), attending to the cache
    of earlier positions.

    rows = sources * cache.group: the `group` rows of one source (the beams of a sentence) share
    that source's encoder-decoder keys and values, so their queries attend to them together.
    No dropout, and each residual sum is fused into the linear map before it.
    """
    attention = layer.self_attention
    linears = cache.linears[index]
    queries, key, value = attention.split_self_projections(linears.self_qkv(x))
    # The cache keeps the dtype init_cache gave it (bf16 under autocast).
    cache.key_buffer[index, position, : cache.rows] = key[:, :, 0]  # (rows, heads, d_head)
    cache.value_buffer[index, position, : cache.rows] = value[:, :, 0]
    keys, values = cache.layer_keys_values(index, position + 1)  # (rows, heads, position + 1, d)
    # One query over the positions so far: no causal mask is needed.
    x = layer.self_attention_norm(
        _attend(attention, queries.to(keys.dtype), keys, values, None, linears.self_output, x))

    attention = layer.cross_attention
    memory_keys, memory_values = cache.memory_keys[index], cache.memory_values[index]
    # (rows, 1, d) -> (sources, group, d): a source's rows are its queries, so the encoder-decoder
    # keys and values are read once per source, not copied to every beam.
    grouped = x.view(memory_keys.shape[0], cache.group, -1)
    queries = attention.split_heads(linears.cross_query(grouped), attention.head_dim)
    x = layer.cross_attention_norm(_attend(
        attention, queries.to(memory_keys.dtype), memory_keys, memory_values, src_mask, linears.cross_output, grouped,
    ).view_as(x))
    return layer.feed_forward_norm(linears.feed_forward_outer(linears.feed_forward_inner(x), x))


def _attend(
    attention: MultiHeadAttention, queries: Tensor, keys: Tensor, values: Tensor, key_mask: Tensor | None,
    output: Callable[..., Tensor], residual: Tensor,
) -> Tensor:
    """Eq. 1 for the decoder step, then W^O with the residual sum fused: output(Concat(heads), residual)."""
    if queries.device.type == "cpu":
        heads = _few_query_attention(queries, keys, values, key_mask)
    else:
        heads = F.scaled_dot_product_attention(queries, keys, values, attn_mask=key_mask)
    return output(attention.merge_heads(heads), residual)


def _few_query_attention(queries: Tensor, keys: Tensor, values: Tensor, key_mask: Tensor | None) -> Tensor:
    """Eq. 1 as two matrix multiplies and a softmax, for the cached decoder step on the CPU (no causal mask).

    With one to a few queries a row, SDPA's CPU kernel (flash attention, blocked for long queries) is
    slower than this, and slower with 2 threads than with 1 (BENCHMARKS.md). Training and CUDA keep SDPA.

    A floating key_mask is an additive bias (0 or -inf, `key_padding_bias`): the scale and the mask then
    go into the query-key product itself (baddbmm), with no pass over the scores. The cached step
    uses it for the encoder-decoder attention, whose keys init_cache stores transposed, so the
    product reads them in place.
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
        # with a plain loop, and products and sums are faster.
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
