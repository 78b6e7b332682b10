"""What the beam search (``aiayn.search``) drives, and what plugs into it: the model and its cache
(``SearchModel``, ``SearchCache``, the written contract that ``aiayn.speed.incremental.InferenceModel``
and its ``DecoderCache`` keep), and the steps a faster path may do its own way (``SearchSteps``), with
the plain steps (``PlainSteps``). The fast steps are ``aiayn.speed.search_steps.FAST_STEPS``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.tokens import BOS_ID, EOS_ID, PAD_ID


@runtime_checkable
class SearchCache(Protocol):
    """The model's decoder cache, as a search step drives it: the search passes it back to the model and,
    once a step, has it keep the rows of the hypotheses that go on (``aiayn.speed.decoder_cache.DecoderCache``
    documents the arguments)."""

    filled: int  # the positions fed so far

    def reorder(self, index: Tensor, sources: Tensor | None = None, starts: Tensor | None = None,
                copied: int | None = None) -> SearchCache:
        """Keep rows ``index``, in that order (with ``sources``: regrouped, new source j the old sources[j])."""

    def copy_starts(self, index: Tensor, sources: Tensor | None = None) -> Tensor:
        """(rows,) the first position that ``reorder(index, sources)`` copies into each row."""


class SearchModel(Protocol):
    """What the search drives: an encoder and a cached one-token decoder step
    (``aiayn.speed.incremental.InferenceModel`` documents the arguments). The cache is the model's own.
    A model with a ``config`` whose positional is "learned" caps the output length there."""

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]: ...

    def init_cache(
        self, memory: Tensor, src_pad: Tensor, max_len: int, group: int = 1, capacity: int = 0, scratch: Any = None,
    ) -> SearchCache: ...

    def decode_step(self, tokens: Tensor, position: int, cache: SearchCache) -> Tensor: ...


@dataclass
class NextRows:
    """Which sentences and rows the next step decodes."""

    ended: int  # sentences whose search ended at this step
    kept: Tensor | None  # (going on,) the sentences that go on, in their new order; None when none ended
    rows: Tensor  # (going on * beam,) each live hypothesis's parent row, in the order of `kept`


@runtime_checkable
class SearchSteps(Protocol):
    """The parts of a step that a faster path may do its own way, with the same hypotheses: the plain steps
    (``PlainSteps``), or faster ones plugged in from outside (``aiayn.speed.search_steps.FastSteps``: fewer
    host reads on the CPU, fewer cache copies, a faster top-k)."""

    def log_probs(self, logits: Tensor, force_eos: Tensor) -> Tensor:
        """(rows, vocab) logits -> float32 log-probs, pad and BOS never chosen, EOS forced where force_eos."""

    def top_k(self, scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """scores.topk(k, dim=1): the values exactly, the indices among equal scores possibly others."""

    def slots(self, parents: Tensor) -> Tensor:
        """(sentences, beam) the parent of each surviving candidate -> the beam slot each one takes."""

    def may_be_set(self, flags: Tensor) -> bool:
        """False only when no flag is set (then a step skips work); True where reading them would cost more."""

    def next_rows(self, cache: SearchCache, parent_rows: Tensor, done: Tensor, step: int) -> NextRows:
        """parent_rows (active, beam), done (active,) -> the sentences that go on, and the cache reordered
        for them, unless every sentence ended."""


class PlainSteps:
    """The search's steps as plainly written: a masked fill, torch's top-k, hypotheses in rank order, the
    cache reordered by the rows that go on."""

    def log_probs(self, logits: Tensor, force_eos: Tensor) -> Tensor:
        log_probs = token_log_probs(logits)
        not_eos = torch.arange(log_probs.shape[1], device=log_probs.device).ne(EOS_ID)
        return log_probs.masked_fill_(force_eos[:, None] & not_eos, -math.inf)

    def top_k(self, scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
        return scores.topk(k, dim=1)

    def slots(self, parents: Tensor) -> Tensor:
        return torch.arange(parents.shape[1], device=parents.device).expand_as(parents)

    def may_be_set(self, flags: Tensor) -> bool:
        return True

    def next_rows(self, cache: SearchCache, parent_rows: Tensor, done: Tensor, step: int) -> NextRows:
        active, beam = parent_rows.shape
        ended = int(done.sum())
        kept = (~done).nonzero().squeeze(1) if ended else None
        if ended == active:
            return NextRows(ended, kept, parent_rows.new_empty(0))
        rows = (parent_rows if kept is None else parent_rows[kept]).reshape(-1)
        # The first step had one row per sentence: the rows are the parents' sentences, grown into beams.
        cache_rows = rows // beam if step == 0 else rows
        sources = kept if kept is not None or step > 0 else torch.arange(active, device=done.device)
        cache.reorder(cache_rows, sources=sources)
        return NextRows(ended, kept, rows)


PLAIN_STEPS = PlainSteps()


def token_log_probs(logits: Tensor) -> Tensor:
    """(rows, vocab) logits -> float32 log-probs with pad and BOS never chosen."""
    log_probs = F.log_softmax(logits.float(), dim=-1)
    log_probs[:, PAD_ID] = -math.inf
    log_probs[:, BOS_ID] = -math.inf
    return log_probs
