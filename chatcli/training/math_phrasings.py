"""How users ask the arithmetic beyond one operator: its phrasings, as phrasings.py's are built.

Owns the wording of expressions with several operators ("the sum of 12 and 8, times 3"),
percentages ("15% of 80"), averages ("the average of 3, 5 and 10"), questions in number
words ("twelve times seven") and requests the calculator cannot do (powers, roots,
functions). As in phrasings.py a question is a wrapper around a core: eval uses wrappers
training never sees and wrapper/core pairs training never combines (`phrasings.compose`),
and the eval-only frames here (EVAL_*) are kept below a word-level similarity to every
training frame by a test. It knows nothing about numbers, splits of numbers or answers.
"""

from __future__ import annotations

import random

from chatcli.training import phrasings
from chatcli.training.phrasings import EVAL_QUESTION_WRAPPERS, QUESTION_WRAPPERS, compose

# ---- expressions: {e} is the whole expression, in symbols or in words ----------------------------
EXPRESSION_CORES = ["{e}", "the value of {e}", "the result of {e}"]
# Words that read left to right in a chain: "3 plus 4 times 5" is 3+4*5 (23), as written. Not
# "multiplied by" or "over", which people read as closing what came before.
OPERATOR_WORDS = {"+": ["plus"], "-": ["minus"], "*": ["times"], "/": ["divided by"]}
SYMBOL_FORMS = {"+": ["+"], "-": ["-"], "*": ["*", "x"], "/": ["/"]}
# A two-operand group named by its operation, as OPERATOR_CORES name it in training.
GROUP_WORDS = {
    "+": "the sum of {a} and {b}",
    "-": "the difference between {a} and {b}",
    "*": "the product of {a} and {b}",
    "/": "the quotient of {a} and {b}",
}
# "{g}, then {w} {c}": the group first, the operator word after (a left-to-right chain).
THEN_FORMS = ["{g}, then {w} {c}", "{g}, and then {w} {c}", "{g}, all {w} {c}"]

# ---- percentages ---------------------------------------------------------------------------------
PERCENT_OF_CORES = ["{p}% of {x}", "{p} percent of {x}", "{p} per cent of {x}"]
PERCENT_CHANGE_CORES = {
    "+": ["{x} increased by {p}%", "{x} plus {p}%", "{x} with {p}% added", "{x} raised by {p}%"],
    "-": ["{x} decreased by {p}%", "{x} minus {p}%", "{p}% off {x}", "{x} reduced by {p}%"],
}
# {y} as a share of {x}: the whole question, no wrapper.
# The words of the eval-only frames ("as a percentage", "the whole", "over") are taught here
# in other sentences: the eval checks the reading of new sentences, not new words.
PERCENT_SHARE_FRAMES = [
    "What percent of {x} is {y}?", "{y} is what percent of {x}?",
    "What percentage of {x} is {y}?", "{y} out of {x} is what percent?",
    "what % of {x} is {y}", "What is {y} of {x} in percent?", "{y} over {x}, in percent",
    "With {x} as the whole, what percent is {y}?", "Write {y} of {x} as a percentage.",
    "{y} parts of a whole of {x}: what percentage is that?",
    # The whole named first, then the part, so that neither number is copied for the other
    # (docs/training-history.md, "What the data's comments stand on").
    "Taking {x} as the total, {y} is what percent?", "Out of {x}, {y} is how much in percent?",
    "Suppose the total is {x}. What share of it in percent is {y}?",
    "When {x} counts as 100%, what percent is {y}?",
    # More of both orders: with fewer, one number was still copied for both.
    "Tell me {y} against {x} in percent.", "Turn {y} out of {x} into a percentage.",
    "Show me {y} as a share of {x}, in percent.", "Put {y} of {x} in percent terms.",
    "If the total is {x}, what percent is {y}?", "For a total of {x}, what percent is {y}?",
    "Of {x} in all, what percentage is {y}?",
    # A verb, the part, then the whole: without them the part was written for the whole.
    "Rewrite {y} as a share of {x} in percent.", "Turn {y} into a percent of {x}.",
    "State {y} in percent of {x}.", "Convert {y} into a percentage relative to {x}.",
    "Change {y} into a percent of {x}.", "Report {y} in percentage terms of {x}.",
    "Write out {y} as a fraction of {x}, in percent.",
]  # fmt: skip
EVAL_PERCENT_SHARE_FRAMES = [  # eval only
    "Express {y} as a percentage of {x}.", "If {x} is the whole, how many percent is {y}?",
    "Give me {y} over {x} as a percent.",
]  # fmt: skip

