"""The decode stage: batched beam search with incremental decoding (paper, Section 6.1).

The paper decodes with beam size 4, length penalty alpha = 0.6, a maximum output length of input
length + 50, and terminates early when possible. This module is that search as tensor operations
over sentences x beams, driven by the model's cached one-token step (``Transformer.decode_step``):
the encoder-decoder keys and values are computed once per sentence, the decoder's self-attention
keys and values are appended one position per step.

Top-down: the search settings, the length penalty, the greedy reference decoder, the beam search,
batched translation of text, model loading, and the ``aiayn decode`` CLI.

Imports torch alone at module level; sentencepiece and tqdm are imported where they are used.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.errors import UserError, cli
from aiayn.model import ScratchBuffers

# The vocabulary's fixed ids (aiayn.bpe): repeated here so that this module needs no sentencepiece import.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


@dataclass(frozen=True)
class SearchConfig:
    """How to search; the defaults are the paper's (Section 6.1, docs/PAPER.md "Inference")."""

    beam_size: int = 4
    length_penalty: float = 0.6  # alpha of GNMT's ((5 + length) / 6) ** alpha
    max_len_a: float = 1.0  # an output has at most floor(max_len_a * source_length + max_len_b) tokens
    max_len_b: int = 50  # the paper: input length + 50
    n_best: int = 1  # hypotheses returned per sentence, best first
    early_stopping: bool = True  # stop a sentence once no live hypothesis can beat its finished ones

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


def _position_limit(model: Any) -> int | None:
    """A learned positional table has a last row; sinusoids extend to any position (Section 3.5)."""
    config = getattr(model, "config", None)
    if getattr(config, "positional", None) == "learned":
        return int(config.max_positions) - 1
    return None


