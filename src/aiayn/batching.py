"""Length-bucketed token batches (PAPER.md, Batching: "batched together by approximate sequence length").

Sentences are sorted by length with a seeded random tie-break, cut into batches whose
*padded* size stays under a token budget on both sides, and the batches are shuffled.
Every process computes the same list from (seed, epoch), so resuming and multi-GPU
sharding need nothing but a cursor into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from aiayn.bpe import BOS_ID, EOS_ID, PAD_ID


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

    @property
    def padded_tokens(self) -> int:
        return self.src.numel() + self.tgt_in.numel()

    def to(self, device) -> "Batch":
        return Batch(self.src.to(device, non_blocking=True), self.tgt_in.to(device, non_blocking=True),
                     self.tgt_out.to(device, non_blocking=True), self.src_tokens, self.tgt_tokens)


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
    """Build the tensors of one batch from a binarised split (see aiayn.binarize.TokenizedSplit)."""
    rows = np.asarray(rows, dtype=np.int64)
    src = _pad_rows(split.src_ids, split.src_offsets, rows, None, EOS_ID)
    tgt_in = _pad_rows(split.tgt_ids, split.tgt_offsets, rows, BOS_ID, None)
    tgt_out = _pad_rows(split.tgt_ids, split.tgt_offsets, rows, None, EOS_ID)
    src_tokens = int((src != PAD_ID).sum())
    tgt_tokens = int((tgt_out != PAD_ID).sum())
    return Batch(torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out), src_tokens, tgt_tokens)
