"""The demo's grammar: one sentence as a tree (the structures) and ``render``, which writes it in both
languages, with German word order, agreement, case and contractions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from aiayn.demo.lexicon import Adjective, Adverb, Conjunction, Noun, Preposition, Verb

# ----------------------------------------------------------------------------------------------
# Structures: one sentence as a tree that renders to both languages
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pronoun:
    en: str
    de: str
    person: str                  # "1sg" | "3sg" | "pl"


SUBJECT_PRONOUNS = (Pronoun("i", "ich", "1sg"), Pronoun("we", "wir", "pl"), Pronoun("they", "sie", "pl"))
_DE_PERSONAL = {"m": "er", "f": "sie", "n": "es"}


def pronoun_for(noun: Noun) -> Pronoun:
    """The pronoun that refers back to ``noun``: English by natural gender, German by grammatical."""
    return Pronoun(noun.en_pronoun, _DE_PERSONAL[noun.gender], "3sg")


@dataclass(frozen=True)
class Gap:
    """The argument a relative clause leaves out: "the dog that _ sees the cat"."""

    person: str = "3sg"


GAP = Gap()


@dataclass(frozen=True)
class NounPhrase:
    noun: Noun
    determiner: str = "the"      # "the" | "a" | "this" | "every" | "my"
    adjectives: tuple[Adjective, ...] = ()
    prep_phrase: PrepPhrase | None = None
    relative: Clause | None = None   # a clause with a Gap where this noun phrase belongs


@dataclass(frozen=True)
class PluralSubject:
    first: NounPhrase
    second: NounPhrase


@dataclass(frozen=True)
class PrepPhrase:
    preposition: Preposition
    object: NounPhrase


Argument = Union[NounPhrase, Pronoun, PluralSubject, Gap]


@dataclass(frozen=True)
class Clause:
    subject: Argument
    verb: Verb
    form: str = "present"        # "present" | "perfect" | "can" | "must" | "want" | "will"
    negated: bool = False
    dative: Argument | None = None
    accusative: Argument | None = None
    predicate: Adjective | None = None
    prep_phrase: PrepPhrase | None = None
    adverb: Adverb | None = None
    adverb_fronted: bool = False     # English and German both front it; German then inverts
    complement: Clause | None = None  # "says that ..."


@dataclass(frozen=True)
class Subordination:
    main: Clause
    conjunction: Conjunction
    subordinate: Clause
    subordinate_first: bool = False


@dataclass(frozen=True)
class Coordination:
    first: Clause
    conjunction: Conjunction
    second: Clause


Sentence = Union[Clause, Subordination, Coordination]

# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------


def _by_case_and_gender(*rows: str) -> dict[tuple[str, str], str]:
    """One row per case (nominative, accusative, dative), columns masculine, feminine, neuter;
    "-" is an empty ending."""
    return {(case, gender): form.replace("-", "")
            for case, row in zip(("nom", "acc", "dat"), rows) for gender, form in zip("mfn", row.split())}


_DEFINITE = _by_case_and_gender("der die das", "den die das", "dem der dem")
_STRONG_ENDINGS = _by_case_and_gender("er e es", "en e es", "em er em")      # dieser, jeder
_MIXED_ENDINGS = _by_case_and_gender("- e -", "en e -", "em er em")          # ein, kein, mein
_WEAK_ADJECTIVE = _by_case_and_gender("e e e", "en e e", "en en en")        # der alte mann
_MIXED_ADJECTIVE = _by_case_and_gender("er e es", "en e es", "en en en")    # ein alter mann
_CONTRACTIONS = {("in", "dem"): "im", ("von", "dem"): "vom", ("zu", "dem"): "zum",
                 ("zu", "der"): "zur", ("bei", "dem"): "beim"}
_AUXILIARIES = {"haben": {"1sg": "habe", "3sg": "hat", "pl": "haben"},
                "sein": {"1sg": "bin", "3sg": "ist", "pl": "sind"}}
_MODALS = {"can": {"1sg": "kann", "3sg": "kann", "pl": "können"},
           "must": {"1sg": "muss", "3sg": "muss", "pl": "müssen"},
           "must not": {"1sg": "darf", "3sg": "darf", "pl": "dürfen"},   # "must not" is dürfen nicht
           "want": {"1sg": "will", "3sg": "will", "pl": "wollen"},
           "will": {"1sg": "werde", "3sg": "wird", "pl": "werden"}}


def _determiner_de(determiner: str, case: str, gender: str, negative: bool) -> str:
    key = (case, gender)
    if determiner == "the":
        return _DEFINITE[key]
    if determiner in {"this", "every"}:
        return {"this": "dies", "every": "jed"}[determiner] + _STRONG_ENDINGS[key]
    stem = {"a": "kein" if negative else "ein", "my": "mein"}[determiner]
    return stem + _MIXED_ENDINGS[key]


def _person(subject: Argument) -> str:
    if isinstance(subject, PluralSubject):
        return "pl"
    if isinstance(subject, (Pronoun, Gap)):
        return subject.person
    return "3sg"


def _argument(argument: Argument | None, case: str, negative: bool = False) -> tuple[list[str], list[str]]:
    """English and German tokens of one argument in a German case; ``negative`` turns ein into kein."""
    if argument is None or isinstance(argument, Gap):
        return [], []
    if isinstance(argument, Pronoun):
        return [argument.en], [argument.de]
    if isinstance(argument, PluralSubject):
        first_en, first_de = _argument(argument.first, case)
        second_en, second_de = _argument(argument.second, case)
        return first_en + ["and"] + second_en, first_de + ["und"] + second_de
    noun = argument.noun
    weak = argument.determiner in {"the", "this", "every"}
    endings = _WEAK_ADJECTIVE if weak else _MIXED_ADJECTIVE
    en = [argument.determiner] + [adjective.en for adjective in argument.adjectives] + noun.en.split()
    de = [_determiner_de(argument.determiner, case, noun.gender, negative)]
    de += [adjective.de_stem + endings[(case, noun.gender)] for adjective in argument.adjectives]
    de.append(noun.de_form(case))
    if argument.prep_phrase is not None:
        pp_en, pp_de = _prep_phrase(argument.prep_phrase)
        en, de = en + pp_en, de + pp_de
    if argument.relative is not None:
        rel_en, rel_de = _relative(noun, argument.relative)
        en, de = en + rel_en, de + rel_de
    return en, de


def _prep_phrase(phrase: PrepPhrase) -> tuple[list[str], list[str]]:
    preposition = phrase.preposition
    en, de = _argument(phrase.object, preposition.case)
    contracted = phrase.object.determiner == "the" and _CONTRACTIONS.get((preposition.de, de[0]))
    de = [contracted] + de[1:] if contracted else [preposition.de] + de
    return preposition.en.split() + en, de


def _relative(head: Noun, clause: Clause) -> tuple[list[str], list[str]]:
    """"that sees the cat" -> ", der die katze sieht ,": the pronoun takes the gap's case."""
    if isinstance(clause.subject, Gap):
        case = "nom"
    elif isinstance(clause.dative, Gap):
        case = "dat"
    else:
        case = "acc"
    en, de = _clause(clause, "sub")
    relative_en = "who" if head.kind == "person" else "that"
    return [relative_en] + en, [",", _DEFINITE[(case, head.gender)]] + de + [","]


