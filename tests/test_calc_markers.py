"""Calculator markers: written, read back from whole messages and from split streams."""

from __future__ import annotations

import time

import pytest
from fakes import merged

from chatcli.chat.calc_markers import MarkerScanner, format_marker, parts_from_text, text_from_parts
from chatcli.chat.stream import TextDelta, ToolCallDelta, ToolCallStart, ToolResult


def test_markers_are_written_with_and_without_an_answer():
    assert format_marker("1234*56", "69104") == "[calc 1234*56 = 69104]"
    assert format_marker("2**10", None) == "[calc 2**10]"


ROUND_TRIPS = [
    ("plain text", [{"type": "text", "text": "plain text"}]),
    ("", [{"type": "text", "text": ""}]),
    (
        "It is [calc 6*7 = 42] so 42.",
        [
            {"type": "text", "text": "It is "},
            {"type": "python", "text": "6*7"},
            {"type": "python_output", "text": "42"},
            {"type": "text", "text": " so 42."},
        ],
    ),
    (
        "[calc 1/0][calc 10/4 = 2.5]",
        [
            {"type": "python", "text": "1/0"},
            {"type": "python", "text": "10/4"},
            {"type": "python_output", "text": "2.5"},
        ],
    ),
    (
        '[calc "strawberry".count("r") = 3]!',
        [
            {"type": "python", "text": '"strawberry".count("r")'},
            {"type": "python_output", "text": "3"},
            {"type": "text", "text": "!"},
        ],
    ),
]


@pytest.mark.parametrize(("text", "parts"), ROUND_TRIPS)
def test_text_and_parts_round_trip(text, parts):
    assert parts_from_text(text) == parts
    assert text_from_parts(parts) == text


def test_things_that_only_look_like_markers_stay_text():
    for text in ("[calculate 1+1]", "[calc", "a [b] c", "[calc 1+1"):
        assert parts_from_text(text) == [{"type": "text", "text": text}]


def test_a_plain_string_passes_through_text_from_parts():
    assert text_from_parts("as is") == "as is"


def feed_all(chunks: list[str]) -> list:
    scanner = MarkerScanner()
    events = []
    for chunk in chunks:
        events += scanner.feed(chunk)
    return events + scanner.flush()


def test_the_scanner_finds_markers_split_anywhere():
    text = "So [calc 6*7 = 42] is it."
    expected = [
        TextDelta("So "),
        ToolCallStart(),
        ToolCallDelta("6*7"),
        ToolResult("6*7", "42"),
        TextDelta(" is it."),
    ]
    for cut in range(1, len(text)):
        assert merged(feed_all([text[:cut], text[cut:]])) == expected
    assert merged(feed_all(list(text))) == expected


def test_the_scanner_holds_back_only_what_could_be_a_marker():
    scanner = MarkerScanner()
    assert scanner.feed("a [ca") == [TextDelta("a ")]
    assert scanner.feed("t] b [") == [TextDelta("[cat] b ")]
    assert scanner.feed("calc 2**10") == []
    assert scanner.feed("] end") == [
        ToolCallStart(),
        ToolCallDelta("2**10"),
        ToolResult("2**10", None),
        TextDelta(" end"),
    ]
    assert scanner.flush() == []


def test_an_unclosed_marker_comes_out_as_text_at_the_end():
    assert feed_all(["x [calc 1+", "1"]) == [TextDelta("x "), TextDelta("[calc 1+1")]


def test_text_full_of_unclosed_openings_is_text_and_a_marker_after_them_is_found():
    openings = "[calc " * 1000
    assert parts_from_text(openings) == [{"type": "text", "text": openings}]
    assert parts_from_text(openings + "1+1 = 2]") == [
        {"type": "text", "text": openings[: -len("[calc ")]},
        {"type": "python", "text": "1+1"},
        {"type": "python_output", "text": "2"},
    ]
    assert merged(feed_all([openings, "6*7]"])) == [
        TextDelta(openings[: -len("[calc ")]),
        ToolCallStart(),
        ToolCallDelta("6*7"),
        ToolResult("6*7", None),
    ]


def test_reading_markers_takes_linear_time():
    # 1 MB of openings: a quadratic scan takes minutes, a linear one milliseconds.
    openings = "[calc " * (1_000_000 // 6)
    started = time.perf_counter()
    parts_from_text(openings)
    assert time.perf_counter() - started < 1.0
