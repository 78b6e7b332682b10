"""Batched beam search (paper, Section 6.1), and the greedy decoder it is checked against.

The paper decodes with beam size 4, length penalty alpha = 0.6, a maximum output length of input
length + 50, and terminates early when possible. This module is that search as tensor operations
over sentences x beams, driven by a model's cached one-token step (``SearchModel``; for a
Transformer, ``aiayn.speed.incremental.InferenceModel``). It reads as OpenNMT-py's ``beam_search.py``
and fairseq's ``sequence_generator.py`` do: score the candidates, finish those that end, keep the best
live ones, decide which sentences stop (``search_ends``, every stopping rule in one place), reorder the
cache. It stands alone: what exists only for speed (fewer copies and host reads, a faster top-k) plugs
in from outside as ``SearchSteps`` (``aiayn.search_contract``, with the plain steps; the fast ones are
``aiayn.speed.search_steps.FAST_STEPS``, which the decode stage passes); the decode stage's files,
batches and threads are ``aiayn.decode``.

Top-down: the search settings, the length penalty, the beam search, its stopping rules, its state, and
the greedy reference decoder.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import InitVar, dataclass, field
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn import schema
from aiayn.errors import UserError
from aiayn.search_contract import PLAIN_STEPS, SearchModel, SearchSteps
from aiayn.tokens import BOS_ID, EOS_ID, PAD_ID


# The schema's `decode` keys that are the search's own (the rest say how the decode stage feeds it).
SEARCH_KEYS = ("beam_size", "length_penalty", "max_len_a", "max_len_b", "stop_when_beam_finished",
               "stop_when_best_finished", "eos_candidates")


@functools.lru_cache(maxsize=1)
def paper_search() -> dict:
    """The schema's defaults of SEARCH_KEYS, the one home of the paper's search settings. Read when a
    SearchConfig is first made, not at import: this module imports with torch alone."""
    paper = schema.section_defaults("decode")
    return {key: paper[key] for key in SEARCH_KEYS}


def _paper(key: str):
    return field(default_factory=lambda: paper_search()[key])


@dataclass(frozen=True)
class SearchConfig:
    """How to search; the defaults are the schema's `decode` section, the paper's (Section 6.1,
    docs/PAPER.md "Inference"). A value is checked by the schema's rules once, where it enters: built
    here (the Python API), or from a section the config reader checked already (``from_section``)."""

    beam_size: int = _paper("beam_size")
    length_penalty: float = _paper("length_penalty")  # alpha of GNMT's ((5 + length) / 6) ** alpha
    max_len_a: float = _paper("max_len_a")  # an output has at most floor(max_len_a * source + max_len_b) tokens
    max_len_b: int = _paper("max_len_b")
    # also stop once beam_size hypotheses have finished (fairseq's rule)
    stop_when_beam_finished: bool = _paper("stop_when_beam_finished")
    # also stop once a step's best candidate has ended and n_best hypotheses have finished (CTranslate2's
    # early exit; ``search_ends``)
    stop_when_best_finished: bool = _paper("stop_when_best_finished")
    # which EOS candidates of a step's 2 * beam_size finish: "top_beam" (fairseq's), "all" (tensor2tensor's)
    eos_candidates: str = _paper("eos_candidates")
    # Of the Python API alone (the decode stage writes the best of each sentence and always stops early):
    n_best: int = 1  # hypotheses returned per sentence, best first
    early_stopping: bool = True  # stop a sentence once no live hypothesis can beat its finished ones
    checked: InitVar[bool] = False  # the schema's keys were checked where they entered (``from_section``)

    def __post_init__(self, checked: bool) -> None:
        if not checked:
            schema.check_values("decode", {key: getattr(self, key) for key in SEARCH_KEYS}, "SearchConfig")
        if isinstance(self.n_best, bool) or not isinstance(self.n_best, int) or self.n_best < 1:
            raise UserError(f"n_best = {self.n_best!r} must be a whole number of at least 1")
        if self.n_best > self.beam_size:
            raise UserError(
                f"n_best = {self.n_best} is more than beam_size = {self.beam_size} "
                "(a beam search finds at most beam_size hypotheses; raise beam_size)"
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SearchConfig:
        """From keyword values (the Python API), checked as one built here is; unknown keys are named."""
        known = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise UserError(f"unknown decode setting(s): {', '.join(unknown)} (known: {', '.join(known)})")
        return cls(**values)

    @classmethod
    def from_section(cls, section: Mapping[str, Any], **api: Any) -> SearchConfig:
        """From a `decode` section that the config reader has checked and filled (``aiayn.config``), and
        the Python API's own fields (``n_best``, ``early_stopping``)."""
        return cls(**{key: section[key] for key in SEARCH_KEYS}, **api, checked=True)


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


