"""Tests for aiayn.search and aiayn.translate: the cached, batched beam search and its CLIs."""

from __future__ import annotations

import io
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from aiayn.bpe import learn_bpe, load_processor
from aiayn.config import load_config, resolve_preset, to_json
from aiayn.model import ModelConfig, ScratchBuffers, Transformer
from aiayn.search import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SearchConfig,
    beam_search,
    first_differing_positions,
    greedy_search,
    length_penalty,
    length_sorted_batches,
    load_model,
    main,
    max_output_lengths,
    resolve_tokens_per_batch,
    search_batches,
    stable_slots,
    surviving_order,
    top_k,
    translate_n_best,
    translate_sentences,
)
from aiayn.errors import UserError
from aiayn import search, translate
from conftest import REPO

VOCAB = 24


def tiny_model(seed: int = 0, cls: type[Transformer] = Transformer, **changes) -> Transformer:
    torch.manual_seed(seed)
    fields = dict(vocab_size=VOCAB, n_layers=2, d_model=32, d_ff=64, n_heads=4, dropout=0.0)
    fields.update(changes)
    return cls(ModelConfig(**fields)).eval()


def sources(lengths: list[int], seed: int = 0) -> torch.Tensor:
    """Right-padded source ids, each row its length's worth of real tokens, the last one EOS."""
    generator = torch.Generator().manual_seed(seed)
    batch = torch.full((len(lengths), max(lengths)), PAD_ID, dtype=torch.long)
    for row, length in enumerate(lengths):
        batch[row, : length - 1] = torch.randint(4, VOCAB, (length - 1,), generator=generator)
        batch[row, length - 1] = EOS_ID
    return batch


