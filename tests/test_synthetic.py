"""Tests for the default model's training data (chatcli.training.synthetic and the modules of
each skill) and its held-out eval set (chatcli.training.eval_sets)."""

from __future__ import annotations

import random
import re
from collections import Counter
from difflib import SequenceMatcher
from itertools import pairwise

import pytest

from chatcli.engine.calculator import format_result, use_calculator
from chatcli.training import phrasings, small_talk_data, synthetic, vocabulary
from chatcli.training.eval_sets import generate_eval_set
from chatcli.training.exchange import render_text_only
from chatcli.training.held_out import is_held_out_number, is_held_out_string
from chatcli.training.synthetic import KIND_WEIGHTS, generate_conversations
from tests.training_data import (
    NUMBER,
    eval_split_sample,
    learned,
    tool_turns,
    train_sample,
    user_texts,
)

COUNT_CALL = re.compile(r'"([a-z]+)"\.count\("([a-z])"\)')
ARITHMETIC_CALL = re.compile(r"(-?\d+(?:\.\d+)?)([-+*/])(\d+(?:\.\d+)?)")


@pytest.fixture(scope="module")
def train() -> list[tuple[str, list[dict]]]:
    return train_sample()


@pytest.fixture(scope="module")
def eval_conversations() -> list[tuple[str, list[dict]]]:
    return eval_split_sample()


def test_the_same_seed_gives_the_same_conversations():
    assert generate_conversations(200, seed=5) == generate_conversations(200, seed=5)
    assert generate_conversations(200, seed=5) != generate_conversations(200, seed=6)
    assert generate_eval_set(20, seed=3) == generate_eval_set(20, seed=3)


def test_generation_leaves_the_global_random_state_alone():
    random.seed(0)
    before = random.random()
    random.seed(0)
    generate_conversations(50, seed=1)
    assert random.random() == before


def test_an_unknown_split_is_refused():
    with pytest.raises(ValueError, match="split must be one of"):
        generate_conversations(1, seed=0, split="test")


def test_messages_alternate_user_and_assistant_after_an_optional_system_prompt(train):
    for _, conversation in train:
        roles = [message["role"] for message in conversation]
        if roles[0] == "system":
            roles = roles[1:]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        assert len(roles) >= 2


def test_every_tool_output_is_exactly_what_the_calculator_injects(train, eval_conversations):
    n_checked = 0
    for _, conversation in train + eval_conversations:
        for turn in tool_turns(conversation):
            assert turn["python_output"] == format_result(use_calculator(turn["python"]))
            n_checked += 1
    assert n_checked > 10_000


def test_a_tool_reply_is_the_call_then_one_sentence_copying_the_result(train):
    for _, conversation in train:
        for message in learned(conversation):
            if message["role"] != "assistant" or isinstance(message["content"], str):
                continue
            types = [part["type"] for part in message["content"]]
            assert types == ["python", "python_output", "text"]
            output, sentence = message["content"][1]["text"], message["content"][2]["text"]
            assert output in sentence
            assert sentence.endswith(".") and sentence.count(". ") == 0


def test_expressions_are_compact_and_use_the_numbers_the_user_wrote(train):
    for kind, conversation in train:
        if kind != "arithmetic":
            continue
        (question,) = user_texts(conversation)
        (turn,) = tool_turns(conversation)
        match = ARITHMETIC_CALL.fullmatch(turn["python"])
        assert match, turn["python"]
        written = NUMBER.findall(question.replace(",", ""))
        assert match.group(1) in written and match.group(3) in written


def test_users_sometimes_write_thousands_separators_but_expressions_never_do(train):
    questions = [q for kind, c in train if kind == "arithmetic" for q in user_texts(c)]
    assert sum(bool(re.search(r"\d,\d{3}", q)) for q in questions) > 200
    assert not any("," in turn["python"] for _, c in train for turn in tool_turns(c))


def test_counting_answers_use_singular_for_one(train):
    for kind, conversation in train:
        if kind != "counting":
            continue
        (turn,) = tool_turns(conversation)
        word, letter = COUNT_CALL.fullmatch(turn["python"]).groups()
        expected = (
            f"There is 1 {letter} in {word}."
            if turn["python_output"] == "1"
            else f"There are {turn['python_output']} {letter}'s in {word}."
        )
        assert turn["text"] == expected


