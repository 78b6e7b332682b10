"""Length-bucketed token batches (docs/PAPER.md, Batching: "batched together by approximate sequence length").

Sentences are sorted by length with a seeded random tie-break, cut into batches whose
*padded* size stays under a token budget on both sides, and the batches are shuffled.
Every process computes the same list from (seed, epoch), so resuming and multi-GPU
sharding need nothing but a cursor into it. Decoding batches by length too, longest first
(``length_sorted_batches``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from aiayn.errors import UserError
from aiayn.tokens import BOS_ID, EOS_ID, PAD_ID


def length_batches(
    src_lengths: np.ndarray,
    tgt_lengths: np.ndarray,
    max_tokens: int,
    seed: int | None = None,
    epoch: int = 0,
) -> list[np.ndarray]:
    """Indices of sentence pairs, grouped so that ``rows * longest`` <= ``max_tokens`` on each side.

    Lengths here are BPE ids without bos/eos; each side gets one more token in the batch
    (eos on the source, bos/eos on the shifted target), which the budget includes. With a
    ``seed`` the order within equal lengths and the order of batches are shuffled; without
    one the batches come in length order (evaluation).
    """
    src_cost = np.asarray(src_lengths, dtype=np.int64) + 1
    tgt_cost = np.asarray(tgt_lengths, dtype=np.int64) + 1
    if len(src_cost) == 0:
        return []
    rng = np.random.default_rng([seed, epoch]) if seed is not None else None
    tie_break = rng.random(len(src_cost)) if rng is not None else np.arange(len(src_cost))
    longest = np.maximum(src_cost, tgt_cost)
    # by the longer side first, so that it never shrinks within a run; then target, source length
    order = np.lexsort((tie_break, src_cost, tgt_cost, longest))
    longest = longest[order]
    batches: list[np.ndarray] = []
    start = 0
    n = len(order)
    # Greedy cut once per epoch over sentences (not tokens); within a batch lengths only grow,
    # so the padded size of order[start:end] is (end - start) * longest[end - 1].
    while start < n:
        # the largest end with (end - start) * longest[end - 1] <= max_tokens, found by bisection
        low, high = start + 1, n
        while low < high:
            mid = (low + high + 1) // 2
            if (mid - start) * longest[mid - 1] <= max_tokens:
                low = mid
            else:
                high = mid - 1
        batches.append(order[start:low])
        start = low
    if rng is not None:
        rng.shuffle(batches)
    return batches


@dataclass
class Batch:
    src: torch.Tensor      # (rows, src_len) ids + eos, right-padded
    tgt_in: torch.Tensor   # (rows, tgt_len) bos + ids, right-padded
    tgt_out: torch.Tensor  # (rows, tgt_len) ids + eos, right-padded
    src_tokens: int        # real (non-pad) tokens
    tgt_tokens: int
    tgt_real: torch.Tensor | None = None  # (tgt_tokens,) where tgt_out.flatten() is not pad, found on the host

    def __post_init__(self) -> None:
        if self.tgt_real is None:
            self.tgt_real = real_positions(self.tgt_out)

    @property
    def padded_tokens(self) -> int:
        return self.src.numel() + self.tgt_in.numel()

    def to(self, device) -> "Batch":
        """On ``device``; to a GPU from pinned memory, so that no copy waits for the GPU's queue."""
        device = torch.device(device)

        def moved(tensor: torch.Tensor) -> torch.Tensor:
            if device.type == "cuda" and tensor.device.type == "cpu":
                tensor = tensor.pin_memory()
            return tensor.to(device, non_blocking=True)

        return Batch(moved(self.src), moved(self.tgt_in), moved(self.tgt_out), self.src_tokens, self.tgt_tokens,
                     moved(self.tgt_real))


def real_positions(tgt_out: torch.Tensor) -> torch.Tensor:
    """The flat positions of ``tgt_out``'s non-pad tokens. Found where the batch is built (on the
    host), they let the loss skip pads without asking the GPU which tokens they are."""
    return tgt_out.reshape(-1).ne(PAD_ID).nonzero().squeeze(1)


def _pad_rows(ids: np.ndarray, offsets: np.ndarray, rows: np.ndarray, prefix: int | None, suffix: int | None) -> np.ndarray:
    """Gather ``rows`` sentences from flat ``ids`` into a right-padded matrix, adding bos/eos.

    Vectorised: one fancy-indexing gather for the whole batch, no loop over tokens.
    """
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    extra = (prefix is not None) + (suffix is not None)
    width = int(lengths.max(initial=0)) + extra
    out = np.full((len(rows), width), PAD_ID, dtype=np.int64)
    shift = 1 if prefix is not None else 0
    if prefix is not None:
        out[:, 0] = prefix
    column = np.arange(width - extra)
    inside = column[None, :] < lengths[:, None]
    source_index = starts[:, None] + column[None, :]
    out[:, shift:shift + width - extra][inside] = ids[source_index[inside]]
    if suffix is not None:
        out[np.arange(len(rows)), lengths + shift] = suffix
    return out