@torch.no_grad()
def beam_search(
    model: SearchModel, src: Tensor, config: SearchConfig | None = None, scratch: Any = None,
    steps: SearchSteps = PLAIN_STEPS,
) -> list[list[Hypothesis]]:
    """src (batch, src_len), right-padded with 0 -> for each sentence its config.n_best hypotheses, best first.

    Each step scores every (live hypothesis, next token) pair of a sentence and keeps the top
    2 * beam_size; of those, the ones ending in EOS that rank in the top beam_size are finished (their
    score divided by the length penalty; fairseq's scheme, ``eos_candidates: top_beam``, or every EOS
    candidate of the 2 * beam_size with ``all``, tensor2tensor's), and the best beam_size others stay
    live, so the beam is always full. ``search_ends`` decides when a sentence's search ends; a sentence
    whose search has ended leaves the batch (its cache rows are dropped), so short sentences do not
    wait for long ones.

    `scratch` goes to the model's init_cache: a thread that searches batch after batch passes the
    same ``ScratchBuffers`` to each, so that their caches reuse one memory. `steps`: the plain steps, or
    faster ones with the same hypotheses (``SearchSteps``).
    """
    config = config or SearchConfig()
    beam = config.beam_size
    batch = src.shape[0]
    if batch == 0:
        return []
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
        log_probs = steps.log_probs(model.decode_step(beams.last_tokens, step, cache), force_eos)
        candidates = _Candidates.best(log_probs, beams.live_log_probs, beam, steps)
        beams.finish(candidates, step, config.length_penalty, steps, all_candidates=config.eos_candidates == "all")
        parent_rows, new_tokens = beams.continue_live(candidates, steps)
        done = search_ends(beams, candidates, step, config)
        going_on = steps.next_rows(cache, parent_rows, done, step)  # reorders the cache
        if going_on.ended:
            beams.write_results()
            if going_on.ended == beams.active:
                break
            beams.keep(going_on.kept)
            new_tokens = new_tokens[going_on.kept]
        beams.extend(going_on.rows, new_tokens, step)
    return _hypotheses(beams.result_scores, beams.result_log_probs, beams.result_tokens)