def test_followups_build_on_the_previous_answer(train):
    n_arithmetic = n_counting = 0
    for kind, conversation in train:
        if kind != "followup":
            continue
        turns = tool_turns(conversation)
        assert 2 <= len(turns) <= 3
        for previous, turn in pairwise(turns):
            old = COUNT_CALL.fullmatch(previous["python"])
            if old:
                new = COUNT_CALL.fullmatch(turn["python"])
                assert new, turn["python"]
                changed = [old.group(i) != new.group(i) for i in (1, 2)]
                assert sum(changed) == 1  # a new word or a new letter, not both
                n_counting += 1
            else:
                match = ARITHMETIC_CALL.fullmatch(turn["python"])
                assert match and match.group(1) == previous["python_output"]
                n_arithmetic += 1
    assert n_arithmetic > 1000 and n_counting > 300


def test_the_mix_follows_kind_weights(train):
    counts = Counter(kind for kind, _ in train)
    for kind, weight in KIND_WEIGHTS.items():
        assert counts[kind] / len(train) == pytest.approx(weight, abs=0.015)
    assert sum(KIND_WEIGHTS.values()) == pytest.approx(1.0)


def test_some_conversations_open_with_a_system_prompt(train):
    share = sum(c[0]["role"] == "system" for _, c in train) / len(train)
    assert share == pytest.approx(synthetic.SYSTEM_PROMPT_PROBABILITY, abs=0.02)


def test_conversations_are_short(train, eval_conversations):
    for kind, conversation in train + eval_conversations:
        text = render_text_only(conversation)
        if kind == "long_chat":  # made to fill most of a 1280-token context
            assert len(text) < synthetic.MAX_LONG_CHAT_CHARS + 100
        else:
            assert len(text) < 1200
            assert len(text.split()) < 150


def test_about_one_number_in_twenty_is_held_out():
    keys = range(100, 100_000)
    share = sum(is_held_out_number(str(key)) for key in keys) / len(keys)
    assert share == pytest.approx(0.05, abs=0.005)
    assert not any(is_held_out_number(str(key)) for key in range(100))


def test_eval_only_lists_are_disjoint_from_training_lists():
    pairs = [
        (vocabulary.TRAIN_WORDS, vocabulary.EVAL_WORDS),
        (vocabulary.TRAIN_NAMES, vocabulary.EVAL_NAMES),
        (vocabulary.TRAIN_ITEMS, vocabulary.EVAL_ITEMS),
        (synthetic.TRAIN_SYSTEM_PROMPTS, synthetic.EVAL_SYSTEM_PROMPTS),
        (phrasings.QUESTION_WRAPPERS, phrasings.EVAL_QUESTION_WRAPPERS),
        (phrasings.VERB_WRAPPERS, phrasings.EVAL_VERB_WRAPPERS),
        (phrasings.FOLLOWUP_WRAPPERS, phrasings.EVAL_FOLLOWUP_WRAPPERS),
        (phrasings.COUNT_FRAMES, phrasings.EVAL_COUNT_FRAMES),
        (phrasings.NEW_WORD_FRAMES, phrasings.EVAL_NEW_WORD_FRAMES),
        (phrasings.NEW_LETTER_FRAMES, phrasings.EVAL_NEW_LETTER_FRAMES),
        (phrasings.OUT_OF_SCOPE_TOPICS, phrasings.EVAL_OUT_OF_SCOPE_TOPICS),
        (phrasings.OUT_OF_SCOPE_FRAMES, phrasings.EVAL_OUT_OF_SCOPE_FRAMES),
        (phrasings.OUT_OF_SCOPE_STANDALONE, phrasings.EVAL_OUT_OF_SCOPE_STANDALONE),
    ]
    pairs += [(train, held_out) for train, held_out, _ in small_talk_data.IDENTITY.values()]
    for train, held_out in pairs:
        assert held_out and not set(train) & set(held_out)


def test_every_operator_word_is_taught_and_some_pairs_are_held_out():
    # Eval sentences are new combinations; the operator phrasings inside them are all trained.
    for op, cores in phrasings.OPERATOR_CORES.items():
        wrappers = phrasings.QUESTION_WRAPPERS
        held = [(w, c) for w in wrappers for c in cores if phrasings.held_out_pair(w, c)]
        assert 0 < len(held) < len(wrappers) * len(cores) / 2, op
        for core in cores:
            assert any(not phrasings.held_out_pair(w, core) for w in wrappers)


