"""Tests for aiayn.search: the cached, batched beam search, against a slow reference and by its rules."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from aiayn import search
from aiayn.errors import UserError
from aiayn.model import ModelConfig, Transformer
from aiayn.search import SearchConfig, beam_search, greedy_search, length_penalty, max_output_lengths
from aiayn.search_contract import PLAIN_STEPS, SearchCache, SearchSteps
from aiayn.speed import search_steps
from aiayn.speed.decoder_cache import DecoderCache
from aiayn.speed.incremental import InferenceModel, RowCounting
from aiayn.speed.search_steps import FAST_STEPS, stable_slots, surviving_order, top_k
from aiayn.tokens import BOS_ID, EOS_ID, PAD_ID

VOCAB = 24


def fast_search(model, src, config=None, steps=FAST_STEPS):
    """The search as the decode stage runs it: with the fast steps (each test of the plain steps says so)."""
    return beam_search(model, src, config, steps=steps)


def tiny_model(seed: int = 0, cls: type[InferenceModel] = InferenceModel, **changes) -> InferenceModel:
    """A small random Transformer in eval mode, ready for the search (as `cls`, which may change its steps)."""
    torch.manual_seed(seed)
    fields = dict(vocab_size=VOCAB, n_layers=2, d_model=32, d_ff=64, n_heads=4, dropout=0.0)
    fields.update(changes)
    return cls(Transformer(ModelConfig(**fields)).eval())


def sources(lengths: list[int], seed: int = 0) -> torch.Tensor:
    """Right-padded source ids, each row its length's worth of real tokens, the last one EOS."""
    generator = torch.Generator().manual_seed(seed)
    batch = torch.full((len(lengths), max(lengths)), PAD_ID, dtype=torch.long)
    for row, length in enumerate(lengths):
        batch[row, : length - 1] = torch.randint(4, VOCAB, (length - 1,), generator=generator)
        batch[row, length - 1] = EOS_ID
    return batch


@pytest.fixture(scope="module")
def half_trained() -> InferenceModel:
    """60 Adam steps on reversing the source: outputs of varied length that end with EOS on their own,
    with beams that finish at different steps (a random model mostly runs to the maximum length)."""
    inference = tiny_model(seed=0)
    model = inference.model.train()
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
    model.eval()
    return inference


def with_weights(cls: type[InferenceModel], inference: InferenceModel) -> InferenceModel:
    """The same Transformer behind another inference class."""
    return cls(inference.model)


class NoEosTransformer(InferenceModel):
    """A real Transformer whose EOS logit is pushed far below every other, so it never ends by itself."""

    def decode_step(self, tokens, position, cache):
        logits = super().decode_step(tokens, position, cache)
        logits[:, EOS_ID] = logits.min(dim=-1).values - 50.0
        return logits


class BigramCache:
    filled = 0

    def __init__(self, src_pad):
        self.src_pad = src_pad

    def reorder(self, index, sources=None, starts=None, copied=None):
        self.src_pad = self.src_pad.index_select(0, index)
        return self

    def copy_starts(self, index, sources=None):
        return torch.zeros_like(index)


class BigramModel(nn.Module):
    """A hand-written next-token table behind the search's model interface: p(next | previous token)."""

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