@pytest.fixture(scope="module")
def half_trained() -> Transformer:
    """60 Adam steps on reversing the source: outputs of varied length that end with EOS on their own,
    with beams that finish at different steps (a random model mostly runs to the maximum length)."""
    model = tiny_model(seed=0).train()
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(60):
        lengths = torch.randint(2, 10, (32,), generator=generator).tolist()
        src = sources(lengths, seed=1000 + step)
        tgt = torch.full((32, src.shape[1]), PAD_ID)
        for row, length in enumerate(lengths):
            tgt[row, : length - 1] = src[row, : length - 1].flip(0)
            tgt[row, length - 1] = EOS_ID
        tgt_in = torch.cat([torch.full((32, 1), BOS_ID), tgt[:, :-1]], dim=1)
        loss = F.cross_entropy(model(src, tgt_in).reshape(-1, VOCAB), tgt.reshape(-1), ignore_index=PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def with_weights(cls: type[Transformer], model: Transformer) -> Transformer:
    copy = cls(model.config).eval()
    copy.load_state_dict(model.state_dict())
    return copy


class NoEosTransformer(Transformer):
    """A real Transformer whose EOS logit is pushed far below every other, so it never ends by itself."""

    def decode_step(self, tokens, position, cache):
        logits = super().decode_step(tokens, position, cache)
        logits[:, EOS_ID] = logits.min(dim=-1).values - 50.0
        return logits


class CountingTransformer(Transformer):
    """Counts decoder steps, to see whether early termination saved any."""

    steps = 0

    def decode_step(self, tokens, position, cache):
        self.steps += 1
        return super().decode_step(tokens, position, cache)


class BigramCache:
    def __init__(self, src_pad):
        self.src_pad = src_pad


class BigramModel(nn.Module):
    """A hand-written next-token table behind the Transformer's inference API: p(next | previous token)."""

    def __init__(self, probabilities: dict[int, dict[int, float]], vocab: int = 12):
        super().__init__()
        table = torch.full((vocab, vocab), 1e-9)
        for previous, row in probabilities.items():
            for token, probability in row.items():
                table[previous, token] = probability
        self.register_buffer("log_table", table.log())

    def encode(self, src):
        return src.float()[:, :, None], src.eq(PAD_ID)

    def init_cache(self, memory, src_pad, max_len, group=1, capacity=0, scratch=None):
        return BigramCache(src_pad.repeat_interleave(group, dim=0))

    def decode_step(self, tokens, position, cache):
        assert tokens.shape[0] == cache.src_pad.shape[0]
        return self.log_table[tokens]

    def reorder_cache(self, cache, index, sources=None, filled=None, group=None, copy_from=None, copied=None):
        cache.src_pad = cache.src_pad.index_select(0, index)
        return cache


A, B, C = 5, 6, 7
# Greedy takes A (0.6) and then at best 0.15 (0.09 in all); the beam finds B then EOS (0.4 * 0.95 = 0.38).
GARDEN_PATH = {
    BOS_ID: {A: 0.6, B: 0.4},
    A: {EOS_ID: 0.15, 4: 0.15, 8: 0.14, 9: 0.14, 10: 0.14, 11: 0.14, C: 0.14},
    B: {EOS_ID: 0.95, C: 0.05},
    **{token: {EOS_ID: 0.9, C: 0.1} for token in (4, C, 8, 9, 10, 11)},
}


# EOS first is the most probable output (0.3), but with alpha = 1 the longer A 8 (0.24 * 0.98 * 0.99) scores
# higher; it overtakes only at length 3, so a bound that looks one token ahead would stop too soon.
LONGER_WINS = {
    BOS_ID: {EOS_ID: 0.3, A: 0.24, B: 0.2, C: 0.15, 4: 0.11},
    A: {8: 0.98, EOS_ID: 0.01, 4: 0.01},
    8: {EOS_ID: 0.99, 4: 0.01},
    B: {C: 0.99, EOS_ID: 0.01},
    C: {EOS_ID: 0.99, 4: 0.01},
    4: {EOS_ID: 0.99, 4: 0.01},
}


def reference_beam_search(model, src_row: list[int], config: SearchConfig) -> list[tuple[list[int], float]]:
    """The slow, obvious search: every hypothesis re-runs model.forward on its whole prefix, one at a time.

    Same scheme as beam_search without early termination: the top 2 * beam candidates, EOS among the
    top beam finish, the best beam others stay live, stop when beam have finished or at the maximum length.
    """
    src = torch.tensor([src_row])
    max_len = math.floor(config.max_len_a * len(src_row) + config.max_len_b)
    beam = config.beam_size
    live = [([], 0.0)]
    finished = []
    for step in range(max_len + 1):
        candidates = []
        for tokens, log_prob in live:
            with torch.no_grad():
                logits = model(src, torch.tensor([[BOS_ID] + tokens]))[0, -1]
            log_probs = F.log_softmax(logits.double(), dim=-1)
            log_probs[PAD_ID] = log_probs[BOS_ID] = -math.inf
            if step == max_len:
                log_probs[[t for t in range(len(log_probs)) if t != EOS_ID]] = -math.inf
            candidates += [(log_prob + value, tokens, token) for token, value in enumerate(log_probs.tolist())]
        candidates = sorted(candidates, key=lambda candidate: -candidate[0])[: 2 * beam]
        for log_prob, tokens, token in candidates[:beam]:
            if token == EOS_ID and math.isfinite(log_prob):
                finished.append((log_prob / length_penalty(len(tokens) + 1, config.length_penalty), tokens))
        finished = sorted(finished, key=lambda hypothesis: -hypothesis[0])[:beam]
        live = [(tokens + [token], log_prob) for log_prob, tokens, token in candidates if token != EOS_ID][:beam]
        if len(finished) >= beam:
            break
    return [(tokens, score) for score, tokens in finished]



@pytest.mark.parametrize("parents, slots", [
    ([0, 1, 2, 3], [0, 1, 2, 3]),  # every beam continues in place: nothing to copy
    ([0, 0, 1, 1], [0, 2, 1, 3]),  # second children take the free slots 2 and 3, in order
    ([2, 2, 2, 2], [2, 0, 1, 3]),
    ([3, 1, 3, 0], [3, 1, 2, 0]),
])
def test_stable_slots_keep_first_children_in_their_parents_slot(parents, slots):
    assert stable_slots(torch.tensor([parents])).tolist() == [slots]


def test_stable_slots_are_a_permutation_for_every_parent_pattern():
    patterns = torch.cartesian_prod(*[torch.arange(4)] * 4)  # all 256 parent tuples of beam 4
    slots = stable_slots(patterns)
    assert torch.equal(slots.sort(dim=1).values, torch.arange(4).expand(256, 4))
    first_child = torch.tensor([[p not in row[:j] for j, p in enumerate(row)] for row in patterns.tolist()])
    assert torch.equal(slots[first_child], patterns[first_child])


def test_surviving_order_keeps_places_and_fills_holes_from_the_end():
    done = torch.tensor([False, True, False, True, False, False, True, False])
    # 5 go on: places 0, 2 and 4 keep theirs; places 1 and 3 (ended) swap with the survivors past place 4, 5 and 7.
    assert surviving_order(done).tolist() == [0, 5, 2, 7, 4, 1, 6, 3]
    assert surviving_order(torch.tensor([True, True])).tolist() == [0, 1]
    assert surviving_order(torch.tensor([False, False, True])).tolist() == [0, 1, 2]
    assert surviving_order(torch.tensor([True, True, False, False])).tolist() == [2, 3, 0, 1]


def test_first_differing_positions_follow_the_shared_tokens_of_a_sentence():
    # Two sentences of beam 2 after step 3 (tokens of steps 0..2); the fourth column is not written yet.
    tokens = torch.tensor([[5, 6, 7, 0], [5, 6, 8, 0], [9, 4, 4, 0], [10, 4, 4, 0]])
    keep_rows = torch.tensor([1, 1, 3, 2])
    # Row 0 takes row 1's hypothesis: tokens 0 and 1 agree, so positions 0..2 (BOS, 5, 6) are shared.
    # Row 1 keeps its own (nothing to copy: filled = 4). Rows 2 and 3 swap: they differ at token 0.
    assert first_differing_positions(tokens, tokens[keep_rows], 3, 2, None).tolist() == [3, 4, 1, 1]
    # The first sentence ends and the second moves into its rows: nothing of theirs is shared.
    assert first_differing_positions(tokens, tokens[keep_rows[2:]], 3, 2, torch.tensor([1])).tolist() == [0, 0]


class FullCopyTransformer(Transformer):
    """Copies the whole written history of every row that moves, as reorder_cache did before copy_from."""

    def reorder_cache(self, cache, index, sources=None, filled=None, group=None, copy_from=None, copied=None):
        return super().reorder_cache(cache, index, sources, filled, group)


@pytest.mark.parametrize("kind", ["half_trained", "random"])
def test_copying_only_where_hypotheses_differ_gives_exactly_the_full_copy_search(kind, half_trained):
    model = half_trained if kind == "half_trained" else tiny_model(seed=21)
    full_copy = with_weights(FullCopyTransformer, model)
    config = SearchConfig(beam_size=4, n_best=4, max_len_a=0.5, max_len_b=6)
    src = sources([7, 3, 5, 9, 12, 4, 8, 2], seed=22)
    expected = beam_search(full_copy, src, config)
    assert [[(h.tokens, h.score, h.log_prob) for h in sentence] for sentence in beam_search(model, src, config)] == \
        [[(h.tokens, h.score, h.log_prob) for h in sentence] for sentence in expected]


@pytest.mark.parametrize("early_stopping", [True, False])
def test_cached_batched_search_equals_full_recomputation(early_stopping, half_trained):
    model = half_trained
    config = SearchConfig(beam_size=3, length_penalty=0.6, max_len_a=0.5, max_len_b=6,
                          n_best=1 if early_stopping else 3, early_stopping=early_stopping)
    src = sources([7, 3, 5, 9, 12, 4], seed=2)
    results = beam_search(model, src, config)
    assert len({len(h[0].tokens) for h in results}) > 2  # the case worth testing: they end at different steps
    for row, hypotheses in zip(src.tolist(), results):
        expected = reference_beam_search(model, [t for t in row if t != PAD_ID], config)[: config.n_best]
        assert [h.tokens for h in hypotheses] == [tokens for tokens, _ in expected]
        assert [h.score for h in hypotheses] == pytest.approx([score for _, score in expected], abs=1e-4)


@pytest.mark.parametrize("trained", [False, True])
def test_beam_size_one_equals_greedy_decoding(trained, half_trained):
    model = half_trained if trained else tiny_model(seed=3)
    src = sources([9, 4, 12, 6, 2, 7], seed=4)
    greedy = greedy_search(model, src, max_len_a=1.0, max_len_b=8, length_penalty_alpha=0.6)
    beam = beam_search(model, src, SearchConfig(beam_size=1, max_len_b=8, length_penalty=0.6))
    assert [h[0].tokens for h in beam] == [h.tokens for h in greedy]
    assert [h[0].log_prob for h in beam] == pytest.approx([h.log_prob for h in greedy], abs=1e-4)
    assert [h[0].score for h in beam] == pytest.approx([h.score for h in greedy], abs=1e-4)


def test_beam_finds_the_more_probable_output_that_greedy_misses():
    model = BigramModel(GARDEN_PATH)
    src = torch.tensor([[4, 4, EOS_ID]])
    greedy = greedy_search(model, src, max_len_b=5)[0]
    best = beam_search(model, src, SearchConfig(beam_size=4, max_len_b=5))[0][0]
    assert greedy.tokens == [A]
    assert greedy.log_prob == pytest.approx(math.log(0.6 * 0.15), abs=1e-5)
    assert best.tokens == [B]
    assert best.log_prob == pytest.approx(math.log(0.4 * 0.95), abs=1e-5)
    assert best.score > greedy.score


def test_beam_size_one_stops_at_its_first_eos_like_greedy_even_when_longer_would_score_higher():
    model = BigramModel(LONGER_WINS)
    src = torch.tensor([[4, 4, EOS_ID]])
    assert greedy_search(model, src, max_len_b=5, length_penalty_alpha=1.0)[0].tokens == []
    assert beam_search(model, src, SearchConfig(beam_size=1, length_penalty=1.0, max_len_b=5))[0][0].tokens == []


@pytest.mark.parametrize(
    "length, alpha, expected",
    [(1, 0.6, 1.0), (7, 0.6, 2.0**0.6), (13, 0.6, 3.0**0.6), (11, 1.0, 16 / 6), (30, 0.0, 1.0)],
)
def test_length_penalty_is_gnmt_form(length, alpha, expected):
    assert length_penalty(length, alpha) == pytest.approx(expected)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_scores_are_log_prob_over_length_penalty_counting_eos(alpha, half_trained):
    src = sources([6, 8, 3, 9], seed=6)
    results = beam_search(half_trained, src, SearchConfig(beam_size=4, length_penalty=alpha, n_best=4))
    for hypotheses in results:
        for hypothesis in hypotheses:
            expected = hypothesis.log_prob / ((5 + len(hypothesis.tokens) + 1) / 6) ** alpha
            assert hypothesis.score == pytest.approx(expected, rel=1e-5)
            if alpha == 0.0:
                assert hypothesis.score == hypothesis.log_prob


def test_a_larger_length_penalty_favours_longer_outputs(half_trained):
    src = sources([7, 3, 5, 9, 12, 4, 6, 8], seed=2)
    total = {alpha: sum(len(h[0].tokens) for h in beam_search(half_trained, src, SearchConfig(length_penalty=alpha)))
             for alpha in (0.0, 1.0)}
    assert total[1.0] > total[0.0]


def test_n_best_are_distinct_and_sorted_best_first():
    model = tiny_model(seed=7)
    for hypotheses in beam_search(model, sources([5, 9], seed=8), SearchConfig(beam_size=4, n_best=4)):
        assert len(hypotheses) == 4
        scores = [h.score for h in hypotheses]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.tokens) for h in hypotheses}) == 4