def _output_lengths(model: Any, src: Tensor, max_len_a: float, max_len_b: int) -> Tensor:
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
    most that. The values are exactly topk's; among equal scores the indices may differ. For a beam
    search step (62 sentences x 4 beams x 8000 tokens, k = 8) topk took 3.3 ms and this 1.0 ms
    (one thread, BENCHMARKS.md's CPU). Elsewhere, and for small rows, it is topk.
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
    no copy of its cached keys and values (``Transformer.reorder_cache`` skips rows that stay).
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
    model: Any, src: Tensor, max_len_a: float = 1.0, max_len_b: int = 50, length_penalty_alpha: float = 0.6
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
    model: Any, src: Tensor, config: SearchConfig = SearchConfig(), scratch: ScratchBuffers | None = None
) -> list[list[Hypothesis]]:
    """src (batch, src_len), right-padded with 0 -> for each sentence its config.n_best hypotheses, best first.

    The model needs the Transformer's inference API: encode, init_cache (with group, capacity and
    scratch), decode_step, reorder_cache (with sources, filled, group, copy_from and copied). A thread that
    searches batch after batch passes the same `scratch` to each, so their caches reuse one memory.

    Each step scores every (live hypothesis, next token) pair of a sentence and keeps the top
    2 * beam_size; of those, the ones ending in EOS that rank in the top beam_size are finished (their
    score divided by the length penalty), and the best beam_size others stay live, so the beam is
    always full (fairseq's scheme). The live hypotheses are kept in the slots of their parents where
    they can (``stable_slots``), so only the cached keys and values of beams that branch are copied. A
    sentence's search ends at the first of:

    - beam_size hypotheses have finished (fairseq's rule; with beam_size 1 this is greedy decoding);
    - early termination, the paper's "terminate early when possible" with tensor2tensor's bound:
      a live hypothesis with log-prob L <= 0 at length l can only finish at a length l' in
      (l, max_len + 1] with log-prob L' <= L, so its best possible score is L / max(lp(l + 1),
      lp(max_len + 1)) (for alpha >= 0, the length penalty at the maximum length). Once the
      n_best-th finished score is at least that bound for the best live hypothesis, no later
      hypothesis can enter the n_best, so stopping returns what searching on would have returned;
    - its maximum length floor(max_len_a * source_length + max_len_b), where EOS is forced.

    A sentence whose search has ended leaves the batch (its cache rows are dropped), so short
    sentences do not wait for long ones.

    On an accelerator the host reads the device once per step: one small tensor with the number of
    sentences that ended and the size of the step's cache copy, which is all it needs to shape the
    next step. The hypotheses stay on the device until the search ends. On the CPU, where reads are
    free (``reads_are_free``), a step also reads to skip work that most steps do not need.
    """
    beam = config.beam_size
    device = src.device
    batch = src.shape[0]
    if batch == 0:
        return []
    reads_free = reads_are_free(device)
    max_lens = _output_lengths(model, src, config.max_len_a, config.max_len_b).to(device)
    longest = int(max_lens.max())
    width = longest + 1  # token slots: up to max_len tokens (the EOS is not stored), never zero

    memory, src_pad = model.encode(src)
    # All beams start as the same empty hypothesis, so the first step decodes one row per sentence;
    # the cache then grows into one group of beam rows per sentence, which share the sentence's
    # encoder-decoder keys and values.
    cache = model.init_cache(memory, src_pad, longest + 1, capacity=batch * beam, scratch=scratch)

    sentence_ids = torch.arange(batch, device=device)  # (active,) the input row of each active sentence
    live_log_probs = torch.zeros((batch, 1), device=device)  # (active, rows per sentence this step)
    live_tokens = torch.full((batch * beam, width), PAD_ID, dtype=torch.long, device=device)
    last_tokens = torch.full((batch,), BOS_ID, dtype=torch.long, device=device)
    finished_scores = torch.full((batch, beam), -math.inf, device=device)  # sorted, best first
    finished_log_probs = torch.full((batch, beam), -math.inf, device=device)
    finished_tokens = torch.full((batch, beam, width), PAD_ID, dtype=torch.long, device=device)
    candidate_rank = torch.arange(2 * beam, device=device)
    # Each sentence's n_best, written when its search ends and read once after the loop.
    result_scores = torch.full((batch, config.n_best), -math.inf, device=device)
    result_log_probs = torch.full((batch, config.n_best), -math.inf, device=device)
    result_tokens = torch.full((batch, config.n_best, width), PAD_ID, dtype=torch.long, device=device)

    for step in range(longest + 1):
        active, rows = live_log_probs.shape  # rows: 1 at the first step, then beam
        force_eos = max_lens.eq(step)[:, None].expand(active, rows).reshape(-1)
        log_probs = _step_log_probs(model.decode_step(last_tokens, step, cache), force_eos, reads_free)
        vocab = log_probs.shape[1]  # log_probs: (active * rows, vocab)
        totals = log_probs.add_(live_log_probs.reshape(-1, 1)).view(active, rows * vocab)
        if totals.shape[1] < 2 * beam:  # a first step over a vocabulary smaller than the candidates kept
            totals = F.pad(totals, (0, 2 * beam - totals.shape[1]), value=-math.inf)
        top_log_probs, top_index = top_k(totals, 2 * beam)  # (active, 2 * beam), best first
        top_beam = torch.div(top_index, vocab, rounding_mode="floor")
        top_token = top_index % vocab
        source_rows = (torch.arange(active, device=device) * beam)[:, None] + top_beam  # rows of live_tokens
        is_eos = top_token.eq(EOS_ID)

        # Finish the EOS candidates among the top beam_size; merge with earlier ones, keep the best beam_size.
        # On the CPU a step where nothing ends skips the merge (its concatenations and gathers were about
        # 1% of a bench search's operator time); elsewhere asking would cost a device synchronisation.
        ends = is_eos[:, :beam] & top_log_probs[:, :beam].isfinite()
        if not reads_free or bool(ends.any()):
            end_log_probs = top_log_probs[:, :beam].masked_fill(~ends, -math.inf)
            end_scores = end_log_probs / length_penalty(step + 1.0, config.length_penalty)
            end_tokens = live_tokens[source_rows[:, :beam].reshape(-1)].view(active, beam, width)
            merged_scores, merged_index = torch.cat([finished_scores, end_scores], dim=1).topk(beam, dim=1)
            finished_scores = merged_scores
            finished_log_probs = torch.cat([finished_log_probs, end_log_probs], dim=1).gather(1, merged_index)
            finished_tokens = torch.cat([finished_tokens, end_tokens], dim=1).gather(
                1, merged_index[:, :, None].expand(-1, -1, width)
            )

        # The best beam_size candidates that do not end stay live (there are at least beam_size of them,
        # as each live hypothesis has one EOS among its candidates).
        live_positions = (is_eos.long() * 2 * beam + candidate_rank).argsort(dim=1)[:, :beam]
        slots = stable_slots(top_beam.gather(1, live_positions))
        live_positions = live_positions.gather(1, slots.argsort(dim=1))  # slot order, no longer best first
        live_log_probs = top_log_probs.gather(1, live_positions)
        keep_rows = source_rows.gather(1, live_positions)  # (active, beam)
        new_tokens = top_token.gather(1, live_positions)

        best_live = live_log_probs.max(dim=1).values
        done = finished_scores.isfinite().sum(dim=1).ge(beam) | max_lens.le(step)
        done |= ~best_live.isfinite()
        if config.early_stopping:
            best_possible_penalty = torch.maximum(
                length_penalty((max_lens + 1).float(), config.length_penalty),
                torch.full_like(best_live, float(length_penalty(step + 2.0, config.length_penalty))),
            )
            done |= finished_scores[:, config.n_best - 1] >= best_live / best_possible_penalty

        # The sentences that go on move to the first places (surviving_order), and each cache row takes
        # over the row of its new hypothesis, copying the positions where the two differ. On the CPU a
        # step where no sentence ended (most) keeps the sentences in place without computing an order.
        order = None if reads_free and not bool(done.any()) else surviving_order(done)  # (active,)
        if order is not None:
            keep_rows = keep_rows[order]
        keep_rows = keep_rows.reshape(-1)
        kept_tokens = live_tokens[keep_rows]
        if step == 0:
            # The first step had one row per sentence: the rows are the parents' sentences, grown into beams.
            cache_rows = keep_rows // beam
            copy_from = torch.where(cache_rows.eq(torch.arange(active * beam, device=device)), 1, 0)
        else:
            # Only the positions written so far are copied, and of those only the ones where a row's
            # new hypothesis differs from the one it replaces.
            cache_rows = keep_rows
            copy_from = first_differing_positions(live_tokens, kept_tokens, step, beam, order)

        # The step's one read: how many sentences ended, and how many (row, position) blocks of keys and
        # values the cache copy moves for the rows of the sentences that go on.
        ended, copied = 0, None
        if order is not None:
            ended_count = done.sum()
            copy_lengths = (step + 1 - copy_from).clamp(min=0)
            going_on = torch.arange(active * beam, device=device) < (active - ended_count) * beam  # rows kept
            ended, copied = torch.stack([ended_count, (copy_lengths * going_on).sum()]).tolist()

        kept = None  # the sentences that go on, when some ended
        if ended:
            # Every active sentence's n_best is written; a sentence's last write is the one of the step it ended.
            result_scores.index_copy_(0, sentence_ids, finished_scores[:, : config.n_best])
            result_log_probs.index_copy_(0, sentence_ids, finished_log_probs[:, : config.n_best])
            result_tokens.index_copy_(0, sentence_ids, finished_tokens[:, : config.n_best])
            if ended == active:
                break
            kept = order[: active - ended]
            rows_kept = (active - ended) * beam
            sentence_ids = sentence_ids[kept]
            max_lens = max_lens[kept]
            live_log_probs = live_log_probs[kept]
            finished_scores = finished_scores[kept]
            finished_log_probs = finished_log_probs[kept]
            finished_tokens = finished_tokens[kept]
            new_tokens = new_tokens[kept]
            cache_rows, copy_from, kept_tokens = cache_rows[:rows_kept], copy_from[:rows_kept], kept_tokens[:rows_kept]
        # group: the first step's one row per sentence grows into beam rows; later steps keep that grouping.
        cache = model.reorder_cache(cache, cache_rows, sources=kept, filled=step + 1, group=beam, copy_from=copy_from,
                                    copied=copied)
        live_tokens = kept_tokens
        live_tokens[:, step] = new_tokens.reshape(-1)
        last_tokens = live_tokens[:, step]
    return _hypotheses(result_scores, result_log_probs, result_tokens)


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


