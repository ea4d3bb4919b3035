"""Conversations that go on well after a reply that went wrong, for sampling's sake.

At temperature 0.6 a reply sometimes goes wrong: a digit miscopied, or the previous result
carried into a new call (`7006652*tattoo`, which the calculator refuses, so nothing is
injected and the reply runs on as text). That reply stays in the history, and the model was
only ever trained on flawless histories. These conversations hold such a reply and then the
right one, so that a slip stays one slip:

- carried: a count asked after a large product gets the refused carried call and a garbled
  sentence; the user asks again and gets the right call;
- miscopied: an answer whose call has one digit wrong (its output and sentence consistent with
  that call); the next question, of either tool kind, is answered right;
- retry: within one reply, a refused call is followed at once by the right call.

The flawed reply or part is marked `"learn": False` (loss_mask.py keeps it in the context but
out of the loss): the model learns what follows a slip, never the slip. It knows nothing
about the mix or about evaluation.
"""

from __future__ import annotations

import random

from chatcli.engine.calculator import use_calculator
from chatcli.training.arithmetic_data import arithmetic_exchange, large_product_exchange
from chatcli.training.counting_data import count_exchange, counting_exchange
from chatcli.training.exchange import Exchange, calculate
from chatcli.training.held_out import is_held_out_number, numbers_in

FLAW_WEIGHTS = {"carried": 0.4, "miscopied": 0.3, "retry": 0.3}
SAME_QUESTION_PROBABILITY = 0.5  # after a garbled reply the user asks the same question again
AGAIN_PREFIXES = ["", "", "try again: ", "no, ", "that's wrong. "]


def recovery(rng: random.Random, split: str) -> list[dict]:
    flaw = rng.choices(list(FLAW_WEIGHTS), list(FLAW_WEIGHTS.values()))[0]
    if flaw == "miscopied":
        return _after_a_miscopied_answer(rng, split)
    first = large_product_exchange(rng, split)
    while not _kept(first.result, split):  # the carried call writes it
        first = large_product_exchange(rng, split)
    count = counting_exchange(rng, split)
    bad_call = carried_call(first.result, count.expression)
    if flaw == "retry":
        # The refused call, then straight away the right one, in the same reply.
        user, reply = count.messages()
        reply["content"].insert(0, {"type": "python", "text": bad_call, "learn": False})
        return [*first.messages(), user, reply]
    garbled = {
        "role": "assistant",
        "content": [
            {"type": "python", "text": bad_call},
            {"type": "text", "text": garbled_sentence(rng, count)},
        ],
        "learn": False,
    }
    if rng.random() < SAME_QUESTION_PROBABILITY:
        question, prefix = count.question, rng.choice(AGAIN_PREFIXES)
        if prefix:
            question = prefix + question[0].lower() + question[1:]
        again = count_exchange(question, *_count_parts(count))
    else:
        again = counting_exchange(rng, split)
    asked = {"role": "user", "content": count.question}
    return [*first.messages(), asked, garbled, *again.messages()]


def carried_call(previous_result: str, count_call: str) -> str:
    """The slip seen at temperature 0.6: the previous result carried into a count's call,
    the word as a bare name (`7006652*tattoo`). The calculator refuses it."""
    word = count_call.split('"')[1]
    call = f"{previous_result}*{word.replace(' ', '')}"
    assert use_calculator(call) is None, call
    return call


def garbled_sentence(rng: random.Random, exchange: Exchange) -> str:
    """Text as a reply runs on after a refused call: the right sentence cut short, its
    number wrong."""
    words = exchange.sentence.split()
    cut = words[: rng.randint(1, max(1, len(words) - 1))]
    digits = [i for i, w in enumerate(cut) if any(c.isdigit() for c in w)]
    for i in digits:
        cut[i] = str(rng.randint(0, 10**7))
    return " ".join(cut) + rng.choice(("", ".", " now."))


def miscopied(rng: random.Random, exchange: Exchange) -> Exchange | None:
    """The exchange with one digit of its call changed, its output and sentence following
    the wrong call; None when the call has no digit to change."""
    positions = [i for i, c in enumerate(exchange.expression) if c.isdigit()]
    if not positions:
        return None
    i = rng.choice(positions)
    digit = rng.choice([d for d in "0123456789" if d != exchange.expression[i]])
    call = exchange.expression[:i] + digit + exchange.expression[i + 1 :]
    if use_calculator(call) is None:
        return None
    result = calculate(call)
    # The call first, so that a result that is part of it ("12" in "12*1") stays.
    sentence = exchange.sentence.replace(exchange.expression, "\0")
    sentence = sentence.replace(exchange.result, result).replace("\0", call)
    return Exchange(exchange.question, call, result, sentence)


def _kept(text: str, split: str) -> bool:
    """In training, no held-out number in a call the conversation writes (eval: any)."""
    return split == "eval" or not any(is_held_out_number(n) for n in numbers_in(text))


def _after_a_miscopied_answer(rng: random.Random, split: str) -> list[dict]:
    while True:
        first = arithmetic_exchange(rng, split)
        wrong = miscopied(rng, first)
        if wrong is not None and _kept(wrong.expression, split):
            break
    user, reply = wrong.messages()
    reply["learn"] = False
    second = (
        counting_exchange(rng, split) if rng.random() < 0.5 else arithmetic_exchange(rng, split)
    )
    return [user, reply, *second.messages()]


def _count_parts(exchange: Exchange) -> tuple[str, str]:
    """(word, letter) of a count's call `"word".count("l")`."""
    word, _, letter, _ = exchange.expression.split('"')[1:5]
    return word, letter