@pytest.mark.parametrize("trained", [False, True])
def test_a_sentence_decodes_the_same_alone_and_in_a_batch_with_longer_ones(trained, half_trained):
    model = half_trained if trained else tiny_model(seed=9)
    lengths = [4, 15, 9, 22, 3]
    batch = sources(lengths, seed=10)
    config = SearchConfig(beam_size=4, n_best=2, max_len_b=10)
    together = beam_search(model, batch, config)
    for row, length in enumerate(lengths):
        alone = beam_search(model, batch[row : row + 1, :length], config)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in together[row]]
        assert [h.score for h in alone] == pytest.approx([h.score for h in together[row]], abs=1e-4)


def test_two_workers_return_what_one_worker_returns_batch_by_batch(half_trained):
    model = half_trained
    config = SearchConfig(beam_size=3, n_best=2, max_len_b=8)
    batches = [sources(lengths, seed=seed) for seed, lengths in enumerate([[5, 9], [12, 3, 7], [4], [8, 8, 2, 6]])]
    threads = torch.get_num_threads()
    finished = []
    one = search_batches(model, batches, config, workers=1)
    two = search_batches(model, batches, config, workers=2, on_done=finished.append)
    assert torch.get_num_threads() == threads  # restored after the workers' own setting
    assert sorted(finished) == sorted(batch.shape[0] for batch in batches)
    assert [[[h.tokens for h in sentence] for sentence in batch] for batch in two] == \
        [[[h.tokens for h in sentence] for sentence in batch] for batch in one]
    assert [h.score for batch in two for sentence in batch for h in sentence] == \
        pytest.approx([h.score for batch in one for sentence in batch for h in sentence], abs=1e-4)
    assert search_batches(model, [], config, workers=2) == []