def _verb_en(verb: Verb, form: str, person: str, negated: bool) -> list[str]:
    third = person == "3sg"
    particle = [verb.en_particle] if verb.en_particle else []
    not_ = ["not"] if negated else []
    if form == "present":
        if verb.frame == "copula":
            return [{"1sg": "am", "3sg": "is", "pl": "are"}[person]] + not_
        if negated:
            return ["does" if third else "do", "not", verb.en_base] + particle
        return [verb.en_third if third else verb.en_base] + particle
    if form == "perfect":
        return ["has" if third else "have"] + not_ + [verb.en_participle] + particle
    if form == "want":
        if negated:
            return ["does" if third else "do", "not", "want", "to", verb.en_base] + particle
        return ["wants" if third else "want", "to", verb.en_base] + particle
    if form == "can":
        return ["cannot" if negated else "can", verb.en_base] + particle
    return [form] + not_ + [verb.en_base] + particle


def _verb_de(verb: Verb, form: str, person: str, negated: bool) -> tuple[str, list[str], list[str]]:
    """(finite verb of a main clause, its clause-final part, the verb-final group of a subordinate clause)."""
    if form == "present":
        finite = verb.de_form(person)
        return finite, [verb.de_prefix] if verb.de_prefix else [], [verb.de_prefix + finite]
    if form == "perfect":
        auxiliary = _AUXILIARIES[verb.aux][person]
        return auxiliary, [verb.de_participle], [verb.de_participle, auxiliary]
    modal = _MODALS["must not" if form == "must" and negated else form][person]
    infinitive = verb.de_prefix + verb.de_infinitive
    return modal, [infinitive], [infinitive, modal]


