"""The decoder's cache for incremental decoding, which owns its reordering (beam search calls ``reorder``
once a step).

For speed only: the encoder-decoder keys and values are kept once per source sentence; the decoder's
self-attention keys and values are written one position per step into buffers allocated once, which also
keep the tokens fed, so that a reorder copies only the positions where a row's new history differs.
``aiayn.speed.incremental`` fills it; tests/speed/test_incremental.py holds it to the model's full decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from aiayn.speed.packed import StepLinears


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
    # tokens up to a position hold the same keys and values there (``copy_starts``).
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

    def reorder(
        self, index: Tensor, sources: Tensor | None = None, starts: Tensor | None = None, copied: int | None = None,
    ) -> DecoderCache:
        """Keep decoder rows `index` (beam search: the hypotheses that survive), in that order.

        Without `sources`, the sources stay and rows move among the rows of their source; a cache of
        one row per source (group 1) lets the sources follow their rows instead (`index` may repeat
        rows, to grow a batch into beams). With `sources`, new source j is old source sources[j], and
        each keeps len(index) // len(sources) rows, new row i belonging to new source i // that
        group; beam search decodes its first step with one row per sentence and so grows it into beams.

        Only the positions fed so far are copied, and of a row only those from ``copy_starts`` on (the
        positions before it already hold the same keys and values). A caller that has computed them
        passes `starts`, and `copied`, the number of (row, position) blocks they copy: given it, the
        copy reads nothing from the device (a synchronisation on a GPU). Updates the cache in place
        and returns it.
        """
        filled, rows = self.filled, index.shape[0]
        if sources is not None and (rows < sources.shape[0] or rows % sources.shape[0]):
            raise ValueError(f"{rows} rows do not divide among {sources.shape[0]} sources")
        if starts is None:
            starts = self.copy_starts(index, sources)
        if sources is not None:
            self.group = rows // sources.shape[0]
        elif self.group == 1:
            sources = index
        if sources is not None:
            # Kept in its memory layout (d_head-major on the CPU, see InferenceModel.init_cache).
            transposed = self.memory_keys.stride(-1) != 1
            keys = self.memory_keys.transpose(-1, -2) if transposed else self.memory_keys
            keys = keys.index_select(1, sources)
            self.memory_keys = keys.transpose(-1, -2) if transposed else keys
            self.memory_values = self.memory_values.index_select(1, sources)
            self.src_pad = self.src_pad.index_select(0, sources)
        fed = self.fed[:filled, : self.rows].index_select(1, index)
        if rows > self.key_buffer.shape[2]:  # past the capacity: larger buffers, positions >= filled unwritten
            for name in ("key_buffer", "value_buffer"):
                old = getattr(self, name)
                new = old.new_empty(old.shape[0], old.shape[1], rows, *old.shape[3:])
                new[:, :filled] = old[:, :filled, : self.rows].index_select(2, index)
                setattr(self, name, new)
            self.fed = self.fed.new_empty((self.max_len, rows))
        else:
            _copy_rows(self, index, starts, filled, copied)
        self.fed[:filled, :rows] = fed
        self.rows = rows
        return self

    def copy_starts(self, index: Tensor, sources: Tensor | None = None) -> Tensor:
        """(new rows,) the first position that ``reorder(index, sources)`` copies into row i from old row
        index[i]; the positions before it need no copy, because old row i belongs to the same source and
        was fed the same tokens there (beam search: hypotheses of one sentence that share their first
        tokens share the keys and values of those positions). A row that stays copies nothing; a row past
        the old rows, or of another source, copies all."""
        filled, old_rows, rows = self.filled, self.rows, index.shape[0]
        if filled == 0:
            return torch.zeros_like(index)
        both = min(rows, old_rows)
        differs = self.fed[:filled, :both].ne(self.fed[:filled, :old_rows].index_select(1, index[:both]))
        first = torch.where(differs.any(dim=0), differs.int().argmax(dim=0), filled)  # (both,)
        row = torch.arange(both, device=index.device)
        if sources is not None:  # new row i belongs to old source sources[i // group]
            same_source = sources[row // (rows // sources.shape[0])].eq(row // self.group)
        elif self.group == 1:  # the sources follow their rows
            same_source = index[:both].eq(row)
        else:
            same_source = torch.ones_like(row, dtype=torch.bool)
        first = torch.where(same_source, first, 0)
        return torch.cat([first, first.new_zeros(rows - both)])


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


def _copy_rows(
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