def first_differing_positions(
    tokens: Tensor, new_tokens: Tensor, step: int, beam: int, kept: Tensor | None,
) -> Tensor:
    """The first decoder position at which new row i (hypothesis new_tokens[i]) may have other
    self-attention keys and values than old row i (hypothesis tokens[i]), whose cache it takes over.

    tokens (old rows, width) and new_tokens (new rows, width) hold each hypothesis's tokens of steps
    0 .. step - 1 (beam search: new_tokens are the old rows that survive); decoder position
    p reads the tokens before it (BOS, then tokens[:p]). Two hypotheses of one sentence whose first
    k tokens agree descend from one hypothesis of length k, whose keys and values at positions
    0 .. k were computed once and copied, so those positions need no copy (on bench/decode_cpu.py
    that is an eighth of what copying the whole rows moved). A row that takes over another
    sentence's row starts at 0.
    """
    rows = new_tokens.shape[0]
    differs = tokens[:rows, :step].ne(new_tokens[:, :step])  # (rows, step)
    first = torch.where(differs.any(dim=1), differs.int().argmax(dim=1), step) + 1
    if kept is not None:  # new row i is a row of sentence kept[i // beam]; old row i was of sentence i // beam
        sentence = torch.arange(rows, device=kept.device) // beam
        first = torch.where(kept[sentence].eq(sentence), first, 0)
    return first


