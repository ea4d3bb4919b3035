"""Tests for chatcli.training.math_phrasings: the eval-only frames stay apart from training's."""

from __future__ import annotations

import random
import re
from difflib import SequenceMatcher

import pytest

from chatcli.training import math_phrasings as mp
from chatcli.training import phrasings

MAX_SIMILARITY = 0.7  # as for the composed counting frames (test_synthetic)


def words(frame: str) -> list[str]:
    """A frame's words, every slot the same word: "What is {a}^{b}?" -> what is {n}^{n}."""
    frame = re.sub(r"\{[a-z]\}", "{n}", frame.lower())
    return re.sub(r"[^\w{}%^*!/ ']", "", frame).split()


def wrapped(cores: list[str]) -> list[str]:
    return [w.format(x=c) for w in phrasings.QUESTION_WRAPPERS for c in cores]


FAMILIES = {
    "percent share": (mp.PERCENT_SHARE_FRAMES + wrapped(mp.PERCENT_OF_CORES),
                      mp.EVAL_PERCENT_SHARE_FRAMES),
    "average": (mp.AVERAGE_VERB_FRAMES + wrapped(mp.AVERAGE_CORES), mp.EVAL_AVERAGE_VERB_FRAMES),
    "beyond": ([f for fs in mp.BEYOND_QUESTIONS.values() for f in fs]
               + [w.format(x=c) for w in mp.BEYOND_WRAPPERS for c in mp.BEYOND_CORES]
               + mp.MORE_BEYOND_FRAMES,
               [f for fs in mp.EVAL_BEYOND_QUESTIONS.values() for f in fs]),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_eval_only_frames_are_new_and_far_from_every_training_frame(family):
    train, held_out = FAMILIES[family]
    assert held_out and not set(train) & set(held_out)
    for eval_frame in held_out:
        for frame in train:
            similarity = SequenceMatcher(None, words(frame), words(eval_frame)).ratio()
            assert similarity < MAX_SIMILARITY, (frame, eval_frame, similarity)


def test_training_never_asks_in_an_eval_only_frame():
    rng = random.Random(0)
    questions = [mp.percent_share_question(rng, "train", "12", "80") for _ in range(500)]
    questions += [mp.average_question(rng, "train", ["3", "5", "10"]) for _ in range(500)]
    questions += [mp.beyond_question(rng, "train", "144", "2") for _ in range(500)]
    held_out = [
        f.format(y="12", x="80", l=mp.number_list(random.Random(i), ["3", "5", "10"]), a="144", b="2")
        for i in range(20)
        for f in mp.EVAL_PERCENT_SHARE_FRAMES + mp.EVAL_AVERAGE_VERB_FRAMES
        + [f for fs in mp.EVAL_BEYOND_QUESTIONS.values() for f in fs]
    ]  # fmt: skip
    assert not set(questions) & set(held_out)


def test_eval_asks_share_and_beyond_questions_in_eval_only_frames():
    rng = random.Random(0)
    shares = {mp.percent_share_question(rng, "eval", "12", "80") for _ in range(200)}
    assert shares == {f.format(y="12", x="80") for f in mp.EVAL_PERCENT_SHARE_FRAMES}
    beyond = {mp.beyond_question(rng, "eval", "144", "2") for _ in range(300)}
    every = {f.format(a="144", b="2") for fs in mp.EVAL_BEYOND_QUESTIONS.values() for f in fs}
    assert beyond == every


def test_chain_words_read_left_to_right():
    # No operator word that people read as closing what came before ("4 multiplied by 5").
    for op, options in mp.OPERATOR_WORDS.items():
        assert options and not {"multiplied by", "over"} & set(options), op


def test_number_lists_name_every_number_once_in_order():
    rng = random.Random(1)
    seen = set()
    for _ in range(200):
        text = mp.number_list(rng, ["3", "5", "10"])
        assert re.findall(r"\d+", text) == ["3", "5", "10"]
        seen.add(text)
    assert seen == {"3, 5 and 10", "3, 5, and 10", "3, 5, 10"}
    assert mp.number_list(rng, ["7", "9"]) == "7 and 9"