# ---- averages: {l} is the list ("3, 5 and 10") -----------------------------------------------------
AVERAGE_CORES = ["the average of {l}", "the mean of {l}", "the average of the numbers {l}",
                 "the arithmetic mean of {l}"]  # fmt: skip
AVERAGE_VERB_FRAMES = ["Average {l}.", "average these: {l}", "Take the mean of {l}.",
                       "Can you average {l}?", "Please average {l} for me.",
                       "I want to average {l}.", "Averaging {l} gives what?",
                       "Say I average {l}: what's the result?",
                       "When I average {l}, what comes out?",
                       # A clause after the list, so that its words are not read as
                       # one more number of it.
                       "Average {l}, then tell me the result.", "If we take the mean of {l}, what is it?",
                       "Suppose you average {l}. What's the answer?",
                       "So I averaged {l}; what should it come to?",
                       # A clause, then a question: earlier recipes still miscounted the list
                       # or declined in the held-out "If I average {l}, what do I get?"
                       # (docs/training-history.md).
                       "If you average {l}, what's the answer?",
                       "When we average {l}, what do we have?",
                       "Once I average {l}, what is the mean?"]  # fmt: skip
EVAL_AVERAGE_VERB_FRAMES = ["If I average {l}, what do I get?"]  # eval only
# Of average questions, those in a verb frame rather than "the average of {l}" in a wrapper;
# training asks more of them than eval does, as it has more verb frames to teach.
AVERAGE_VERB_PROBABILITY = {"train": 0.35, "eval": 0.25}

# ---- requests outside the calculator: {a} and {b} are numbers --------------------------------------
BEYOND_QUESTIONS = {
    "power": ["What is {a}^{b}?", "{a} to the power of {b}", "What's {a} squared?",
              "{a}^{b}", "Calculate {a} to the {b}th power.", "What's {a} cubed?",
              "{a} raised to the {b}th power", "cube {a}", "Square {a} for me."],
    "root": ["What is the square root of {a}?", "sqrt({a})", "cube root of {a}",
             "What's the root of {a}?"],
    "function": ["What is sin({a})?", "cos({a})", "log of {a}", "What is {a} factorial?",
                 "{a}!", "What is ln {a}?", "{a} mod {b}", "What's the remainder of {a} / {b}?",
                 "What's the natural log of {a}?", "logarithm base 2 of {a}",
                 "Find the logarithm of {a} to base 10.", "What is cot({a})?", "tangent of {a}"],
}  # fmt: skip
# No frame writes a power as `{a}**{b}`: it differs from a product by one token, and a model
# that learnt it declined bare small products as powers.
#
# Training only: the requests as noun phrases in QUESTION_WRAPPERS, so that what decides
# between a call and the calculator's limits is the request, not its sentence (a model that
# saw "I need {x}." wrap arithmetic only multiplied such requests). Four wrappers stay out, as they would say a
# held-out frame ("How much is {a} cubed?") or nearly (a test bounds the similarity).
BEYOND_CORES = [
    "the square root of {a}", "the cube root of {a}", "{a} squared", "{a} cubed",
    "{a} to the power of {b}", "{a} to the {b}th power", "the log of {a}", "the sine of {a}",
    "{a} factorial", "the tangent of {a}", "the {b}th root of {a}",
    "the cosine of {a}", "{a} mod {b}", "{a} raised to {b}",
]  # fmt: skip
BEYOND_WRAPPERS = [
    w
    for w in QUESTION_WRAPPERS
    if w not in ("How much is {x}?", "I need {x}.", "What do you get for {x}?", "Compute {x}.")
]
BEYOND_COMPOSED_PROBABILITY = 0.5  # of training's beyond questions
# Training only: the words of the held-out "I need the square root of {a}, can you do it?" in
# other sentences about what the calculator cannot do: with "I need {x}." wrapping
# arithmetic alone, a model computed a sum for every one of them.
MORE_BEYOND_FRAMES = [
    "I need the cube root of {a}. Is that possible?", "Can you do the log of {a}? I need it.",
    "I need {a} to the power of {b}; is that something you do?",
    "Could you do {a} squared? I need it for work.", "Sine of {a}: I need it. Can you?",
    "I need {a} factorial, please.", "Can you do it: {a} cubed?",
]  # fmt: skip
MORE_BEYOND_PROBABILITY = 0.2  # of training's beyond questions not composed
EVAL_BEYOND_QUESTIONS = {  # eval only
    "power": ["How much is {a} cubed?", "What do you get if you raise {a} to the power {b}?"],
    "root": ["I need the square root of {a}, can you do it?", "Take the root of {a} for me."],
    "function": ["What is tan({a})?", "Compute the natural logarithm of {a}."],
}  # fmt: skip


