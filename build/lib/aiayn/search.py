"""Batched beam search (paper, Section 6.1), and the greedy decoder it is checked against.

The paper decodes with beam size 4, length penalty alpha = 0.6, a maximum output length of input
length + 50, and terminates early when possible. This module is that search as tensor operations
over sentences x beams, driven by a model's cached one-token step (``SearchModel``; for a
Transformer, ``aiayn.speed.incremental.InferenceModel``). The decode stage's files, batches and threads
are ``aiayn.decode``.

Top-down: the search settings, the length penalty, the greedy reference decoder, the beam search.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.errors import UserError
from aiayn.tokens import BOS_ID, EOS_ID, PAD_ID


@dataclass(frozen=True)
class SearchConfig:
    """How to search; the defaults are the paper's (Section 6.1, docs/PAPER.md "Inference")."""

    beam_size: int = 4
    length_penalty: float = 0.6  # alpha of GNMT's ((5 + length) / 6) ** alpha
    max_len_a: float = 1.0  # an output has at most floor(max_len_a * source_length + max_len_b) tokens
    max_len_b: int = 50  # the paper: input length + 50
    n_best: int = 1  # hypotheses returned per sentence, best first
    early_stopping: bool = True  # stop a sentence once no live hypothesis can beat its finished ones
    stop_when_beam_finished: bool = False  # also stop once beam_size hypotheses have finished (fairseq's rule)
    # also stop once a step's best candidate has ended and n_best hypotheses have finished (CTranslate2's
    # rule at length penalty 0; ``beam_search``)
    stop_when_best_finished: bool = False

    def __post_init__(self) -> None:
        for name, minimum in (("beam_size", 1), ("n_best", 1), ("max_len_b", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise UserError(f"decode.{name} = {value!r} must be a whole number of at least {minimum}")
        for name in ("length_penalty", "max_len_a"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise UserError(f"decode.{name} = {value!r} must be a number")
        if self.max_len_a < 0:
            raise UserError(f"decode.max_len_a = {self.max_len_a} must not be negative")
        if self.n_best > self.beam_size:
            raise UserError(
                f"n_best = {self.n_best} is more than beam_size = {self.beam_size} "
                "(a beam search finds at most beam_size hypotheses; raise beam_size)"
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SearchConfig:
        known = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise UserError(f"unknown decode setting(s): {', '.join(unknown)} (known: {', '.join(known)})")
        return cls(**values)


@dataclass(frozen=True)
class Hypothesis:
    """One output: tokens without BOS and EOS, score = log_prob / length_penalty(len(tokens) + 1)."""

    tokens: list[int]
    score: float
    log_prob: float  # the sum of the token log-probabilities, the final EOS included


class SearchModel(Protocol):
    """What the search drives: an encoder and a cached one-token decoder step. The cache is the
    model's own (the search only passes it back); ``aiayn.speed.incremental.InferenceModel`` documents the
    arguments. A model with a ``config`` whose positional is "learned" caps the output length there."""

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]: ...

    def init_cache(
        self, memory: Tensor, src_pad: Tensor, max_len: int, group: int = 1, capacity: int = 0, scratch: Any = None,
    ) -> Any: ...

    def decode_step(self, tokens: Tensor, position: int, cache: Any) -> Tensor: ...

    def reorder_cache(
        self, cache: Any, index: Tensor, sources: Tensor | None = None, copied: int | None = None,
    ) -> Any: ...

    def copy_lengths(self, cache: Any, index: Tensor, sources: Tensor | None = None) -> Tensor: ...


def length_penalty(length: Tensor | float, alpha: float) -> Tensor | float:
    """GNMT's lp(Y) = ((5 + |Y|) / 6) ** alpha (docs/PAPER.md "Inference", the t2t form); alpha = 0 gives 1.

    |Y| counts the final EOS, as tensor2tensor and fairseq count it: an empty translation has length 1.
    """
    return ((5.0 + length) / 6.0) ** alpha


def max_output_lengths(src: Tensor, max_len_a: float, max_len_b: int, pad_id: int = PAD_ID) -> Tensor:
    """(batch, src_len) -> (batch,) the most tokens each output may have before its EOS.

    The source length counts its EOS (the non-pad tokens), as fairseq's max_len_a * src_len + max_len_b does.
    """
    source_lengths = src.ne(pad_id).sum(dim=1)
    return torch.floor(source_lengths.double() * max_len_a + max_len_b).long()


def _position_limit(model: SearchModel) -> int | None:
    """A learned positional table has a last row; sinusoids extend to any position (Section 3.5)."""
    config = getattr(model, "config", None)
    if getattr(config, "positional", None) == "learned":
        return int(config.max_positions) - 1
    return None


def _output_lengths(model: SearchModel, src: Tensor, max_len_a: float, max_len_b: int) -> Tensor:
    lengths = max_output_lengths(src, max_len_a, max_len_b)
    limit = _position_limit(model)
    # The forced EOS is fed at position max_len, which must exist in a learned table.
    return lengths.clamp(max=limit) if limit is not None else lengths


def reads_are_free(device: torch.device) -> bool:
    """Whether the search may read tensor values on the host whenever it likes. On the CPU a read costs
    nothing; on an accelerator each one waits until the device has run everything queued before it (a
    synchronisation), so there the search reads one small tensor per step (``beam_search``)."""
    return device.type == "cpu"


def _step_log_probs(logits: Tensor, force_eos: Tensor, reads_free: bool = True) -> Tensor:
    """(rows, vocab) logits -> float32 log-probs with pad and BOS never chosen and EOS forced where asked.

    With reads_free (the CPU) only the rows at their maximum length are touched, found by reading
    force_eos; otherwise one masked fill over all rows does the same without reading it.
    """
    log_probs = F.log_softmax(logits.float(), dim=-1)
    log_probs[:, PAD_ID] = -math.inf
    log_probs[:, BOS_ID] = -math.inf
    if not reads_free:
        not_eos = torch.arange(log_probs.shape[1], device=log_probs.device).ne(EOS_ID)
        return log_probs.masked_fill_(force_eos[:, None] & not_eos, -math.inf)
    forced = force_eos.nonzero().squeeze(1)
    if forced.numel():  # only rows at their maximum length: most steps touch no row here
        eos = log_probs[forced, EOS_ID]
        log_probs[forced] = -math.inf
        log_probs[forced, EOS_ID] = eos
    return log_probs


def top_k(scores: Tensor, k: int, block: int = 32) -> tuple[Tensor, Tensor]:
    """scores (rows, n) -> the k largest of each row and their indices, best first, as scores.topk(k, dim=1).

    On the CPU a row's k largest are picked among the k blocks of `block` consecutive scores with the
    largest maxima (and the scores past the last whole block): those k maxima are k scores, so the
    k-th largest score is at least the k-th largest maximum, and a score in any other block is at
    most that. The values are exactly topk's; among equal scores the indices may differ. It is faster
    than topk over a beam search step's scores (BENCHMARKS.md). Elsewhere, and for small rows, it is topk.
    """
    rows, n = scores.shape
    blocks = n // block
    if scores.device.type != "cpu" or blocks < 4 * k or not scores.is_contiguous():
        return scores.topk(k, dim=1)
    maxima = scores.as_strided((rows, blocks, block), (n, block, 1)).amax(dim=2)  # (rows, blocks)
    chosen = maxima.topk(k, dim=1).indices  # (rows, k)
    positions = (chosen[:, :, None] * block + torch.arange(block, device=scores.device)).view(rows, k * block)
    if n > blocks * block:
        tail = torch.arange(blocks * block, n, device=scores.device).expand(rows, -1)
        positions = torch.cat([positions, tail], dim=1)
    values, where = scores.gather(1, positions).topk(k, dim=1)
    return values, positions.gather(1, where)


def stable_slots(parents: Tensor) -> Tensor:
    """(sentences, beam) parent beam of each surviving candidate -> the beam slot each one takes.

    A candidate takes its parent's slot when it is the first (best) child of that parent; the other
    children take the slots of parents that left no child, in ascending order. The result is a
    permutation of 0 .. beam - 1 per sentence, and a hypothesis that continues in its own slot needs
    no copy of its cached keys and values (``InferenceModel.reorder_cache`` skips rows that stay).
    """
    beam = parents.shape[1]
    slots = torch.arange(beam, device=parents.device)
    same_parent = parents[:, :, None].eq(parents[:, None, :])  # (sentences, child j, child i)
    earlier = torch.ones(beam, beam, dtype=torch.bool, device=parents.device).tril(-1)  # i < j
    first = ~(same_parent & earlier).any(dim=2)
    claimed = parents[:, :, None].eq(slots).any(dim=1)  # (sentences, slot): some child has this parent
    free_slots = (claimed.long() * beam + slots).argsort(dim=1)  # unclaimed slots first, ascending
    rank = (~first).long().cumsum(dim=1) - 1  # the k-th later child takes the k-th free slot
    return torch.where(first, parents, free_slots.gather(1, rank.clamp(min=0)))


@torch.no_grad()
def greedy_search(
    model: SearchModel, src: Tensor, max_len_a: float = SearchConfig.max_len_a,
    max_len_b: int = SearchConfig.max_len_b, length_penalty_alpha: float = SearchConfig.length_penalty
) -> list[Hypothesis]:
    """The reference decoder: the most probable next token at every step, with the same cache and limits.

    Beam search with beam_size 1 returns exactly this (the tests hold it to that).
    """
    batch = src.shape[0]
    max_lens = _output_lengths(model, src, max_len_a, max_len_b).to(src.device)
    longest = int(max_lens.max())
    memory, src_pad = model.encode(src)
    cache = model.init_cache(memory, src_pad, longest + 1)
    tokens = torch.full((batch, longest + 1), PAD_ID, dtype=torch.long, device=src.device)
    log_prob = torch.zeros(batch, dtype=torch.float32, device=src.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=src.device)
    last = torch.full((batch,), BOS_ID, dtype=torch.long, device=src.device)
    reads_free = reads_are_free(src.device)
    for step in range(longest + 1):
        log_probs = _step_log_probs(model.decode_step(last, step, cache), max_lens.eq(step), reads_free)
        best_log_prob, last = log_probs.max(dim=-1)
        log_prob += torch.where(finished, 0.0, best_log_prob)
        tokens[:, step] = torch.where(finished, PAD_ID, last)
        finished |= last.eq(EOS_ID)
        if bool(finished.all()):
            break
    hypotheses = []
    for row, row_log_prob in zip(tokens.tolist(), log_prob.tolist()):
        output = row[: row.index(EOS_ID)]
        score = row_log_prob / length_penalty(len(output) + 1, length_penalty_alpha)
        hypotheses.append(Hypothesis(tokens=output, score=score, log_prob=row_log_prob))
    return hypotheses


@torch.no_grad()
def beam_search(
    model: SearchModel, src: Tensor, config: SearchConfig = SearchConfig(), scratch: Any = None
) -> list[list[Hypothesis]]:
    """src (batch, src_len), right-padded with 0 -> for each sentence its config.n_best hypotheses, best first.

    `scratch` goes to the model's init_cache: a thread that searches batch after batch passes the
    same ``ScratchBuffers`` to each, so that their caches reuse one memory.

    Each step scores every (live hypothesis, next token) pair of a sentence and keeps the top
    2 * beam_size; of those, the ones ending in EOS that rank in the top beam_size are finished (their
    score divided by the length penalty), and the best beam_size others stay live, so the beam is
    always full (fairseq's scheme). The live hypotheses are kept in the slots of their parents where
    they can (``stable_slots``), so only the cached keys and values of beams that branch are copied. A
    sentence's search ends at the first of:

    - early termination, the paper's "terminate early when possible" with tensor2tensor's bound:
      a live hypothesis with log-prob L <= 0 at length l can only finish at a length l' in
      (l, max_len + 1] with log-prob L' <= L, so its best possible score is L / max(lp(l + 1),
      lp(max_len + 1)) (for alpha >= 0, the length penalty at the maximum length). Once the
      n_best-th finished score is at least that bound for the best live hypothesis, no later
      hypothesis can enter the n_best, so stopping returns what searching on would have returned;
    - its maximum length floor(max_len_a * source_length + max_len_b), where EOS is forced;
    - only with ``stop_when_beam_finished`` (fairseq's rule, not tensor2tensor's: off by default):
      beam_size hypotheses have finished, although a live one might still beat them. It saves steps
      and shortens outputs (BENCHMARKS.md, "Why outputs are short"); with beam_size 1 it is greedy
      decoding.
    - only with ``stop_when_best_finished`` (off by default): the best candidate of one of its steps
      (the highest log-prob of all its continuations, before the length penalty) has been EOS, and at
      least n_best hypotheses have finished. This is CTranslate2's early exit (``BeamSearch::search``
      in its src/decoding.cc, with ``patience`` 1), which CTranslate2 itself takes only at length
      penalty 0: with a length penalty it ends a sentence once beam_size x patience hypotheses have
      finished, which is ``stop_when_beam_finished``. With n_best 1 it ends the sentence at the first
      step whose best candidate is EOS. At alpha 0 and n_best 1 the bound above ends it at that step
      already (every later hypothesis has a lower log-prob than that candidate), so the rule changes
      nothing there; at alpha > 0 it can end a sentence before the bound does, and a longer hypothesis
      that the search did not reach could have scored higher.

    A sentence whose search has ended leaves the batch (its cache rows are dropped), so short
    sentences do not wait for long ones.

    On an accelerator the host reads the device once per step: one small tensor with the number of
    sentences that ended and the size of the step's cache copy, which is all it needs to shape the
    next step. The hypotheses stay on the device until the search ends. On the CPU, where reads are
    free (``reads_are_free``), a step also reads to skip work that most steps do not need.
    """
    beam = config.beam_size
    batch = src.shape[0]
    if batch == 0:
        return []
    reads_free = reads_are_free(src.device)
    max_lens = _output_lengths(model, src, config.max_len_a, config.max_len_b).to(src.device)
    longest = int(max_lens.max())
    memory, src_pad = model.encode(src)
    # All beams start as the same empty hypothesis, so the first step decodes one row per sentence;
    # the cache then grows into one group of beam rows per sentence, which share the sentence's
    # encoder-decoder keys and values.
    cache = model.init_cache(memory, src_pad, longest + 1, capacity=batch * beam, scratch=scratch)
    beams = _Beams.start(max_lens, beam, config.n_best, width=longest + 1)
    for step in range(longest + 1):
        force_eos = beams.max_lens.eq(step)[:, None].expand_as(beams.live_log_probs).reshape(-1)
        log_probs = _step_log_probs(model.decode_step(beams.last_tokens, step, cache), force_eos, reads_free)
        candidates = _Candidates.best(log_probs, beams.live_log_probs, beam)
        if config.stop_when_best_finished:
            beams.note_best_ended(candidates)
        beams.finish(candidates, step, config.length_penalty, reads_free)
        keep_rows, new_tokens = beams.continue_live(candidates)
        done = beams.done(step, config)
        # The sentences that go on move to the first places (surviving_order). On the CPU a step where
        # no sentence ended (most) keeps the sentences in place without computing an order.
        order = None if reads_free and not bool(done.any()) else surviving_order(done)  # (active,)
        keep_rows = (keep_rows if order is None else keep_rows[order]).reshape(-1)
        # The first step had one row per sentence: the rows are the parents' sentences, grown into beams.
        cache_rows = keep_rows // beam if step == 0 else keep_rows
        ended, copied = _read_step(model, cache, cache_rows, done, order, beam)
        kept = None  # the sentences that go on, when some ended
        if ended:
            beams.write_results()
            if ended == beams.active:
                break
            kept = order[: beams.active - ended]
            rows_kept = kept.shape[0] * beam
            cache_rows, keep_rows, new_tokens = cache_rows[:rows_kept], keep_rows[:rows_kept], new_tokens[kept]
            beams.keep(kept)
        # The first step regroups the cache (its sources given), later steps keep the grouping.
        sources = kept if kept is not None or step > 0 else torch.arange(beams.active, device=src.device)
        cache = model.reorder_cache(cache, cache_rows, sources=sources, copied=copied)
        beams.extend(keep_rows, new_tokens, step)
    return _hypotheses(beams.result_scores, beams.result_log_probs, beams.result_tokens)


def _read_step(
    model: SearchModel, cache: Any, cache_rows: Tensor, done: Tensor, order: Tensor | None, beam: int,
) -> tuple[int, int | None]:
    """The step's one read of the device: how many sentences ended, and how many (row, position) blocks
    of keys and values the cache copy moves for the rows of the sentences that go on, so that the copy
    reads nothing. Without an order (the CPU, where no sentence ended) nothing is read here: (0, None)."""
    if order is None:
        return 0, None
    ended_count = done.sum()
    going_on = torch.arange(cache_rows.shape[0], device=done.device) < (done.shape[0] - ended_count) * beam
    copied = (model.copy_lengths(cache, cache_rows, order) * going_on).sum()
    ended, copied = torch.stack([ended_count, copied]).tolist()
    return ended, copied


@dataclass
class _Candidates:
    """A step's best 2 * beam_size continuations of each sentence, best first: (active, 2 * beam)."""

    log_probs: Tensor  # the hypothesis's log-prob with the token's
    parents: Tensor  # the live hypothesis (beam slot) it continues
    tokens: Tensor
    rows: Tensor  # the parent's row of the live tokens (sentence * beam + slot)

    @classmethod
    def best(cls, log_probs: Tensor, live_log_probs: Tensor, beam: int) -> _Candidates:
        """log_probs (active * rows, vocab) of the next token, live_log_probs (active, rows)."""
        active, rows = live_log_probs.shape  # rows: 1 at the first step, then beam
        vocab = log_probs.shape[1]
        totals = log_probs.add_(live_log_probs.reshape(-1, 1)).view(active, rows * vocab)
        if totals.shape[1] < 2 * beam:  # a first step over a vocabulary smaller than the candidates kept
            totals = F.pad(totals, (0, 2 * beam - totals.shape[1]), value=-math.inf)
        top_log_probs, top_index = top_k(totals, 2 * beam)  # (active, 2 * beam), best first
        parents = torch.div(top_index, vocab, rounding_mode="floor")
        rows_of_parents = (torch.arange(active, device=parents.device) * beam)[:, None] + parents
        return cls(top_log_probs, parents, top_index % vocab, rows_of_parents)


@dataclass
class _Beams:
    """The search's state: per active sentence its live and finished hypotheses, and per input
    sentence its n_best, written when its search ends and read once after the loop."""

    sentence_ids: Tensor  # (active,) the input row of each active sentence
    max_lens: Tensor  # (active,)
    live_log_probs: Tensor  # (active, rows per sentence this step)
    live_tokens: Tensor  # (active * beam, width)
    last_tokens: Tensor  # (active * rows,) the tokens the next step feeds
    finished_scores: Tensor  # (active, beam), sorted, best first
    finished_log_probs: Tensor
    finished_tokens: Tensor  # (active, beam, width)
    best_ended: Tensor  # (active,) the best candidate of one of the sentence's steps was EOS (stop_when_best_finished)
    result_scores: Tensor  # (batch, n_best)
    result_log_probs: Tensor
    result_tokens: Tensor  # (batch, n_best, width)

    @classmethod
    def start(cls, max_lens: Tensor, beam: int, n_best: int, width: int) -> _Beams:
        """Every sentence with one live empty hypothesis; width: token slots, up to max_len tokens (the
        EOS is not stored), never zero."""
        batch, device = max_lens.shape[0], max_lens.device
        return cls(
            sentence_ids=torch.arange(batch, device=device),
            max_lens=max_lens,
            live_log_probs=torch.zeros((batch, 1), device=device),
            live_tokens=torch.full((batch * beam, width), PAD_ID, dtype=torch.long, device=device),
            last_tokens=torch.full((batch,), BOS_ID, dtype=torch.long, device=device),
            finished_scores=torch.full((batch, beam), -math.inf, device=device),
            finished_log_probs=torch.full((batch, beam), -math.inf, device=device),
            finished_tokens=torch.full((batch, beam, width), PAD_ID, dtype=torch.long, device=device),
            best_ended=torch.zeros(batch, dtype=torch.bool, device=device),
            result_scores=torch.full((batch, n_best), -math.inf, device=device),
            result_log_probs=torch.full((batch, n_best), -math.inf, device=device),
            result_tokens=torch.full((batch, n_best, width), PAD_ID, dtype=torch.long, device=device),
        )

    @property
    def active(self) -> int:
        return self.sentence_ids.shape[0]

    @property
    def beam(self) -> int:
        return self.finished_scores.shape[1]

    def finish(self, candidates: _Candidates, step: int, alpha: float, reads_free: bool) -> None:
        """The EOS candidates among the top beam_size finish (their score divided by the length penalty)
        and merge with the earlier ones, keeping the best beam_size. On the CPU a step where nothing
        ends skips the merge (its concatenations and gathers); elsewhere asking would cost a device
        synchronisation."""
        beam, width = self.beam, self.live_tokens.shape[1]
        top_log_probs = candidates.log_probs[:, :beam]
        ends = candidates.tokens[:, :beam].eq(EOS_ID) & top_log_probs.isfinite()
        if reads_free and not bool(ends.any()):
            return
        end_log_probs = top_log_probs.masked_fill(~ends, -math.inf)
        end_scores = end_log_probs / length_penalty(step + 1.0, alpha)
        end_tokens = self.live_tokens[candidates.rows[:, :beam].reshape(-1)].view(self.active, beam, width)
        merged_scores, merged_index = torch.cat([self.finished_scores, end_scores], dim=1).topk(beam, dim=1)
        self.finished_scores = merged_scores
        self.finished_log_probs = torch.cat([self.finished_log_probs, end_log_probs], dim=1).gather(1, merged_index)
        self.finished_tokens = torch.cat([self.finished_tokens, end_tokens], dim=1).gather(
            1, merged_index[:, :, None].expand(-1, -1, width)
        )

    def note_best_ended(self, candidates: _Candidates) -> None:
        """Marks the sentences whose best candidate of this step (the first, by log-prob) is EOS; the mark
        stays, as CTranslate2's top_beam_finished does, for n_best > 1 may need later steps."""
        best = candidates.tokens[:, 0].eq(EOS_ID) & candidates.log_probs[:, 0].isfinite()
        self.best_ended = self.best_ended | best

    def continue_live(self, candidates: _Candidates) -> tuple[Tensor, Tensor]:
        """The best beam_size candidates that do not end stay live (there are at least beam_size of them,
        as each live hypothesis has one EOS among its candidates), in the slots of their parents where
        they can (``stable_slots``), so that only the cached keys and values of beams that branch are
        copied. Sets their log-probs; returns the rows of their parents (active, beam) and their new
        tokens (active, beam), in slot order."""
        beam = self.beam
        rank = torch.arange(2 * beam, device=candidates.tokens.device)
        live = (candidates.tokens.eq(EOS_ID).long() * 2 * beam + rank).argsort(dim=1)[:, :beam]
        slots = stable_slots(candidates.parents.gather(1, live))
        live = live.gather(1, slots.argsort(dim=1))  # slot order, no longer best first
        self.live_log_probs = candidates.log_probs.gather(1, live)
        return candidates.rows.gather(1, live), candidates.tokens.gather(1, live)

    def done(self, step: int, config: SearchConfig) -> Tensor:
        """(active,) whether a sentence's search ends at this step (``beam_search`` says when)."""
        best_live = self.live_log_probs.max(dim=1).values
        done = self.max_lens.le(step) | ~best_live.isfinite()
        if config.stop_when_beam_finished:
            done |= self.finished_scores.isfinite().sum(dim=1).ge(self.beam)
        if config.stop_when_best_finished:
            # finished_scores is sorted best first, -inf where none: its n_best-th is finite once n_best have finished.
            done |= self.best_ended & self.finished_scores[:, config.n_best - 1].isfinite()
        if config.early_stopping:
            best_possible_penalty = torch.maximum(
                length_penalty((self.max_lens + 1).float(), config.length_penalty),
                torch.full_like(best_live, float(length_penalty(step + 2.0, config.length_penalty))),
            )
            done |= self.finished_scores[:, config.n_best - 1] >= best_live / best_possible_penalty
        return done

    def write_results(self) -> None:
        """Every active sentence's n_best is written; a sentence's last write is the one of the step it ended."""
        n_best = self.result_scores.shape[1]
        self.result_scores.index_copy_(0, self.sentence_ids, self.finished_scores[:, :n_best])
        self.result_log_probs.index_copy_(0, self.sentence_ids, self.finished_log_probs[:, :n_best])
        self.result_tokens.index_copy_(0, self.sentence_ids, self.finished_tokens[:, :n_best])

    def keep(self, kept: Tensor) -> None:
        """Only the sentences `kept` go on, in that order."""
        for name in ("sentence_ids", "max_lens", "live_log_probs", "finished_scores", "finished_log_probs",
                     "finished_tokens", "best_ended"):
            setattr(self, name, getattr(self, name)[kept])

    def extend(self, keep_rows: Tensor, new_tokens: Tensor, step: int) -> None:
        """Live hypothesis i is the one of row keep_rows[i] with new_tokens[i] appended at `step`."""
        self.live_tokens = self.live_tokens[keep_rows]
        self.live_tokens[:, step] = new_tokens.reshape(-1)
        self.last_tokens = self.live_tokens[:, step]


def surviving_order(done: Tensor) -> Tensor:
    """(active,) True where a sentence's search has ended -> a permutation of the sentences that puts
    the ones that go on first and moves few of them: with s going on, each that ended in the first s
    places swaps with one that goes on from past them (the k-th such place with the k-th such sentence).

    Its shape does not depend on the values of `done`, so an accelerator computes it without a
    synchronisation; the first s entries are the sentences that go on.
    """
    places = torch.arange(done.shape[0], device=done.device)
    first = places < done.shape[0] - done.sum()  # the places the sentences that go on will take
    holes, movers = done & first, ~done & ~first  # as many of each
    # A stable argsort of "not a hole" lists the holes first, in order (the same for movers).
    hole_places, mover_places = (~holes).int().argsort(stable=True), (~movers).int().argsort(stable=True)
    hole_rank, mover_rank = (holes.cumsum(0) - 1).clamp(min=0), (movers.cumsum(0) - 1).clamp(min=0)
    return torch.where(holes, mover_places[hole_rank], torch.where(movers, hole_places[mover_rank], places))


def _hypotheses(scores: Tensor, log_probs: Tensor, tokens: Tensor) -> list[list[Hypothesis]]:
    """(sentences, n_best) scores and log-probs and (sentences, n_best, width) tokens -> each sentence's
    finished hypotheses (the -inf scores of ones never found left out), read from the device at once."""
    return [
        [Hypothesis(tokens=[t for t in hypothesis if t != PAD_ID], score=score, log_prob=log_prob)
         for score, log_prob, hypothesis in zip(row_scores, row_log_probs, row_tokens)
         if math.isfinite(score)]
        for row_scores, row_log_probs, row_tokens in zip(scores.tolist(), log_probs.tolist(), tokens.tolist())
    ]