def reference_beam_search(inference, src_row: list[int], config: SearchConfig) -> list[tuple[list[int], float]]:
    """The slow, obvious search: every hypothesis re-runs model.forward on its whole prefix, one at a time.

    Same scheme as beam_search without early termination: the top 2 * beam candidates, EOS among the
    top beam finish (among all 2 * beam with eos_candidates "all"), the best beam others stay live, stop at the maximum length (or, with
    stop_when_beam_finished, once beam have finished; with stop_when_best_finished, once the best
    candidate of some step has been EOS and n_best have finished).
    """
    src = torch.tensor([src_row])
    max_len = math.floor(config.max_len_a * len(src_row) + config.max_len_b)
    beam = config.beam_size
    live = [([], 0.0)]
    finished = []
    best_ended = False
    for step in range(max_len + 1):
        candidates = []
        for tokens, log_prob in live:
            with torch.no_grad():
                logits = inference.model(src, torch.tensor([[BOS_ID] + tokens]))[0, -1]
            log_probs = F.log_softmax(logits.double(), dim=-1)
            log_probs[PAD_ID] = log_probs[BOS_ID] = -math.inf
            if step == max_len:
                log_probs[[t for t in range(len(log_probs)) if t != EOS_ID]] = -math.inf
            candidates += [(log_prob + value, tokens, token) for token, value in enumerate(log_probs.tolist())]
        candidates = sorted(candidates, key=lambda candidate: -candidate[0])[: 2 * beam]
        best_ended = best_ended or (candidates[0][2] == EOS_ID and math.isfinite(candidates[0][0]))
        for log_prob, tokens, token in candidates[: 2 * beam if config.eos_candidates == "all" else beam]:
            if token == EOS_ID and math.isfinite(log_prob):
                finished.append((log_prob / length_penalty(len(tokens) + 1, config.length_penalty), tokens))
        finished = sorted(finished, key=lambda hypothesis: -hypothesis[0])[:beam]
        live = [(tokens + [token], log_prob) for log_prob, tokens, token in candidates if token != EOS_ID][:beam]
        if config.stop_when_beam_finished and len(finished) >= beam:
            break
        if config.stop_when_best_finished and best_ended and len(finished) >= config.n_best:
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


class FullCopyCache(DecoderCache):
    """Copies the whole written history of every row that moves, as the reorder did before it compared
    the tokens fed."""

    def copy_starts(self, index, sources=None):
        return torch.where(index.eq(torch.arange(index.shape[0])), self.filled, 0)


class FullCopyTransformer(InferenceModel):
    def init_cache(self, *args, **kwargs):
        return FullCopyCache(**vars(super().init_cache(*args, **kwargs)))


@pytest.mark.parametrize("kind", ["half_trained", "random"])
def test_copying_only_where_hypotheses_differ_gives_exactly_the_full_copy_search(kind, half_trained):
    model = half_trained if kind == "half_trained" else tiny_model(seed=21)
    full_copy = with_weights(FullCopyTransformer, model)
    config = SearchConfig(beam_size=4, n_best=4, max_len_a=0.5, max_len_b=6)
    src = sources([7, 3, 5, 9, 12, 4, 8, 2], seed=22)
    expected = fast_search(full_copy, src, config)
    assert [[(h.tokens, h.score, h.log_prob) for h in sentence] for sentence in fast_search(model, src, config)] == \
        [[(h.tokens, h.score, h.log_prob) for h in sentence] for sentence in expected]


@pytest.mark.parametrize("steps", [FAST_STEPS, PLAIN_STEPS], ids=["fast", "plain"])
@pytest.mark.parametrize("stop_when_beam_finished", [False, True])
@pytest.mark.parametrize("early_stopping", [True, False])
def test_cached_batched_search_equals_full_recomputation(early_stopping, stop_when_beam_finished, steps, half_trained):
    model = half_trained
    config = SearchConfig(beam_size=3, length_penalty=0.6, max_len_a=0.5, max_len_b=6,
                          n_best=1 if early_stopping else 3, early_stopping=early_stopping,
                          stop_when_beam_finished=stop_when_beam_finished)
    src = sources([7, 3, 5, 9, 12, 4], seed=2)
    results = beam_search(model, src, config, steps=steps)
    assert len({len(h[0].tokens) for h in results}) > 2  # the case worth testing: they end at different steps
    for row, hypotheses in zip(src.tolist(), results):
        expected = reference_beam_search(model, [t for t in row if t != PAD_ID], config)[: config.n_best]
        assert [h.tokens for h in hypotheses] == [tokens for tokens, _ in expected]
        assert [h.score for h in hypotheses] == pytest.approx([score for _, score in expected], abs=1e-4)


