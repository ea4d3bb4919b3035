from __future__ import annotations

import pytest

from chatcli.chat.stop_text import StopText
from chatcli.chat.stream import StreamEvent, TextDelta, ToolCallStart, ToolResult


def shown(stops: list[str], pieces: list[str | StreamEvent]) -> tuple[list[StreamEvent], bool]:
    """Feeds `pieces` (strings as text) one at a time, then flushes: what was passed on."""
    stop = StopText(stops)
    out: list[StreamEvent] = []
    for piece in pieces:
        out += stop.feed([TextDelta(piece) if isinstance(piece, str) else piece])
    return out + stop.flush(), stop.stopped


def text(events: list[StreamEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def test_text_is_cut_before_the_first_stop_string_and_nothing_follows():
    out, stopped = shown(["END", "!"], ["Hello", " wor", "ld! and END", " more"])
    assert (text(out), stopped) == ("Hello world", True)


def test_a_stop_string_split_across_pieces_is_found():
    out, stopped = shown(["\nUser:"], ["Sure.", "\n", "Us", "er", ": next"])
    assert (text(out), stopped) == ("Sure.", True)


def test_text_that_only_began_a_stop_string_is_passed_on_once_it_cannot_be_one():
    stop = StopText(["\nUser:"])
    assert stop.feed([TextDelta("a\nUs")]) == [TextDelta("a")]  # "\nUs" may begin it
    assert stop.feed([TextDelta("e it")]) == [TextDelta("\nUse it")]
    assert not stop.stopped


def test_what_was_held_back_comes_out_when_the_stream_ends():
    out, stopped = shown(["there!"], ["Hi! th"])
    assert (text(out), stopped) == ("Hi! th", False)


def test_a_calculator_call_passes_and_releases_what_was_held():
    call = [ToolCallStart(), ToolResult("6*7", "42")]
    out, stopped = shown(["ab"], ["xa", *call, "b", "ab"])
    assert out == [TextDelta("x"), TextDelta("a"), *call, TextDelta("b")]
    assert stopped


def test_a_stop_string_at_the_very_start_passes_nothing():
    out, stopped = shown(["Hi"], ["Hi there"])
    assert (out, stopped) == ([], True)


def test_the_earliest_of_several_stop_strings_wins():
    out, _ = shown(["later", "soon"], ["soon and later"])
    assert text(out) == ""
    out, _ = shown(["b c", "c d"], ["a b c d"])
    assert text(out) == "a "


def test_an_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="must not be empty"):
        StopText(["ok", ""])


def test_the_stop_string_that_ends_first_wins_however_the_text_is_cut():
    # "bcd" is complete at the 4th character, before "abcdef", which starts earlier.
    whole, _ = shown(["bcd", "abcdef"], ["abcdef"])
    by_character, _ = shown(["bcd", "abcdef"], list("abcdef"))
    assert text(whole) == text(by_character) == "a"