def expression_question(rng: random.Random, split: str, expression_text: str) -> str:
    wrapper, core = compose(rng, split, QUESTION_WRAPPERS, EVAL_QUESTION_WRAPPERS, EXPRESSION_CORES)
    text = wrapper.format(x=core.format(e=expression_text))
    return text[0].upper() + text[1:] if rng.random() < 0.5 else text


def percent_of_question(rng: random.Random, split: str, p: str, x: str) -> str:
    wrapper, core = compose(rng, split, QUESTION_WRAPPERS, EVAL_QUESTION_WRAPPERS, PERCENT_OF_CORES)
    return _capitalised(rng, wrapper.format(x=core.format(p=p, x=x)))


def percent_change_question(rng: random.Random, split: str, op: str, p: str, x: str) -> str:
    cores = PERCENT_CHANGE_CORES[op]
    wrapper, core = compose(rng, split, QUESTION_WRAPPERS, EVAL_QUESTION_WRAPPERS, cores)
    return _capitalised(rng, wrapper.format(x=core.format(p=p, x=x)))


def percent_share_question(rng: random.Random, split: str, y: str, x: str) -> str:
    """A whole question, no wrapper: eval asks only in the eval-only frames."""
    frames = EVAL_PERCENT_SHARE_FRAMES if split == "eval" else PERCENT_SHARE_FRAMES
    return rng.choice(frames).format(y=y, x=x)


def average_question(rng: random.Random, split: str, numbers: list[str]) -> str:
    listed = number_list(rng, numbers)
    if rng.random() < AVERAGE_VERB_PROBABILITY[split]:
        frames = AVERAGE_VERB_FRAMES
        if split == "eval":
            frames = EVAL_AVERAGE_VERB_FRAMES
        return rng.choice(frames).format(l=listed)
    wrapper, core = compose(rng, split, QUESTION_WRAPPERS, EVAL_QUESTION_WRAPPERS, AVERAGE_CORES)
    return _capitalised(rng, wrapper.format(x=core.format(l=listed)))


def number_list(rng: random.Random, numbers: list[str]) -> str:
    """ "3, 5 and 10", "3, 5, and 10" or "3, 5, 10"."""
    if len(numbers) == 2 or rng.random() < 0.8:
        comma = "," if len(numbers) > 2 and rng.random() < 0.3 else ""
        return ", ".join(numbers[:-1]) + f"{comma} and {numbers[-1]}"
    return ", ".join(numbers)


def worded_arithmetic_question(rng: random.Random, split: str, op: str, a: str, b: str) -> str:
    """An arithmetic question whose operator is a word ("twelve times seven"): the cores of
    phrasings.OPERATOR_CORES and OPERATOR_VERBS that use no symbol, wrapped as they are."""
    if rng.random() < 0.3:
        text = phrasings.verb_question(rng, split, phrasings.OPERATOR_VERBS[op]).format(a=a, b=b)
    else:
        cores = [c for c in phrasings.OPERATOR_CORES[op] if not set(c) & set("+-*/")]
        wrapper, core = compose(rng, split, QUESTION_WRAPPERS, EVAL_QUESTION_WRAPPERS, cores)
        text = wrapper.format(x=core.format(a=a, b=b))
    return _capitalised(rng, text)


def beyond_question(rng: random.Random, split: str, a: str, b: str) -> str:
    """A request for a power, a root or a function, which the calculator does not do."""
    if split == "train" and rng.random() < BEYOND_COMPOSED_PROBABILITY:
        text = rng.choice(BEYOND_WRAPPERS).format(x=rng.choice(BEYOND_CORES))
        return _capitalised(rng, text.format(a=a, b=b))
    if split == "train" and rng.random() < MORE_BEYOND_PROBABILITY:
        return rng.choice(MORE_BEYOND_FRAMES).format(a=a, b=b)
    kind = rng.choice(list(BEYOND_QUESTIONS))
    frames = BEYOND_QUESTIONS[kind]
    if split == "eval":
        frames = EVAL_BEYOND_QUESTIONS[kind]
    return rng.choice(frames).format(a=a, b=b)


def _capitalised(rng: random.Random, text: str) -> str:
    return text[0].upper() + text[1:] if rng.random() < 0.5 else text