@pytest.mark.parametrize("kind, alpha, n_best, early_stopping", [
    ("half_trained", 0.6, 1, True), ("half_trained", 2.0, 1, True), ("half_trained", 2.0, 1, False),
    ("half_trained", 1.0, 2, True), ("half_trained", 2.0, 3, False), ("random", 0.6, 1, True),
])
def test_stopping_when_the_best_candidate_ends_equals_the_slow_reference(kind, alpha, n_best, early_stopping,
                                                                         half_trained):
    """At alpha 2 the rule ends some sentences before a better hypothesis is found: their outputs differ
    from the default search's, and still equal the reference's with the same rule."""
    model = half_trained if kind == "half_trained" else tiny_model(seed=31)
    config = SearchConfig(beam_size=3, length_penalty=alpha, max_len_a=0.5, max_len_b=6, n_best=n_best,
                          early_stopping=early_stopping, stop_when_best_finished=True)
    differ = 0
    for seed, lengths in ((2, [7, 3, 5, 9, 12, 4]), (12, [2, 8, 6, 10])):
        src = sources(lengths, seed=seed)
        results = fast_search(model, src, config)
        default = fast_search(model, src, dataclasses.replace(config, stop_when_best_finished=False))
        differ += sum([h.tokens for h in a] != [h.tokens for h in b] for a, b in zip(results, default))
        for row, hypotheses in zip(src.tolist(), results):
            expected = reference_beam_search(model, [t for t in row if t != PAD_ID], config)[:n_best]
            assert [h.tokens for h in hypotheses] == [tokens for tokens, _ in expected]
            assert [h.score for h in hypotheses] == pytest.approx([score for _, score in expected], abs=1e-4)
    if alpha == 2.0:
        assert differ > 0


@pytest.mark.parametrize("steps, early_stopping, n_best", [(FAST_STEPS, True, 1), (PLAIN_STEPS, False, 3)],
                         ids=["fast", "plain"])
def test_every_eos_candidate_finishing_equals_the_slow_reference(early_stopping, n_best, steps, half_trained):
    """tensor2tensor's rule (eos_candidates: all): an EOS candidate ranked below the top beam finishes too.
    Its outputs equal the slow reference's under the same rule, and on these sentences some differ from
    fairseq's (the default), so the switch changes what it says."""
    config = SearchConfig(beam_size=3, length_penalty=0.6, max_len_a=0.5, max_len_b=6, n_best=n_best,
                          early_stopping=early_stopping, eos_candidates="all")
    differ = 0
    for seed, lengths in ((2, [7, 3, 5, 9, 12, 4]), (12, [2, 8, 6, 10]), (22, [11, 5, 5, 3, 9])):
        src = sources(lengths, seed=seed)
        results = beam_search(half_trained, src, config, steps=steps)
        default = beam_search(half_trained, src, dataclasses.replace(config, eos_candidates="top_beam"), steps=steps)
        differ += sum([(h.tokens, h.score) for h in a] != [(h.tokens, h.score) for h in b]
                      for a, b in zip(results, default))
        for row, hypotheses in zip(src.tolist(), results):
            expected = reference_beam_search(half_trained, [t for t in row if t != PAD_ID], config)[:n_best]
            assert [h.tokens for h in hypotheses] == [tokens for tokens, _ in expected]
            assert [h.score for h in hypotheses] == pytest.approx([score for _, score in expected], abs=1e-4)
    assert differ > 0


@pytest.mark.parametrize("kind", ["half_trained", "random"])
def test_stopping_when_the_best_candidate_ends_never_decodes_more_than_the_default(kind, half_trained):
    model = half_trained if kind == "half_trained" else tiny_model(seed=31)
    counted = {}
    for rule in ("default", "best"):
        counting = with_weights(RowCounting, model)
        for seed, lengths in ((2, [7, 3, 5, 9, 12, 4]), (12, [2, 8, 6, 10]), (22, [11, 5, 5, 3, 9])):
            steps_before = counting.steps
            fast_search(counting, sources(lengths, seed=seed),
                        SearchConfig(beam_size=4, max_len_b=8, stop_when_best_finished=rule == "best"))
            counted.setdefault(rule, []).append(counting.steps - steps_before)
        counted[rule + " rows"] = counting.rows
    assert all(best <= default for best, default in zip(counted["best"], counted["default"]))
    assert counted["best rows"] <= counted["default rows"]
    if kind == "half_trained":  # outputs that end by themselves: the rule saves rows
        assert counted["best rows"] < counted["default rows"]


def test_stopping_when_the_best_candidate_ends_returns_the_first_best_eos_even_when_longer_would_score_higher():
    """EOS first is the step's best candidate, so the rule ends the search there; the bound alone goes on
    to A 8, which scores higher under alpha = 1."""
    model = BigramModel(LONGER_WINS)
    src = torch.tensor([[4, 4, EOS_ID]])
    config = SearchConfig(beam_size=2, length_penalty=1.0, max_len_b=5)
    assert fast_search(model, src, config)[0][0].tokens == [A, 8]
    assert fast_search(model, src, dataclasses.replace(config, stop_when_best_finished=True))[0][0].tokens == []