def test_batches_searched_in_one_scratch_memory_equal_each_searched_alone(half_trained):
    # Large, small, large: the third batch's cache reuses memory the first two wrote, never read back.
    batches = [sources(lengths, seed=seed) for seed, lengths in enumerate([[9, 7, 8, 9], [3], [6, 9, 2, 5, 9]])]
    config = SearchConfig(beam_size=3, n_best=3, max_len_b=6)
    alone = [beam_search(half_trained, batch, config) for batch in batches]
    shared = search_batches(half_trained, batches, config)
    assert [[[(h.tokens, h.score) for h in sentence] for sentence in batch] for batch in shared] == \
        [[[(h.tokens, h.score) for h in sentence] for sentence in batch] for batch in alone]


def test_scratch_buffers_reuse_their_memory_until_a_tensor_does_not_fit():
    scratch, like = ScratchBuffers(), torch.zeros(1)
    first = scratch.take("keys", (2, 3, 4), like)
    assert first.shape == (2, 3, 4) and first.is_contiguous()
    assert scratch.take("keys", (5, 4), like).data_ptr() == first.data_ptr()  # fits: the same memory
    assert scratch.take("values", (2, 3), like).data_ptr() != first.data_ptr()  # another name, other memory
    grown = scratch.take("keys", (7, 4), like)
    assert grown.shape == (7, 4) and grown.data_ptr() != first.data_ptr()
    assert scratch.take("keys", (2, 2), like.double()).dtype == torch.float64


@pytest.mark.parametrize("workers", [0, -1, 1.5, True])
def test_search_batches_rejects_a_bad_worker_count(workers):
    with pytest.raises(UserError, match="workers"):
        search_batches(tiny_model(), [sources([3])], SearchConfig(), workers=workers)


def test_output_never_exceeds_a_times_source_length_plus_b():
    model = tiny_model(seed=11, cls=NoEosTransformer)
    lengths = [3, 10, 6]
    src = sources(lengths, seed=12)
    config = SearchConfig(beam_size=3, max_len_a=1.5, max_len_b=2, n_best=3)
    for length, hypotheses in zip(lengths, beam_search(model, src, config)):
        assert [len(h.tokens) for h in hypotheses] == [math.floor(1.5 * length + 2)] * 3
    greedy = greedy_search(model, src, max_len_a=1.5, max_len_b=2)
    assert [len(h.tokens) for h in greedy] == [math.floor(1.5 * length + 2) for length in lengths]
    assert max_output_lengths(src, 1.5, 2).tolist() == [6, 17, 11]


