"""How users ask things: compositional phrasings for the synthetic conversations.

Owns: the wording of questions (arithmetic, follow-ups, letter counting, out-of-scope). Each
question is a *wrapper* ("Can you compute {x}?") around a *core* that carries the meaning
("{a} divided by {b}", "the letter {l}"). Every operator word is taught in training; what the
eval split holds out is whole sentences: wrappers that training never uses, and wrapper/core
pairs that training never combines (chosen by a stable hash). A model that passes the eval has
learned to read the core inside any wrapper, not to memorise sentences.
"""

from __future__ import annotations

import random
import zlib

HELD_OUT_COMBO_MODULUS = 5  # one wrapper/core pair in five is eval only
EVAL_ONLY_WRAPPER_PROBABILITY = 0.5  # of eval questions; the rest use held-out pairs

# ---- arithmetic: {a} and {b} are the operands in expression order ------------------------------
OPERATOR_CORES = {
    "+": ["{a} + {b}", "{a}+{b}", "{a} plus {b}", "the sum of {a} and {b}",
          "{a} and {b} added together", "the total of {a} and {b}"],
    "-": ["{a} - {b}", "{a}-{b}", "{a} minus {b}", "the difference between {a} and {b}",
          "{a} less {b}", "{b} subtracted from {a}"],
    "*": ["{a} * {b}", "{a}*{b}", "{a} times {b}", "{a} x {b}", "the product of {a} and {b}",
          "{a} multiplied by {b}"],
    "/": ["{a} / {b}", "{a}/{b}", "{a} divided by {b}", "the quotient of {a} and {b}",
          "{a} over {b}", "{a} split into {b} equal parts"],
}  # fmt: skip
QUESTION_WRAPPERS = [
    "What is {x}?", "what's {x}", "Compute {x}.", "calculate {x}", "How much is {x}?",
    "{x} = ?", "{x}", "Please work out {x}.", "Can you compute {x}?", "Tell me {x}.",
    "Find {x}.", "Solve {x}.", "Give me {x}.", "Evaluate {x}.", "I need {x}.",
    "Quick question: what is {x}?", "Do you know what {x} is?", "What do you get for {x}?",
    "Work out {x} please.",
]  # fmt: skip
EVAL_QUESTION_WRAPPERS = [  # eval only
    "Could you figure out {x} for me?", "I'd like to know {x}.", "What would {x} be?",
    "Hey, what is {x}?",
]  # fmt: skip
OPERATOR_VERBS = {
    "+": ["add {a} and {b}", "add {b} to {a}"],
    "-": ["subtract {b} from {a}", "take {b} away from {a}", "take {b} from {a}"],
    "*": ["multiply {a} by {b}", "multiply {a} and {b}"],
    "/": ["divide {a} by {b}", "split {a} into {b} equal parts"],
}
VERB_WRAPPERS = [
    "{v}", "Please {v}.", "Can you {v}?", "{v} for me", "I want you to {v}.", "Now {v}.",
    "Help me {v}.", "Quickly {v}.",
]  # fmt: skip
EVAL_VERB_WRAPPERS = ["Could you {v}, please?", "If I {v}, what do I get?"]  # eval only
# Training only, kept out of VERB_WRAPPERS (whose pairs with the verbs also make the held-out
# questions): a clause with the request, then a question about its result. Only average
# questions were asked that way ("When I average {l}, what comes out?"), and a model trained
# so read the held-out "If I multiply {a} and {b}, what do I get?" as an average, `(a*b)/2`
# (docs/training-history.md).
MORE_VERB_WRAPPERS = [
    "When I {v}, what comes out?", "Say I {v}: what's the result?", "If we {v}, what is it?",
    "Suppose you {v}. What's the answer?", "If you {v}, what's the answer?",
    "When you {v}, what do you have?",
]  # fmt: skip
MORE_VERB_PROBABILITY = 0.3  # of training's questions in a verb wrapper

# ---- follow-ups: {r} is the previous result in words, {n} the new operand ------------------------
FOLLOWUP_CORES = {
    "*": ["times {n}", "multiply {r} by {n}", "{r} times {n}", "multiplied by {n}"],
    "+": ["plus {n}", "add {n} to {r}", "add {n}", "{r} plus {n}"],
    "-": ["minus {n}", "subtract {n} from {r}", "take {n} off {r}", "take away {n}",
          "{r} minus {n}"],
    "/": ["divided by {n}", "divide {r} by {n}", "split {r} into {n} equal parts",
          "{r} divided by {n}"],
}  # fmt: skip
FIXED_FOLLOWUPS = [("double {r}", "*", "2"), ("triple {r}", "*", "3"),
                   ("halve {r}", "/", "2"), ("quadruple {r}", "*", "4")]  # fmt: skip
