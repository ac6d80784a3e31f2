"""Generates the bundled English-German corpus from a small grammar with correct German morphology and word order.

Run `python -m fastformer.data.make_corpus` to rewrite fastformer/data/corpus/{train,valid,test}.{en,de}; the output
is a pure function of --seed. The grammar covers gender, case (nominative, accusative, dative) and number of
determiners, adjectives and nouns; verb agreement and stem changes; verb-second order after a fronted adverb;
verb-final order in subordinate clauses and after modal verbs; negation with "nicht"/"kein" and yes-no questions.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
SPLITS = {"train": 18000, "valid": 500, "test": 500}


@dataclass(frozen=True)
class Noun:
    english: str
    english_plural: str
    german: str
    german_plural: str
    gender: str  # "m", "f" or "n"

    def german_form(self, plural: bool, case: str) -> str:
        """The dative plural adds -n unless the plural already ends in -n or -s."""
        if not plural:
            return self.german
        if case == "dat" and not self.german_plural.endswith(("n", "s")):
            return self.german_plural + "n"
        return self.german_plural


NOUNS = [Noun(*fields) for fields in [
    ("man", "men", "Mann", "Männer", "m"), ("woman", "women", "Frau", "Frauen", "f"),
    ("child", "children", "Kind", "Kinder", "n"), ("dog", "dogs", "Hund", "Hunde", "m"),
    ("cat", "cats", "Katze", "Katzen", "f"), ("house", "houses", "Haus", "Häuser", "n"),
    ("car", "cars", "Auto", "Autos", "n"), ("book", "books", "Buch", "Bücher", "n"),
    ("teacher", "teachers", "Lehrer", "Lehrer", "m"), ("table", "tables", "Tisch", "Tische", "m"),
    ("apple", "apples", "Apfel", "Äpfel", "m"), ("bird", "birds", "Vogel", "Vögel", "m"),
    ("letter", "letters", "Brief", "Briefe", "m"), ("friend", "friends", "Freund", "Freunde", "m"),
    ("city", "cities", "Stadt", "Städte", "f"), ("garden", "gardens", "Garten", "Gärten", "m"),
    ("door", "doors", "Tür", "Türen", "f"), ("flower", "flowers", "Blume", "Blumen", "f"),
    ("girl", "girls", "Mädchen", "Mädchen", "n"), ("doctor", "doctors", "Arzt", "Ärzte", "m"),
    ("horse", "horses", "Pferd", "Pferde", "n"), ("tree", "trees", "Baum", "Bäume", "m"),
    ("chair", "chairs", "Stuhl", "Stühle", "m"), ("window", "windows", "Fenster", "Fenster", "n"),
    ("picture", "pictures", "Bild", "Bilder", "n"), ("computer", "computers", "Computer", "Computer", "m"),
    ("school", "schools", "Schule", "Schulen", "f"), ("bottle", "bottles", "Flasche", "Flaschen", "f"),
    ("song", "songs", "Lied", "Lieder", "n"), ("key", "keys", "Schlüssel", "Schlüssel", "m"),
]]

ADJECTIVES = [("big", "groß"), ("small", "klein"), ("old", "alt"), ("new", "neu"), ("red", "rot"),
              ("green", "grün"), ("beautiful", "schön"), ("young", "jung"), ("happy", "glücklich"),
              ("tired", "müde"), ("fast", "schnell"), ("quiet", "ruhig"), ("cheap", "billig"), ("warm", "warm")]

# Determiner stems and their ending tables per (gender or "pl", case); "ein"-words have bare forms where the
# definite article has -er/-es, and they take the mixed adjective declension.
DEFINITE = {("m", "nom"): "der", ("f", "nom"): "die", ("n", "nom"): "das", ("pl", "nom"): "die",
            ("m", "acc"): "den", ("f", "acc"): "die", ("n", "acc"): "das", ("pl", "acc"): "die",
            ("m", "dat"): "dem", ("f", "dat"): "der", ("n", "dat"): "dem", ("pl", "dat"): "den"}
DIESER_ENDINGS = {("m", "nom"): "er", ("f", "nom"): "e", ("n", "nom"): "es", ("pl", "nom"): "e",
                  ("m", "acc"): "en", ("f", "acc"): "e", ("n", "acc"): "es", ("pl", "acc"): "e",
                  ("m", "dat"): "em", ("f", "dat"): "er", ("n", "dat"): "em", ("pl", "dat"): "en"}
EIN_ENDINGS = {**DIESER_ENDINGS, ("m", "nom"): "", ("n", "nom"): "", ("n", "acc"): ""}
# Adjective endings after der/dieser (weak) and after ein/mein/kein (mixed); strong after a number or no article.
WEAK_ADJECTIVE = {key: "en" for key in DEFINITE} | {("m", "nom"): "e", ("f", "nom"): "e", ("n", "nom"): "e",
                                                    ("f", "acc"): "e", ("n", "acc"): "e"}
MIXED_ADJECTIVE = {**WEAK_ADJECTIVE, ("m", "nom"): "er", ("n", "nom"): "es", ("n", "acc"): "es"}
STRONG_PLURAL_ADJECTIVE = {"nom": "e", "acc": "e", "dat": "en"}

# (English, German stem or definite table, kind): kind says how the German form is built.
DETERMINERS = [("the", "definite"), ("this", "dies"), ("a", "ein"), ("my", "mein"), ("no", "kein")]
PLURAL_ENGLISH = {"the": "the", "this": "these", "my": "my", "no": "no"}
NUMBERS = [("two", "zwei"), ("three", "drei"), ("four", "vier"), ("five", "fünf"), ("six", "sechs"),
           ("seven", "sieben"), ("ten", "zehn"), ("twelve", "zwölf")]
GERMAN_NUMBERS = {german for _, german in NUMBERS}


@dataclass(frozen=True)
class Verb:
    english: str
    english_third: str
    german: tuple[str, str, str, str, str, str]  # ich, du, er/sie/es, wir, ihr, sie (plural)
    infinitive: str


def regular(english: str, stem: str, third: str | None = None, second: str | None = None,
            english_third: str | None = None) -> Verb:
    """A German verb by its stem, with optional stem-changed du/er forms; English third person defaults to +s."""
    t_stem = stem + "e" if stem.endswith(("t", "d", "fn")) else stem
    du = second or (t_stem + "st")
    er = third or (t_stem + "t")
    return Verb(english, english_third or english + "s", (stem + "e", du, er, stem + "en", t_stem + "t", stem + "en"),
                stem + "en")


TRANSITIVE = [
    Verb("see", "sees", ("sehe", "siehst", "sieht", "sehen", "seht", "sehen"), "sehen"),
    Verb("read", "reads", ("lese", "liest", "liest", "lesen", "lest", "lesen"), "lesen"),
    Verb("carry", "carries", ("trage", "trägst", "trägt", "tragen", "tragt", "tragen"), "tragen"),
    Verb("have", "has", ("habe", "hast", "hat", "haben", "habt", "haben"), "haben"),
    regular("buy", "kauf"), regular("find", "find"), regular("visit", "besuch"), regular("need", "brauch"),
    regular("paint", "mal"), regular("hear", "hör"), regular("love", "lieb"), regular("build", "bau"),
    regular("sell", "verkauf"), regular("open", "öffn", english_third="opens"),
    regular("watch", "beobacht", english_third="watches"),
]
INTRANSITIVE = [
    Verb("sleep", "sleeps", ("schlafe", "schläfst", "schläft", "schlafen", "schlaft", "schlafen"), "schlafen"),
    regular("sit", "sitz", second="sitzt"), regular("stand", "steh"), regular("wait", "wart"),
    regular("play", "spiel"), regular("live", "wohn"), regular("work", "arbeit"), regular("sing", "sing"),
]
# Prepositions that govern the dative when they describe a location.
PREPOSITIONS = [("in", "in"), ("with", "mit"), ("behind", "hinter"), ("under", "unter"), ("next to", "neben"),
                ("near", "bei"), ("on", "auf")]
CONTRACTIONS = {("in", "dem"): "im", ("bei", "dem"): "beim"}
MODALS = [("can", ("kann", "kannst", "kann", "können", "könnt", "können"), "can"),
          ("wants to", ("will", "willst", "will", "wollen", "wollt", "wollen"), "want to")]
ADVERBS = [("today", "heute"), ("tomorrow", "morgen"), ("now", "jetzt"), ("often", "oft"), ("sometimes", "manchmal")]
VERBS_OF_SAYING = [("know", "knows", "weiß", "weiß"), ("think", "thinks", "glaube", "glaubt"),
                   ("say", "says", "sage", "sagt")]
# (English, German, person index into Verb.german, English third person singular?)
PRONOUNS = [("I", "ich", 0, False), ("you", "du", 1, False), ("he", "er", 2, True), ("she", "sie", 2, True),
            ("we", "wir", 3, False), ("they", "sie", 5, False)]


@dataclass(frozen=True)
class Phrase:
    english: str
    german: str
    person: int  # index into Verb.german
    third_singular: bool  # English -s agreement


def noun_phrase(rng: random.Random, case: str, allow_pronoun: bool = False) -> Phrase:
    """A determiner (or number) + optional adjective + noun, declined for case; optionally a personal pronoun."""
    if allow_pronoun and case == "nom" and rng.random() < 0.25:
        english, german, person, third = rng.choice(PRONOUNS)
        return Phrase(english, german, person, third)
    noun = rng.choice(NOUNS)
    adjective = rng.choice(ADJECTIVES) if rng.random() < 0.5 else None
    if rng.random() < 0.15:
        english_number, german_number = rng.choice(NUMBERS)
        words_en, words_de = [english_number], [german_number]
        adjective_ending = STRONG_PLURAL_ADJECTIVE[case]
        plural = True
    else:
        english_det, kind = rng.choice(DETERMINERS)
        plural = kind != "ein" and rng.random() < 0.3
        key = ("pl" if plural else noun.gender, case)
        if kind == "definite":
            german_det, adjective_ending = DEFINITE[key], WEAK_ADJECTIVE[key]
        elif kind == "dies":
            german_det, adjective_ending = kind + DIESER_ENDINGS[key], WEAK_ADJECTIVE[key]
        else:
            german_det, adjective_ending = kind + EIN_ENDINGS[key], MIXED_ADJECTIVE[key]
        words_en = [PLURAL_ENGLISH[english_det] if plural else english_det]
        words_de = [german_det]
    if adjective is not None:
        words_en.append(adjective[0])
        # müde + e -> müde, not müdee.
        words_de.append(adjective[1].removesuffix("e") + adjective_ending)
    words_en.append(noun.english_plural if plural else noun.english)
    words_de.append(noun.german_form(plural, case))
    if words_en[0] == "a" and words_en[1][0] in "aeiou":
        words_en[0] = "an"
    return Phrase(" ".join(words_en), " ".join(words_de), 5 if plural else 2, not plural)


def prepositional_phrase(rng: random.Random) -> tuple[str, str]:
    english, german = rng.choice(PREPOSITIONS)
    object_phrase = noun_phrase(rng, "dat")
    first, _, rest = object_phrase.german.partition(" ")
    if (german, first) in CONTRACTIONS:
        return f"{english} {object_phrase.english}", f"{CONTRACTIONS[german, first]} {rest}"
    return f"{english} {object_phrase.english}", f"{german} {object_phrase.german}"


def english_verb(verb: Verb, subject: Phrase) -> str:
    return verb.english_third if subject.third_singular else verb.english


def clause(rng: random.Random) -> tuple[list[str], str, list[str], str, Phrase]:
    """-> (English words, German subject, German words after the finite verb, German finite verb, subject).

    The split lets callers place the German finite verb second, first (questions) or last (subordinate clauses).
    """
    subject = noun_phrase(rng, "nom", allow_pronoun=True)
    pattern = rng.random()
    if pattern < 0.4:
        verb = rng.choice(TRANSITIVE)
        obj = noun_phrase(rng, "acc")
        english = [subject.english, english_verb(verb, subject), obj.english]
        rest = [obj.german]
        if rng.random() < 0.3:
            pp_en, pp_de = prepositional_phrase(rng)
            english.append(pp_en)
            rest.append(pp_de)
        return english, subject.german, rest, verb.german[subject.person], subject
    if pattern < 0.7:
        verb = rng.choice(INTRANSITIVE)
        pp_en, pp_de = prepositional_phrase(rng)
        return [subject.english, english_verb(verb, subject), pp_en], subject.german, [pp_de], \
            verb.german[subject.person], subject
    adjective_en, adjective_de = rng.choice(ADJECTIVES)
    english_be = "am" if subject.english == "I" else ("is" if subject.third_singular else "are")
    german_be = ("bin", "bist", "ist", "sind", "seid", "sind")[subject.person]
    return [subject.english, english_be, adjective_en], subject.german, [adjective_de], german_be, subject


def sentence(rng: random.Random) -> tuple[str, str]:
    """One English sentence and its German translation."""
    kind = rng.random()
    if kind < 0.12:  # modal: the German infinitive goes to the end
        subject = noun_phrase(rng, "nom", allow_pronoun=True)
        verb = rng.choice(TRANSITIVE)
        obj = noun_phrase(rng, "acc")
        modal_en, modal_de, modal_base = rng.choice(MODALS)
        modal_english = modal_en if subject.third_singular else modal_base
        english = f"{subject.english} {modal_english} {verb.english} {obj.english}."
        german = f"{subject.german} {modal_de[subject.person]} {obj.german} {verb.infinitive}."
        return english, german
    if kind < 0.22:  # negation of a transitive clause: kein for indefinite objects, nicht otherwise
        subject = noun_phrase(rng, "nom", allow_pronoun=True)
        verb = rng.choice(TRANSITIVE)
        obj = noun_phrase(rng, "acc")
        auxiliary = "does not" if subject.third_singular else "do not"
        german_object = obj.german
        if german_object.startswith(("ein ", "eine ", "einen ")):
            german_object = "k" + german_object
            english = f"{subject.english} {auxiliary} {verb.english} any {obj.english.split(' ', 1)[1]}."
        elif german_object.startswith("kein") or german_object.split()[0] in GERMAN_NUMBERS:
            return sentence(rng)
        else:
            english = f"{subject.english} {auxiliary} {verb.english} {obj.english}."
            german_object += " nicht"
        return english, f"{subject.german} {verb.german[subject.person]} {german_object}."
    english, german_subject, rest, finite, subject = clause(rng)
    if kind < 0.32:  # yes-no question: verb first in German, do-support in English unless the verb is "be"
        if english[1] in ("am", "is", "are"):
            english_question = [english[1], english[0]] + english[2:]
        else:
            verb = next(v for v in TRANSITIVE + INTRANSITIVE if english[1] in (v.english, v.english_third))
            english_question = ["does" if subject.third_singular else "do", english[0], verb.english] + english[2:]
        return " ".join(english_question) + "?", " ".join([finite, german_subject] + rest) + "?"
    if kind < 0.45:  # fronted adverb: verb second, so the German subject follows the verb
        adverb_en, adverb_de = rng.choice(ADVERBS)
        return f"{adverb_en} {' '.join(english)}.", " ".join([adverb_de, finite, german_subject] + rest) + "."
    if kind < 0.58:  # subordinate clause: verb last
        main = noun_phrase(rng, "nom", allow_pronoun=True)
        say_en, say_en_third, say_de_first, say_de_third = rng.choice(VERBS_OF_SAYING)
        say_de = {0: say_de_first, 2: say_de_third}.get(main.person)
        if say_de is None:
            return sentence(rng)
        english_main = f"{main.english} {say_en_third if main.third_singular else say_en}"
        return (f"{english_main} that {' '.join(english)}.",
                f"{main.german} {say_de}, dass {' '.join([german_subject] + rest + [finite])}.")
    return " ".join(english) + ".", " ".join([german_subject, finite] + rest) + "."


def capitalize(text: str) -> str:
    return text[0].upper() + text[1:]


def generate(seed: int) -> dict[str, list[tuple[str, str]]]:
    """-> {split: [(english, german), ...]} with no English sentence in two splits (or twice in one)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[tuple[str, str]]] = {}
    for split, size in SPLITS.items():
        pairs: list[tuple[str, str]] = []
        while len(pairs) < size:
            english, german = map(capitalize, sentence(rng))
            if english not in seen:
                seen.add(english)
                pairs.append((english, german))
        splits[split] = pairs
    return splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=2017)
    parser.add_argument("--out-dir", type=Path, default=CORPUS_DIR)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for split, pairs in generate(args.seed).items():
        for index, lang in enumerate(("en", "de")):
            text = "".join(pair[index] + "\n" for pair in pairs)
            (args.out_dir / f"{split}.{lang}").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
