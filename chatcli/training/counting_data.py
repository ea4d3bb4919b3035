"""The letter-counting skill's data: counting questions and follow-ups on a count.

Owns how a count is asked and answered ("How many r's in strawberry?", then "and e?" or
"what about banana?") and which words each split counts. Every question becomes one call
`"word".count("l")` and one sentence copying its output. It knows nothing about the mix of
conversation kinds or about evaluation.
"""

from __future__ import annotations

import random
import re
import string

from chatcli.training import phrasings
from chatcli.training.exchange import Exchange, calculate, vary, with_filler
from chatcli.training.phrasings import PHRASE_FORMS
from chatcli.training.vocabulary import (
    EVAL_WORDS,
    TRAIN_WORDS,
    dictionary_words,
    pseudo_word,
    random_string,
)

# Of counting questions. Dictionary words, made-up words and random strings force the model
# to copy whatever word it is given (see vocabulary.py).
DICTIONARY_WORD_PROBABILITY = 0.45
PSEUDO_WORD_PROBABILITY = 0.15
RANDOM_STRING_PROBABILITY = 0.25  # the rest use TRAIN_WORDS
EVAL_RANDOM_STRING_PROBABILITY = 0.3  # of eval counting questions; the rest use EVAL_WORDS
VERB_FRAME_PROBABILITY = 0.3  # of training letter-counting follow-ups: "now {verb} X"
STRAY_WORD_PROBABILITY = 0.3  # of training counting questions: a dictionary word among its words
LETTER_IN_WORD_PROBABILITY = 0.8  # the letter asked about occurs in the word
# A short phrase to count in: 2-3 words, sometimes joined by a small word ("salt and pepper").
PHRASE_WORDS = (2, 2, 3)
PHRASE_JOINERS = ["and", "of", "the", "a", "my", "in", "with", "for"]
JOINER_PROBABILITY = 0.3
MAX_PHRASE_CHARS = 32

COUNT_CALL = re.compile(r'"([a-z]+)"\.count\("([a-z])"\)')


def counting_exchange(
    rng: random.Random, split: str, word: str | None = None, letter: str | None = None
) -> Exchange:
    word = word or sample_word(rng, split)
    letter = letter or sample_letter(rng, split, word)
    stray = None
    if split == "train" and rng.random() < STRAY_WORD_PROBABILITY:
        stray = rng.choice(dictionary_words())
    question = phrasings.counting_question(rng, split, word, letter, stray)
    return count_exchange(with_filler(rng, split, vary(rng, question)), word, letter)


def counting_followup(rng: random.Random, split: str, previous: Exchange) -> Exchange:
    word, letter = COUNT_CALL.fullmatch(previous.expression).groups()
    verb = None
    if split == "train" and rng.random() < VERB_FRAME_PROBABILITY:
        verb = rng.choice(dictionary_words())
    if rng.random() < 0.5:
        new_word = word
        while new_word == word:
            new_word = sample_word(rng, split)
        question = phrasings.new_word_question(rng, split, new_word, verb)
        return count_exchange(vary(rng, question), new_word, letter)
    new_letter = letter
    while new_letter == letter:
        new_letter = sample_letter(rng, split, word)
    question = phrasings.new_letter_question(rng, split, new_letter, verb)
    return count_exchange(vary(rng, question), word, new_letter)


def count_exchange(question: str, word: str, letter: str) -> Exchange:
    expression = f'"{word}".count("{letter}")'
    result = calculate(expression)
    shown = f'"{word}"' if " " in word else word  # a phrase stays quoted in the answer
    if result == "1":
        sentence = f"There is 1 {letter} in {shown}."
    else:
        sentence = f"There are {result} {letter}'s in {shown}."
    return Exchange(question, expression, result, sentence)


def phrase_count_exchange(rng: random.Random, split: str) -> Exchange:
    """A letter counted in a short phrase: `"salt and pepper".count("p")`."""
    phrase = sample_phrase(rng, split)
    letter = sample_letter(rng, split, phrase.replace(" ", ""))
    question = phrasings.counting_question(rng, split, phrase, letter, forms=PHRASE_FORMS)
    return count_exchange(with_filler(rng, split, vary(rng, question)), phrase, letter)


def sample_phrase(rng: random.Random, split: str) -> str:
    """2-3 words of the split (eval: the eval words and held-out random strings only)."""
    while True:
        words = [_phrase_word(rng, split) for _ in range(rng.choice(PHRASE_WORDS))]
        if rng.random() < JOINER_PROBABILITY:
            words.insert(rng.randint(1, len(words) - 1), rng.choice(PHRASE_JOINERS))
        phrase = " ".join(words)
        if len(phrase) <= MAX_PHRASE_CHARS and len(set(words)) == len(words):
            return phrase


def _phrase_word(rng: random.Random, split: str) -> str:
    while True:
        word = sample_word(rng, split)
        if len(word) <= 10:
            return word


def sample_word(rng: random.Random, split: str) -> str:
    draw = rng.random()
    if split == "eval":  # English words it never trained on, and random strings
        if draw < EVAL_RANDOM_STRING_PROBABILITY:
            return random_string(rng, split)
        return rng.choice(EVAL_WORDS)
    if draw < DICTIONARY_WORD_PROBABILITY:
        return rng.choice(dictionary_words())
    draw -= DICTIONARY_WORD_PROBABILITY
    if draw < PSEUDO_WORD_PROBABILITY:
        return pseudo_word(rng, split, 1, 3)
    draw -= PSEUDO_WORD_PROBABILITY
    if draw < RANDOM_STRING_PROBABILITY:
        return random_string(rng, split)
    return rng.choice(TRAIN_WORDS)


def sample_letter(rng: random.Random, split: str, word: str) -> str:
    """The letter to count: most often one of the word's. Eval draws it as often as it occurs
    in the word; training draws each of the word's letters alike, so that "e", the commonest
    letter in words, is not the one to fall back on (a model counted it when asked about
    another letter)."""
    if rng.random() < LETTER_IN_WORD_PROBABILITY:
        return rng.choice(word if split == "eval" else list(dict.fromkeys(word)))
    return rng.choice(string.ascii_lowercase)
