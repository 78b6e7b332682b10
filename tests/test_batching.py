"""Length-bucketed token batches and their tensors."""

from __future__ import annotations

import numpy as np

from aiayn.batching import collate, length_batches
from aiayn.binarize import load_split
from aiayn.bpe import BOS_ID, EOS_ID, PAD_ID


def test_every_pair_lands_in_exactly_one_batch_within_the_token_budget():
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(1, 60, 5000), rng.integers(1, 60, 5000)
    batches = length_batches(src, tgt, max_tokens=900, seed=1, epoch=0)
    assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(5000))
    for rows in batches:
        longest = max((src[rows] + 1).max(), (tgt[rows] + 1).max())
        assert len(rows) * longest <= 900 or len(rows) == 1


def test_batches_group_similar_lengths_and_waste_little_padding():
    rng = np.random.default_rng(0)
    src = rng.integers(1, 100, 20000)
    tgt = np.clip(src + rng.integers(-3, 4, 20000), 1, None)
    batches = length_batches(src, tgt, max_tokens=4000, seed=1)
    real = sum(int((tgt[rows] + 1).sum()) for rows in batches)
    padded = sum(len(rows) * int((tgt[rows] + 1).max()) for rows in batches)
    assert real / padded > 0.9


def test_batch_order_is_fixed_by_seed_and_epoch():
    lengths = np.random.default_rng(0).integers(1, 50, 1000)
    same = length_batches(lengths, lengths, 500, seed=3, epoch=2)
    again = length_batches(lengths, lengths, 500, seed=3, epoch=2)
    other = length_batches(lengths, lengths, 500, seed=3, epoch=3)
    assert all(np.array_equal(a, b) for a, b in zip(same, again))
    assert not all(np.array_equal(a, b) for a, b in zip(same, other))


def test_collate_adds_eos_to_the_source_and_shifts_the_target(prepared):
    split = load_split(prepared / "bin" / "dev")
    rows = np.array([0, 5, 3])
    batch = collate(split, rows)
    for r, i in enumerate(rows):
        src, tgt = split.src(i).tolist(), split.tgt(i).tolist()
        assert batch.src[r, :len(src) + 1].tolist() == src + [EOS_ID]
        assert set(batch.src[r, len(src) + 1:].tolist()) <= {PAD_ID}
        assert batch.tgt_in[r, :len(tgt) + 1].tolist() == [BOS_ID] + tgt
        assert batch.tgt_out[r, :len(tgt) + 1].tolist() == tgt + [EOS_ID]
        assert set(batch.tgt_out[r, len(tgt) + 1:].tolist()) <= {PAD_ID}
    assert batch.tgt_tokens == sum(len(split.tgt(i)) + 1 for i in rows)
