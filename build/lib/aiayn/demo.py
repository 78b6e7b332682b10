"""The embedded demo corpus: synthetic English -> German-like sentence pairs from a seed.

No data files ship with the project, so the default pipeline trains on a corpus drawn from a
small grammar. The grammar is built so that a translator needs what the Transformer offers:

* reordering: verb-final subordinate and relative clauses, verb-second after a fronted adverb
  or clause, participles, infinitives and separable prefixes at the end of the clause;
* agreement across several words: gender and case of the noun choose article, adjective
  ending and relative pronoun, and an English "it" becomes er / sie / es after the gender of
  a noun several words to its left;
* compounds: "the kitchen table" becomes one word, "der küchentisch", with the head's gender;
* word order carries meaning: subject and object differ only by position in English but by
  case in German ("the dog sees the man" -> "der hund sieht den mann").

The target is a function of the source (the grammar never lets one English string come from
two structures that translate differently), so a small model can approach a perfect score.
``generate_corpus`` is the entry point; the dataclasses and ``render`` below are the building
blocks it samples, public so that tests and readers can build one sentence by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

from aiayn.errors import UserError, cli
from aiayn.fileio import write_lines_atomic

MAX_SOURCE_TOKENS = 40
MAX_TARGET_TOKENS = 46

# ----------------------------------------------------------------------------------------------
# Lexicon
# ----------------------------------------------------------------------------------------------

ANIMATE_KINDS = frozenset({"person", "animal"})


@dataclass(frozen=True)
class Noun:
    en: str                      # may be two words for a compound: "kitchen table"
    de: str
    gender: str                  # "m" | "f" | "n"
    kind: str                    # "person" | "animal" | "thing" | "place"
    tags: frozenset[str]         # the kind plus semantic classes verbs select on
    en_pronoun: str = "it"
    de_oblique: str | None = None    # weak masculine nouns: der junge, den jungen, dem jungen
    compound: bool = False

    def de_form(self, case: str) -> str:
        if self.de_oblique and case != "nom":
            return self.de_oblique
        return self.de


@dataclass(frozen=True)
class Adjective:
    en: str
    de: str                      # predicative: "der tisch ist dunkel"
    de_stem: str                 # attributive stem: "der dunkle tisch"
    kinds: frozenset[str]


@dataclass(frozen=True)
class Verb:
    en_base: str
    en_third: str
    en_participle: str
    en_particle: str             # "switch on": the particle follows the verb, before the object
    de_infinitive: str           # without the separable prefix
    de_first: str
    de_third: str
    de_plural: str
    de_participle: str           # with the prefix: eingeschaltet
    de_prefix: str
    aux: str                     # "haben" | "sein"
    frame: str                   # "intransitive" | "accusative" | "dative" | "ditransitive" | "clausal" | "copula"
    objects: frozenset[str]      # tags an object may carry (the accusative one for ditransitives)

    def de_form(self, person: str) -> str:
        return {"1sg": self.de_first, "3sg": self.de_third, "pl": self.de_plural}[person]


@dataclass(frozen=True)
class Preposition:
    en: str
    de: str
    case: str                    # "acc" | "dat"
    objects: frozenset[str]
    on_nouns: bool               # may also modify a noun ("the dog in the garden")


@dataclass(frozen=True)
class Adverb:
    en: str
    de: str


@dataclass(frozen=True)
class Conjunction:
    en: str
    de: str


def _nouns(table: str, kind: str) -> list[Noun]:
    """Rows: ``en de gender [pronoun] [oblique=form] [tags...]``; ``_`` joins English words."""
    nouns = []
    for row in table.strip().splitlines():
        en, de, gender, *rest = row.split()
        pronoun = rest.pop(0) if rest and rest[0] in {"he", "she"} else "it"
        oblique = None
        if rest and rest[0].startswith("oblique="):
            oblique = rest.pop(0).removeprefix("oblique=")
        tags = frozenset({kind, *rest})
        nouns.append(Noun(en.replace("_", " "), de, gender, kind, tags, pronoun, oblique))
    return nouns


PERSONS = _nouns("""
man mann m he
woman frau f she
boy junge m he oblique=jungen
girl mädchen n she
father vater m he
mother mutter f she
brother bruder m he
sister schwester f she
king könig m he
queen königin f she
uncle onkel m he
aunt tante f she
son sohn m he
daughter tochter f she
grandfather großvater m he
grandmother großmutter f she
""", "person")

ANIMALS = _nouns("""
dog hund m
cat katze f
horse pferd n
bird vogel m
mouse maus f
bear bär m oblique=bären
lion löwe m oblique=löwen
monkey affe m oblique=affen
cow kuh f
sheep schaf n
fish fisch m
rabbit kaninchen n
pig schwein n
duck ente f
fox fuchs m
goat ziege f
""", "animal")

THINGS = _nouns("""
table tisch m
chair stuhl m
lamp lampe f device
book buch n readable openable
door tür f openable
window fenster n openable
cup tasse f
glass glas n
bottle flasche f openable
key schlüssel m
car auto n openable
bag tasche f openable
picture bild n
letter brief m readable openable
apple apfel m food
bread brot n food
cake kuchen m food
cheese käse m food
clock uhr f device
bed bett n
box kiste f openable
ball ball m
hat hut m
coat mantel m
shirt hemd n
phone telefon n device
radio radio n device
computer computer m device
newspaper zeitung f readable
map karte f readable
pen stift m
knife messer n
spoon löffel m
plate teller m
tree baum m
pot topf m
umbrella schirm m openable
bicycle fahrrad n
flower blume f
""", "thing")

PLACES = _nouns("""
garden garten m
kitchen küche f
house haus n
school schule f
park park m
city stadt f
forest wald m
street straße f
room zimmer n
village dorf n
shop laden m
church kirche f
office büro n
river fluss m
train_station bahnhof m
market markt m
hospital krankenhaus n
bridge brücke f
""", "place")

# English modifier noun -> the German stem it takes inside a compound (note the linking forms:
# küche -> küchen-, schule -> schul-, buch -> bücher-).
COMPOUND_STEMS = {
    "apple": "apfel", "kitchen": "küchen", "school": "schul", "house": "haus", "garden": "garten",
    "water": "wasser", "coffee": "kaffee", "tea": "tee", "wine": "wein", "bread": "brot",
    "flower": "blumen", "car": "auto", "winter": "winter", "book": "bücher", "door": "tür",
    "village": "dorf", "church": "kirchen",
}

# head noun -> the modifiers it combines with; the compound takes the head's gender and tags
COMPOUND_HEADS = {
    "tree": "apple", "table": "kitchen garden school coffee", "chair": "kitchen garden",
    "door": "house kitchen garden car church", "key": "house car door", "cup": "coffee tea",
    "bottle": "water wine", "glass": "water wine", "bag": "school book", "clock": "kitchen church",
    "knife": "kitchen bread", "book": "school", "window": "kitchen car house school church",
    "lamp": "kitchen garden", "pot": "flower coffee tea", "coat": "winter", "cake": "apple",
    "shop": "book bread flower wine", "house": "garden school", "street": "village",
    "garden": "school kitchen flower", "market": "flower village",
}


def _compounds() -> list[Noun]:
    heads = {noun.en: noun for noun in THINGS + PLACES}
    compounds = []
    for head_en, modifiers in COMPOUND_HEADS.items():
        head = heads[head_en]
        for modifier in modifiers.split():
            compounds.append(Noun(f"{modifier} {head.en}", COMPOUND_STEMS[modifier] + head.de,
                                  head.gender, head.kind, head.tags, compound=True))
    return compounds


COMPOUNDS = _compounds()
NOUNS = tuple(PERSONS + ANIMALS + THINGS + PLACES + COMPOUNDS)


def _adjectives(table: str) -> list[Adjective]:
    """Rows: ``en de [attributive-stem] kinds`` with kinds from A(nimate) T(hing) P(lace)."""
    kinds_of = {"A": ("person", "animal"), "T": ("thing",), "P": ("place",)}
    adjectives = []
    for row in table.strip().splitlines():
        en, de, *rest = row.split()
        stem = rest[0] if len(rest) == 2 else de
        kinds = frozenset(kind for letter in rest[-1] for kind in kinds_of[letter])
        adjectives.append(Adjective(en, de, stem, kinds))
    return adjectives


ADJECTIVES = tuple(_adjectives("""
old alt ATP
new neu TP
small klein ATP
big groß ATP
beautiful schön ATP
red rot T
green grün T
dark dunkel dunkl TP
cheap billig T
expensive teuer teur TP
heavy schwer T
empty leer TP
clean sauber TP
warm warm TP
cold kalt TP
tired müde müd A
hungry hungrig A
happy froh A
clever klug A
young jung A
friendly freundlich A
brave mutig A
lazy faul A
loud laut AP
quiet ruhig AP
"""))


def _verbs(table: str) -> list[Verb]:
    """Rows: ``en base third participle [+particle] | de infinitive first third participle aux
    [+prefix] | frame | object tags``."""
    verbs = []
    for row in table.strip().splitlines():
        en_part, de_part, frame, objects = (field.split() for field in row.split("|"))
        en_particle = en_part.pop()[1:] if en_part[-1].startswith("+") else ""
        de_prefix = de_part.pop()[1:] if de_part[-1].startswith("+") else ""
        infinitive, first, third, participle, aux = de_part
        plural = "sind" if infinitive == "sein" else infinitive
        verbs.append(Verb(*en_part, en_particle, infinitive, first, third, plural, participle,
                          de_prefix, aux, frame[0], frozenset(objects) - {"-"}))
    return verbs


VERBS = tuple(_verbs("""
sleep sleeps slept | schlafen schlafe schläft geschlafen haben | intransitive | -
laugh laughs laughed | lachen lache lacht gelacht haben | intransitive | -
wait waits waited | warten warte wartet gewartet haben | intransitive | -
work works worked | arbeiten arbeite arbeitet gearbeitet haben | intransitive | -
run runs run | laufen laufe läuft gelaufen sein | intransitive | -
come comes come | kommen komme kommt gekommen sein | intransitive | -
swim swims swum | schwimmen schwimme schwimmt geschwommen sein | intransitive | -
dance dances danced | tanzen tanze tanzt getanzt haben | intransitive | -
sing sings sung | singen singe singt gesungen haben | intransitive | -
play plays played | spielen spiele spielt gespielt haben | intransitive | -
wake wakes woken +up | wachen wache wacht aufgewacht sein +auf | intransitive | -
get gets got +up | stehen stehe steht aufgestanden sein +auf | intransitive | -
come comes come +back | kommen komme kommt zurückgekommen sein +zurück | intransitive | -
fall falls fallen +asleep | schlafen schlafe schläft eingeschlafen sein +ein | intransitive | -
see sees seen | sehen sehe sieht gesehen haben | accusative | person animal thing place
buy buys bought | kaufen kaufe kauft gekauft haben | accusative | thing animal
find finds found | finden finde findet gefunden haben | accusative | person animal thing
like likes liked | mögen mag mag gemocht haben | accusative | person animal thing place
need needs needed | brauchen brauche braucht gebraucht haben | accusative | thing
read reads read | lesen lese liest gelesen haben | accusative | readable
carry carries carried | tragen trage trägt getragen haben | accusative | thing animal
wash washes washed | waschen wasche wäscht gewaschen haben | accusative | thing animal
sell sells sold | verkaufen verkaufe verkauft verkauft haben | accusative | thing animal
visit visits visited | besuchen besuche besucht besucht haben | accusative | person place
love loves loved | lieben liebe liebt geliebt haben | accusative | person animal
paint paints painted | malen male malt gemalt haben | accusative | person animal thing place
know knows known | kennen kenne kennt gekannt haben | accusative | person animal place
forget forgets forgotten | vergessen vergesse vergisst vergessen haben | accusative | thing person
eat eats eaten | essen esse isst gegessen haben | accusative | food
hold holds held | halten halte hält gehalten haben | accusative | thing animal
clean cleans cleaned | putzen putze putzt geputzt haben | accusative | thing place
switch switches switched +on | schalten schalte schaltet eingeschaltet haben +ein | accusative | device
switch switches switched +off | schalten schalte schaltet ausgeschaltet haben +aus | accusative | device
open opens opened | machen mache macht aufgemacht haben +auf | accusative | openable
close closes closed | machen mache macht zugemacht haben +zu | accusative | openable
pick picks picked +up | heben hebe hebt aufgehoben haben +auf | accusative | thing animal
call calls called | rufen rufe ruft angerufen haben +an | accusative | person
look looks looked +at | sehen sehe sieht angesehen haben +an | accusative | person animal thing place
bring brings brought +back | bringen bringe bringt zurückgebracht haben +zurück | accusative | thing animal
help helps helped | helfen helfe hilft geholfen haben | dative | person animal
follow follows followed | folgen folge folgt gefolgt sein | dative | person animal
thank thanks thanked | danken danke dankt gedankt haben | dative | person
answer answers answered | antworten antworte antwortet geantwortet haben | dative | person
give gives given | geben gebe gibt gegeben haben | ditransitive | thing
show shows shown | zeigen zeige zeigt gezeigt haben | ditransitive | thing
bring brings brought | bringen bringe bringt gebracht haben | ditransitive | thing
send sends sent | schicken schicke schickt geschickt haben | ditransitive | thing
say says said | sagen sage sagt gesagt haben | clausal | -
think thinks thought | glauben glaube glaubt geglaubt haben | clausal | -
know knows known | wissen weiß weiß gewusst haben | clausal | -
hope hopes hoped | hoffen hoffe hofft gehofft haben | clausal | -
hear hears heard | hören höre hört gehört haben | clausal | -
be is been | sein bin ist gewesen sein | copula | -
"""))

PREPOSITIONS = (
    Preposition("in", "in", "dat", frozenset({"place"}), True),
    Preposition("on", "auf", "dat", frozenset({"thing"}), True),
    Preposition("under", "unter", "dat", frozenset({"thing"}), True),
    Preposition("behind", "hinter", "dat", frozenset({"thing", "place"}), True),
    Preposition("in front of", "vor", "dat", frozenset({"thing", "place"}), True),
    Preposition("next to", "neben", "dat", frozenset({"person", "animal", "thing", "place"}), True),
    Preposition("with", "mit", "dat", frozenset({"person", "animal", "thing"}), True),
    Preposition("without", "ohne", "acc", frozenset({"person", "animal", "thing"}), True),
    Preposition("from", "von", "dat", frozenset({"person", "place"}), True),
    Preposition("near", "bei", "dat", frozenset({"place"}), False),
    Preposition("for", "für", "acc", frozenset({"person", "animal"}), False),
    Preposition("through", "durch", "acc", frozenset({"place"}), False),
    Preposition("to", "zu", "dat", frozenset({"person", "place"}), False),
)

ADVERBS = tuple(Adverb(en, de) for en, de in (
    ("today", "heute"), ("tomorrow", "morgen"), ("often", "oft"), ("now", "jetzt"),
    ("sometimes", "manchmal"), ("then", "dann"), ("unfortunately", "leider"), ("usually", "meistens"),
))

SUBORDINATORS = tuple(Conjunction(en, de) for en, de in (
    ("because", "weil"), ("although", "obwohl"), ("when", "wenn"), ("if", "wenn"),
    ("while", "während"), ("before", "bevor"), ("after", "nachdem"),
))
COORDINATORS = (Conjunction("and", "und"), Conjunction("but", "aber"))

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


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------


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


class _Sampler:
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

    def role_swapped(self, clause: Clause) -> Clause | None:
        """"the man sees the dog" for "the dog sees the man", where the verb allows it.

        Such twins have the same bag of English words and differ in German case, so a model that
        ignores word order cannot translate both.
        """
        subject, obj = clause.subject, clause.accusative
        if (clause.verb.frame == "accusative" and isinstance(subject, NounPhrase)
                and isinstance(obj, NounPhrase) and subject.relative is None and obj.relative is None
                and obj.noun.kind in ANIMATE_KINDS and clause.verb.objects & subject.noun.tags):
            return dataclasses.replace(clause, subject=obj, accusative=subject)
        return None

    def sentences(self) -> list[Sentence]:
        """One sentence, sometimes followed by its role-swapped twin."""
        sentence = self.sentence()
        twin = self.role_swapped(sentence) if isinstance(sentence, Clause) and self.chance(0.25) else None
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


def generate_corpus(seed: int, sizes: dict[str, int]) -> dict[str, list[tuple[str, str]]]:
    """``sizes[split]`` distinct (English, German) pairs per split, the same for the same seed.

    No source or target sentence occurs twice in the whole corpus, so the splits are disjoint.
    Splits are filled in the order of their names, so the result does not depend on the order
    of ``sizes``.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UserError(f"demo seed must be an integer, got {seed!r}")
    for split, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise UserError(f"demo size of split {split!r} must be a non-negative integer, got {size!r}")
    total = sum(sizes.values())
    sampler = _Sampler(random.Random(seed))
    seen: set[str] = set()
    pairs: list[tuple[str, str]] = []
    attempts = 0
    while len(pairs) < total:
        attempts += 1
        if attempts > 20 * total + 10_000:
            raise UserError(f"the demo grammar ran out of new sentences after {len(pairs)} of {total}; "
                            "ask for fewer pairs")
        for sentence in sampler.sentences():
            en, de = render(sentence)
            if len(en.split()) > MAX_SOURCE_TOKENS or len(de.split()) > MAX_TARGET_TOKENS:
                continue
            if en in seen or de in seen or len(pairs) == total:
                continue
            seen.update((en, de))
            pairs.append((en, de))
    corpus, start = {}, 0
    for split in sorted(sizes):
        corpus[split] = pairs[start:start + sizes[split]]
        start += sizes[split]
    return {split: corpus[split] for split in sizes}


@cli
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aiayn demo", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--train", type=int, default=30000, help="pairs in the train split")
    parser.add_argument("--dev", type=int, default=1000, help="pairs in the dev split")
    parser.add_argument("--test", type=int, default=1000, help="pairs in the test split")
    parser.add_argument("--out-dir", required=True, help="folder for <split>.<lang>")
    parser.add_argument("--src-lang", default="en", help="suffix of the English-like files")
    parser.add_argument("--tgt-lang", default="de", help="suffix of the German-like files")
    args = parser.parse_args(argv)
    if args.src_lang == args.tgt_lang:
        raise UserError(f"--src-lang and --tgt-lang are both {args.src_lang!r}; they must differ")
    corpus = generate_corpus(args.seed, {"train": args.train, "dev": args.dev, "test": args.test})
    out_dir = Path(args.out_dir)
    for split, pairs in corpus.items():
        write_lines_atomic(out_dir / f"{split}.{args.src_lang}", [en for en, _ in pairs])
        write_lines_atomic(out_dir / f"{split}.{args.tgt_lang}", [de for _, de in pairs])
        print(f"{split}: {len(pairs)} pairs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
