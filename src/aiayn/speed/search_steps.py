"""What the beam search (``aiayn.search``) does only for speed: fewer copies, fewer host reads, a faster top-k.

``FAST_STEPS`` plugs into the search as its ``SearchSteps`` (the decode stage passes it). None of it
changes a result; tests/test_search.py holds these steps to the plain ones, the search to a slow
reference and the accelerator path to the CPU's. ``reads_are_free`` tells the two paths apart: on the
CPU a read of a tensor's value costs nothing, so a step reads to skip work most steps do not need; on
an accelerator each read waits for the device (a synchronisation), so a step reads one small tensor
(``next_rows``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from aiayn.search_contract import PLAIN_STEPS, NextRows, SearchCache, token_log_probs
from aiayn.tokens import EOS_ID


def reads_are_free(device: torch.device) -> bool:
    """Whether the search may read tensor values on the host whenever it likes: on the CPU, not elsewhere."""
    return device.type == "cpu"


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
    no copy of its cached keys and values (``DecoderCache.reorder`` skips rows that stay).
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


def step_log_probs(logits: Tensor, force_eos: Tensor) -> Tensor:
    """The plain steps' log-probs; on the CPU only the rows at their maximum length are touched, found by
    reading force_eos (most steps touch no row), where the plain masked fill passes over all rows."""
    if not reads_are_free(logits.device):
        return PLAIN_STEPS.log_probs(logits, force_eos)
    log_probs = token_log_probs(logits)
    forced = force_eos.nonzero().squeeze(1)
    if forced.numel():
        eos = log_probs[forced, EOS_ID]
        log_probs[forced] = -math.inf
        log_probs[forced, EOS_ID] = eos
    return log_probs


def next_rows(cache: SearchCache, parent_rows: Tensor, done: Tensor, step: int, reads_free: bool) -> NextRows:
    """parent_rows (active, beam), done (active,) -> the sentences that go on, and the cache reordered
    for them (one ``reorder`` call), unless every sentence ended.

    The sentences that go on move to the first places (``surviving_order``); on the CPU a step where
    none ended (most) keeps them in place without computing an order. On an accelerator this is the
    step's one host read: how many sentences ended, and how many blocks the cache copy moves for the
    rows of those that go on, so that the copy reads nothing.
    """
    active, beam = parent_rows.shape
    order = None if reads_free and not bool(done.any()) else surviving_order(done)  # (active,)
    rows = (parent_rows if order is None else parent_rows[order]).reshape(-1)
    # The first step had one row per sentence: the rows are the parents' sentences, grown into beams.
    cache_rows = rows // beam if step == 0 else rows
    ended, starts, copied = 0, None, None
    if order is not None:
        ended_count = done.sum()
        starts = cache.copy_starts(cache_rows, order)
        going_on = torch.arange(cache_rows.shape[0], device=done.device) < (active - ended_count) * beam
        ended, copied = torch.stack([ended_count, ((cache.filled - starts) * going_on).sum()]).tolist()
    kept = None
    if ended:
        if ended == active:
            return NextRows(ended, order[:0], rows[:0])
        kept = order[: active - ended]
        going_on_rows = kept.shape[0] * beam
        cache_rows, rows, starts = cache_rows[:going_on_rows], rows[:going_on_rows], starts[:going_on_rows]
    # The first step regroups the cache (its sources given), later steps keep the grouping.
    sources = kept if kept is not None or step > 0 else torch.arange(active, device=done.device)
    cache.reorder(cache_rows, sources=sources, starts=starts, copied=copied)
    return NextRows(ended, kept, rows)


class FastSteps:
    """The search's ``SearchSteps`` for speed: on the CPU, reads that skip work; everywhere, stable slots
    (fewer cache copies) and one host read a step; the block top-k on the CPU."""

    def log_probs(self, logits: Tensor, force_eos: Tensor) -> Tensor:
        return step_log_probs(logits, force_eos)

    def top_k(self, scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
        return top_k(scores, k)

    def slots(self, parents: Tensor) -> Tensor:
        return stable_slots(parents)

    def may_be_set(self, flags: Tensor) -> bool:
        return not reads_are_free(flags.device) or bool(flags.any())

    def next_rows(self, cache: SearchCache, parent_rows: Tensor, done: Tensor, step: int) -> NextRows:
        return next_rows(cache, parent_rows, done, step, reads_are_free(done.device))


FAST_STEPS = FastSteps()