def collate(split, rows: np.ndarray) -> Batch:
    """Build the tensors of one batch from a binarized split (see aiayn.binarize.TokenizedSplit)."""
    rows = np.asarray(rows, dtype=np.int64)
    src = _pad_rows(split.src_ids, split.src_offsets, rows, None, EOS_ID)
    tgt_in = _pad_rows(split.tgt_ids, split.tgt_offsets, rows, BOS_ID, None)
    tgt_out = _pad_rows(split.tgt_ids, split.tgt_offsets, rows, None, EOS_ID)
    src_tokens = int((src != PAD_ID).sum())
    tgt_tokens = int((tgt_out != PAD_ID).sum())
    return Batch(torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out), src_tokens, tgt_tokens)


def padded_to_multiple(batch: Batch, multiple: int) -> Batch:
    """The batch with its rows and both lengths rounded up to multiples of ``multiple``: for
    torch.compile, few distinct shapes and none of size 1 (which it would compile a graph for)."""
    rows, src_len = batch.src.shape

    def up(size: int) -> int:
        return -(-size // multiple) * multiple

    return padded_to_shape(batch, up(rows), up(src_len), up(batch.tgt_in.shape[1]))


def padded_to_shape(batch: Batch, rows: int, src_len: int, tgt_len: int) -> Batch:
    """The batch grown to (rows, src_len) and (rows, tgt_len), each at least the batch's own size.

    Added positions are pads, masked as any other; an added row is a source of one eos (a source of
    pads alone would leave attention nothing to attend to) and a target of pads. The loss counts only
    non-pad targets, so it does not change, and nothing flows back from the added rows.
    """
    own_rows, own_src = batch.src.shape
    own_tgt = batch.tgt_in.shape[1]
    if (rows, src_len, tgt_len) == (own_rows, own_src, own_tgt):
        return batch

    def grown(ids: torch.Tensor, length: int) -> torch.Tensor:
        out = ids.new_full((rows, length), PAD_ID)
        out[:ids.shape[0], :ids.shape[1]] = ids
        return out

    src = grown(batch.src, src_len)
    src[own_rows:, 0] = EOS_ID
    return Batch(src, grown(batch.tgt_in, tgt_len), grown(batch.tgt_out, tgt_len), batch.src_tokens,
                 batch.tgt_tokens)


# --- the batch of one optimizer step ------------------------------------------------------

def step_batches(src_lengths: np.ndarray, tgt_lengths: np.ndarray, tokens_per_step: int, seed: int,
                 epoch: int = 0) -> list[np.ndarray]:
    """The sentences of each optimizer step of one epoch: the paper's "about 25000 + 25000 tokens".

    Sentences are sorted by length as in ``length_batches`` and cut greedily into the fewest
    consecutive sentences whose padded size ``rows * (longest + 1)`` reaches ``tokens_per_step``
    on *each* side (so a step is never under the budget, and over it by less than its last
    sentence's growth). An epoch's remainder below the budget joins the step before it. The
    steps come shuffled; every process computes the same list from (seed, epoch), whatever the
    number of processes, so a run can resume on another number of devices exactly.
    """
    src_cost = np.asarray(src_lengths, dtype=np.int64) + 1
    tgt_cost = np.asarray(tgt_lengths, dtype=np.int64) + 1
    n = len(src_cost)
    if n == 0:
        return []
    rng = np.random.default_rng([seed, epoch])
    # by the longer side, then target, then source; ties in a seeded random order (a shuffle, then a stable sort)
    key = (np.maximum(src_cost, tgt_cost) << 42) | (tgt_cost << 21) | src_cost
    shuffled = rng.permutation(n)
    order = shuffled[np.argsort(key[shuffled], kind="stable")]
    src_cost, tgt_cost = src_cost[order], tgt_cost[order]
    cuts = [0]
    start = 0
    window = 1024
    while start < n:
        while True:
            end = min(n, start + window)
            rows = np.arange(1, end - start + 1)
            # padded size of order[start:start + rows] on each side; non-decreasing in rows
            filled = (rows * np.maximum.accumulate(src_cost[start:end]) >= tokens_per_step) & \
                     (rows * np.maximum.accumulate(tgt_cost[start:end]) >= tokens_per_step)
            if filled.any() or end == n:
                break
            window *= 4
        rows = int(np.argmax(filled)) + 1 if filled.any() else n - start
        start += rows
        cuts.append(start)
        window = 2 * rows  # the next step is about as long: look that far first
    if len(cuts) > 2 and not _fills(src_cost[cuts[-2]:], tgt_cost[cuts[-2]:], tokens_per_step):
        del cuts[-2]  # the epoch's remainder is under the budget: it joins the step before it
    steps = [order[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    rng.shuffle(steps)
    return steps


def _fills(src_cost: np.ndarray, tgt_cost: np.ndarray, tokens: int) -> bool:
    rows = len(src_cost)
    return rows * int(src_cost.max()) >= tokens and rows * int(tgt_cost.max()) >= tokens


def micro_batches_per_step(size: int, longest: int, device_tokens: int, layout: int) -> int:
    """How many micro-batches a step of padded ``size`` is split into: a multiple of ``layout``.

    ``layout`` is the number of devices the preset is laid out for (its ``gpus``, at least 1):
    the count is the same on 1, 2, ... or ``layout`` processes, so the same micro-batches (and
    dropout masks) are drawn whatever the hardware. Each micro-batch holds at most
    ``device_tokens`` plus two sentences (``longest`` is the step's longest sentence + 1).
    """
    return layout * max(1, math.ceil(max(size - longest, 1) / (layout * device_tokens)))


def split_step(src_lengths: np.ndarray, tgt_lengths: np.ndarray, rows: np.ndarray, device_tokens: int,
               layout: int) -> list[np.ndarray]:
    """A step's sentences cut into micro-batches of near-equal rows (the rows are in length order). Where
    ``device_tokens`` asks for more micro-batches than sentences, as many as the layout allows: one sentence
    a micro-batch is within ``device_tokens`` plus two sentences already."""
    src_longest, tgt_longest = int(src_lengths[rows].max()) + 1, int(tgt_lengths[rows].max()) + 1
    size = len(rows) * max(src_longest, tgt_longest)
    parts = micro_batches_per_step(size, max(src_longest, tgt_longest), device_tokens, layout)
    if parts > len(rows) >= layout:
        parts = layout * (len(rows) // layout)
    if parts > len(rows):
        raise UserError(f"a step of {len(rows)} sentences cannot be split into {parts} micro-batches "
                        f"for {layout} devices; raise train.tokens_per_step or lower the preset's gpus")
    return np.array_split(rows, parts)


@dataclass(frozen=True)
class StepShape:
    """What every process knows of a step without communicating: its sizes, from the lengths alone."""

    real_src: int      # non-pad tokens: each sentence + eos
    real_tgt: int      # target tokens predicted: each sentence + eos
    padded_src: int    # positions computed, summed over the micro-batches
    padded_tgt: int
    shapes: tuple      # (rows, src_len, tgt_len) of each micro-batch as computed, for FLOPs

    @classmethod
    def of(cls, src_lengths: np.ndarray, tgt_lengths: np.ndarray, micro: list[np.ndarray],
           padded_lengths: tuple[np.ndarray, np.ndarray] | None = None) -> "StepShape":
        """``padded_lengths``: the (source, target) lengths that a micro-batch is padded to (bucketed,
        ``aiayn.speed.shapes``), and then every micro-batch also to the step's most rows; by default each
        is padded to its longest sentence alone."""
        src_cut, tgt_cut = padded_lengths or (src_lengths, tgt_lengths)
        most = max(len(rows) for rows in micro)
        shapes = tuple((most if padded_lengths else len(rows), int(src_cut[rows].max()) + 1,
                        int(tgt_cut[rows].max()) + 1) for rows in micro)
        return cls(real_src=int(sum(int(src_lengths[rows].sum()) + len(rows) for rows in micro)),
                   real_tgt=int(sum(int(tgt_lengths[rows].sum()) + len(rows) for rows in micro)),
                   padded_src=sum(r * s for r, s, _ in shapes), padded_tgt=sum(r * t for r, _, t in shapes),
                   shapes=shapes)


def length_sorted_batches(lengths: Sequence[int], tokens_per_batch: int, beam_size: int) -> list[list[int]]:
    """Indices for decoding grouped into batches of similar length, longest first, each within the token budget.

    The budget counts padded source tokens times beam_size (each source row becomes beam_size
    decoder rows); a sentence longer than the budget alone still gets a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        # Sorted longest first, so the batch's padded length is that of its first sentence.
        padded = lengths[current[0]] if current else lengths[index]
        if current and (len(current) + 1) * padded * beam_size > tokens_per_batch:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches
