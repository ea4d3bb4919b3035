from __future__ import annotations

from chatcli.chat.stream import (
    SpecialToken,
    StreamEvent,
    TextDelta,
    TokenDecoder,
    ToolCallDelta,
    ToolCallStart,
    ToolResult,
    decode_assistant_parts,
)
from chatcli.model.special_tokens import (
    ASSISTANT_END,
    BOS,
    OUTPUT_END,
    OUTPUT_START,
    PYTHON_END,
    PYTHON_START,
    SPECIAL_TOKENS,
)


class ByteTokenizer:
    """Ids 0..255 are single bytes, then the 9 special tokens in nanochat order, then any
    multi-byte chunks registered with `chunk` (which may end or start mid-character)."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def chunk(self, data: bytes) -> int:
        self.chunks.append(data)
        return 256 + len(SPECIAL_TOKENS) + len(self.chunks) - 1

    def decode_bytes(self, ids: list[int]) -> bytes:
        out = b""
        for i in ids:
            assert i < 256 or i >= 256 + len(SPECIAL_TOKENS), "special ids have no bytes here"
            out += bytes([i]) if i < 256 else self.chunks[i - 256 - len(SPECIAL_TOKENS)]
        return out

    def encode_special(self, name: str) -> int:
        return 256 + SPECIAL_TOKENS.index(name)


TOK = ByteTokenizer()


def sp(name: str) -> int:
    return TOK.encode_special(name)


def text(s: str) -> list[int]:
    return list(s.encode("utf-8"))


def run(
    tokens: list[int], masks: list[int] | None = None, raw: bool = False, tools: bool = True
) -> list[StreamEvent]:
    decoder = TokenDecoder(TOK, raw=raw, tools=tools)
    masks = masks if masks is not None else [1] * len(tokens)
    events: list[StreamEvent] = []
    for token, mask in zip(tokens, masks, strict=True):
        events += decoder.feed(token, mask)
    return events + decoder.flush()


def merged(events: list[StreamEvent]) -> list[StreamEvent]:
    """Joins runs of TextDelta and of ToolCallDelta, since byte tokens make one per byte."""
    out: list[StreamEvent] = []
    for event in events:
        if out and isinstance(event, TextDelta) and isinstance(out[-1], TextDelta):
            out[-1] = TextDelta(out[-1].text + event.text)
        elif out and isinstance(event, ToolCallDelta) and isinstance(out[-1], ToolCallDelta):
            out[-1] = ToolCallDelta(out[-1].text + event.text)
        else:
            out.append(event)
    return out


def tool_call(expression: str, output: str | None) -> tuple[list[int], list[int]]:
    """The tokens and masks of one calculator call, answered by the engine when output is set."""
    model = [sp(PYTHON_START), *text(expression), sp(PYTHON_END)]
    forced = [] if output is None else [sp(OUTPUT_START), *text(output), sp(OUTPUT_END)]
    return model + forced, [1] * len(model) + [0] * len(forced)


def test_text_comes_out_in_order_exactly_once():
    reply = "Hello, world! Line two.\nAnd a third."
    events = run([*text(reply), sp(ASSISTANT_END)])
    assert all(isinstance(e, TextDelta) for e in events)
    assert "".join(e.text for e in events) == reply
    assert [e.text for e in events] == list(reply)


def test_three_byte_character_split_across_tokens_is_held_back_until_whole():
    euro = "€".encode()  # e2 82 ac
    decoder = TokenDecoder(TOK)
    assert decoder.feed(TOK.chunk(b"a" + euro[:1]), 1) == [TextDelta("a")]
    assert decoder.feed(TOK.chunk(euro[1:2]), 1) == []
    assert decoder.feed(TOK.chunk(euro[2:] + b"!"), 1) == [TextDelta("€!")]
    assert decoder.flush() == []


def test_four_byte_character_split_across_tokens_comes_out_whole():
    grin = "😀".encode()  # f0 9f 98 80
    tokens = [TOK.chunk(b"x" + grin[:2]), TOK.chunk(grin[2:3]), TOK.chunk(grin[3:] + b"y")]
    decoder = TokenDecoder(TOK)
    assert [decoder.feed(t, 1) for t in tokens] == [[TextDelta("x")], [], [TextDelta("😀y")]]


def test_characters_split_byte_by_byte_never_show_replacement_mid_stream():
    reply = "naïve café € 😀 中文"
    events = run([*text(reply), sp(ASSISTANT_END)])
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == reply
    assert not any("\ufffd" in e.text for e in events if isinstance(e, TextDelta))


def test_incomplete_character_at_the_very_end_is_replaced_only_at_flush():
    decoder = TokenDecoder(TOK)
    assert decoder.feed(TOK.chunk(b"ok\xf0\x9f"), 1) == [TextDelta("ok")]
    assert decoder.flush() == [TextDelta("\ufffd")]


def test_special_token_cuts_off_a_partial_character():
    events = run([*text("a"), 0xE2, sp(ASSISTANT_END)])
    assert events == [TextDelta("a"), TextDelta("\ufffd")]


def test_successful_tool_call_gives_expression_then_result():
    call, call_masks = tool_call("12*7", "84")
    tokens = [*text("So "), *call, *text(" done"), sp(ASSISTANT_END)]
    masks = [1] * 3 + call_masks + [1] * 6
    assert merged(run(tokens, masks)) == [
        TextDelta("So "),
        ToolCallStart(),
        ToolCallDelta("12*7"),
        ToolResult("12*7", "84"),
        TextDelta(" done"),
    ]


def test_expression_streams_as_it_is_written():
    events = run([sp(PYTHON_START), *text("1+2")])
    assert events[:4] == [
        ToolCallStart(),
        ToolCallDelta("1"),
        ToolCallDelta("+"),
        ToolCallDelta("2"),
    ]


def test_failed_tool_call_then_the_models_own_text():
    call, call_masks = tool_call("1/0", None)
    tokens = [*call, *text("oops"), sp(ASSISTANT_END)]
    masks = call_masks + [1] * 5
    assert merged(run(tokens, masks)) == [
        ToolCallStart(),
        ToolCallDelta("1/0"),
        ToolResult("1/0", None),
        TextDelta("oops"),
    ]


def test_failed_tool_call_right_before_assistant_end():
    call, call_masks = tool_call("1/0", None)
    events = run([*call, sp(ASSISTANT_END)], [*call_masks, 1])
    assert merged(events)[-1] == ToolResult("1/0", None)
    assert sum(isinstance(e, ToolResult) for e in events) == 1


def test_output_start_written_by_the_model_is_not_a_tool_result():
    call, call_masks = tool_call("2+2", None)
    tokens = [*call, sp(OUTPUT_START), *text("5"), sp(OUTPUT_END), sp(ASSISTANT_END)]
    masks = [*call_masks, 1, 1, 1, 1]
    assert merged(run(tokens, masks)) == [
        ToolCallStart(),
        ToolCallDelta("2+2"),
        ToolResult("2+2", None),
        TextDelta("5"),
    ]


def test_a_call_the_stream_stops_inside_its_expression_is_cut_not_failed():
    events = merged(run([*text("x "), sp(PYTHON_START), *text("2+")]))
    assert events == [
        TextDelta("x "),
        ToolCallStart(),
        ToolCallDelta("2+"),
        ToolResult("2+", None, cut=True),
    ]
    assert events[-1].status == "cut"


def test_with_the_tools_off_a_closed_call_was_not_run_rather_than_failed():
    call, call_masks = tool_call("2+2", None)
    closed = merged(run([*call, *text("4"), sp(ASSISTANT_END)], [*call_masks, 1, 1], tools=False))
    assert closed[2] == ToolResult("2+2", None, off=True)
    assert closed[2].status == "off"
    at_end = run(call, call_masks, tools=False)  # the stream ends right after python_end
    assert at_end[-1].status == "off"
    cut = merged(run([sp(PYTHON_START), *text("2+")], tools=False))
    assert cut[-1].status == "cut"  # cut stays cut: /continue may finish it with tools on
    refused, refused_masks = tool_call("1/0", None)
    assert run(refused, refused_masks)[-1].status == "failed"  # tools on: the tool gave none


def test_a_call_the_stream_stops_right_after_python_end_failed():
    # The engine writes a result right after <|python_end|>: none coming means none was given.
    call, call_masks = tool_call("1/0", None)
    events = run(call, call_masks)
    assert events[-1] == ToolResult("1/0", None)
    assert events[-1].status == "failed"


def test_a_call_the_stream_stops_right_after_python_end_is_cut_where_an_answer_was_due():
    # The context's last position held <|python_end|>: no room for the result the calculator
    # gives, so the call was cut (/continue finishes it), not refused.
    call, call_masks = tool_call("1234*56", None)
    events = run(call, call_masks)
    assert events[-1] == ToolResult("1234*56", None, cut=True)
    assert events[-1].status == "cut"


def test_unterminated_tool_call_fails_at_assistant_end():
    events = merged(run([sp(PYTHON_START), *text("2+"), sp(ASSISTANT_END)]))
    assert events == [ToolCallStart(), ToolCallDelta("2+"), ToolResult("2+", None)]


def test_tool_output_cut_off_midway_is_cut():
    tokens = [sp(PYTHON_START), *text("9*9"), sp(PYTHON_END), sp(OUTPUT_START), *text("8")]
    masks = [1, 1, 1, 1, 1, 0, 0]
    assert merged(run(tokens, masks))[-1] == ToolResult("9*9", None, cut=True)


def test_a_resumed_decoder_finishes_the_call_its_earlier_tokens_opened():
    call, call_masks = tool_call("12*7", "84")
    shown = 3  # <|python_start|>12 was shown by the turn that was cut
    decoder = TokenDecoder(TOK)
    decoder.resume(call[:shown], call_masks[:shown])
    events: list[StreamEvent] = []
    for token, mask in zip(call[shown:], call_masks[shown:], strict=True):
        events += decoder.feed(token, mask)
    events += decoder.flush()
    # Nothing of what was already shown comes again; the badge has the whole expression.
    assert merged(events) == [ToolCallDelta("*7"), ToolResult("12*7", "84")]
    assert events[-1].status == "ok"


def test_a_resumed_decoder_finishes_a_result_cut_midway():
    call, call_masks = tool_call("11*3", "33")
    decoder = TokenDecoder(TOK)
    decoder.resume(call[:-2], call_masks[:-2])  # ... <|output_start|>3
    events = decoder.feed(call[-2], 0) + decoder.feed(call[-1], 0)
    assert events == [ToolResult("11*3", "33")]


def test_nothing_after_assistant_end_or_bos_is_shown():
    assert run([*text("a"), sp(ASSISTANT_END), *text("b")]) == [TextDelta("a")]
    assert run([*text("a"), sp(BOS), *text("b")]) == [TextDelta("a")]


def test_raw_mode_shows_every_special_token_in_order_without_tool_reading():
    call, call_masks = tool_call("1+1", "2")
    tokens = [*text("hi "), *call, sp(ASSISTANT_END)]
    masks = [1, 1, 1, *call_masks, 1]
    assert merged(run(tokens, masks, raw=True)) == [
        TextDelta("hi "),
        SpecialToken(PYTHON_START),
        TextDelta("1+1"),
        SpecialToken(PYTHON_END),
        SpecialToken(OUTPUT_START),
        TextDelta("2"),
        SpecialToken(OUTPUT_END),
        SpecialToken(ASSISTANT_END),
    ]


def test_assistant_parts_of_a_reply_with_answered_and_failed_calls():
    ok, ok_masks = tool_call("1+1", "2")
    bad, bad_masks = tool_call("1/0", None)
    tokens = [*text("a "), *ok, *text(" b "), *bad, *text("c"), sp(ASSISTANT_END)]
    masks = [1, 1, *ok_masks, 1, 1, 1, *bad_masks, 1, 1]
    assert decode_assistant_parts(tokens, masks, TOK) == [
        {"type": "text", "text": "a "},
        {"type": "python", "text": "1+1"},
        {"type": "python_output", "text": "2"},
        {"type": "text", "text": " b "},
        {"type": "python", "text": "1/0"},
        {"type": "text", "text": "c"},
    ]


def test_assistant_parts_of_plain_text_merge_into_one_part():
    tokens = [*text("Just text."), sp(ASSISTANT_END)]
    parts = decode_assistant_parts(tokens, [1] * len(tokens), TOK)
    assert parts == [{"type": "text", "text": "Just text."}]