def test_at_alpha_zero_stopping_when_the_best_candidate_ends_changes_nothing(half_trained):
    """With no length penalty the bound already ends a sentence at the step whose best candidate is EOS."""
    src = sources([7, 3, 5, 9, 12, 4, 6, 8], seed=2)
    results, steps = {}, {}
    for rule in (False, True):
        counting = with_weights(RowCounting, half_trained)
        results[rule] = [[(h.tokens, h.score) for h in sentence] for sentence in fast_search(
            counting, src, SearchConfig(length_penalty=0.0, max_len_b=8, stop_when_best_finished=rule))]
        steps[rule] = (counting.steps, counting.rows)
    assert results[True] == results[False]
    assert steps[True] == steps[False]


@pytest.mark.parametrize("trained", [False, True])
def test_beam_size_one_equals_greedy_decoding(trained, half_trained):
    model = half_trained if trained else tiny_model(seed=3)
    src = sources([9, 4, 12, 6, 2, 7], seed=4)
    greedy = greedy_search(model, src, max_len_a=1.0, max_len_b=8, length_penalty_alpha=0.6)
    beam = fast_search(model, src, SearchConfig(beam_size=1, max_len_b=8, length_penalty=0.6,
                                                stop_when_beam_finished=True))
    assert [h[0].tokens for h in beam] == [h.tokens for h in greedy]
    assert [h[0].log_prob for h in beam] == pytest.approx([h.log_prob for h in greedy], abs=1e-4)
    assert [h[0].score for h in beam] == pytest.approx([h.score for h in greedy], abs=1e-4)


def test_beam_finds_the_more_probable_output_that_greedy_misses():
    model = BigramModel(GARDEN_PATH)
    src = torch.tensor([[4, 4, EOS_ID]])
    greedy = greedy_search(model, src, max_len_b=5)[0]
    best = fast_search(model, src, SearchConfig(beam_size=4, max_len_b=5))[0][0]
    assert greedy.tokens == [A]
    assert greedy.log_prob == pytest.approx(math.log(0.6 * 0.15), abs=1e-5)
    assert best.tokens == [B]
    assert best.log_prob == pytest.approx(math.log(0.4 * 0.95), abs=1e-5)
    assert best.score > greedy.score


def test_with_fairseqs_rule_beam_size_one_stops_at_its_first_eos_like_greedy_even_when_longer_would_score_higher():
    model = BigramModel(LONGER_WINS)
    src = torch.tensor([[4, 4, EOS_ID]])
    assert greedy_search(model, src, max_len_b=5, length_penalty_alpha=1.0)[0].tokens == []
    config = SearchConfig(beam_size=1, length_penalty=1.0, max_len_b=5, stop_when_beam_finished=True)
    assert fast_search(model, src, config)[0][0].tokens == []


def test_without_fairseqs_rule_only_the_bound_ends_a_search_so_a_longer_hypothesis_can_still_win():
    """The same beam of one, ended by tensor2tensor's bound alone: EOS first has finished, but A 8 can
    still beat it under the length penalty, so the search goes on and finds it."""
    model = BigramModel(LONGER_WINS)
    src = torch.tensor([[4, 4, EOS_ID]])
    for beam in (1, 2):
        config = SearchConfig(beam_size=beam, length_penalty=1.0, max_len_b=5, stop_when_beam_finished=False)
        best = fast_search(model, src, config)[0][0]
        assert best.tokens == [A, 8]
        assert best.score == pytest.approx(math.log(0.24 * 0.98 * 0.99) / (8 / 6), abs=1e-5)


@pytest.mark.parametrize(
    "length, alpha, expected",
    [(1, 0.6, 1.0), (7, 0.6, 2.0**0.6), (13, 0.6, 3.0**0.6), (11, 1.0, 16 / 6), (30, 0.0, 1.0)],
)
def test_length_penalty_is_gnmt_form(length, alpha, expected):
    assert length_penalty(length, alpha) == pytest.approx(expected)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_scores_are_log_prob_over_length_penalty_counting_eos(alpha, half_trained):
    src = sources([6, 8, 3, 9], seed=6)
    results = fast_search(half_trained, src, SearchConfig(beam_size=4, length_penalty=alpha, n_best=4))
    for hypotheses in results:
        for hypothesis in hypotheses:
            expected = hypothesis.log_prob / ((5 + len(hypothesis.tokens) + 1) / 6) ** alpha
            assert hypothesis.score == pytest.approx(expected, rel=1e-5)
            if alpha == 0.0:
                assert hypothesis.score == hypothesis.log_prob