def test_small_arithmetic_comes_in_short_frames_more_often_than_the_powers_one_symbol_away(train):
    # "7-2" and "7^2" differ in one token. With more short powers than short small differences
    # in training (11 against 7 here), run 40 declined half of "What is 3-2?" as a power.
    short = re.compile(
        r"(?:what is |what's |compute |calculate |how much is )?\d{1,2} ?([-+*/^]) ?\d{1,2}"
    )
    by_operator: Counter[str] = Counter()
    for _, conversation in train:
        for text in user_texts(conversation):
            found = short.fullmatch(text.strip().lower().rstrip(" =?."))
            if found:
                by_operator[found[1]] += 1
    assert by_operator["^"] > 10
    for op in "+-*/":
        assert by_operator[op] > 3 * by_operator["^"], by_operator


def test_render_text_only_shows_tool_parts_between_special_tokens():
    conversation = [
        {"role": "user", "content": "What is 1234*56?"},
        {
            "role": "assistant",
            "content": [
                {"type": "python", "text": "1234*56"},
                {"type": "python_output", "text": "69104"},
                {"type": "text", "text": "1234*56 = 69104."},
            ],
        },
    ]
    assert render_text_only(conversation) == (
        "user: What is 1234*56?\n"
        "assistant: <|python_start|>1234*56<|python_end|>"
        "<|output_start|>69104<|output_end|>1234*56 = 69104."
    )


def test_main_prints_labelled_samples(capsys):
    synthetic.main(["--n", "3", "--seed", "0"])
    out = capsys.readouterr().out
    assert out.count("--- ") == 3
    assert "user: " in out and "assistant: " in out


def test_dictionary_words_to_count_share_nothing_with_the_eval_words():
    words = vocabulary.dictionary_words()
    assert len(words) > 90_000  # 97,211 with english-words 2.0.2
    # Nor any word the eval's random strings and made-up words could draw.
    assert not any(is_held_out_string(w) for w in words)
    assert all(4 <= len(w) <= 12 and w.isascii() and w.isalpha() and w.islower() for w in words)
    for eval_word in vocabulary.EVAL_WORDS:
        assert not any(eval_word in w or w in eval_word for w in words), eval_word


def test_training_counts_dictionary_words_but_never_an_eval_word(train):
    counted = [
        match.group(1)
        for _, conversation in train
        for message in conversation
        if message["role"] == "assistant" and not isinstance(message["content"], str)
        for part in message["content"]
        if part["type"] == "python"
        for match in [COUNT_CALL.fullmatch(part["text"])]
        if match
    ]
    assert len(counted) > 100
    dictionary = set(vocabulary.dictionary_words())
    from_dictionary = sum(w in dictionary and w not in vocabulary.TRAIN_WORDS for w in counted)
    # About 45% of the counted words: the model sees far more English words than it can
    # memorise, so it learns to copy them.
    assert 0.3 < from_dictionary / len(counted) < 0.6
    assert not set(counted) & set(vocabulary.EVAL_WORDS)


def test_verb_follow_ups_are_training_only():
    rng = random.Random(0)
    for question in (
        phrasings.new_letter_question(rng, "train", "a", verb="zymotic"),
        phrasings.new_word_question(rng, "train", "kayak", verb="zymotic"),
    ):
        assert "zymotic" in question
    with pytest.raises(AssertionError, match="training-only"):
        phrasings.new_letter_question(rng, "eval", "a", verb="zymotic")


def frame_words(frame: str) -> list[str]:
    """A frame's words, lowercased, punctuation but {slots} and apostrophes dropped."""
    return re.sub(r"[^\w{} ']", "", frame.lower()).split()


def test_clause_verb_wrappers_are_training_only_and_far_from_the_held_out_ones():
    # "When I {v}, what comes out?" teaches the clause-then-question sentence with every
    # operation, not only with averages; the held-out "If I {v}, what do I get?" stays new.
    more, held_out = phrasings.MORE_VERB_WRAPPERS, phrasings.EVAL_VERB_WRAPPERS
    assert not set(more) & (set(held_out) | set(phrasings.VERB_WRAPPERS))

    for frame in more:
        for eval_frame in held_out:
            similarity = SequenceMatcher(None, frame_words(frame), frame_words(eval_frame)).ratio()
            assert similarity < 0.7, (frame, eval_frame, similarity)
    verbs = phrasings.OPERATOR_VERBS["*"]
    rng = random.Random(0)
    train = [phrasings.verb_question(rng, "train", verbs) for _ in range(2000)]
    evals = [phrasings.verb_question(rng, "eval", verbs) for _ in range(2000)]
    in_more = [any(q.startswith(w.split("{v}")[0]) and q.endswith(w.split("{v}")[1])
                   for w in more) for q in train]  # fmt: skip
    assert sum(in_more) / len(train) == pytest.approx(phrasings.MORE_VERB_PROBABILITY, abs=0.04)
    for question in evals:
        assert not any(question.endswith(w.split("{v}")[1]) for w in more), question


