"""The words of the synthetic data: words to count, names and items, and made-up words.

Owns the fixed word lists of each split (TRAIN_* and EVAL_*, the EVAL_* ones never used in
training), the dictionary words training counts, and the made-up words and random letter
strings of either split. It knows nothing about questions or answers.

Counting words are English (memorisable), English words from a dictionary, made-up
pronounceable words and random letter strings. All but the first force the model to copy
whatever word it is given, so a word it never saw (the eval's) is copied rather than replaced
by a familiar one.
"""

from __future__ import annotations

import functools
import random
import string

from chatcli.errors import ChatcliError
from chatcli.training.held_out import is_held_out_string

TRAIN_NAMES = ["Sam", "Mia", "Leo", "Ava", "Tom", "Zoe", "Ben", "Lily", "Max", "Emma", "Noah"]
EVAL_NAMES = ["Ivy", "Omar", "Rosa", "Hugo"]  # eval only
TRAIN_ITEMS = [("apple", "apples"), ("cookie", "cookies"), ("book", "books"),
               ("pencil", "pencils"), ("marble", "marbles"), ("sticker", "stickers"),
               ("card", "cards"), ("orange", "oranges"), ("stamp", "stamps"),
               ("ticket", "tickets")]  # fmt: skip
EVAL_ITEMS = [("shell", "shells"), ("button", "buttons"), ("candle", "candles")]  # eval only

TRAIN_WORDS = [
    "strawberry", "banana", "apple", "hello", "mississippi", "letter", "butter", "coffee",
    "balloon", "bookkeeper", "committee", "occurrence", "raspberry", "blueberry", "cherry",
    "orange", "lemon", "grape", "pineapple", "watermelon", "computer", "keyboard", "window",
    "garden", "teacher", "student", "school", "pencil", "paper", "rabbit", "giraffe", "elephant",
    "kangaroo", "hippopotamus", "penguin", "dolphin", "turtle", "monkey", "parrot", "squirrel",
    "chocolate", "vanilla", "cinnamon", "pepper", "tomato", "potato", "carrot", "broccoli",
    "spaghetti", "pizza", "sandwich", "cookie", "muffin", "pancake", "breakfast", "dinner",
    "summer", "winter", "autumn", "spring", "rainbow", "thunder", "lightning", "mountain", "river",
    "ocean", "island", "forest", "desert", "volcano", "planet", "galaxy", "rocket", "astronaut",
    "bicycle", "airplane", "train", "bottle", "kettle", "puzzle", "guitar", "piano", "violin",
    "trumpet", "drummer", "success", "address", "possess", "necessary", "accommodate", "embarrass",
    "assessment", "tennessee", "referee", "coconut", "avocado", "zebra", "alphabet", "umbrella",
    "yellow", "purple", "silver", "happiness", "sunshine", "moonlight", "butterfly", "caterpillar",
    "grasshopper", "library", "calendar", "tomorrow", "yesterday", "parallel",
]  # fmt: skip
EVAL_WORDS = [  # eval only
    "cucumber", "mango", "peppermint", "lollipop", "marshmallow", "crocodile", "flamingo",
    "octopus", "pumpkin", "blizzard", "hurricane", "telescope", "saxophone", "accordion",
    "wallpaper", "carpenter", "engineer", "nonsense", "mushroom", "avalanche", "referral",
    "bubblegum", "pepperoni", "cappuccino", "kayak",
]  # fmt: skip

# Pieces of made-up words: onset + nucleus + coda, one to three syllables.
ONSETS = ["b", "bl", "br", "c", "ch", "cl", "cr", "d", "dr", "f", "fl", "fr", "g", "gl", "gr",
          "h", "j", "k", "l", "m", "n", "p", "pl", "pr", "qu", "r", "s", "sh", "sk", "sl", "sn",
          "sp", "st", "t", "th", "tr", "v", "w", "z", ""]  # fmt: skip
NUCLEI = ["a", "e", "i", "o", "u", "ai", "ee", "oo", "ou", "ea", "y"]
CODAS = ["", "", "", "n", "r", "l", "m", "s", "t", "ck", "ng", "sh", "x", "p", "rt", "nd"]

# Dictionary words (~97k, most never seen twice) are the eval's kind of word: with only the 113
# memorisable ones and made-up words, the model copied an unseen English word's first pieces
# and then finished it with a familiar ending ("saxophone" -> "saxophapp", "peppermint" ->
# "peppermther").


@functools.cache
def dictionary_words() -> list[str]:
    """Training only: the GCIDE dictionary's words of 4-12 letters (the english-words package,
    in the train extra), less every eval word, any word containing one or inside one, and any
    word the eval split's random strings and made-up words may use (is_held_out_string)."""
    try:
        from english_words import get_english_words_set
    except ImportError as e:
        raise ChatcliError(
            "Generating training data needs english-words: pip install -e '.[train]'"
        ) from e
    words = get_english_words_set(["gcide"], lower=True, alpha=True)
    return sorted(
        w
        for w in words
        if 4 <= len(w) <= 12
        and w.isascii()
        and w.isalpha()
        and not any(e in w or w in e for e in EVAL_WORDS)
        and w not in ALL_NAMES
        and not is_held_out_string(w)
    )


ALL_WORDS = frozenset(TRAIN_WORDS) | frozenset(EVAL_WORDS)
ALL_NAMES = frozenset(n.lower() for n in TRAIN_NAMES + EVAL_NAMES) | frozenset(
    form for pair in TRAIN_ITEMS + EVAL_ITEMS for form in pair
)


def pseudo_word(rng: random.Random, split: str, min_syllables: int, max_syllables: int) -> str:
    """A made-up pronounceable word of the split ("blorfin"), never a real word we list."""
    while True:
        text = "".join(
            rng.choice(ONSETS) + rng.choice(NUCLEI) + rng.choice(CODAS)
            for _ in range(rng.randint(min_syllables, max_syllables))
        )
        in_split = is_held_out_string(text) == (split == "eval")
        if len(text) >= 3 and in_split and text not in ALL_WORDS and text not in ALL_NAMES:
            return text


def random_string(rng: random.Random, split: str) -> str:
    """Random letters of the split; a small alphabet makes letters repeat, so counts above 1
    are common."""
    while True:
        alphabet = rng.sample(string.ascii_lowercase, rng.randint(3, 8))
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(4, 12)))
        in_split = is_held_out_string(text) == (split == "eval")
        if in_split and text not in ALL_WORDS:
            return text