def test_learned_positions_cap_the_output_at_the_table_size():
    model = tiny_model(seed=13, cls=NoEosTransformer, positional="learned", max_positions=12)
    hypotheses = beam_search(model, sources([5], seed=14), SearchConfig(beam_size=2, max_len_b=50))[0]
    assert len(hypotheses[0].tokens) == 11


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("n_best", [1, 2])
def test_early_termination_returns_what_searching_to_the_end_returns(alpha, n_best, half_trained):
    src = sources([5, 8, 3, 11, 6, 9, 4], seed=15)
    outputs, steps = {}, {}
    for early in (True, False):
        model = with_weights(CountingTransformer, half_trained)
        config = SearchConfig(beam_size=4, length_penalty=alpha, max_len_b=15, n_best=n_best, early_stopping=early)
        outputs[early] = beam_search(model, src, config)
        steps[early] = model.steps
    assert [[h.tokens for h in hs] for hs in outputs[True]] == [[h.tokens for h in hs] for hs in outputs[False]]
    scores = {early: [h.score for hs in outputs[early] for h in hs] for early in outputs}
    assert scores[True] == pytest.approx(scores[False])
    assert steps[True] <= steps[False]
    if alpha == 0.0:  # the bound is tightest without a length penalty: here it must save steps
        assert steps[True] < steps[False]


def test_early_termination_keeps_searching_while_a_longer_hypothesis_can_still_win():
    # After the first step EOS has finished at log(0.3) and the best live hypothesis has log(0.24):
    # without a length penalty it could never win, but with it, two tokens later, it does.
    model = BigramModel(LONGER_WINS)
    best = beam_search(model, torch.tensor([[4, 4, EOS_ID]]), SearchConfig(beam_size=2, length_penalty=1.0,
                                                                          max_len_b=5))[0][0]
    assert best.tokens == [A, 8]
    assert best.score == pytest.approx(math.log(0.24 * 0.98 * 0.99) / (8 / 6), abs=1e-5)


def test_finished_sentences_leave_the_batch():
    rows = []

    class RowCounting(NoEosTransformer):
        def decode_step(self, tokens, position, cache):
            rows.append(tokens.shape[0])
            return super().decode_step(tokens, position, cache)

    model = tiny_model(seed=17, cls=RowCounting)
    beam_search(model, sources([3, 3, 3, 30], seed=18), SearchConfig(beam_size=2, max_len_b=0, max_len_a=1.0))
    assert rows[0] == 4  # the first step: one row per sentence (all beams are the same empty hypothesis)
    assert rows[1] == 8  # then 4 sentences x 2 beams
    assert rows[-1] == 2  # only the long sentence's beams are left at the end
    assert len(rows) == 31  # 30 tokens and the forced EOS


# --- the accelerator's path: at most one host read per step, the CPU's hypotheses ---------------------

aten = torch.ops.aten


class HostReads(TorchDispatchMode):
    """Counts what would make the host wait for a GPU: a value read back (item, bool, int, float:
    _local_scalar_dense; tolist, numpy, cpu) and operators whose output shape depends on values
    (nonzero, masked_select, unique, boolean-mask indexing, repeat_interleave without output_size).
    On CPU tensors these cost nothing, so counting them on the CPU bounds what the same code does on a GPU.
    """

    READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
             aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default}
    INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
    METHODS = ("tolist", "numpy", "cpu")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        masked = func in self.INDEXING and any(
            index is not None and index.dtype == torch.bool for index in args[1])
        sized_by_values = func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
        self.count += func in self.READS or masked or sized_by_values
        return func(*args, **kwargs)

    def __enter__(self):
        self.methods = {name: getattr(torch.Tensor, name) for name in self.METHODS}
        for name, method in self.methods.items():
            setattr(torch.Tensor, name, self.counting(method))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self.methods.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def counting(self, method):
        def counted(tensor, *args, **kwargs):
            self.count += 1
            return method(tensor, *args, **kwargs)
        return counted


@pytest.mark.parametrize("read", [
    lambda x: x[0].item(), lambda x: bool(x.any()), lambda x: int(x.sum()), lambda x: x.tolist(),
    lambda x: x.cpu(), lambda x: x.nonzero(), lambda x: x[x > 1], lambda x: x.repeat_interleave(x),
    lambda x: x.unique(),
], ids=["item", "bool", "int", "tolist", "cpu", "nonzero", "mask", "repeat_interleave", "unique"])
def test_host_reads_counts_each_kind_of_read_once(read):
    x = torch.tensor([1, 0, 2])
    with HostReads() as reads:
        read(x)
        x.repeat_interleave(x, output_size=3)  # given its size, no read
        x[torch.tensor([0, 2])]  # integer indexing has a fixed shape
    assert reads.count == 1


class StepMarking(Transformer):
    """Notes the host reads counted so far, and the decoder rows, at each decoder step."""

    reads: HostReads | None = None

    def decode_step(self, tokens, position, cache):
        self.marks.append(self.reads.count)
        self.rows.append(tokens.shape[0])
        return super().decode_step(tokens, position, cache)


