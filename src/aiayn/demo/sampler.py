"""The demo's sampler: draws sentence trees (``aiayn.demo.grammar``) from the lexicon with fixed weights,
so the same seed gives the same sentences."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
from dataclasses import dataclass

from aiayn.demo.grammar import (GAP, SUBJECT_PRONOUNS, Argument, Clause, Coordination, NounPhrase, PluralSubject,
                                PrepPhrase, Sentence, Subordination, pronoun_for)
from aiayn.demo.lexicon import (ADJECTIVES, ADVERBS, ANIMATE_KINDS, COORDINATORS, NOUNS, PREPOSITIONS, SUBORDINATORS,
                                VERBS, Adjective, Noun, Verb)


@functools.lru_cache(maxsize=None)
def _nouns_tagged(tags: frozenset[str]) -> tuple[tuple[Noun, ...], tuple[Noun, ...]]:
    simple = tuple(noun for noun in NOUNS if noun.tags & tags and not noun.compound)
    compound = tuple(noun for noun in NOUNS if noun.tags & tags and noun.compound)
    return simple, compound


@functools.lru_cache(maxsize=None)
def _verbs_of(frame: str) -> tuple[Verb, ...]:
    return tuple(verb for verb in VERBS if verb.frame == frame)


@functools.lru_cache(maxsize=None)
def _adjectives_for(kind: str) -> tuple[Adjective, ...]:
    return tuple(adjective for adjective in ADJECTIVES if kind in adjective.kinds)


@dataclass(frozen=True)
class _Weighted:
    options: tuple
    cumulative: tuple[int, ...]


def _weighted(weights: dict) -> _Weighted:
    return _Weighted(tuple(weights), tuple(itertools.accumulate(weights.values())))


_PERSON = frozenset({"person"})
_NOUN_PREPOSITIONS = tuple(preposition for preposition in PREPOSITIONS if preposition.on_nouns)
# the mix below gives English lengths from 3 to 40 tokens, median about 15, a fifth over 20
_SENTENCE_KINDS = _weighted({"simple": 32, "subordinate": 20, "reported": 13, "coordinate": 15, "referring": 20})
_FRAMES = _weighted({"intransitive": 22, "accusative": 44, "dative": 8, "ditransitive": 10, "copula": 12})
_REFERRING_FRAMES = _weighted({"accusative": 70, "dative": 12, "ditransitive": 18})
_RELATIVE_FRAMES = _weighted({"intransitive": 35, "accusative": 50, "dative": 15})
_FORMS = _weighted({"present": 50, "perfect": 20, "can": 7, "must": 5, "want": 6, "will": 12})
_REFERRING_FORMS = _weighted({"present": 75, "perfect": 15, "will": 10})
_REPORTING_FORMS = _weighted({"present": 75, "perfect": 25})
_SUBJECT_DETERMINERS = _weighted({"the": 55, "a": 20, "this": 10, "my": 10, "every": 5})
_OBJECT_DETERMINERS = _weighted({"the": 55, "a": 25, "this": 10, "my": 10})
_SUBJECT_KINDS = _weighted({"noun": 78, "pronoun": 12, "plural": 10})
_ADJECTIVE_COUNTS = _weighted({0: 58, 1: 30, 2: 12})


def role_swapped(clause: Clause) -> Clause | None:
    """"the man sees the dog" for "the dog sees the man", where the verb allows it.

    Such twins have the same bag of English words and differ in German case, so a model that
    ignores word order cannot translate both. Draws nothing: the same clause gives the same twin.
    """
    subject, obj = clause.subject, clause.accusative
    if (clause.verb.frame == "accusative" and isinstance(subject, NounPhrase)
            and isinstance(obj, NounPhrase) and subject.relative is None and obj.relative is None
            and obj.noun.kind in ANIMATE_KINDS and clause.verb.objects & subject.noun.tags):
        return dataclasses.replace(clause, subject=obj, accusative=subject)
    return None


class Sampler:
    """Draws sentence trees; every choice goes through ``self.rng`` so a seed fixes the corpus."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def chance(self, probability: float) -> bool:
        return self.rng.random() < probability

    def pick(self, weighted: _Weighted):
        return self.rng.choices(weighted.options, cum_weights=weighted.cumulative)[0]

    def noun(self, tags: frozenset[str]) -> Noun:
        simple, compound = _nouns_tagged(tags)
        if compound and self.chance(0.25):
            return self.rng.choice(compound)
        return self.rng.choice(simple)

    def adjectives(self, noun: Noun, most: int) -> tuple[Adjective, ...]:
        count = min(self.pick(_ADJECTIVE_COUNTS), most)
        return tuple(self.rng.sample(_adjectives_for(noun.kind), count)) if count else ()

    def noun_phrase(self, tags: frozenset[str], *, subject: bool = False, simple: bool = False,
                    relative: float = 0.0) -> NounPhrase:
        noun = self.noun(tags)
        determiner = self.pick(_SUBJECT_DETERMINERS if subject else _OBJECT_DETERMINERS)
        adjectives = self.adjectives(noun, 1 if simple else 2)
        prep_phrase = relative_clause = None
        # never both: English would hang "that ..." on the nearer noun, the grammar on the head
        if self.chance(relative):
            relative_clause = self.relative_clause(noun)
        elif not simple and self.chance(0.12):
            prep_phrase = self.prep_phrase(noun_attached=True)
        return NounPhrase(noun, determiner, adjectives, prep_phrase, relative_clause)

    def prep_phrase(self, noun_attached: bool) -> PrepPhrase:
        preposition = self.rng.choice(_NOUN_PREPOSITIONS if noun_attached else PREPOSITIONS)
        return PrepPhrase(preposition, self.noun_phrase(preposition.objects, simple=True))

    def subject(self, tags: frozenset[str], relative: float) -> Argument:
        kind = self.pick(_SUBJECT_KINDS)
        if kind == "pronoun":
            return self.rng.choice(SUBJECT_PRONOUNS)
        if kind == "plural":
            return PluralSubject(self.noun_phrase(tags, subject=True, simple=True),
                                 self.noun_phrase(tags, subject=True, simple=True))
        return self.noun_phrase(tags, subject=True, relative=relative)

    def relative_clause(self, head: Noun) -> Clause:
        form = "perfect" if self.chance(0.25) else "present"
        negated = self.chance(0.1)
        if head.kind in ANIMATE_KINDS and self.chance(0.5):
            frame = self.pick(_RELATIVE_FRAMES)
            verb = self.rng.choice(_verbs_of(frame))
            obj = self.noun_phrase(verb.objects, simple=True) if frame != "intransitive" else None
            prep_phrase = self.prep_phrase(False) if frame == "intransitive" and self.chance(0.3) else None
            return Clause(GAP, verb, form, negated,
                          dative=obj if frame == "dative" else None,
                          accusative=obj if frame == "accusative" else None,
                          prep_phrase=prep_phrase)
        verbs = [verb for verb in _verbs_of("accusative") + _verbs_of("dative") if verb.objects & head.tags]
        verb = self.rng.choice(verbs)
        if self.chance(0.2):
            subject: Argument = self.rng.choice(SUBJECT_PRONOUNS)
        else:
            subject = self.noun_phrase(ANIMATE_KINDS, subject=True, simple=True)
        if verb.frame == "dative":
            return Clause(subject, verb, form, negated, dative=GAP)
        return Clause(subject, verb, form, negated, accusative=GAP)

    def clause(self, *, frame: str | None = None, may_front: bool = True, relative: float = 0.15) -> Clause:
        rng = self.rng
        frame = frame or self.pick(_FRAMES)
        verb = rng.choice(_verbs_of(frame))
        subject = self.subject(ANIMATE_KINDS, relative)
        form = self.pick(_FORMS)
        negated = self.chance(0.15)
        dative = accusative = predicate = None
        if frame == "dative":
            dative = self.noun_phrase(verb.objects, relative=relative)
        elif frame == "ditransitive":
            dative = self.noun_phrase(_PERSON, simple=True)
            accusative = self.noun_phrase(verb.objects, relative=relative)
        elif frame == "accusative":
            accusative = self.noun_phrase(verb.objects, relative=relative)
        elif frame == "copula":
            kind = subject.noun.kind if isinstance(subject, NounPhrase) else "person"
            predicate = rng.choice(_adjectives_for(kind))
        last = accusative or dative
        # after a relative clause, a trailing phrase could belong to either clause; allow none
        open_end = not (isinstance(last, NounPhrase) and last.relative is not None)
        prep_phrase = None
        if open_end and frame != "copula" and self.chance(0.2):
            prep_phrase = self.prep_phrase(noun_attached=False)
        adverb, fronted = None, False
        if self.chance(0.15):
            fronted = may_front and self.chance(0.5)
            if fronted or open_end:
                adverb = rng.choice(ADVERBS)
        return Clause(subject, verb, form, negated, dative, accusative, predicate, prep_phrase,
                      adverb, fronted and adverb is not None)

    def referring_clause(self, antecedent: Noun) -> Clause:
        """A clause whose subject is a pronoun for ``antecedent``: "it is cheap", "she sleeps"."""
        pronoun = pronoun_for(antecedent)
        form = self.pick(_REFERRING_FORMS)
        negated = self.chance(0.1)
        if antecedent.kind in ANIMATE_KINDS and self.chance(0.4):
            return Clause(pronoun, self.rng.choice(_verbs_of("intransitive")), form, negated)
        predicate = self.rng.choice(_adjectives_for(antecedent.kind))
        return Clause(pronoun, _verbs_of("copula")[0], form, negated, predicate=predicate)

    def sentences(self) -> list[Sentence]:
        """One sentence, sometimes followed by its role-swapped twin."""
        sentence = self.sentence()
        twin = role_swapped(sentence) if isinstance(sentence, Clause) and self.chance(0.25) else None
        return [sentence] if twin is None else [sentence, twin]

    def sentence(self) -> Sentence:
        rng = self.rng
        kind = self.pick(_SENTENCE_KINDS)
        if kind == "simple":
            return self.clause()
        if kind == "subordinate":
            subordinate_first = self.chance(0.35)
            main = self.clause(may_front=not subordinate_first)
            subordinate = self.clause(may_front=False)
            return Subordination(main, rng.choice(SUBORDINATORS), subordinate, subordinate_first)
        if kind == "reported":
            subject = self.subject(_PERSON, relative=0.05)
            verb = rng.choice(_verbs_of("clausal"))
            form = self.pick(_REPORTING_FORMS)
            # only a fronted adverb: one at the end would read as part of the reported clause
            adverb = rng.choice(ADVERBS) if self.chance(0.08) else None
            return Clause(subject, verb, form, adverb=adverb, adverb_fronted=True,
                          complement=self.clause(may_front=False))
        if kind == "coordinate":
            return Coordination(self.clause(), rng.choice(COORDINATORS), self.clause())
        main = self.clause(frame=self.pick(_REFERRING_FRAMES))
        antecedent = (main.accusative or main.dative).noun
        second = self.referring_clause(antecedent)
        if self.chance(0.5):
            return Subordination(main, rng.choice(SUBORDINATORS[:2]), second)
        return Coordination(main, rng.choice(COORDINATORS), second)
