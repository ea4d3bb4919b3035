"""The data of everyday calculations: percentages and averages, each one calculator call.

Owns how "15% of 80", "80 increased by 15%", "What percent of 80 is 12?" and "the average of
3, 5 and 10" become calls (`15*80/100`, `80*(100+15)/100`, `12*100/80`, `(3+5+10)/3`) and a
sentence copying the output. Multiplying before dividing by 100 keeps the result exact where
it can be (`7*33/100` is 2.31; `7/100*33` is 2.3100000000000005; `804+804*34/100` is
1077.3600000000001 where `804*(100+34)/100` is 1077.36). Operands follow held_out.py:
a training question uses no held-out number, an eval question at least one. It knows nothing
about the mix or about evaluation.
"""

from __future__ import annotations

import random

from chatcli.training import math_phrasings
from chatcli.training.exchange import Exchange, calculate, display, vary, with_filler
from chatcli.training.expression_data import small_operand
from chatcli.training.held_out import operands_in_split, sample_decimal, sample_int

PERCENT_FORM_WEIGHTS = {"of": 0.5, "change": 0.25, "share": 0.25}
# Training asks more shares and longer lists than eval does: they are where earlier recipes
# missed (a share's part copied for its whole, a list of 4 divided by 5;
# docs/training-history.md).
TRAIN_PERCENT_FORM_WEIGHTS = {"of": 0.4, "change": 0.2, "share": 0.4}
DECIMAL_PERCENT_PROBABILITY = 0.15  # 12.5% rather than 12%
AVERAGE_SIZE_WEIGHTS = {2: 1, 3: 4, 4: 3, 5: 2}
TRAIN_AVERAGE_SIZE_WEIGHTS = {2: 1, 3: 3, 4: 3, 5: 3}
DECIMAL_AVERAGE_PROBABILITY = 0.1  # of the numbers averaged


def percent_exchange(rng: random.Random, split: str) -> Exchange:
    weights = TRAIN_PERCENT_FORM_WEIGHTS if split == "train" else PERCENT_FORM_WEIGHTS
    form = rng.choices(list(weights), list(weights.values()))[0]
    if form == "share":
        return _percent_share(rng, split)
    while True:
        p, x = _percent(rng), _base(rng, split)
        if operands_in_split((p, x), split):
            break
    if form == "of":
        call = f"{p}*{x}/100"
        question = math_phrasings.percent_of_question(rng, split, p, display(rng, x))
        sentence = "{p}% of {x} is {result}."
    else:
        op = rng.choice("+-")
        call = f"{x}*(100{op}{p})/100"
        question = math_phrasings.percent_change_question(rng, split, op, p, display(rng, x))
        sentence = "The answer is {result}."
    result = calculate(call)
    question = with_filler(rng, split, vary(rng, question))
    return Exchange(question, call, result, sentence.format(p=p, x=x, result=result))


def average_exchange(rng: random.Random, split: str) -> Exchange:
    weights = TRAIN_AVERAGE_SIZE_WEIGHTS if split == "train" else AVERAGE_SIZE_WEIGHTS
    k = rng.choices(list(weights), list(weights.values()))[0]
    while True:
        numbers = [_averaged(rng) for _ in range(k)]
        if split == "eval":
            numbers[rng.randrange(k)] = sample_int(rng, "eval", max_digits=4)
        if operands_in_split(numbers, split):
            break
    call = f"({'+'.join(numbers)})/{k}"
    result = calculate(call)
    # No thousands separators here: in "1,234, 5 and 10" the commas would be ambiguous.
    question = math_phrasings.average_question(rng, split, numbers)
    question = with_filler(rng, split, vary(rng, question))
    return Exchange(question, call, result, f"The average is {result}.")


def _percent_share(rng: random.Random, split: str) -> Exchange:
    """What percent of x is y: `y*100/x`."""
    while True:
        x = _base(rng, split)
        y = str(rng.randint(1, max(1, int(float(x)))))
        if "." not in x and operands_in_split((x, y), split):
            break
    call = f"{y}*100/{x}"
    result = calculate(call)
    question = math_phrasings.percent_share_question(rng, split, y, display(rng, x))
    question = with_filler(rng, split, vary(rng, question))
    return Exchange(question, call, result, f"{y} is {result}% of {x}.")


def _percent(rng: random.Random) -> str:
    """A percentage as people pick them: often a multiple of 5, sometimes 12.5."""
    if rng.random() < DECIMAL_PERCENT_PROBABILITY:
        return f"{rng.randint(1, 99)}.5"
    if rng.random() < 0.6:
        return str(5 * rng.randint(1, 20))
    return str(rng.randint(1, 100))


def _base(rng: random.Random, split: str) -> str:
    """What the percentage is of: a price with cents, or a whole number of 2-5 digits."""
    if rng.random() < 0.15:
        return sample_decimal(rng, split)
    while True:
        text = sample_int(rng, split, max_digits=5)
        if len(text) >= 2:
            return text


def _averaged(rng: random.Random) -> str:
    if rng.random() < DECIMAL_AVERAGE_PROBABILITY:
        return sample_decimal(rng, "train")
    return small_operand(rng)