def accelerator_path(monkeypatch) -> None:
    """Makes beam_search take the path it takes on a GPU, where reading a tensor costs a synchronisation."""
    monkeypatch.setattr(search, "reads_are_free", lambda device: False)


@pytest.mark.parametrize("early_stopping", [True, False])
def test_the_accelerator_path_reads_the_host_at_most_once_a_step(early_stopping, half_trained, monkeypatch):
    accelerator_path(monkeypatch)
    model = with_weights(StepMarking, half_trained)
    config = SearchConfig(beam_size=4, n_best=2, max_len_a=0.5, max_len_b=6, early_stopping=early_stopping)
    src = sources([7, 3, 5, 9, 12, 4, 8, 2, 10, 6], seed=31)
    model.marks, model.rows, model.reads = [], [], HostReads()
    with model.reads:
        beam_search(model, src, config)
    assert len(set(model.rows[1:])) > 2  # sentences left the batch at different steps
    reads_per_step = [later - earlier for earlier, later in zip(model.marks, model.marks[1:])]
    assert max(reads_per_step) <= 1
    # Once before the loop (the longest output), the last step's one, the results (three tensors) after it.
    assert model.marks[0] <= 1 and model.reads.count - model.marks[-1] <= 1 + 3


@pytest.mark.parametrize("kind", ["half_trained", "random", "learned_positions"])
def test_the_accelerator_path_finds_the_cpu_paths_hypotheses(kind, half_trained, monkeypatch):
    model = {"half_trained": half_trained, "random": tiny_model(seed=41),
             "learned_positions": tiny_model(seed=42, positional="learned", max_positions=12)}[kind]
    src = sources([7, 3, 5, 9, 12, 4, 8, 2, 1], seed=43)
    configs = [SearchConfig(max_len_b=8), SearchConfig(beam_size=3, n_best=3, max_len_a=0.5, max_len_b=6,
                                                      early_stopping=False), SearchConfig(beam_size=1, max_len_b=8)]
    cpu = [beam_search(model, src, config) for config in configs]
    accelerator_path(monkeypatch)
    assert [beam_search(model, src, config) for config in configs] == cpu  # tokens, and scores to the bit


def test_length_sorted_batches_keep_the_budget_and_cover_every_sentence():
    lengths = [5, 40, 12, 3, 40, 7, 25, 1000]
    batches = length_sorted_batches(lengths, tokens_per_batch=200, beam_size=2)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) * 2 <= 200
    assert batches[0] == [7]  # too long for the budget, it still gets a batch of its own


@pytest.mark.parametrize("value, device, expected", [
    ("auto", "cpu", 8000), ("auto", "cuda", 50000), ("auto", torch.device("cuda", 1), 50000), ("auto", "meta", 8000),
    (3000, "cuda", 3000), (3000, "cpu", 3000),
])
def test_auto_tokens_per_batch_is_gpu_sized_on_cuda_and_the_cpus_elsewhere(value, device, expected):
    assert resolve_tokens_per_batch(value, device) == expected


@pytest.mark.parametrize("value", [0, -5, "many", True, 2.5])
def test_a_tokens_per_batch_that_is_not_a_whole_number_or_auto_is_a_user_error(value):
    with pytest.raises(UserError, match="tokens_per_batch"):
        resolve_tokens_per_batch(value, "cpu")


@pytest.mark.parametrize("paper_config", ["wmt14_en_de.yaml", "wmt14_en_fr.yaml"])
def test_the_paper_configs_decode_auto_sized_batches(paper_config):
    config = load_config([REPO / "config" / "config.yaml", REPO / "config" / paper_config])
    assert config["decode"]["tokens_per_batch"] == "auto"


def test_auto_batches_keep_the_big_models_decoding_memory_within_an_80_gb_gpu():
    """config/README.md's arithmetic: the worst batch is of two-token sources, outputs up to source + 50."""
    config = load_config([REPO / "config" / "config.yaml", REPO / "config" / "wmt14_en_de.yaml"])
    big = resolve_preset(config, "big")
    source_len, positions = 2, 2 + config["decode"]["max_len_b"] + 1
    rows = resolve_tokens_per_batch("auto", "cuda") // source_len
    per_row_and_position = 2 * big["n_layers"] * big["d_model"] * 2  # keys and values, bf16
    cache = rows * positions * per_row_and_position
    log_probs = rows * config["bpe"]["vocab_size"] * (2 + 4 + 4)
    assert cache * 1.5 + log_probs < 0.75 * 80e9


def test_search_config_from_dict_rejects_unknown_keys_and_bad_values():
    assert SearchConfig.from_dict({"beam_size": 5, "length_penalty": 1}) == SearchConfig(beam_size=5, length_penalty=1)
    with pytest.raises(UserError, match="unknown decode setting"):
        SearchConfig.from_dict({"beam": 4})
    with pytest.raises(UserError, match="beam_size"):
        SearchConfig(beam_size=0)
    with pytest.raises(UserError, match="n_best"):
        SearchConfig(beam_size=2, n_best=3)


