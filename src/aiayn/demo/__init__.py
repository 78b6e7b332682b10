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
``generate_corpus`` (``corpus``) is the entry point. It samples (``sampler``) sentence trees
(``grammar``) from a lexicon (``lexicon``) and renders them in both languages; the dataclasses and
``render`` are public so that tests and readers can build one sentence by hand.
"""

from aiayn.demo.corpus import MAX_SOURCE_TOKENS, MAX_TARGET_TOKENS, generate_corpus, main
from aiayn.demo.grammar import (GAP, SUBJECT_PRONOUNS, Clause, Coordination, Gap, NounPhrase, PluralSubject, PrepPhrase,
                                Pronoun, Subordination, pronoun_for, render)
from aiayn.demo.lexicon import (ADJECTIVES, ADVERBS, ANIMALS, COMPOUNDS, COORDINATORS, NOUNS, PERSONS, PLACES,
                                PREPOSITIONS, SUBORDINATORS, THINGS, VERBS, Adjective, Adverb, Conjunction, Noun,
                                Preposition, Verb)

__all__ = [
    "ADJECTIVES", "ADVERBS", "ANIMALS", "COMPOUNDS", "COORDINATORS", "GAP", "MAX_SOURCE_TOKENS", "MAX_TARGET_TOKENS",
    "NOUNS", "PERSONS", "PLACES", "PREPOSITIONS", "SUBJECT_PRONOUNS", "SUBORDINATORS", "THINGS", "VERBS",
    "Adjective", "Adverb", "Clause", "Conjunction", "Coordination", "Gap", "Noun", "NounPhrase", "PluralSubject",
    "PrepPhrase", "Preposition", "Pronoun", "Subordination", "Verb", "generate_corpus", "main", "pronoun_for", "render",
]