def composed_count_frames() -> list[str]:
    wrappers, cores = phrasings.COUNT_REQUEST_WRAPPERS, phrasings.COUNT_REQUEST_CORES
    requests = [phrasings.count_request(w, c) for w in wrappers for c in cores]
    return phrasings.COUNT_QUESTION_FRAMES + requests


def test_composed_count_frames_stay_far_from_every_held_out_frame():
    held_out = phrasings.EVAL_COUNT_FRAMES + [
        f for f in phrasings.COUNT_FRAMES if phrasings.held_out_pair(f, "")
    ]
    assert "How many times does {L} appear in {W}?" in held_out
    # Nor close to the eval-only arithmetic wrappers ("Could you figure out {x} for me?").
    held_out += phrasings.EVAL_QUESTION_WRAPPERS + phrasings.EVAL_VERB_WRAPPERS

    for frame in composed_count_frames():
        for eval_frame in held_out:
            similarity = SequenceMatcher(None, frame_words(frame), frame_words(eval_frame)).ratio()
            assert similarity < 0.7, (frame, eval_frame, similarity)


def test_composed_count_frames_are_training_only():
    patterns = [
        re.compile(re.escape(f).replace(r"\{L\}", ".+").replace(r"\{W\}", ".+"))
        for f in composed_count_frames()
    ]

    def composed_share(split: str) -> float:
        rng = random.Random(0)
        questions = [phrasings.counting_question(rng, split, "kayak", "k") for _ in range(3000)]
        return sum(any(p.fullmatch(q) for p in patterns) for q in questions) / len(questions)

    assert composed_share("train") == pytest.approx(phrasings.COMPOSED_COUNT_PROBABILITY, abs=0.03)
    assert composed_share("eval") == 0


def test_mixed_conversations_chain_two_or_three_segments_of_different_kinds():
    assert sum(synthetic.MIXED_SEGMENT_WEIGHTS.values()) == pytest.approx(1.0)
    rng = random.Random(3)
    lengths = Counter()
    for _ in range(500):
        segments = synthetic.mixed_segments(rng, "train")
        lengths[len(segments)] += 1
        kinds = [kind for kind, _ in segments]
        assert set(kinds) <= set(synthetic.MIXED_SEGMENT_WEIGHTS)
        assert all(a != b for a, b in pairwise(kinds)), kinds
        for _, segment in segments:
            assert segment[0]["role"] == "user" and segment[-1]["role"] == "assistant"
    assert set(lengths) == {2, 3} and lengths[3] > 100


def test_mixed_conversations_put_other_requests_after_a_tool_exchange(train):
    mixed = [c for kind, c in train if kind == "mixed"]
    assert len(mixed) > 0.8 * KIND_WEIGHTS["mixed"] * len(train)  # enough to judge shares by
    declined_after_a_tool = 0
    for conversation in mixed:
        # A system prompt is put in front afterwards, as in every kind.
        dialogue = [m for m in conversation if m["role"] != "system"]
        assert len(render_text_only(dialogue)) < synthetic.MAX_MIXED_CHARS
        assert len(user_texts(conversation)) >= 2
        replies = [m["content"] for m in conversation if m["role"] == "assistant"]
        declined_after_a_tool += any(
            isinstance(before, list) and isinstance(after, str) and "too small" in after
            for before, after in pairwise(replies)
        )
    # The case scripts/context_check.py found the model failing: about a fifth of mixed
    # conversations decline an out-of-scope question right after a calculator reply.
    assert 0.15 < declined_after_a_tool / len(mixed) < 0.5


def test_how_to_questions_are_training_only_and_never_about_bread():
    def how_to_share(split: str) -> float:
        rng = random.Random(0)
        questions = [phrasings.out_of_scope_question(rng, split) for _ in range(3000)]
        asks = {
            f.format(v=task) for f in phrasings.HOW_TO_FRAMES for task in phrasings.HOW_TO_TASKS
        }
        return sum(q in asks for q in questions) / len(questions)

    assert how_to_share("train") == pytest.approx(phrasings.HOW_TO_PROBABILITY, abs=0.03)
    assert how_to_share("eval") == 0
    # The held-out "How do I bake bread?" keeps its task to itself.
    assert not any("bake" in t or "bread" in t for t in phrasings.HOW_TO_TASKS)