def _hypotheses(scores: Tensor, log_probs: Tensor, tokens: Tensor) -> list[list[Hypothesis]]:
    """(sentences, n_best) scores and log-probs and (sentences, n_best, width) tokens -> each sentence's
    finished hypotheses (the -inf scores of ones never found left out), read from the device at once."""
    return [
        [Hypothesis(tokens=[t for t in hypothesis if t != PAD_ID], score=score, log_prob=log_prob)
         for score, log_prob, hypothesis in zip(row_scores, row_log_probs, row_tokens)
         if math.isfinite(score)]
        for row_scores, row_log_probs, row_tokens in zip(scores.tolist(), log_probs.tolist(), tokens.tolist())
    ]


# decode.tokens_per_batch = auto (the schema's default) by device. On CUDA, 50000 keeps the big model's
# decoder cache (beam 4, outputs up to source + 50, bf16) within an 80 GB GPU even for a batch of the
# shortest sources (config/README.md has the arithmetic); elsewhere the CPU's 8000.
AUTO_TOKENS_PER_BATCH = {"cuda": 50000}
CPU_TOKENS_PER_BATCH = 8000


def resolve_tokens_per_batch(tokens_per_batch: int | str, device: torch.device | str) -> int:
    """decode.tokens_per_batch as a number: `auto` by the device's type (AUTO_TOKENS_PER_BATCH, else
    CPU_TOKENS_PER_BATCH); a number as it is."""
    if tokens_per_batch == "auto":
        return AUTO_TOKENS_PER_BATCH.get(torch.device(device).type, CPU_TOKENS_PER_BATCH)
    if isinstance(tokens_per_batch, bool) or not isinstance(tokens_per_batch, int) or tokens_per_batch < 1:
        raise UserError(f"tokens_per_batch = {tokens_per_batch!r} must be a whole number of at least 1, or auto")
    return tokens_per_batch