RESULT_WORDS = ["it", "that", "the result", "the answer"]
FOLLOWUP_WRAPPERS = [
    "and {c}?", "now {c}", "{c}?", "what about {c}?", "ok, {c}", "then {c}", "and now {c}",
    "Now {c} please.",
]  # fmt: skip
EVAL_FOLLOWUP_WRAPPERS = ["next, {c}", "alright, {c} please"]  # eval only
# Training only, kept out of FOLLOWUP_WRAPPERS (whose pairs with the cores also make the
# held-out follow-ups): the eval-only wrappers' words ("alright", "please" after the request)
# in other wrappers: without them those words alone made a model miscopy the previous
# answer.
MORE_FOLLOWUP_WRAPPERS = ["alright then, {c}", "ok, {c} please", "right, {c}", "and then {c}"]
MORE_FOLLOWUP_PROBABILITY = 0.3

# ---- letter counting: {L} the letter phrase, {W} the word phrase --------------------------------
COUNT_FRAMES = [
    "How many {L} are in {W}?", "how many {L} in {W}", "Count the {L} in {W}.",
    "How many times does {L} appear in {W}?", "How many {L} does {W} have?",
    "number of {L} in {W}?", "In {W}, how many {L} are there?",
    "What's the count of {L} in {W}?", "Tell me how many {L} {W} has.",
]  # fmt: skip
EVAL_COUNT_FRAMES = [  # eval only
    "Can you count the {L} in {W} for me?", "I wonder how many {L} there are in {W}.",
]  # fmt: skip
# Training only, and outside the held-out split (so the eval set is unchanged): counting
# requests composed from a wrapper and a core, most with other words between the question and
# the letter. The COUNT_FRAMES training keeps put the letter right after "how many" or "count
# of"; in the held-out "How many times does {L} appear in {W}?" the model then wrote a letter
# at random ("j"), and one run declined "Can you count the {L} in {W} for me?" as out of
# scope. A test bounds each composed frame's word-level similarity to every held-out
# counting frame and eval-only arithmetic wrapper (below 0.7): none starts "Could you", which
# eval-only arithmetic wrappers do.
COUNT_REQUEST_WRAPPERS = [
    "Please {c}.", "Can you {c}?", "I'd like you to {c}.", "Would you {c}?", "{C}, please.",
    "Help me {c}.", "Quick one: {c}.", "I need you to {c}.", "{C}.",
    # Words after the word to count, so that they are not taken for it ("... for me?").
    "{C} for me.", "Would you {c} for me, thanks?", "{C} for us please.",
]  # fmt: skip
COUNT_REQUEST_CORES = [
    "tell me how many {L} you find in {W}", "check how many times {L} turns up inside {W}",
    "find out how often {L} occurs in {W}", "work out the {L} count for {W}",
    "look at {W} and count {L}", "tell me the total of {L} inside {W}",
    "find every {L} in {W} and count them", "see how many copies of {L} {W} has",
    "figure out how many times {L} is used in {W}", "count up the {L} that {W} contains",
]  # fmt: skip
COUNT_QUESTION_FRAMES = [  # training only: questions with the letter past "how many"
    "How often is {L} found in {W}?", "How many copies of {L} can you see in {W}?",
    "{W}: how many {L}?", "How often do you see {L} in {W}?",
    "How frequently can {L} be found within {W}?", "In {W}, how often does {L} occur?",
]  # fmt: skip
COMPOSED_COUNT_PROBABILITY = 0.35  # of training counting questions
COUNT_QUESTION_FRAME_SHARE = 0.3  # of composed frames; the rest are wrapper x core requests
LETTER_FORMS = ["{l}'s", "{l}s", "letter {l}", "the letter {l}", "'{l}'", "'{l}'s"]
WORD_FORMS = ["{w}", "'{w}'", '"{w}"', "the word {w}"]
# A phrase of several words is quoted or named: a bare one would not say where it starts.
PHRASE_FORMS = ["'{w}'", '"{w}"', "the phrase '{w}'", 'the phrase "{w}"', "the words '{w}'"]
NEW_WORD_FRAMES = ["what about {W}?", "and in {W}?", "how about {W}?", "and {W}?"]
EVAL_NEW_WORD_FRAMES = ["same question for {W}"]  # eval only
NEW_LETTER_FRAMES = ["and {L}?", "now count {L}", "what about {L}?", "and how many {L}?"]
EVAL_NEW_LETTER_FRAMES = ["now try {L}"]  # eval only
# Training only: follow-ups around an arbitrary verb ({V}, a dictionary word), so that a verb
# the model never saw ("now try X" in eval) is read as part of the frame, not as the word or
# the letter. Without these the model copied "try" into the call ("trycodile", .count("t")).
# The eval frame is then held out in its wording ("try" is never a verb here), not in its
# shape. Counting questions get a general form of the same idea: in some, a stray
# dictionary word replaces or joins one of the frame's words (with_stray_word), so that
# unknown words around the letter and the word are read as part of the sentence.
VERB_NEW_WORD_FRAMES = ["now {V} {W}", "ok, {V} {W}", "{V} {W} next"]
VERB_NEW_LETTER_FRAMES = ["now {V} {L}", "ok, {V} {L}", "{V} {L} next"]