def _clause(clause: Clause, order: str) -> tuple[list[str], list[str]]:
    """Render one clause; ``order`` is the German word order: "main" (verb second, a fronted
    adverb first), "inverted" (verb first: a clause before it fills the first position) or
    "sub" (verb last)."""
    person = _person(clause.subject)
    accusative = clause.accusative
    # "does not see a dog" -> "sieht keinen hund", with no separate "nicht"
    kein = clause.negated and isinstance(accusative, NounPhrase) and accusative.determiner == "a"
    subject_en, subject_de = _argument(clause.subject, "nom")
    dative_en, dative_de = _argument(clause.dative, "dat")
    accusative_en, accusative_de = _argument(accusative, "acc", negative=kein)
    pp_en, pp_de = _prep_phrase(clause.prep_phrase) if clause.prep_phrase else ([], [])
    predicate_en = [clause.predicate.en] if clause.predicate else []
    predicate_de = [clause.predicate.de] if clause.predicate else []
    adverb = clause.adverb
    fronted = adverb is not None and clause.adverb_fronted
    complement_en, complement_de = _clause(clause.complement, "sub") if clause.complement else ([], [])

    en = [adverb.en] if fronted else []
    en += subject_en + _verb_en(clause.verb, clause.form, person, clause.negated)
    en += dative_en + accusative_en + predicate_en + pp_en
    if adverb is not None and not fronted:
        en.append(adverb.en)
    if clause.complement:
        en += ["that"] + complement_en

    finite, clause_final, verb_final = _verb_de(clause.verb, clause.form, person, clause.negated)
    first = [adverb.de] if fronted and order == "main" else []
    middle = [] if order == "main" and not first else list(subject_de)
    if adverb is not None and not (fronted and order == "main"):
        middle.append(adverb.de)
    middle += dative_de + accusative_de + pp_de
    if clause.negated and not kein:
        middle.append("nicht")
    middle += predicate_de
    if order == "sub":
        de = middle + verb_final
    elif order == "main" and not first:
        de = subject_de + [finite] + middle + clause_final
    else:
        de = first + [finite] + middle + clause_final
    if clause.complement:
        de += [",", "dass"] + complement_de
    return en, de


def _tidy(tokens: list[str]) -> str:
    """Drop the comma a relative clause leaves before another comma or the full stop."""
    kept: list[str] = []
    for token in tokens:
        if token in {",", "."} and kept and kept[-1] == ",":
            kept[-1] = token
        else:
            kept.append(token)
    return " ".join(kept)


def _english(tokens: list[str]) -> str:
    fixed = [("an" if token == "a" and following[0] in "aeiou" else token)
             for token, following in zip(tokens, tokens[1:] + ["."])]
    return " ".join(fixed)


def render(sentence: Sentence) -> tuple[str, str]:
    """The (English, German) strings of one sentence, lowercase, punctuation as tokens."""
    if isinstance(sentence, Clause):
        en, de = _clause(sentence, "main")
    elif isinstance(sentence, Subordination):
        main_en, main_de = _clause(sentence.main, "inverted" if sentence.subordinate_first else "main")
        sub_en, sub_de = _clause(sentence.subordinate, "sub")
        conjunction = sentence.conjunction
        if sentence.subordinate_first:
            en = [conjunction.en] + sub_en + [","] + main_en
            de = [conjunction.de] + sub_de + [","] + main_de
        else:
            en = main_en + [conjunction.en] + sub_en
            de = main_de + [",", conjunction.de] + sub_de
    else:
        first_en, first_de = _clause(sentence.first, "main")
        second_en, second_de = _clause(sentence.second, "main")
        conjunction = sentence.conjunction
        en = first_en + [",", conjunction.en] + second_en
        # German puts no comma before "und" between main clauses, but one before "aber"
        de = first_de + ([conjunction.de] if conjunction.de == "und" else [",", conjunction.de]) + second_de
    return _english(en + ["."]), _tidy(de + ["."])