def search_ends(beams: _Beams, candidates: _Candidates, step: int, config: SearchConfig) -> Tensor:
    """(active,) whether each sentence's search ends at this step: every stopping rule, in one place.

    A sentence's search ends at the first of:

    - its maximum length floor(max_len_a * source_length + max_len_b), where EOS was forced (or no
      live hypothesis is left);
    - early termination (``early_stopping``, on by default), the paper's "terminate early when
      possible" with tensor2tensor's bound: a live hypothesis with log-prob L <= 0 at length l can
      only finish at a length l' in (l, max_len + 1] with log-prob L' <= L, so its best possible score
      is L / max(lp(l + 1), lp(max_len + 1)) (for alpha >= 0). Once the n_best-th finished score is at
      least that bound for the best live hypothesis, no later hypothesis can enter the n_best, so
      stopping returns what searching on would have returned;
    - only with ``stop_when_beam_finished`` (fairseq's rule, off by default): beam_size hypotheses
      have finished, although a live one might still beat them. It saves steps and shortens outputs
      (BENCHMARKS.md); with beam_size 1 it is greedy decoding;
    - only with ``stop_when_best_finished`` (CTranslate2's early exit, off by default): the best
      candidate of one of its steps (by log-prob, before the length penalty) has been EOS, and at
      least n_best hypotheses have finished. At alpha 0 and n_best 1 the bound above already ends the
      search there; at alpha > 0 it can end sooner, missing a longer hypothesis that would score higher.
    """
    if config.stop_when_best_finished:
        # The mark stays, as CTranslate2's top_beam_finished does: n_best > 1 may need later steps.
        best = candidates.tokens[:, 0].eq(EOS_ID) & candidates.log_probs[:, 0].isfinite()
        beams.best_ended = beams.best_ended | best
    best_live = beams.live_log_probs.max(dim=1).values
    done = beams.max_lens.le(step) | ~best_live.isfinite()
    if config.stop_when_beam_finished:
        done |= beams.finished_scores.isfinite().sum(dim=1).ge(beams.beam)
    if config.stop_when_best_finished:
        # finished_scores is sorted best first, -inf where none: its n_best-th is finite once n_best have finished.
        done |= beams.best_ended & beams.finished_scores[:, config.n_best - 1].isfinite()
    if config.early_stopping:
        best_possible_penalty = torch.maximum(
            length_penalty((beams.max_lens + 1).float(), config.length_penalty),
            torch.full_like(best_live, float(length_penalty(step + 2.0, config.length_penalty))),
        )
        done |= beams.finished_scores[:, config.n_best - 1] >= best_live / best_possible_penalty
    return done


@dataclass
class _Candidates:
    """A step's best 2 * beam_size continuations of each sentence, best first: (active, 2 * beam)."""

    log_probs: Tensor  # the hypothesis's log-prob with the token's
    parents: Tensor  # the live hypothesis (beam slot) it continues
    tokens: Tensor
    rows: Tensor  # the parent's row of the live tokens (sentence * beam + slot)

    @classmethod
    def best(cls, log_probs: Tensor, live_log_probs: Tensor, beam: int, steps: SearchSteps) -> _Candidates:
        """log_probs (active * rows, vocab) of the next token, live_log_probs (active, rows)."""
        active, rows = live_log_probs.shape  # rows: 1 at the first step, then beam
        vocab = log_probs.shape[1]
        totals = log_probs.add_(live_log_probs.reshape(-1, 1)).view(active, rows * vocab)
        if totals.shape[1] < 2 * beam:  # a first step over a vocabulary smaller than the candidates kept
            totals = F.pad(totals, (0, 2 * beam - totals.shape[1]), value=-math.inf)
        top_log_probs, top_index = steps.top_k(totals, 2 * beam)  # (active, 2 * beam), best first
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

    def finish(self, candidates: _Candidates, step: int, alpha: float, steps: SearchSteps,
               all_candidates: bool = False) -> None:
        """The EOS candidates among the top beam_size (``all_candidates``: among all 2 * beam_size) finish
        (their score divided by the length penalty) and merge with the earlier ones, keeping the best
        beam_size. A step where nothing ends may skip the merge (its concatenations and gathers), where
        the steps can tell cheaply (the CPU's)."""
        beam, width = self.beam, self.live_tokens.shape[1]
        considered = 2 * beam if all_candidates else beam
        top_log_probs = candidates.log_probs[:, :considered]
        ends = candidates.tokens[:, :considered].eq(EOS_ID) & top_log_probs.isfinite()
        if not steps.may_be_set(ends):
            return
        end_log_probs = top_log_probs.masked_fill(~ends, -math.inf)
        end_scores = end_log_probs / length_penalty(step + 1.0, alpha)
        end_tokens = self.live_tokens[candidates.rows[:, :considered].reshape(-1)].view(self.active, considered, width)
        merged_scores, merged_index = torch.cat([self.finished_scores, end_scores], dim=1).topk(beam, dim=1)
        self.finished_scores = merged_scores
        self.finished_log_probs = torch.cat([self.finished_log_probs, end_log_probs], dim=1).gather(1, merged_index)
        self.finished_tokens = torch.cat([self.finished_tokens, end_tokens], dim=1).gather(
            1, merged_index[:, :, None].expand(-1, -1, width)
        )

    def continue_live(self, candidates: _Candidates, steps: SearchSteps) -> tuple[Tensor, Tensor]:
        """The best beam_size candidates that do not end stay live (there are at least beam_size of them,
        as each live hypothesis has one EOS among its candidates), in the slots ``steps.slots`` gives them
        (the fast steps: their parents' where they can, so that only the cached keys and values of beams
        that branch are copied). Sets their log-probs; returns the rows of their parents (active, beam)
        and their new tokens (active, beam), in slot order."""
        beam = self.beam
        rank = torch.arange(2 * beam, device=candidates.tokens.device)
        live = (candidates.tokens.eq(EOS_ID).long() * 2 * beam + rank).argsort(dim=1)[:, :beam]
        slots = steps.slots(candidates.parents.gather(1, live))
        live = live.gather(1, slots.argsort(dim=1))  # slot order, no longer best first
        self.live_log_probs = candidates.log_probs.gather(1, live)
        return candidates.rows.gather(1, live), candidates.tokens.gather(1, live)

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


