"""The download stage's splits and its checks of a corpus as a whole: a split as opened
(``SplitSource``) and as counted (``SplitStats``, stats.json's numbers), what the stage refuses (a test
split that is the training data) and the warnings it prints and keeps in stats.json (pairs that look
Moses-escaped, identical sides, empty dev/test sides, trimmed whitespace, a dev split that is the
training data).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

from aiayn.errors import UserError
from aiayn.reading import same_file


@dataclass
class SplitStats:
    pairs_read: int = 0
    pairs_written: int = 0
    dropped_empty: int = 0
    dropped_long: int = 0
    dropped_ratio: int | None = None  # only counted (and recorded) when data.max_length_ratio is set
    newlines_replaced: int = 0
    # accepted, but counted and warned about (``warnings``)
    whitespace_trimmed: int = 0   # pairs with whitespace around a side, removed
    moses_escaped: int = 0        # pairs that look tokenized or Moses-escaped (&apos; &quot; @-@)
    identical_sides: int = 0      # pairs whose source and target text are the same
    empty_side_kept: int = 0      # dev/test pairs with an empty side (train drops them: dropped_empty)
    src_words: int = 0
    tgt_words: int = 0
    origin: list[str] = field(default_factory=list)
    first_pair: dict[str, int] = field(default_factory=dict)  # the first pair of each count above, 1-based

    def as_json(self) -> dict:
        return {key: value for key, value in vars(self).items() if value is not None and key != "first_pair"}

    def count(self, what: str, pair: int) -> None:
        setattr(self, what, getattr(self, what) + 1)
        self.first_pair.setdefault(what, pair)


@dataclass
class SplitSource:
    """One split of a source, opened and checked but not read: ``batches()`` streams its pairs."""

    origin: list[str]
    batches: Callable[[], Iterator[tuple[list[str], list[str]]]]
    pairs: int | None = None  # when known beforehand (the progress bar's total)


def held_out_notes(data: dict, sources: dict[str, SplitSource]) -> list[str]:
    """Refuse a test split that is the training data (the same local files, or the same hub split): its
    BLEU would measure what the model remembers, a leak that looks like a result. A dev split that is the
    training data is a warning (returned): dev loss then measures the fit, though nothing is reported as a
    test result."""
    def same(split: str) -> str | None:  # how `split` is the train split, or None
        if data["source"] == "hub" and data["hub"]["splits"][split] == data["hub"]["splits"]["train"]:
            return f"data.hub.splits.{split} is the train split ({data['hub']['splits'][split]!r})"
        ours, train = sources[split].origin, sources["train"].origin
        if data["source"] == "local" and len(ours) == len(train) and all(map(same_file, ours, train)):
            return f"data.local.{split} is data.local.train (the same files: {', '.join(ours)})"
        return None

    if leak := same("test"):
        raise UserError(f"{leak}: the test BLEU would be measured on sentences the model is trained on; give a "
                        "held-out test set (the paper's is newstest2014)")
    if overlap := same("dev"):
        return [f"{overlap}: dev loss and dev BLEU measure how well the model remembers its training data, not "
                "how it translates; give a held-out dev set (the paper's is newstest2013)"]
    return []


def warnings(stats: dict[str, SplitStats]) -> list[str]:
    """One sentence for each kind of pair that was accepted but looks wrong, with counts per split and
    the first one (by its pair number in the split's source); stats.json keeps the counts."""
    def where(what: str) -> str:
        counts = ", ".join(f"{split} {getattr(s, what)}" for split, s in stats.items() if getattr(s, what))
        split, first = next((split, s) for split, s in stats.items() if getattr(s, what))
        return f"{counts}; the first is pair {first.first_pair[what]} of {split}, {', '.join(first.origin)}"

    def total(what: str) -> int:
        return sum(getattr(s, what) for s in stats.values())

    notes = []
    if total("moses_escaped"):
        notes.append(
            f"{total('moses_escaped')} pairs look tokenized or Moses-escaped (&apos; &quot; @-@; "
            f"{where('moses_escaped')}): the paper's BLEU is computed on raw text, so a tokenized corpus needs "
            "detokenizing first (sacremoses detokenize); the count is moses_escaped in stats.json"
        )
    for split, s in stats.items():
        if s.pairs_read and s.identical_sides == s.pairs_read:
            notes.append(
                f"every pair of the {split} split has the same source and target text ({', '.join(s.origin)}): "
                "the same file given for both languages? (identical_sides in stats.json)"
            )
    if total("empty_side_kept"):
        notes.append(
            f"{total('empty_side_kept')} dev/test pairs have an empty side ({where('empty_side_kept')}); they are "
            "kept, since dropping evaluation sentences would change what BLEU is computed on, but check that source "
            "and target files are aligned (empty_side_kept in stats.json)"
        )
    if total("whitespace_trimmed"):
        notes.append(
            f"{total('whitespace_trimmed')} pairs had whitespace around a side, which was trimmed "
            f"({where('whitespace_trimmed')}; whitespace_trimmed in stats.json)"
        )
    return notes
