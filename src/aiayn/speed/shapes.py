"""A bounded set of step shapes for a GPU: bucketed lengths, and a log of the shapes a run has met.

On a GPU every new tensor shape costs something once per process: cuDNN builds an attention plan,
torch.compile a graph, a CUDA graph a capture. The paper's batching ("batched together by approximate
sequence length", ``aiayn.batching.step_batches``) pads each micro-batch to its own longest sentence,
so an epoch brings about one new shape per step. With ``train.shape_buckets`` the steps are cut on
*bucketed* lengths instead: each side's length + 1 (its eos or bos) rounded up to ``BUCKET_BITS``
significant bits (at most 1/8 longer, about 1/16 on average). Sentences of one (source bucket, target bucket) pair then make
steps of one shape; an epoch has about as many shapes as bucket pairs, a few hundred on WMT-like lengths
(tests/speed/test_shapes.py) where it had one a micro-batch, thousands. Still the paper's
approximate-length batching: the same sort, the same greedy cut, coarser lengths.
"""

from __future__ import annotations

import numpy as np

# Significant bits kept of a padded length (length + 1): 8 values an octave above 16, exact below.
BUCKET_BITS = 4


def bucketed(size: np.ndarray | int, bits: int = BUCKET_BITS) -> np.ndarray:
    """``size`` rounded up to ``bits`` significant bits: 1..16 as they are, then 18, 20, ... 32, 36, ..."""
    size = np.asarray(size, dtype=np.int64)
    shift = np.maximum(np.floor(np.log2(np.maximum(size, 1))).astype(np.int64) + 1 - bits, 0)
    return ((size + (1 << shift) - 1) >> shift) << shift


def bucketed_lengths(lengths: np.ndarray, bits: int = BUCKET_BITS) -> np.ndarray:
    """Sentence lengths (without eos/bos) whose padded size (length + 1) is bucketed: what the step cut
    and the micro-batch split see when ``train.shape_buckets`` is on."""
    return bucketed(np.asarray(lengths, dtype=np.int64) + 1, bits) - 1


class ShapeLog:
    """The micro-batch shapes this process has run, and the steps (and their seconds) that met a new one:
    what the per-shape costs of a run came to. Counts carry over a resumed run (``Progress``); the set of
    shapes does not, as a new process pays for its shapes again."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, int, int]] = set()

    def step(self, shapes, progress, seconds: float) -> bool:
        """Record one step of ``shapes`` (rows, src_len, tgt_len) that took ``seconds``; True if it met a new one."""
        new = [shape for shape in shapes if shape not in self.seen]
        self.seen.update(new)
        if new:
            progress.distinct_shapes += len(new)
            progress.new_shape_steps += 1
            progress.new_shape_seconds += seconds
        return bool(new)