# --- text in, text out: a real SentencePiece model trained here, an untrained Transformer -------------

WORDS = "the a house cat dog is small big red green runs sleeps on under table garden we they see".split()


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("spm")
    generator = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(200):
        count = int(torch.randint(3, 10, (1,), generator=generator))
        lines.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (count,), generator=generator)))
    (directory / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    learn_bpe([directory / "train.txt"], directory, vocab_size=60, threads=1)
    return directory / "spm.model"


@pytest.fixture(scope="module")
def text_model(spm_model):
    pieces = load_processor(spm_model).get_piece_size()
    return tiny_model(seed=19, vocab_size=pieces)


SENTENCES = ["the cat sleeps", "", "a big red dog runs under the green table in the garden", "we see", "   ",
             "they see a small house"]


def test_translate_sentences_returns_one_string_per_line_in_input_order(spm_model, text_model):
    processor = load_processor(spm_model)
    config = SearchConfig(beam_size=2, max_len_b=5)
    outputs = translate_sentences(text_model, processor, SENTENCES, config, tokens_per_batch=30, progress=False)
    assert len(outputs) == len(SENTENCES)
    assert outputs[1] == "" and outputs[4] == ""
    one_by_one = [translate_sentences(text_model, processor, [s], config, progress=False)[0] for s in SENTENCES]
    assert outputs == one_by_one
    reversed_outputs = translate_sentences(text_model, processor, SENTENCES[::-1], config, progress=False)
    assert reversed_outputs == outputs[::-1]


def test_translate_sentences_decodes_the_best_hypothesis_tokens(spm_model, text_model):
    processor = load_processor(spm_model)
    config = SearchConfig(beam_size=3, max_len_b=6)
    src = torch.tensor([processor.encode(SENTENCES[0]) + [EOS_ID]])
    expected = processor.decode(beam_search(text_model, src, config)[0][0].tokens)
    assert translate_sentences(text_model, processor, SENTENCES[:1], config, progress=False) == [expected]


def test_auto_tokens_per_batch_decodes_on_the_cpu_what_8000_decodes(spm_model, text_model):
    processor = load_processor(str(spm_model))
    config = SearchConfig(beam_size=2, max_len_b=4)
    auto = translate_sentences(text_model, processor, SENTENCES, config, tokens_per_batch="auto", progress=False)
    assert auto == translate_sentences(text_model, processor, SENTENCES, config, tokens_per_batch=8000, progress=False)


def test_translate_n_best_gives_n_scored_translations_per_sentence(spm_model, text_model):
    processor = load_processor(spm_model)
    results = translate_n_best(text_model, processor, SENTENCES, SearchConfig(beam_size=3, n_best=3, max_len_b=5),
                               progress=False)
    assert len(results) == len(SENTENCES)
    assert results[1] == [(0.0, "")]
    for index in (0, 2, 3, 5):
        assert len(results[index]) == 3
        assert all(isinstance(score, float) and isinstance(text, str) for score, text in results[index])


def save_model_file(path, model: Transformer) -> None:
    torch.save(
        {"format": "aiayn-model-v1", "model_config": model.config.to_dict(), "model": model.state_dict(),
         "vocab_fingerprint": "v", "data_fingerprint": "d", "averaged_steps": [1], "averaged_from": ["x"]},
        path,
    )


def test_load_model_restores_the_weights_in_eval_mode(tmp_path, text_model):
    save_model_file(tmp_path / "model.pt", text_model)
    loaded = load_model(tmp_path / "model.pt")
    assert not loaded.training
    for key, value in text_model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)


DECODE_JSON = to_json({"beam_size": 2, "length_penalty": 0.6, "max_len_a": 1.0, "max_len_b": 4,
                       "tokens_per_batch": 40})


def test_decode_cli_writes_one_line_per_input_line(tmp_path, spm_model, text_model, capsys):
    save_model_file(tmp_path / "model.pt", text_model)
    (tmp_path / "src.txt").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    status = main(["--decode-json", DECODE_JSON, "--model", str(tmp_path / "model.pt"), "--spm-model",
                   str(spm_model), "--input", str(tmp_path / "src.txt"), "--output", str(tmp_path / "out" / "hyp.txt"),
                   "--threads", "1", "--device", "cpu"])
    assert status == 0
    written = (tmp_path / "out" / "hyp.txt").read_text(encoding="utf-8").split("\n")
    processor = load_processor(spm_model)
    expected = translate_sentences(text_model, processor, SENTENCES,
                                   SearchConfig(beam_size=2, max_len_b=4), progress=False)
    assert written == expected + [""]
    assert "sentences/s" in capsys.readouterr().out


