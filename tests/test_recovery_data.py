"""Tests for chatcli.training.recovery_data and loss_mask: a flawed reply stays in the context
of a training conversation but out of its loss."""

from __future__ import annotations

import random

import pytest

from chatcli.engine.calculator import format_result, use_calculator
from chatcli.model.checkpoint import EMBEDDED_DIR
from chatcli.model.special_tokens import ASSISTANT_END, PYTHON_END, PYTHON_START
from chatcli.model.tokenizer import Tokenizer
from chatcli.training.exchange import Exchange
from chatcli.training.loss_mask import render_for_training, unlearned_spans
from chatcli.training.recovery_data import carried_call, garbled_sentence, miscopied, recovery
from tests.training_data import learned, tool_turns


def unlearned_items(conversation: list[dict]) -> list[dict]:
    """The messages and parts marked "learn": False."""
    items = []
    for message in conversation:
        if message.get("learn") is False:
            items.append(message)
        elif isinstance(message["content"], list):
            items += [p for p in message["content"] if p.get("learn") is False]
    return items


@pytest.fixture(scope="module")
def conversations() -> list[list[dict]]:
    rng = random.Random(4)
    return [recovery(rng, "train") for _ in range(600)]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    path = EMBEDDED_DIR / "tokenizer" / "tokenizer.pkl"
    if not path.exists():
        pytest.skip("embedded model not built")
    return Tokenizer.from_file(path)


def test_each_holds_one_flaw_and_ends_with_a_right_tool_reply(conversations):
    for conversation in conversations:
        assert len(unlearned_items(conversation)) == 1
        assert conversation[-1]["role"] == "assistant" and "learn" not in conversation[-1]
        last = tool_turns(conversation)[-1]
        assert last["python_output"] == format_result(use_calculator(last["python"]))
        assert last["python_output"] in last["text"]


def test_flawed_calls_are_refused_or_answered_as_the_calculator_would(conversations):
    kinds = {"refused": 0, "answered": 0}
    for conversation in conversations:
        for message in conversation:
            if message["role"] != "assistant" or isinstance(message["content"], str):
                continue
            parts = message["content"]
            for i, part in enumerate(parts):
                if part["type"] != "python":
                    continue
                value = use_calculator(part["text"])
                if value is None:  # nothing is injected after a refused call
                    assert i + 1 == len(parts) or parts[i + 1]["type"] != "python_output"
                    kinds["refused"] += 1
                else:
                    assert parts[i + 1] == {"type": "python_output", "text": format_result(value)}
                    kinds["answered"] += 1
    assert kinds["refused"] > 200


def test_the_learned_view_is_a_flawless_conversation(conversations):
    for conversation in conversations:
        view = learned(conversation)
        roles = [m["role"] for m in view]
        assert roles[-2:] == ["user", "assistant"]
        for message in view:
            if message["role"] == "assistant" and isinstance(message["content"], list):
                assert [p["type"] for p in message["content"]] == [
                    "python",
                    "python_output",
                    "text",
                ]


def test_a_carried_call_is_the_previous_result_times_the_word():
    assert carried_call("7006652", '"tattoo".count("t")') == "7006652*tattoo"
    assert use_calculator("7006652*tattoo") is None


def test_a_miscopied_answer_keeps_its_call_output_and_sentence_consistent():
    rng = random.Random(0)
    exchange = Exchange("What is 1234*56?", "1234*56", "69104", "1234*56 = 69104.")
    for _ in range(50):
        wrong = miscopied(rng, exchange)
        if wrong is None:  # a digit change the calculator refuses (none here) or no digit
            continue
        assert wrong.expression != "1234*56" and len(wrong.expression) == len("1234*56")
        assert wrong.result == format_result(use_calculator(wrong.expression))
        assert wrong.sentence == f"{wrong.expression} = {wrong.result}."
    assert miscopied(rng, Exchange("q", '"abc".count("a")', "1", "There is 1 a in abc.")) is None


def test_a_garbled_sentence_is_the_right_one_cut_short_with_its_number_wrong():
    rng = random.Random(1)
    exchange = Exchange("q", '"tattoo".count("t")', "3", "There are 3 t's in tattoo.")
    for _ in range(30):
        text = garbled_sentence(rng, exchange)
        assert text.startswith("There") and text != exchange.sentence


def test_unlearned_spans_are_masked_out_and_nothing_else_changes(tokenizer):
    conversation = [
        {"role": "user", "content": "What is 1234*5678?"},
        {
            "role": "assistant",
            "content": [
                {"type": "python", "text": "1234*5678"},
                {"type": "python_output", "text": "7006652"},
                {"type": "text", "text": "The answer is 7006652."},
            ],
        },
        {"role": "user", "content": "How many t in tattoo?"},
        {
            "role": "assistant",
            "content": [
                {"type": "python", "text": "7006652*tattoo"},
                {"type": "text", "text": "an 3006652 tattoo now."},
            ],
            "learn": False,
        },
        {"role": "user", "content": "How many t in tattoo?"},
        {
            "role": "assistant",
            "content": [
                {"type": "python", "text": "7006652*tattoo", "learn": False},
                {"type": "python", "text": '"tattoo".count("t")'},
                {"type": "python_output", "text": "3"},
                {"type": "text", "text": "There are 3 t's in tattoo."},
            ],
        },
    ]
    plain_ids, plain_mask = tokenizer.render_conversation(conversation)
    ids, mask = render_for_training(tokenizer, conversation)
    assert ids == plain_ids
    (reply_start, reply_end), (part_start, part_end) = unlearned_spans(tokenizer, conversation)
    # The whole flawed reply, its <|assistant_end|> included; then the one refused call.
    assert tokenizer.decode(ids[reply_start:reply_end]) == (
        f"{PYTHON_START}7006652*tattoo{PYTHON_END}an 3006652 tattoo now.{ASSISTANT_END}"
    )
    assert tokenizer.decode(ids[part_start:part_end]) == f"{PYTHON_START}7006652*tattoo{PYTHON_END}"
    unlearned = set(range(reply_start, reply_end)) | set(range(part_start, part_end))
    for i, (m, plain) in enumerate(zip(mask, plain_mask, strict=True)):
        assert m == (0 if i in unlearned else plain), i
    assert sum(plain_mask) - sum(mask) == (reply_end - reply_start) + (part_end - part_start)
    # The right call after the refused one is still learned.
    assert tokenizer.decode([t for t, m in zip(ids[part_end:], mask[part_end:], strict=True) if m])
    assert mask[part_end] == 1


def test_without_marks_training_renders_as_the_tokenizer_does(tokenizer):
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    assert render_for_training(tokenizer, conversation) == tokenizer.render_conversation(
        conversation
    )
    assert render_for_training(tokenizer, conversation, max_tokens=5) == (
        tokenizer.render_conversation(conversation, max_tokens=5)
    )
