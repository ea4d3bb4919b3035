"""Tests for chatcli.training.eval_sets: the held-out prompts, kept apart from training."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections import Counter

import pytest

from chatcli.engine.calculator import format_result, use_calculator
from chatcli.training import math_phrasings, phrasings
from chatcli.training.eval_sets import (
    BASE_EVAL_KINDS,
    EVAL_KINDS,
    NEW_EVAL_KINDS,
    EvalItem,
    generate_eval_set,
)
from chatcli.training.held_out import is_held_out_number, is_held_out_string, numbers_in
from chatcli.training.vocabulary import EVAL_WORDS
from tests.training_data import (
    NUMBER,
    eval_items,
    eval_split_sample,
    tool_turns,
    train_sample,
    training_calls,
    user_texts,
)

COUNT_CALL = re.compile(r'"([a-z ]+)"\.count\("([a-z])"\)')
ARITHMETIC_CALL = re.compile(r"(-?\d+(?:\.\d+)?)([-+*/])(\d+(?:\.\d+)?)")
# Kinds whose questions carry several numbers, small ones among them: at least one held out.
SEVERAL_NUMBER_KINDS = ("expression", "percent", "average", "number_words")


@pytest.fixture(scope="module")
def eval_set() -> list[EvalItem]:
    return eval_items()


def _digest(items: list[EvalItem]) -> str:
    return hashlib.sha256(json.dumps([dataclasses.astuple(i) for i in items]).encode()).hexdigest()


def test_the_readme_eval_set_is_pinned():
    # docs/models.md's scores are over generate_eval_set(100, seed=1234) of the five base kinds,
    # and runs are compared on it: a change to the training data must leave it byte for byte
    # as it was. Change a digest only with a change meant to alter the eval set, and re-score
    # every model then.
    base = generate_eval_set(100, seed=1234, kinds=BASE_EVAL_KINDS)
    assert _digest(base) == "143c60738e1c06f99360f4a3de2e669b3daab72fe512973266e2c5bbab2e8513"
    new = generate_eval_set(100, seed=1234, kinds=NEW_EVAL_KINDS)
    assert _digest(new) == "b15caefe43fd80b4c6f267efb3eaf771889761220846304d10405c460c5fa5ff"


def test_asking_for_some_kinds_leaves_each_kind_s_items_as_they_are():
    everything = generate_eval_set(20, seed=5)
    assert [i.kind for i in everything] == [k for k in EVAL_KINDS for _ in range(20)]
    for kinds in (["percent"], ["counting", "beyond"], ["followup"]):
        some = generate_eval_set(20, seed=5, kinds=kinds)
        assert some == [item for item in everything if item.kind in kinds]


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown eval kinds"):
        generate_eval_set(1, seed=0, kinds=["poetry"])


def test_eval_set_has_each_kind_with_its_expected_answer(eval_set):
    assert Counter(item.kind for item in eval_set) == {kind: 300 for kind in EVAL_KINDS}
    for item in eval_set:
        assert item.messages[-1]["role"] == "user"
        if item.kind in ("identity", "out_of_scope", "beyond"):
            assert item.expected is None and item.expected_expression is None
        else:
            assert item.expected == format_result(use_calculator(item.expected_expression))


def test_eval_arithmetic_operands_never_appear_in_training_expressions(eval_set):
    train_operands = {number for call in training_calls() for number in numbers_in(call)}
    eval_operands = set()
    for item in eval_set:
        if item.kind == "arithmetic":
            match = ARITHMETIC_CALL.fullmatch(item.expected_expression)
            eval_operands |= {match.group(1), match.group(3)}
    assert len(eval_operands) > 300
    assert all(is_held_out_number(number) for number in eval_operands)
    assert not eval_operands & train_operands
    # Nor does any training call, learned or not, write a held-out number.
    assert not any(is_held_out_number(number) for number in train_operands)


def test_every_eval_question_of_several_numbers_has_a_held_out_one(eval_set):
    for item in eval_set:
        if item.kind in SEVERAL_NUMBER_KINDS:
            numbers = numbers_in(item.expected_expression)
            assert any(is_held_out_number(n) for n in numbers), item.expected_expression


def test_signed_eval_questions_use_held_out_numbers_only(eval_set):
    signed = [item for item in eval_set if item.kind == "signed"]
    for item in signed:
        assert all(is_held_out_number(n) for n in numbers_in(item.expected_expression))
    calls = [item.expected_expression for item in signed]
    assert sum("-" in c.lstrip("-") or c.startswith("-") for c in calls) > 100  # negatives
    assert sum("." in c for c in calls) > 100  # decimals


def test_eval_phrases_to_count_are_eval_words_and_held_out_strings(eval_set):
    joiners = {"and", "of", "the", "a", "my", "in", "with", "for"}
    for item in eval_set:
        if item.kind == "phrase_count":
            phrase = COUNT_CALL.fullmatch(item.expected_expression).group(1)
            for word in phrase.split():
                assert word in EVAL_WORDS or word in joiners or is_held_out_string(word), word


def test_eval_beyond_questions_are_eval_only_frames(eval_set):
    def pattern(frame: str) -> re.Pattern:
        # As a user varies it: maybe no capital, maybe no question mark.
        text = re.escape(frame.lower().rstrip("?")).replace(r"\{a\}", r"\d+")
        return re.compile(text.replace(r"\{b\}", r"\d+") + r"\??")

    frames = [f for fs in math_phrasings.EVAL_BEYOND_QUESTIONS.values() for f in fs]
    patterns = [pattern(f) for f in frames]
    for item in eval_set:
        if item.kind == "beyond":
            question = item.messages[-1]["content"].lower()
            assert any(p.fullmatch(question) for p in patterns), question


def test_cross_kind_follow_ups_switch_tool_after_an_answer(eval_set):
    n_count_after_product = 0
    for item in [i for i in eval_set if i.kind == "cross_followup"]:
        (previous,) = tool_turns(item.messages)
        count_now = COUNT_CALL.fullmatch(item.expected_expression) is not None
        assert count_now != (COUNT_CALL.fullmatch(previous["python"]) is not None)
        if count_now:  # after a product of two 3-4 digit numbers: a result of 5+ digits
            assert len(previous["python_output"]) >= 5
            assert previous["python_output"] not in item.expected_expression
            assert " " not in item.expected_expression  # a word: the base skill
            n_count_after_product += 1
        else:  # one operator: the base skill
            assert ARITHMETIC_CALL.fullmatch(item.expected_expression)
    assert 100 < n_count_after_product < 200


def test_eval_phrasings_never_appear_in_training():
    # Blank out numbers so "what is 12+7" and "what is 480+3" count as one phrasing.
    def skeleton(text: str) -> str:
        return NUMBER.sub("N", text.replace(",", "")).lower().rstrip("?.")

    train_skeletons = {skeleton(q) for _, c in train_sample() for q in user_texts(c)}
    eval_questions = [q for _, c in eval_split_sample() for q in user_texts(c)]
    assert len(eval_questions) > 3000
    for question in eval_questions:
        assert skeleton(question) not in train_skeletons, question


def test_eval_followups_carry_the_complete_previous_turns(eval_set):
    for item in eval_set:
        if item.kind != "followup":
            continue
        previous = tool_turns(item.messages)
        assert 1 <= len(previous) <= 2
        assert item.messages[-2]["role"] == "assistant"
        last = previous[-1]
        assert last["python_output"] in last["text"]
        match = ARITHMETIC_CALL.fullmatch(item.expected_expression)
        if match:
            assert match.group(1) == last["python_output"]
        else:
            assert COUNT_CALL.fullmatch(item.expected_expression)


def test_every_new_kind_has_eval_only_wording():
    # Each new kind's eval questions are held out in their wording as the base kinds' are:
    # eval-only wrappers and held-out wrapper/core pairs, or eval-only frames.
    assert phrasings.EVAL_QUESTION_WRAPPERS and math_phrasings.EVAL_PERCENT_SHARE_FRAMES
    assert math_phrasings.EVAL_AVERAGE_VERB_FRAMES
    assert all(math_phrasings.EVAL_BEYOND_QUESTIONS.values())
    for cores in (math_phrasings.EXPRESSION_CORES, math_phrasings.PERCENT_OF_CORES,
                  math_phrasings.AVERAGE_CORES):  # fmt: skip
        held = [
            (w, c)
            for w in phrasings.QUESTION_WRAPPERS
            for c in cores
            if phrasings.held_out_pair(w, c)
        ]
        assert held, cores
