"""The demo corpus: deterministic, disjoint, and a language pair that needs attention and word order."""

from __future__ import annotations

import collections
import re

import pytest

from aiayn import demo
from aiayn.demo import (
    ADJECTIVES, ADVERBS, COMPOUNDS, GAP, NOUNS, SUBORDINATORS, VERBS, Clause, NounPhrase,
    Subordination, generate_corpus, pronoun_for, render,
)
from aiayn.errors import UserError
from aiayn.reading import read_lines

SIZES = {"train": 6000, "dev": 500, "test": 500}


@pytest.fixture(scope="module")
def corpus():
    return generate_corpus(7, SIZES)


def noun(en):
    return next(n for n in NOUNS if n.en == en)


def phrase(en, determiner="the", adjectives=(), relative=None):
    chosen = tuple(next(a for a in ADJECTIVES if a.en == name) for name in adjectives)
    return NounPhrase(noun(en), determiner, chosen, relative=relative)


def verb(base, frame="accusative", particle=""):
    return next(v for v in VERBS if v.en_base == base and v.frame == frame and v.en_particle == particle)


def conjunction(en):
    return next(c for c in SUBORDINATORS if c.en == en)


def test_same_seed_gives_the_same_corpus_and_another_seed_a_different_one():
    sizes = {"train": 300, "dev": 30, "test": 30}
    assert generate_corpus(11, sizes) == generate_corpus(11, sizes)
    assert generate_corpus(11, sizes) != generate_corpus(12, sizes)


def test_corpus_does_not_depend_on_the_order_of_the_sizes():
    assert generate_corpus(3, {"train": 200, "dev": 20}) == generate_corpus(3, {"dev": 20, "train": 200})


def test_split_sizes_are_exact(corpus):
    assert {split: len(pairs) for split, pairs in corpus.items()} == SIZES
    assert generate_corpus(5, {"train": 10, "dev": 0}) == {"train": generate_corpus(5, {"train": 10})["train"],
                                                          "dev": []}


def test_no_sentence_appears_twice_within_or_across_splits(corpus):
    for side in (0, 1):
        sentences = [pair[side] for pairs in corpus.values() for pair in pairs]
        assert len(set(sentences)) == len(sentences)


def test_sentences_are_lowercase_tokens_separated_by_single_spaces(corpus):
    for en, de in corpus["train"]:
        for sentence in (en, de):
            assert sentence == sentence.lower() == " ".join(sentence.split())
            assert sentence.endswith(" .") and ". " not in sentence
            assert all(token in {",", "."} or re.fullmatch(r"[a-zäöüß]+", token) for token in sentence.split())


def test_lengths_run_from_3_to_about_40_words_with_a_broad_spread(corpus):
    lengths = [len(en.split()) for en, _ in corpus["train"]]
    target_lengths = [len(de.split()) for _, de in corpus["train"]]
    assert min(lengths) >= 3 and min(target_lengths) >= 3
    assert 30 <= max(lengths) <= demo.MAX_SOURCE_TOKENS and max(target_lengths) <= demo.MAX_TARGET_TOKENS
    assert sum(length > 20 for length in lengths) >= 0.10 * len(lengths)
    assert sum(6 <= length <= 25 for length in lengths) >= 0.75 * len(lengths)


def test_subordinate_clause_puts_the_verb_last():
    says = Clause(phrase("man"), verb("say", "clausal"),
                  complement=Clause(phrase("dog"), verb("see"), accusative=phrase("cat")))
    assert render(says) == ("the man says that the dog sees the cat .",
                            "der mann sagt , dass der hund die katze sieht .")
    switched_on = Clause(phrase("man"), verb("switch", particle="on"), "perfect", accusative=phrase("lamp"))
    assert render(switched_on)[1] == "der mann hat die lampe eingeschaltet ."
    waits = Subordination(Clause(phrase("woman"), verb("wait", "intransitive")), conjunction("because"), switched_on)
    assert render(waits) == ("the woman waits because the man has switched on the lamp .",
                             "die frau wartet , weil der mann die lampe eingeschaltet hat .")


def test_separable_prefix_goes_to_the_end_of_a_main_clause_and_joins_the_verb_in_a_subordinate_one():
    switches = Clause(phrase("man"), verb("switch", particle="on"), accusative=phrase("lamp", adjectives=["old"]))
    assert render(switches)[1] == "der mann schaltet die alte lampe ein ."
    says = Clause(phrase("woman"), verb("say", "clausal"), complement=switches)
    assert render(says)[1] == "die frau sagt , dass der mann die alte lampe einschaltet ."


def test_fronted_adverb_or_clause_puts_the_verb_second():
    today = next(a for a in ADVERBS if a.en == "today")
    fronted = Clause(phrase("dog"), verb("see"), accusative=phrase("man"), adverb=today, adverb_fronted=True)
    assert render(fronted) == ("today the dog sees the man .", "heute sieht der hund den mann .")
    because_first = Subordination(Clause(phrase("man"), verb("wait", "intransitive")), conjunction("because"),
                                  Clause(phrase("dog"), verb("sleep", "intransitive")), subordinate_first=True)
    assert render(because_first) == ("because the dog sleeps , the man waits .",
                                     "weil der hund schläft , wartet der mann .")


def test_article_and_adjective_endings_follow_gender_case_and_determiner():
    gives = Clause(phrase("man", "a", ["old"]), verb("give", "ditransitive"),
                   dative=phrase("woman", adjectives=["young"]), accusative=phrase("book", "a", ["red"]))
    assert render(gives) == ("an old man gives the young woman a red book .",
                             "ein alter mann gibt der jungen frau ein rotes buch .")
    helps = Clause(phrase("boy", adjectives=["tired"]), verb("help", "dative"), dative=phrase("boy", "my", ["tired"]))
    assert render(helps)[1] == "der müde junge hilft meinem müden jungen ."
    refuses = Clause(phrase("dog"), verb("see"), negated=True, accusative=phrase("cat", "a"))
    assert render(refuses) == ("the dog does not see a cat .", "der hund sieht keine katze .")