def test_decode_cli_with_two_workers_writes_what_one_worker_writes(tmp_path, spm_model, text_model):
    save_model_file(tmp_path / "model.pt", text_model)
    (tmp_path / "src.txt").write_text("\n".join(SENTENCES * 3) + "\n", encoding="utf-8")
    written = []
    for workers in (1, 2):
        section = to_json({"beam_size": 2, "max_len_b": 4, "tokens_per_batch": 30, "workers": workers})
        output = tmp_path / f"hyp{workers}.txt"
        assert main(["--decode-json", section, "--model", str(tmp_path / "model.pt"), "--spm-model", str(spm_model),
                     "--input", str(tmp_path / "src.txt"), "--output", str(output), "--threads", "2",
                     "--device", "cpu"]) == 0
        written.append(output.read_text(encoding="utf-8"))
    assert written[0] == written[1]
    assert len(written[0].split("\n")) == 3 * len(SENTENCES) + 1


def test_decode_cli_reports_a_missing_model_file_with_exit_status_2(tmp_path, spm_model, capsys):
    (tmp_path / "src.txt").write_text("the cat\n", encoding="utf-8")
    status = main(["--decode-json", DECODE_JSON, "--model", str(tmp_path / "nope.pt"), "--spm-model", str(spm_model),
                   "--input", str(tmp_path / "src.txt"), "--output", str(tmp_path / "hyp.txt"), "--device", "cpu"])
    assert status == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "nope.pt" in error and "Traceback" not in error
    assert not (tmp_path / "hyp.txt").exists()


def test_decode_cli_refuses_a_vocabulary_of_another_size(tmp_path, spm_model, capsys):
    save_model_file(tmp_path / "model.pt", tiny_model(seed=20, vocab_size=30))
    (tmp_path / "src.txt").write_text("the cat\n", encoding="utf-8")
    status = main(["--decode-json", DECODE_JSON, "--model", str(tmp_path / "model.pt"), "--spm-model", str(spm_model),
                   "--input", str(tmp_path / "src.txt"), "--output", str(tmp_path / "hyp.txt"), "--device", "cpu"])
    assert status == 2
    assert "vocab_size = 30" in capsys.readouterr().err


def run_translate(monkeypatch, capsys, text: str, argv: list[str]) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode("utf-8")), encoding="utf-8"))
    status = translate.main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize("workers", ["1", "2"])
def test_translate_cli_writes_one_translation_per_stdin_line(
    workers, tmp_path, spm_model, text_model, monkeypatch, capsys
):
    save_model_file(tmp_path / "model.pt", text_model)
    argv = ["--model", str(tmp_path / "model.pt"), "--spm-model", str(spm_model), "--beam", "2",
            "--max-len-b", "4", "--device", "cpu", "--workers", workers, "--tokens-per-batch", "30"]
    status, out, _ = run_translate(monkeypatch, capsys, "\n".join(SENTENCES) + "\n", argv)
    assert status == 0
    expected = translate_sentences(text_model, load_processor(spm_model), SENTENCES,
                                   SearchConfig(beam_size=2, max_len_b=4), progress=False)
    assert out.split("\n") == expected + [""]


def test_translate_cli_n_best_prints_scored_blocks(tmp_path, spm_model, text_model, monkeypatch, capsys):
    save_model_file(tmp_path / "model.pt", text_model)
    argv = ["--model", str(tmp_path / "model.pt"), "--spm-model", str(spm_model), "--beam", "3", "--n-best", "2",
            "--max-len-b", "4", "--device", "cpu"]
    status, out, _ = run_translate(monkeypatch, capsys, "the cat\nwe see\n", argv)
    assert status == 0
    blocks = out.split("\n\n")
    assert len(blocks) == 3 and blocks[-1] == ""
    for block in blocks[:2]:
        lines = block.split("\n")
        assert len(lines) == 2
        scores = [float(line.split("\t")[0]) for line in lines]
        assert scores == sorted(scores, reverse=True)


def test_translate_cli_reports_n_best_above_beam_with_exit_status_2(tmp_path, spm_model, monkeypatch, capsys):
    argv = ["--model", str(tmp_path / "model.pt"), "--spm-model", str(spm_model), "--beam", "2", "--n-best", "3"]
    status, _, err = run_translate(monkeypatch, capsys, "the cat\n", argv)
    assert status == 2
    assert "n_best = 3 is more than beam_size = 2" in err


@pytest.mark.parametrize("n", [32 * 40, 32 * 40 + 7, 50])  # whole blocks, a tail past the last block, too few blocks
def test_top_k_by_block_maxima_gives_topk_values_and_the_positions_of_those_values(n):
    generator = torch.Generator().manual_seed(n)
    scores = torch.randn(6, n, generator=generator)
    scores[1, 5] = 100.0  # one block holds all of row 1's best: its other blocks must still be searched
    scores[1, 6:12] = torch.arange(99.0, 93.0, -1)
    scores[2] = -math.inf  # a row that is -inf but for two scores (a forced end), one of them in the tail
    scores[2, 3], scores[2, n - 1] = -1.0, -2.0
    scores[3, ::3] = 0.5  # ties
    values, indices = top_k(scores, 8)
    expected = scores.topk(8, dim=1).values
    assert torch.equal(values, expected)
    assert torch.equal(scores.gather(1, indices), values)  # each index holds its value
    assert all(len(set(row)) == 8 for row in indices.tolist())  # no position twice