def _output_lengths(model: SearchModel, src: Tensor, max_len_a: float, max_len_b: int) -> Tensor:
    lengths = max_output_lengths(src, max_len_a, max_len_b)
    limit = _position_limit(model)
    # The forced EOS is fed at position max_len, which must exist in a learned table.
    return lengths.clamp(max=limit) if limit is not None else lengths


def _position_limit(model: SearchModel) -> int | None:
    """A learned positional table has a last row; sinusoids extend to any position (Section 3.5)."""
    config = getattr(model, "config", None)
    if getattr(config, "positional", None) == "learned":
        return int(config.max_positions) - 1
    return None


def _hypotheses(scores: Tensor, log_probs: Tensor, tokens: Tensor) -> list[list[Hypothesis]]:
    """(sentences, n_best) scores and log-probs and (sentences, n_best, width) tokens -> each sentence's
    finished hypotheses (the -inf scores of ones never found left out), read from the device at once."""
    return [
        [Hypothesis(tokens=[t for t in hypothesis if t != PAD_ID], score=score, log_prob=log_prob)
         for score, log_prob, hypothesis in zip(row_scores, row_log_probs, row_tokens)
         if math.isfinite(score)]
        for row_scores, row_log_probs, row_tokens in zip(scores.tolist(), log_probs.tolist(), tokens.tolist())
    ]


@torch.no_grad()
def greedy_search(
    model: SearchModel, src: Tensor, max_len_a: float | None = None, max_len_b: int | None = None,
    length_penalty_alpha: float | None = None, steps: SearchSteps = PLAIN_STEPS,
) -> list[Hypothesis]:
    """The reference decoder: the most probable next token at every step, with the same cache and limits
    (those left out: the schema's, as SearchConfig's).

    Beam search with beam_size 1 returns exactly this (the tests hold it to that).
    """
    paper = paper_search()
    max_len_a = paper["max_len_a"] if max_len_a is None else max_len_a
    max_len_b = paper["max_len_b"] if max_len_b is None else max_len_b
    length_penalty_alpha = paper["length_penalty"] if length_penalty_alpha is None else length_penalty_alpha
    batch = src.shape[0]
    max_lens = _output_lengths(model, src, max_len_a, max_len_b).to(src.device)
    longest = int(max_lens.max())
    memory, src_pad = model.encode(src)
    cache = model.init_cache(memory, src_pad, longest + 1)
    tokens = torch.full((batch, longest + 1), PAD_ID, dtype=torch.long, device=src.device)
    log_prob = torch.zeros(batch, dtype=torch.float32, device=src.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=src.device)
    last = torch.full((batch,), BOS_ID, dtype=torch.long, device=src.device)
    for step in range(longest + 1):
        log_probs = steps.log_probs(model.decode_step(last, step, cache), max_lens.eq(step))
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