def tokens_per_batch_argument(text: str) -> int | str:
    """A --tokens-per-batch value: a whole number, or auto (checked by resolve_tokens_per_batch)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number or auto") from None


def length_sorted_batches(lengths: Sequence[int], tokens_per_batch: int, beam_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length, longest first, each within the token budget.

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


def _pad(sequences: Sequence[Sequence[int]], device: torch.device | str) -> Tensor:
    longest = max(len(sequence) for sequence in sequences)
    batch = torch.full((len(sequences), longest), PAD_ID, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        batch[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
    return batch.to(device)


def search_workers(workers: int, device: torch.device) -> int:
    """The workers search_batches uses: as asked on the CPU; 1 on an accelerator, which runs one search
    at a time (larger batches keep it busy), so that CPU configs also run there."""
    return workers if device.type == "cpu" else 1


def search_batches(
    model: Any,
    batches: Sequence[Tensor],
    config: SearchConfig = SearchConfig(),
    workers: int = 1,
    on_done: Callable[[int], None] | None = None,
) -> list[list[list[Hypothesis]]]:
    """beam_search on each padded batch (all on one device, most sentences first), returning each
    batch's results in the order of `batches`.

    With workers > 1 on the CPU (elsewhere it is 1) that many batches are searched at the same time,
    each in its own thread with torch.get_num_threads() // workers intra-op threads (at least 1);
    CTranslate2 calls these inter_threads. torch releases the GIL inside its operators, so
    the threads run on separate cores. A search step is hundreds of small operators, which one
    thread runs with less overhead than two sharing each operator: on 2 cores, 2 workers of 1
    thread each decode 1.07 to 1.23 times as many tokens per second as 1 worker of 2 threads (BENCHMARKS.md).
    on_done(sentences) is called as each batch finishes (from the calling thread).
    Under inference_mode, with bf16 autocast on CUDA.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise UserError(f"workers = {workers!r} must be a whole number of at least 1")
    if not batches:
        return []
    device = batches[0].device
    workers = search_workers(workers, device)
    per_thread = threading.local()  # each thread's ScratchBuffers: its searches reuse one cache memory

    def search(batch: Tensor) -> list[list[Hypothesis]]:
        if not hasattr(per_thread, "scratch"):
            per_thread.scratch = ScratchBuffers()
        # bf16 on a GPU (pitfall 5: no loss scale to overflow); the log-softmax stays float32 in beam_search.
        # inference_mode and autocast are per thread, so each worker enters them itself.
        autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
        with torch.inference_mode(), autocast:
            return beam_search(model, batch, config, per_thread.scratch)

    results: list[list[list[Hypothesis]]] = [[] for _ in batches]
    # Most sentences first (each costs a decoder row per beam and step; source length matters less): a
    # thread's first search sizes the scratch memory that its later ones reuse, and with workers the
    # last batches to start are small ones, so that the workers finish close together.
    largest_first = sorted(range(len(batches)), key=lambda index: (-batches[index].shape[0], -batches[index].numel()))
    if workers == 1:
        for index in largest_first:
            results[index] = search(batches[index])
            if on_done is not None:
                on_done(batches[index].shape[0])
        return results

    from concurrent.futures import ThreadPoolExecutor, as_completed

    threads = torch.get_num_threads()
    per_worker = max(1, threads // workers)

    def initialise() -> None:
        torch.set_num_threads(per_worker)  # OpenMP's thread count is per calling thread: set it in each

    try:
        with ThreadPoolExecutor(max_workers=workers, initializer=initialise, thread_name_prefix="aiayn-search") as pool:
            futures = {pool.submit(search, batches[index]): index for index in largest_first}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                if on_done is not None:
                    on_done(batches[futures[future]].shape[0])
    finally:
        torch.set_num_threads(threads)
    return results


def translate_hypotheses(
    model: Any,
    processor: Any,
    sentences: Sequence[str],
    config: SearchConfig = SearchConfig(),
    tokens_per_batch: int | str = "auto",
    device: torch.device | str = "cpu",
    progress: bool = True,
    workers: int = 1,
) -> list[list[Hypothesis]]:
    """Beam-search each sentence; the n_best hypotheses per sentence in input order.

    A blank line is not decoded: it gets one empty hypothesis with score 0. tokens_per_batch: a number
    or `auto` (``resolve_tokens_per_batch``). workers: as in search_batches.
    """
    from tqdm import tqdm

    device = torch.device(device)
    tokens_per_batch = resolve_tokens_per_batch(tokens_per_batch, device)
    results: list[list[Hypothesis]] = [[Hypothesis(tokens=[], score=0.0, log_prob=0.0)] for _ in sentences]
    to_decode = [index for index, sentence in enumerate(sentences) if sentence.strip()]
    if not to_decode:
        return results
    # Source sequences are BPE ids then EOS, no BOS (the binarise stage's convention).
    encoded = [ids + [EOS_ID] for ids in processor.encode([sentences[i] for i in to_decode], out_type=int)]
    batches = length_sorted_batches([len(ids) for ids in encoded], tokens_per_batch, config.beam_size)
    padded = [_pad([encoded[i] for i in batch], device) for batch in batches]
    with tqdm(total=len(encoded), unit="sent", desc="decode", disable=not progress, file=sys.stderr) as bar:
        searched = search_batches(model, padded, config, workers, on_done=bar.update)
    for batch, hypotheses in zip(batches, searched):
        for position, sentence_hypotheses in zip(batch, hypotheses):
            results[to_decode[position]] = sentence_hypotheses
    return results


def translate_sentences(
    model: Any,
    processor: Any,
    sentences: Sequence[str],
    config: SearchConfig = SearchConfig(),
    tokens_per_batch: int | str = "auto",
    device: torch.device | str = "cpu",
    progress: bool = True,
    workers: int = 1,
) -> list[str]:
    """The best translation of each sentence, detokenised, in input order (a blank line gives "")."""
    hypotheses = translate_hypotheses(
        model, processor, sentences, config, tokens_per_batch, device, progress, workers)
    return [processor.decode(best[0].tokens) if best[0].tokens else "" for best in hypotheses]


def translate_n_best(
    model: Any,
    processor: Any,
    sentences: Sequence[str],
    config: SearchConfig = SearchConfig(),
    tokens_per_batch: int | str = "auto",
    device: torch.device | str = "cpu",
    progress: bool = True,
    workers: int = 1,
) -> list[list[tuple[float, str]]]:
    """For each sentence, its config.n_best (score, translation) pairs, best first, in input order."""
    hypotheses = translate_hypotheses(
        model, processor, sentences, config, tokens_per_batch, device, progress, workers)
    return [
        [(hypothesis.score, processor.decode(hypothesis.tokens) if hypothesis.tokens else "")
         for hypothesis in sentence_hypotheses]
        for sentence_hypotheses in hypotheses
    ]


def load_model(path: str, device: torch.device | str = "cpu"):
    """A trained Transformer from an aiayn checkpoint or averaged model file, in eval mode on device."""
    from aiayn.checkpoint import load_checkpoint
    from aiayn.model import ModelConfig, Transformer

    checkpoint = load_checkpoint(path)
    config = ModelConfig.from_dict(checkpoint["model_config"])
    model = Transformer(config)
    try:
        model.load_state_dict(checkpoint["model"], strict=True)
    except RuntimeError as error:
        first = str(error).strip().splitlines()
        detail = " ".join(line.strip() for line in first[:3])
        raise UserError(
            f"{path}: its weights do not fit its own model_config ({detail}); the file was written by "
            "another version of aiayn or is damaged"
        ) from None
    return model.to(device).eval()


def resolve_device(name: str) -> torch.device:
    """'auto' is the GPU when there is one; 'cuda' without a GPU is a user error, not a traceback."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda, but torch sees no GPU here (use --device cpu or auto)")
    return torch.device(name)


def check_vocabulary(model: Any, processor: Any, spm_model: str) -> None:
    """A model decoded with another vocabulary gives fluent-looking nonsense, so refuse it outright."""
    pieces = processor.get_piece_size()
    if pieces != model.config.vocab_size:
        raise UserError(
            f"{spm_model} has {pieces} pieces but the model was trained with vocab_size = "
            f"{model.config.vocab_size}; use the SentencePiece model of the model's own run"
        )


def load_runtime(args: argparse.Namespace) -> tuple[Any, Any, torch.device]:
    """Model, SentencePiece processor and device from the arguments of ``add_runtime_arguments``."""
    from aiayn.bpe import load_processor

    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads {args.threads} must be at least 1")
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    processor = load_processor(args.spm_model)
    model = load_model(args.model, device)
    check_vocabulary(model, processor, args.spm_model)
    return model, processor, device


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="an averaged model.pt or a training checkpoint")
    parser.add_argument("--spm-model", required=True, help="the run's SentencePiece model (spm.model)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")


@cli
def main(argv: Sequence[str] | None = None) -> None:
    from aiayn.config import add_config_arguments, section_from_arguments
    from aiayn.fileio import read_lines, write_lines_atomic

    parser = argparse.ArgumentParser(prog="aiayn decode", description=__doc__.splitlines()[0])
    add_config_arguments(parser, "decode")
    add_runtime_arguments(parser)
    parser.add_argument("--input", required=True, help="source text, one sentence a line")
    parser.add_argument("--output", required=True, help="where to write the translations, one a line")
    args = parser.parse_args(argv)

    section = dict(section_from_arguments(args, "decode"))
    tokens_per_batch = section.pop("tokens_per_batch", "auto")
    workers = int(section.pop("workers", 1))
    config = SearchConfig.from_dict(section)
    sentences = read_lines(args.input)
    model, processor, device = load_runtime(args)
    tokens_per_batch = resolve_tokens_per_batch(tokens_per_batch, device)

    start = time.perf_counter()
    hypotheses = translate_hypotheses(model, processor, sentences, config, tokens_per_batch, device, workers=workers)
    workers = search_workers(workers, device)
    seconds = max(time.perf_counter() - start, 1e-9)
    # Target tokens count each non-empty output's EOS, as fairseq's generated-token counts do.
    target_tokens = sum(len(best[0].tokens) + 1 for best, line in zip(hypotheses, sentences) if line.strip())
    write_lines_atomic(args.output, [processor.decode(best[0].tokens) if best[0].tokens else "" for best in hypotheses])
    print(
        f"decoded {len(sentences)} sentences ({target_tokens} target tokens) in {seconds:.1f} s on {device}: "
        f"{len(sentences) / seconds:.1f} sentences/s, {target_tokens / seconds:.0f} target tokens/s "
        f"(beam {config.beam_size}, alpha {config.length_penalty}, max length "
        f"{config.max_len_a:g} * source + {config.max_len_b}, tokens_per_batch {tokens_per_batch}, workers {workers})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