def test_a_larger_length_penalty_favours_longer_outputs(half_trained):
    src = sources([7, 3, 5, 9, 12, 4, 6, 8], seed=2)
    total = {alpha: sum(len(h[0].tokens) for h in fast_search(half_trained, src, SearchConfig(length_penalty=alpha)))
             for alpha in (0.0, 1.0)}
    assert total[1.0] > total[0.0]


def test_n_best_are_distinct_and_sorted_best_first():
    model = tiny_model(seed=7)
    for hypotheses in fast_search(model, sources([5, 9], seed=8), SearchConfig(beam_size=4, n_best=4)):
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
    together = fast_search(model, batch, config)
    for row, length in enumerate(lengths):
        alone = fast_search(model, batch[row : row + 1, :length], config)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in together[row]]
        assert [h.score for h in alone] == pytest.approx([h.score for h in together[row]], abs=1e-4)


def test_output_never_exceeds_a_times_source_length_plus_b():
    model = tiny_model(seed=11, cls=NoEosTransformer)
    lengths = [3, 10, 6]
    src = sources(lengths, seed=12)
    config = SearchConfig(beam_size=3, max_len_a=1.5, max_len_b=2, n_best=3)
    for length, hypotheses in zip(lengths, fast_search(model, src, config)):
        assert [len(h.tokens) for h in hypotheses] == [math.floor(1.5 * length + 2)] * 3
    greedy = greedy_search(model, src, max_len_a=1.5, max_len_b=2)
    assert [len(h.tokens) for h in greedy] == [math.floor(1.5 * length + 2) for length in lengths]
    assert max_output_lengths(src, 1.5, 2).tolist() == [6, 17, 11]


def test_learned_positions_cap_the_output_at_the_table_size():
    model = tiny_model(seed=13, cls=NoEosTransformer, positional="learned", max_positions=12)
    hypotheses = fast_search(model, sources([5], seed=14), SearchConfig(beam_size=2, max_len_b=50))[0]
    assert len(hypotheses[0].tokens) == 11


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("n_best", [1, 2])
def test_early_termination_returns_what_searching_to_the_end_returns(alpha, n_best, half_trained):
    src = sources([5, 8, 3, 11, 6, 9, 4], seed=15)
    outputs, steps = {}, {}
    for early in (True, False):
        model = with_weights(RowCounting, half_trained)
        config = SearchConfig(beam_size=4, length_penalty=alpha, max_len_b=15, n_best=n_best, early_stopping=early)
        outputs[early] = fast_search(model, src, config)
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
    best = fast_search(model, torch.tensor([[4, 4, EOS_ID]]), SearchConfig(beam_size=2, length_penalty=1.0,
                                                                          max_len_b=5))[0][0]
    assert best.tokens == [A, 8]
    assert best.score == pytest.approx(math.log(0.24 * 0.98 * 0.99) / (8 / 6), abs=1e-5)


def test_finished_sentences_leave_the_batch():
    rows = []

    class RowsPerStep(NoEosTransformer):
        def decode_step(self, tokens, position, cache):
            rows.append(tokens.shape[0])
            return super().decode_step(tokens, position, cache)

    model = tiny_model(seed=17, cls=RowsPerStep)
    fast_search(model, sources([3, 3, 3, 30], seed=18), SearchConfig(beam_size=2, max_len_b=0, max_len_a=1.0))
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


class StepMarking(InferenceModel):
    """Notes the host reads counted so far, and the decoder rows, at each decoder step."""

    reads: HostReads | None = None

    def decode_step(self, tokens, position, cache):
        self.marks.append(self.reads.count)
        self.rows.append(tokens.shape[0])
        return super().decode_step(tokens, position, cache)


def accelerator_path(monkeypatch) -> None:
    """Makes beam_search take the path it takes on a GPU, where reading a tensor costs a synchronisation."""
    monkeypatch.setattr(search_steps, "reads_are_free", lambda device: False)