# ---- questions a tiny model cannot answer ----------------------------------------------------
OUT_OF_SCOPE_TOPICS = [
    "France", "the moon", "dinosaurs", "the Roman Empire", "black holes", "volcanoes",
    "the ocean", "jazz music", "football", "Shakespeare", "electricity", "vaccines",
    "the stock market", "climate change", "ancient Egypt", "Python programming", "democracy",
    "the human heart", "chess", "coffee", "Napoleon", "the internet", "photosynthesis",
    "World War II", "Bitcoin", "the Olympics", "gravity", "the Beatles", "Japan", "robots",
    "pyramids", "tigers", "the weather", "quantum physics", "my car", "French grammar",
]  # fmt: skip
EVAL_OUT_OF_SCOPE_TOPICS = [  # eval only
    "the Mona Lisa", "Mount Everest", "the Great Wall of China", "bees", "Mars", "origami",
    "the Amazon river",
]  # fmt: skip
OUT_OF_SCOPE_FRAMES = [
    "What is {t}?", "Tell me about {t}.", "Explain {t}.", "Who discovered {t}?",
    "Write a poem about {t}.", "Write a story about {t}.", "What do you think about {t}?",
    "Give me facts about {t}.", "Why is {t} important?", "Summarize the history of {t}.",
    "How does {t} work?", "Teach me about {t}.", "What's new with {t}?",
]  # fmt: skip
# Training only, kept out of OUT_OF_SCOPE_FRAMES (whose pairs with the topics also make the
# held-out questions): the words of the eval-only frames ("interesting", "describe") in other
# sentences: without them those words alone made a model count letters.
MORE_OUT_OF_SCOPE_FRAMES = [
    "What's so special about {t}?", "Anything interesting to say about {t}?",
    "Describe {t} for me.", "Write a limerick about {t}.",
]  # fmt: skip
MORE_OUT_OF_SCOPE_PROBABILITY = 0.25  # of training's out-of-scope questions about a topic
EVAL_OUT_OF_SCOPE_FRAMES = [  # eval only
    "Write a haiku about {t}.", "What's interesting about {t}?", "Can you describe {t}?",
]  # fmt: skip
OUT_OF_SCOPE_STANDALONE = [
    "Tell me a joke.", "What should I eat for dinner?", "How do I learn French?",
    "Can you write some code for me?", "What's your favorite color?", "Recommend a good book.",
    "Translate hello into Spanish.", "What is love?", "Who won the last World Cup?",
    "Write an email to my boss.", "Is pineapple on pizza good?", "Why is the sky blue?",
    # "What's the {noun} of {noun}?" as the powers and roots are asked ("What's the root of
    # {a}?"), so that the shape alone does not call for the calculator's limits.
    "What's the purpose of art?", "What's the history of jazz?", "What's the secret of happiness?",
    "What's the point of homework?", "What's the origin of chess?", "What's the theme of Hamlet?",
]  # fmt: skip
EVAL_OUT_OF_SCOPE_STANDALONE = [  # eval only
    "Recommend a good movie.", "How do I bake bread?", "What's the meaning of life?",
]  # fmt: skip
# Training only: how-to questions. With one among the standalone ones, a model counted
# letters in held-out how-to questions: letters are tokens of their own, so any short word
# can look like a letter and a word to count. The held-out question stays held out: no task here bakes or makes bread.
HOW_TO_FRAMES = ["How do I {v}?", "How can I {v}?", "What's the best way to {v}?",
                 "Show me how to {v}.", "how do i {v}"]  # fmt: skip
