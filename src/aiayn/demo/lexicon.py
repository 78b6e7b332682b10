"""The demo's lexicon: English and German nouns, adjectives, verbs, prepositions, adverbs and conjunctions,
with the German gender, plural, case frames and verb forms the grammar (``aiayn.demo.grammar``) needs."""

from __future__ import annotations

from dataclasses import dataclass

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