def test_relative_pronoun_takes_the_head_gender_and_the_case_of_its_role():
    liked = Clause(phrase("woman"), verb("like"), accusative=GAP)
    sees = Clause(phrase("man"), verb("see"), accusative=phrase("dog", relative=liked))
    assert render(sees) == ("the man sees the dog that the woman likes .",
                            "der mann sieht den hund , den die frau mag .")
    sleeps = Clause(GAP, verb("sleep", "intransitive"))
    subject = Clause(phrase("woman", relative=sleeps), verb("see"), accusative=phrase("cat"))
    assert render(subject) == ("the woman who sleeps sees the cat .",
                               "die frau , die schläft , sieht die katze .")


def test_pronoun_agrees_with_the_gender_of_a_distant_noun():
    cheap = next(a for a in ADJECTIVES if a.en == "cheap")
    translations = {}
    for thing in ("table", "lamp", "book"):
        liked = Clause(phrase("woman"), verb("like"), accusative=GAP)
        main = Clause(phrase("man"), verb("buy"), accusative=phrase(thing, adjectives=["old", "red"], relative=liked))
        because = Clause(pronoun_for(noun(thing)), verb("be", "copula"), predicate=cheap)
        en, de = render(Subordination(main, conjunction("because"), because))
        tokens = en.split()
        assert tokens.index("it") - tokens.index(thing) >= 6
        translations[thing] = de
    assert translations["table"].endswith(", weil er billig ist .")
    assert translations["lamp"].endswith(", weil sie billig ist .")
    assert translations["book"].endswith(", weil es billig ist .")
    # English "she" for a girl, German "es" for the neuter "mädchen"
    assert pronoun_for(noun("girl")).en == "she" and pronoun_for(noun("girl")).de == "es"


def test_same_english_pronoun_becomes_different_german_pronouns_in_the_corpus(corpus):
    pronouns_by_ending = collections.defaultdict(set)
    for en, de in corpus["train"]:
        english = re.search(r"because it is (\w+) \.$", en)
        german = re.search(r", weil (er|sie|es) \w+ ist \.$", de)
        if english:
            assert german, (en, de)
            pronouns_by_ending[english.group(1)].add(german.group(1))
    assert set().union(*pronouns_by_ending.values()) == {"er", "sie", "es"}
    assert any(len(pronouns) > 1 for pronouns in pronouns_by_ending.values())


def test_compound_is_one_german_word_with_the_gender_of_its_head():
    kitchen_table = next(c for c in COMPOUNDS if c.en == "kitchen table")
    assert noun("kitchen").gender == "f" and kitchen_table.gender == noun("table").gender == "m"
    sees = Clause(phrase("man"), verb("see"), accusative=NounPhrase(kitchen_table, "a", ()))
    assert render(sees) == ("the man sees a kitchen table .", "der mann sieht einen küchentisch .")
    assert pronoun_for(kitchen_table).de == "er"


def test_compounds_in_the_corpus_are_joined_in_german(corpus):
    found = set()
    for en, de in corpus["train"]:
        padded, words = f" {en} ", de.split()
        for compound in COMPOUNDS:
            if f" {compound.en} " in padded:
                assert compound.de in words, (en, de)
                found.add(compound.de)
    assert len(found) >= 20


def test_word_order_changes_the_translation():
    dog_sees_man = Clause(phrase("dog"), verb("see"), accusative=phrase("man"))
    man_sees_dog = Clause(phrase("man"), verb("see"), accusative=phrase("dog"))
    assert render(dog_sees_man) == ("the dog sees the man .", "der hund sieht den mann .")
    assert render(man_sees_dog) == ("the man sees the dog .", "der mann sieht den hund .")


def test_some_sources_share_a_bag_of_words_but_not_a_translation(corpus):
    targets_by_bag = collections.defaultdict(set)
    for en, de in corpus["train"]:
        targets_by_bag[tuple(sorted(en.split()))].add(de)
    assert sum(len(targets) > 1 for targets in targets_by_bag.values()) >= 10


def test_translation_is_a_function_of_the_source(corpus):
    target_of = {}
    other_seed = generate_corpus(8, {"train": 4000})
    for pairs in [*corpus.values(), *other_seed.values()]:
        for en, de in pairs:
            assert target_of.setdefault(en, de) == de, (en, target_of[en], de)


def test_bad_seed_or_size_is_a_user_error():
    with pytest.raises(UserError, match="non-negative"):
        generate_corpus(1, {"train": -1})
    with pytest.raises(UserError, match="integer"):
        generate_corpus("1", {"train": 1})


def test_main_writes_one_file_per_split_and_language(tmp_path):
    assert demo.main(["--seed", "3", "--train", "40", "--dev", "5", "--test", "6",
                      "--out-dir", str(tmp_path), "--src-lang", "en", "--tgt-lang", "de"]) == 0
    expected = generate_corpus(3, {"train": 40, "dev": 5, "test": 6})
    for split, pairs in expected.items():
        assert read_lines(tmp_path / f"{split}.en") == [en for en, _ in pairs]
        assert read_lines(tmp_path / f"{split}.de") == [de for _, de in pairs]
    assert (tmp_path / "train.de").read_bytes().endswith(b" .\n")


def test_main_reports_a_negative_size_without_a_traceback(tmp_path, capsys):
    assert demo.main(["--train", "-5", "--out-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert list(tmp_path.iterdir()) == []