HOW_TO_TASKS = [
    "tie a tie", "change a tire", "plant tomatoes", "fix a leaky tap", "train a puppy",
    "make pasta", "write a resume", "build a website", "learn to swim", "cook rice",
    "knit a scarf", "paint a wall", "sleep better", "save money", "play guitar", "grow basil",
    "clean an oven", "brew tea", "fold a shirt", "start a blog", "boil an egg", "draw a cat",
]  # fmt: skip
HOW_TO_PROBABILITY = 0.2  # of training out-of-scope questions


def held_out_pair(*parts: str) -> bool:
    """Whether training never combines these wrapper/core parts (stable across runs)."""
    return zlib.crc32("|".join(parts).encode()) % HELD_OUT_COMBO_MODULUS == 0


def compose(
    rng: random.Random, split: str, wrappers: list[str], eval_wrappers: list[str], cores: list[str]
) -> tuple[str, str]:
    """A (wrapper, core) pair of the split: train never sees eval wrappers or held-out pairs."""
    if split == "eval" and rng.random() < EVAL_ONLY_WRAPPER_PROBABILITY:
        return rng.choice(eval_wrappers), rng.choice(cores)
    want_held_out = split == "eval"
    pairs = [(w, c) for w in wrappers for c in cores if held_out_pair(w, c) == want_held_out]
    if not pairs:  # a tiny list with no held-out pair: fall back to an eval-only wrapper
        return rng.choice(eval_wrappers if want_held_out else wrappers), rng.choice(cores)
    return rng.choice(pairs)


def verb_question(rng: random.Random, split: str, verbs: list[str]) -> str:
    """A request in a verb wrapper ("Please multiply {a} by {b}."), its operands unfilled."""
    wrapper, verb = compose(rng, split, VERB_WRAPPERS, EVAL_VERB_WRAPPERS, verbs)
    if split == "train" and rng.random() < MORE_VERB_PROBABILITY:
        wrapper = rng.choice(MORE_VERB_WRAPPERS)
    return wrapper.format(v=verb)


def arithmetic_question(rng: random.Random, split: str, op: str, a: str, b: str) -> str:
    if rng.random() < 0.3:
        text = verb_question(rng, split, OPERATOR_VERBS[op]).format(a=a, b=b)
    else:
        wrapper, core = compose(
            rng, split, QUESTION_WRAPPERS, EVAL_QUESTION_WRAPPERS, OPERATOR_CORES[op]
        )
        text = wrapper.format(x=core.format(a=a, b=b))
    return text[0].upper() + text[1:] if rng.random() < 0.5 else text


def followup_question(rng: random.Random, split: str) -> tuple[str, str, str | None]:
    """(question with {n} unfilled, operator, fixed operand or None)."""
    r = rng.choice(RESULT_WORDS)
    if rng.random() < 0.2:
        core, op, fixed = rng.choice(FIXED_FOLLOWUPS)
        wrapper, _ = compose(rng, split, FOLLOWUP_WRAPPERS, EVAL_FOLLOWUP_WRAPPERS, [core])
        return _more_followup(rng, split, wrapper).format(c=core.format(r=r)), op, fixed
    op = rng.choice("*+-/")
    wrapper, core = compose(
        rng, split, FOLLOWUP_WRAPPERS, EVAL_FOLLOWUP_WRAPPERS, FOLLOWUP_CORES[op]
    )
    return _more_followup(rng, split, wrapper).format(c=core.format(r=r, n="{n}")), op, None


def _more_followup(rng: random.Random, split: str, wrapper: str) -> str:
    """In training, now and then one of MORE_FOLLOWUP_WRAPPERS instead of `wrapper` (drawn
    after it, so the held-out split's draws stay as they were)."""
    if split == "train" and rng.random() < MORE_FOLLOWUP_PROBABILITY:
        return rng.choice(MORE_FOLLOWUP_WRAPPERS)
    return wrapper


def letter_phrase(rng: random.Random, letter: str) -> str:
    return rng.choice(LETTER_FORMS).format(l=letter)


