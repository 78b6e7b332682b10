"""Length-bucketed token batches and their tensors."""

from __future__ import annotations

import numpy as np
import pytest

from aiayn.batching import StepShape, collate, length_batches, length_sorted_batches, split_step, step_batches
from aiayn.binarize import load_split
from aiayn.errors import UserError
from aiayn.tokens import BOS_ID, EOS_ID, PAD_ID


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


# --- one optimizer step: the paper's batch on any number of devices ------------------------

def _corpus(n=60000, seed=0):
    rng = np.random.default_rng(seed)
    src = np.clip(rng.lognormal(3.0, 0.5, n).astype(np.int64), 1, 250)
    tgt = np.clip((src * rng.normal(1.05, 0.15, n)).astype(np.int64), 1, 250)
    return src, tgt


@pytest.mark.parametrize("tokens_per_step, device_tokens", [(25000, 12500), (25000, 25000), (3000, 3000), (4000, 1000)])
def test_a_step_holds_tokens_per_step_per_side_on_1_to_16_devices(tokens_per_step, device_tokens):
    src, tgt = _corpus()
    steps = step_batches(src, tgt, tokens_per_step, seed=1, epoch=0)
    assert np.array_equal(np.sort(np.concatenate(steps)), np.arange(len(src)))  # every pair once an epoch
    remainder = set()
    for index, rows in enumerate(steps):
        padded = (len(rows) * (src[rows].max() + 1), len(rows) * (tgt[rows].max() + 1))
        assert min(padded) >= tokens_per_step  # never under, on either side
        # over by less than one sentence: the step without its last (longest) pair is under on a side
        order = rows[np.lexsort((src[rows], tgt[rows], np.maximum(src[rows], tgt[rows])))]
        shorter = order[:-1]
        if min(len(shorter) * (src[shorter].max() + 1), len(shorter) * (tgt[shorter].max() + 1)) >= tokens_per_step:
            remainder.add(index)  # the epoch's remainder joined this step
            assert max(padded) < 3 * tokens_per_step
    assert len(remainder) <= 1
    for world in range(1, 17):
        for index, rows in enumerate(steps):
            micro = split_step(src, tgt, rows, device_tokens, layout=world)
            assert len(micro) % world == 0 and all(len(m) for m in micro)  # every device gets a share
            if device_tokens * world >= tokens_per_step + 500 and index not in remainder:
                assert len(micro) == world  # one micro-batch per device, each about T / world
            longest = int(np.maximum(src[rows], tgt[rows]).max()) + 1
            for m in micro:
                assert len(m) * (max(src[m].max(), tgt[m].max()) + 1) <= device_tokens + 2 * longest
            shape = StepShape.of(src, tgt, micro)
            assert shape.real_src == int(src[rows].sum()) + len(rows)
            assert shape.real_tgt == int(tgt[rows].sum()) + len(rows)
            # the side that fills last is over by less than one micro-batch per device
            padded = (len(rows) * (src[rows].max() + 1), len(rows) * (tgt[rows].max() + 1))
            assert index in remainder or min(padded) - tokens_per_step < max(tokens_per_step / len(micro) * world, 1)


def test_the_steps_of_an_epoch_are_the_same_whatever_the_number_of_processes():
    src, tgt = _corpus(5000)
    steps = step_batches(src, tgt, 3000, seed=4, epoch=1)
    again = step_batches(src, tgt, 3000, seed=4, epoch=1)
    assert all(np.array_equal(a, b) for a, b in zip(steps, again))
    other_epoch = step_batches(src, tgt, 3000, seed=4, epoch=2)
    assert not all(np.array_equal(a, b) for a, b in zip(steps, other_epoch))
    # a process's micro-batches are micro[rank::world] of one list that depends on the layout only
    micro = split_step(src, tgt, steps[0], 500, layout=4)
    assert [len(m) for m in micro] == [len(m) for m in split_step(src, tgt, steps[0], 500, layout=4)]
    assert len(micro) % 4 == 0


def test_a_step_too_small_to_share_is_refused():
    src = tgt = np.full(6, 9)
    steps = step_batches(src, tgt, 20, seed=0)
    with pytest.raises(UserError, match="cannot be split into 8 micro-batches"):
        split_step(src, tgt, steps[0], 10, layout=8)


@pytest.mark.parametrize("layout, most", [(1, 1), (4, 2)])
def test_device_tokens_below_one_sentence_split_a_step_as_finely_as_its_layout_allows(layout, most):
    src = tgt = np.full(10, 30)
    micro = split_step(src, tgt, np.arange(10), 20, layout=layout)
    assert len(micro) == layout * (10 // layout) and max(len(m) for m in micro) == most
    assert np.array_equal(np.concatenate(micro), np.arange(10))


def test_length_sorted_batches_keep_the_budget_and_cover_every_sentence():
    lengths = [5, 40, 12, 3, 40, 7, 25, 1000]
    batches = length_sorted_batches(lengths, tokens_per_batch=200, beam_size=2)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) * 2 <= 200
    assert batches[0] == [7]  # too long for the budget, it still gets a batch of its own


def test_padding_to_a_multiple_changes_neither_the_loss_nor_the_gradients(prepared):
    import torch

    from aiayn.batching import padded_to_multiple
    from aiayn.loss import teacher_forced_loss
    from aiayn.model import ModelConfig, Transformer

    split = load_split(prepared / "bin" / "train")
    batch = collate(split, np.arange(5))
    padded = padded_to_multiple(batch, 8)
    rows, src_len = batch.src.shape
    assert padded.src.shape[0] == padded.tgt_in.shape[0] == 8 and padded.src.shape[1] % 8 == 0
    assert padded.tgt_in.shape[1] % 8 == 0 and padded.tgt_in.shape == padded.tgt_out.shape
    assert torch.equal(padded.src[:rows, :src_len], batch.src) and torch.all(padded.tgt_out[rows:] == PAD_ID)
    assert torch.all(padded.src[rows:, 0] == EOS_ID)  # an added row has something to attend to
    assert (padded.src_tokens, padded.tgt_tokens) == (batch.src_tokens, batch.tgt_tokens)

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=split.meta["vocab_size"], n_layers=2, d_model=16, d_ff=32, n_heads=2,
                                    dropout=0.0)).double()  # float64: only reduction order differs

    # the non-pad target positions, found on the host (the loss is given them rather than asking a GPU)
    for b in (batch, padded):
        assert len(b.tgt_real) == b.tgt_tokens and torch.all(b.tgt_out.reshape(-1)[b.tgt_real] != PAD_ID)

    def loss_and_gradients(b, real):
        model.zero_grad()
        loss, nll = teacher_forced_loss(model, b.src, b.tgt_in, b.tgt_out, 0.1, tgt_real=real)
        (loss + nll).backward()
        return [loss.detach(), nll.detach()] + [p.grad.clone() for p in model.parameters()]

    want = loss_and_gradients(batch, None)
    for got in (loss_and_gradients(padded, padded.tgt_real), loss_and_gradients(batch, batch.tgt_real)):
        for value, expected in zip(got, want):
            assert torch.isfinite(value).all()
            torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12)