@pytest.mark.parametrize("early_stopping, stop_when_best_finished", [(True, False), (False, False), (True, True)])
def test_the_accelerator_path_reads_the_host_at_most_once_a_step(early_stopping, stop_when_best_finished, half_trained,
                                                                 monkeypatch):
    accelerator_path(monkeypatch)
    model = with_weights(StepMarking, half_trained)
    config = SearchConfig(beam_size=4, n_best=2, max_len_a=0.5, max_len_b=6, early_stopping=early_stopping,
                          stop_when_best_finished=stop_when_best_finished)
    src = sources([7, 3, 5, 9, 12, 4, 8, 2, 10, 6], seed=31)
    model.marks, model.rows, model.reads = [], [], HostReads()
    with model.reads:
        fast_search(model, src, config)
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
                                                      early_stopping=False), SearchConfig(beam_size=1, max_len_b=8),
               SearchConfig(max_len_b=8, stop_when_beam_finished=True),
               SearchConfig(max_len_b=8, length_penalty=2.0, n_best=2, stop_when_best_finished=True)]
    cpu = [fast_search(model, src, config) for config in configs]
    accelerator_path(monkeypatch)
    assert [fast_search(model, src, config) for config in configs] == cpu  # tokens, and scores to the bit


def test_search_config_from_dict_rejects_unknown_keys_and_bad_values():
    assert SearchConfig.from_dict({"beam_size": 5, "length_penalty": 1}) == SearchConfig(beam_size=5, length_penalty=1)
    with pytest.raises(UserError, match="unknown decode setting"):
        SearchConfig.from_dict({"beam": 4})
    with pytest.raises(UserError, match="beam_size"):
        SearchConfig(beam_size=0)
    with pytest.raises(UserError, match="n_best"):
        SearchConfig(beam_size=2, n_best=3)


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



# --- the paper's search standing alone: its imports, the cache it drives, the steps that plug in -----------

def test_the_search_imports_nothing_from_the_speed_wing_or_the_config_machinery():
    """aiayn.search reads as the paper's search: torch, the standard library, the special tokens, the
    user's errors and the schema (its defaults, and its rules for the Python API's values), nothing else."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(search.__file__).read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    ours = {name for name in imported if name.startswith("aiayn")}
    assert not {name for name in ours if name.startswith("aiayn.speed") or name.startswith("aiayn.config")}
    assert ours <= {"aiayn", "aiayn.errors", "aiayn.tokens", "aiayn.schema", "aiayn.search_contract", "aiayn.model",
                    "aiayn.batching"}


def test_the_real_cache_and_the_tests_fake_meet_the_search_cache_contract(half_trained):
    memory, src_pad = half_trained.encode(sources([4, 3]))
    assert isinstance(half_trained.init_cache(memory, src_pad, 5), SearchCache)
    assert isinstance(BigramModel(GARDEN_PATH).init_cache(memory, src_pad, 5), SearchCache)
    assert isinstance(FAST_STEPS, SearchSteps) and isinstance(PLAIN_STEPS, SearchSteps)


@pytest.mark.parametrize("kind", ["half_trained", "random", "learned_positions"])
def test_the_fast_steps_find_the_plain_steps_hypotheses(kind, half_trained):
    model = {"half_trained": half_trained, "random": tiny_model(seed=51),
             "learned_positions": tiny_model(seed=52, positional="learned", max_positions=12)}[kind]
    src = sources([7, 3, 5, 9, 12, 4, 8, 2, 1], seed=53)
    for config in [SearchConfig(max_len_b=8), SearchConfig(beam_size=3, n_best=3, max_len_a=0.5, max_len_b=6,
                                                           early_stopping=False),
                   SearchConfig(max_len_b=8, length_penalty=2.0, n_best=2, stop_when_best_finished=True)]:
        fast, plain = (beam_search(model, src, config, steps=steps) for steps in (FAST_STEPS, PLAIN_STEPS))
        assert [[h.tokens for h in sentence] for sentence in fast] == [[h.tokens for h in sentence] for sentence in plain]
        assert [[h.score for h in sentence] for sentence in fast] == \
            [pytest.approx([h.score for h in sentence], abs=1e-5) for sentence in plain]
    assert greedy_search(model, src, max_len_b=8, steps=FAST_STEPS) == greedy_search(model, src, max_len_b=8)