def word_phrase(rng: random.Random, word: str, forms: list[str] = WORD_FORMS) -> str:
    return rng.choice(forms).format(w=word)


def counting_question(
    rng: random.Random,
    split: str,
    word: str,
    letter: str,
    stray: str | None = None,
    forms: list[str] = WORD_FORMS,
) -> str:
    """A counting question; with a stray word (training only), that word replaces one of the
    frame's own words or is inserted before it ("How many {L} zymotic in {W}?"). `forms` are
    the ways the word is written (PHRASE_FORMS for a phrase)."""
    assert stray is None or split == "train", "stray words are training-only"
    if split == "train" and rng.random() < COMPOSED_COUNT_PROBABILITY:
        frame = composed_count_frame(rng)
    else:
        frame, _ = compose(rng, split, COUNT_FRAMES, EVAL_COUNT_FRAMES, [""])
    if stray is not None:
        frame = with_stray_word(rng, frame, stray)
    return frame.format(L=letter_phrase(rng, letter), W=word_phrase(rng, word, forms))


def composed_count_frame(rng: random.Random) -> str:
    """A training-only counting frame: a question from COUNT_QUESTION_FRAMES, or a request
    composed from COUNT_REQUEST_WRAPPERS and COUNT_REQUEST_CORES."""
    if rng.random() < COUNT_QUESTION_FRAME_SHARE:
        return rng.choice(COUNT_QUESTION_FRAMES)
    return count_request(rng.choice(COUNT_REQUEST_WRAPPERS), rng.choice(COUNT_REQUEST_CORES))


def count_request(wrapper: str, core: str) -> str:
    """The wrapper around the core: {c} as it is, {C} with its first letter capitalised."""
    return wrapper.format(c=core, C=core[0].upper() + core[1:])


def with_stray_word(rng: random.Random, frame: str, stray: str) -> str:
    """The frame with one of its literal words replaced by `stray`, or `stray` inserted
    before it; the {L} and {W} slots stay as they are."""
    words = frame.split(" ")
    literal = [i for i, w in enumerate(words) if "{" not in w]
    i = rng.choice(literal)
    if rng.random() < 0.5:
        words[i] = stray + words[i][len(words[i].rstrip("?.,")) :]  # keep its punctuation
    else:
        words.insert(i, stray)
    return " ".join(words)


def new_word_question(rng: random.Random, split: str, word: str, verb: str | None = None) -> str:
    """ "what about {W}?"; with a verb (training only) "now {V} {W}"."""
    assert verb is None or split == "train", "verb frames are training-only"
    if verb is not None:
        return rng.choice(VERB_NEW_WORD_FRAMES).format(V=verb, W=word_phrase(rng, word))
    frame = rng.choice(EVAL_NEW_WORD_FRAMES if split == "eval" else NEW_WORD_FRAMES)
    return frame.format(W=word_phrase(rng, word))


def new_letter_question(
    rng: random.Random, split: str, letter: str, verb: str | None = None
) -> str:
    """ "and {L}?"; with a verb (training only) "now {V} {L}"."""
    assert verb is None or split == "train", "verb frames are training-only"
    if verb is not None:
        return rng.choice(VERB_NEW_LETTER_FRAMES).format(V=verb, L=letter_phrase(rng, letter))
    frame = rng.choice(EVAL_NEW_LETTER_FRAMES if split == "eval" else NEW_LETTER_FRAMES)
    return frame.format(L=letter_phrase(rng, letter))


def out_of_scope_question(rng: random.Random, split: str) -> str:
    if split == "train" and rng.random() < HOW_TO_PROBABILITY:
        return rng.choice(HOW_TO_FRAMES).format(v=rng.choice(HOW_TO_TASKS))
    if rng.random() < 0.25:
        return rng.choice(
            EVAL_OUT_OF_SCOPE_STANDALONE if split == "eval" else OUT_OF_SCOPE_STANDALONE
        )
    topics = EVAL_OUT_OF_SCOPE_TOPICS if split == "eval" else OUT_OF_SCOPE_TOPICS
    if split == "train" and rng.random() < MORE_OUT_OF_SCOPE_PROBABILITY:
        return rng.choice(MORE_OUT_OF_SCOPE_FRAMES).format(t=rng.choice(topics))
    frame, topic = compose(rng, split, OUT_OF_SCOPE_FRAMES, EVAL_OUT_OF_SCOPE_FRAMES, topics)
    return frame.format(t=topic)
