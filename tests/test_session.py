"""ChatSession: the KV cache kept across turns gives what a fresh full prefill gives."""

from __future__ import annotations

import pytest
import torch
from builders import random_chat_gpt
from fakes import DONE, SPECIAL_IDS, ByteTokenizer, ScriptedModel, reply, tool_call

from chatcli.chat.session import ChatSession, SamplingOptions
from chatcli.chat.stream import TextDelta, ToolResult
from chatcli.errors import ChatcliError, ContextOverflowError
from chatcli.model.gpt import ERAS
from chatcli.model.special_tokens import (
    ASSISTANT_END,
    ASSISTANT_START,
    OUTPUT_END,
    OUTPUT_START,
    PYTHON_END,
    PYTHON_START,
)


def greedy(max_tokens: int = 12) -> SamplingOptions:
    return SamplingOptions(temperature=0.0, top_k=None, max_tokens=max_tokens, seed=1)


def run(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


@pytest.mark.parametrize("era", list(ERAS))
def test_reused_cache_gives_the_logits_of_a_fresh_prefill(era, reference_tokenizer):
    model = random_chat_gpt(era)
    session = ChatSession(model, reference_tokenizer, greedy(), system="Be brief.")
    run(session.send("What is 12*7?"))
    run(session.send("and times three? " * 8))  # the second prompt outgrows the short window
    prompt = session.prompt_tokens()
    run(session.send("thanks"))
    assert session.history_stats[-1].prefill_tokens < 12  # only the new turn was prefilled
    # The cache now holds the whole conversation: rewinding it to `prompt` and prefilling
    # the rest must equal the full forward over `prompt`.
    with torch.inference_mode():
        logits, n = session.warm.prefill(prompt)
        full = model(torch.tensor([prompt]))[:, -1]
    assert n == 1  # everything but the last token came from the cache
    torch.testing.assert_close(logits, full, atol=2e-5, rtol=0)


@pytest.mark.parametrize("era", ["A", "E"])
def test_multi_turn_greedy_equals_a_fresh_session_over_the_same_tokens(era, reference_tokenizer):
    model = random_chat_gpt(era)
    warm = ChatSession(model, reference_tokenizer, greedy())
    for text in ("hello", "What is 3+4?", "and the letter r in strawberry?"):
        run(warm.send(text))
    cold = ChatSession(model, reference_tokenizer, greedy())
    cold.entries = list(warm.entries[:-1])  # same tokens, empty cache
    assert list(cold.regenerate()) == list(warm_regenerate(warm))


def warm_regenerate(session: ChatSession):
    session.pop_last_reply()
    return session.regenerate()


def test_undo_rewinds_the_cache_instead_of_recomputing(reference_tokenizer):
    session = ChatSession(random_chat_gpt("E"), reference_tokenizer, greedy())
    run(session.send("first question"))
    run(session.send("second question"))
    assert session.undo()
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["first question"]
    run(session.send("another"))
    stats = session.history_stats[-1]
    # <|user_start|> is still cached from the undone exchange: only the new text,
    # <|user_end|> and <|assistant_start|> are prefilled.
    assert stats.prefill_tokens == len(reference_tokenizer.encode("another")) + 2


def test_interrupt_keeps_the_partial_reply_and_closes_the_turn(reference_tokenizer):
    session = ChatSession(random_chat_gpt("E"), reference_tokenizer, greedy(max_tokens=30))
    events = session.send("tell me something long")
    for _ in range(3):
        next(events)
    events.close()  # what the REPL does on Ctrl-C
    assert session.last_reply.stats.finish_reason == "interrupted"
    assert session.messages[-1]["role"] == "assistant"
    end = reference_tokenizer.encode_special("<|assistant_end|>")
    assert session.entries[-1].tokens[-1] == end
    run(session.send("next"))  # the session goes on, its prompt well-formed
    prompt = session.prompt_tokens()
    assert prompt.count(end) == 2


def test_continue_extends_a_reply_cut_at_max_tokens(reference_tokenizer):
    session = ChatSession(random_chat_gpt("E"), reference_tokenizer, greedy(max_tokens=5))
    run(session.send("go on and on"))
    first = session.last_reply
    if first.stats.finish_reason != "length":
        pytest.skip("this random model happened to stop early")
    run(session.continue_reply())
    second = session.last_reply
    assert second.tokens[: len(first.tokens)] == first.tokens
    assert len(second.tokens) > len(first.tokens)
    assert len([m for m in session.messages if m["role"] == "assistant"]) == 1


def test_context_guard_drops_oldest_exchanges_and_keeps_the_system_prompt(reference_tokenizer):
    session = ChatSession(
        random_chat_gpt("E", sequence_len=96), reference_tokenizer, greedy(8), system="S"
    )
    for i in range(12):
        run(session.send(f"question number {i} with some words"))
        assert session.history_stats[-1].context_used <= 96
    notices = [n.text for n in session.take_notices()]
    assert any("dropped" in n for n in notices)
    assert session.messages[0] == {"role": "system", "content": "S"}
    assert session.messages[1]["content"] != "question number 0 with some words"


def test_samples_come_from_one_prefill_and_one_can_be_kept(reference_tokenizer):
    opts = SamplingOptions(temperature=1.0, top_k=None, max_tokens=6, seed=3)
    session = ChatSession(random_chat_gpt("E"), reference_tokenizer, opts)
    replies = session.sample_replies("pick one", 3)
    assert len(replies) == 3
    assert len({tuple(r.tokens) for r in replies}) > 1
    session.accept_reply(replies[1])
    assert session.messages[-1] == replies[1].message
    run(session.send("and then?"))
    assert len(session.messages) == 4


@pytest.mark.parametrize("era", ["A", "E"])
def test_samples_fork_the_warm_cache_and_leave_it_holding_the_prompt(era, reference_tokenizer):
    # /samples prefills only the new turn and its rows decode over the conversation's K/V
    # (shared, not copied); greedy rows are the reply a plain send gives, and the chosen
    # row's K/V stay, so the turn after prefills only itself.
    model = random_chat_gpt(era)
    forked, plain = (ChatSession(model, reference_tokenizer, greedy()) for _ in range(2))
    for session in (forked, plain):
        run(session.send("What is 12*7?"))
    replies = forked.sample_replies("and times three?", 2)
    prompt = forked.prompt_tokens()
    assert forked.warm.tokens == prompt and forked.warm.cache.get_pos() == len(prompt)
    run(plain.send("and times three?"))
    assert replies[0].stats.prefill_tokens == plain.history_stats[-1].prefill_tokens
    assert replies[0].stats.prefill_tokens < len(prompt) / 2
    assert replies[0].tokens == replies[1].tokens == plain.last_reply.tokens
    forked.accept_reply(replies[1])
    # The chosen row's K/V went into the warm cache (all but its last token, never run),
    # so the next turn prefills what a plain send's does.
    assert forked.warm.tokens == plain.warm.tokens
    assert forked.warm.cache.get_pos() == len(forked.warm.tokens)
    run(forked.send("thanks"))
    run(plain.send("thanks"))
    assert forked.history_stats[-1].prefill_tokens == plain.history_stats[-1].prefill_tokens
    assert forked.last_reply.tokens == plain.last_reply.tokens


# ---- /continue inside a calculator call (scripted model, byte reference_tokenizer) ---------------------


def scripted_session(expression: str, max_tokens: int) -> ChatSession:
    """A session whose model answers every question with one calculator call, then ' done'."""
    model = ScriptedModel(tool_call(expression, DONE))
    return ChatSession(model, ByteTokenizer(), greedy(max_tokens))


def results(events) -> list[ToolResult]:
    return [e for e in events if isinstance(e, ToolResult)]


CALL_1234 = [
    {"type": "python", "text": "1234*56"},
    {"type": "python_output", "text": "69104"},
    {"type": "text", "text": " done"},
]


def test_continue_after_a_cut_inside_the_expression_runs_the_calculator():
    session = scripted_session("1234*56", max_tokens=5)  # <|python_start|>1234
    assert results(session.send("What is 1234*56?")) == [ToolResult("1234", None, cut=True)]
    session.options.max_tokens = 100
    continued = list(session.continue_reply())
    # The badge covers the whole call, and only the new part of the expression is streamed.
    assert results(continued) == [ToolResult("1234*56", "69104")]
    assert "".join(e.text for e in continued if isinstance(e, TextDelta)) == " done"
    assert session.messages[-1]["content"] == CALL_1234
    out = session.last_reply
    assert out.masks == [1] * 9 + [0] * 7 + [1] * 5  # the call, the forced result, " done"


def test_continue_after_resuming_a_reply_cut_inside_the_expression():
    first = scripted_session("1234*56", max_tokens=5)  # <|python_start|>1234
    run(first.send("What is 1234*56?"))
    # A new session from the saved messages, as --resume builds it: its model goes on
    # from inside the call.
    rest = reply([*ByteTokenizer().encode("*56"), SPECIAL_IDS[PYTHON_END], *DONE])
    model = ScriptedModel(rest)
    session = ChatSession(model, ByteTokenizer(), greedy(100))
    session.load_messages(first.messages)
    continued = list(session.continue_reply())
    call = [SPECIAL_IDS[ASSISTANT_START], SPECIAL_IDS[PYTHON_START], *b"1234"]
    assert model.histories[0][model.prompt_len - len(call) : model.prompt_len] == call
    assert results(continued) == [ToolResult("1234*56", "69104")]
    assert session.messages[-1]["content"][:2] == CALL_1234[:2]


def test_with_the_tools_off_the_call_is_not_run_and_says_so():
    session = scripted_session("1234*56", max_tokens=100)
    session.options.tools = False
    # The scripted model writes the result tokens itself, unmasked: not the tool's.
    [result] = results(session.send("What is 1234*56?"))
    assert (result.output, result.status) == (None, "off")
    assert 0 not in session.last_reply.masks


def test_a_call_that_ends_on_the_contexts_last_position_is_cut_not_failed():
    question = "What is 1234*56?"
    prompt = ChatSession(ScriptedModel(reply([0])), ByteTokenizer(), greedy()).prompt_tokens()
    # The prompt (<|user_start|>, the question, <|user_end|>, <|assistant_start|>) and the
    # call's 9 tokens fill the context exactly; the last token is never written to the cache.
    room = len(prompt) + len(ByteTokenizer().encode(question)) + 3 + 9 - 1
    model = ScriptedModel(tool_call("1234*56", DONE), sequence_len=room)
    session = ChatSession(model, ByteTokenizer(), greedy(100))
    [result] = results(session.send(question))
    assert session.last_reply.stats.finish_reason == "context"
    assert (result.expression, result.output, result.status) == ("1234*56", None, "cut")
    assert session.last_reply.tokens[-1] == SPECIAL_IDS[PYTHON_END]


def test_a_cut_inside_the_forced_result_never_splits_it():
    # 1111*22: the call takes 9 tokens, so 12 stop inside <|output_start|>24442<|output_end|>.
    session = scripted_session("1111*22", max_tokens=12)
    assert results(session.send("What is 1111*22?")) == [ToolResult("1111*22", "24442")]
    assert session.last_reply.stats.finish_reason == "length"
    assert session.last_reply.parts == [
        {"type": "python", "text": "1111*22"},
        {"type": "python_output", "text": "24442"},
    ]
    session.options.max_tokens = 100
    continued = list(session.continue_reply())
    assert results(continued) == []  # the result was shown whole already
    assert session.messages[-1]["content"][-1] == {"type": "text", "text": " done"}


def test_continue_after_an_interrupt_inside_the_forced_result_writes_the_rest_of_it():
    answer = tool_call("1234*56", DONE)
    pressed = []

    def ctrl_c_inside_the_result(generated: list[int]) -> int:
        # Ctrl-C lands while the model reads <|output_start|>6 (0, 4, <|output_end|> queued).
        if len(generated) == 11 and not pressed:
            pressed.append(True)
            raise KeyboardInterrupt
        return answer(generated)

    session = ChatSession(ScriptedModel(ctrl_c_inside_the_result), ByteTokenizer(), greedy(100))
    with pytest.raises(KeyboardInterrupt):
        list(session.send("What is 1234*56?"))
    assert session.last_reply.stats.finish_reason == "interrupted"
    assert ByteTokenizer().decode(session.entries[-1].tokens[-3:-1]) == "<|output_start|>6"
    continued = list(session.continue_reply())
    assert results(continued) == [ToolResult("1234*56", "69104")]
    assert session.messages[-1]["content"] == CALL_1234
    assert session.last_reply.masks == [1] * 9 + [0] * 7 + [1] * 5


def answers_done(generated: list[int]) -> int:
    """A script: every reply is " done", then <|assistant_end|>."""
    return DONE[min(len(generated), len(DONE) - 1)]


def done_session(sequence_len: int = 256, system: str | None = None) -> ChatSession:
    model = ScriptedModel(answers_done, sequence_len=sequence_len)
    return ChatSession(model, ByteTokenizer(), greedy(8), system=system)


def test_a_message_too_long_for_the_context_leaves_the_conversation_as_it_was():
    session = done_session(sequence_len=128)
    for question in ("one?", "two?", "three?"):
        run(session.send(question))
    before = session.messages
    with pytest.raises(ContextOverflowError, match=r"This message alone needs 134 tokens"):
        session.send("x" * 130)
    assert session.messages == before  # nothing dropped for a message that was refused
    assert session.take_notices() == []
    assert run(session.send("four?")) == " done"  # and the cache still serves the next turn
    assert session.history_stats[-1].prefill_tokens < 10


def test_a_long_system_prompt_is_named_when_it_and_the_message_do_not_fit():
    session = done_session(sequence_len=128, system="s" * 80)
    with pytest.raises(
        ContextOverflowError,
        match=r"The system prompt \(82 tokens\) and this message need 136 tokens",
    ):
        session.send("y" * 50)
    assert session.messages == [{"role": "system", "content": "s" * 80}]


def test_a_system_prompt_that_leaves_no_room_is_refused_and_the_old_one_kept():
    session = done_session(sequence_len=128, system="brief")
    with pytest.raises(ContextOverflowError, match=r"takes 102 tokens .* too little"):
        session.set_system("s" * 100)
    assert session.system == "brief"
    session.set_system("s" * 80)  # 128 - 2 * 16 leaves room for this one
    assert run(session.send("hi")) == " done"


def test_continue_after_a_complete_reply_is_refused():
    session = done_session()
    run(session.send("hi"))
    with pytest.raises(ChatcliError, match="nothing to continue"):
        session.continue_reply()
    assert len(session.messages) == 2


def test_dropping_exchanges_counts_the_system_prompt_the_new_first_message_takes_in():
    # 148 tokens of system prompt ride on the first message; dropping that exchange moves
    # them onto the next one, which the drop must count (it once stopped one drop short).
    long_reply = {"on": False}

    def script(generated: list[int]) -> int:
        return ord("a") if long_reply["on"] else answers_done(generated)

    model = ScriptedModel(script, sequence_len=256)
    options = SamplingOptions(temperature=0.0, top_k=None, max_tokens=64, seed=1)
    session = ChatSession(model, ByteTokenizer(), options, system="s" * 148)
    run(session.send("hi"))
    long_reply["on"] = True
    run(session.send("q" * 26))  # a reply cut at 64 tokens
    long_reply["on"] = False
    assert run(session.send("z" * 28)) == " done"
    assert session.history_stats[-1].context_used <= 256
    assert any("dropped" in n.text for n in session.take_notices())
    assert session.messages[0] == {"role": "system", "content": "s" * 148}


def test_a_reply_that_fills_most_of_the_context_warns_before_the_next_turn():
    model = ScriptedModel(lambda generated: ord("a"), sequence_len=64)
    options = SamplingOptions(temperature=0.0, top_k=None, max_tokens=48, seed=1)
    session = ChatSession(model, ByteTokenizer(), options)
    run(session.send("hello"))  # 9 tokens of prompt, 48 of reply: 57 of 64
    assert [n.text for n in session.take_notices()] == [
        "Context 57/64 tokens: the next turns drop the oldest exchanges to make room "
        "(/clear starts afresh)."
    ]


def test_a_resumed_reply_that_had_finished_is_not_continued():
    first = done_session()
    run(first.send("hi"))
    session = done_session()
    session.load_messages(first.messages, finishes=[None, "stop"])
    with pytest.raises(ChatcliError, match="nothing to continue"):
        session.continue_reply()
    session.load_messages(first.messages, finishes=[None, "length"])
    assert run(session.continue_reply()) == " done"


# ---- a conversation longer than the context, replies that end oddly ---------------------------


END = SPECIAL_IDS[ASSISTANT_END]


def long_conversation(exchanges: int) -> list[dict]:
    """`exchanges` question-and-answer pairs of ~40 tokens each, then a last question."""
    messages = []
    for i in range(exchanges):
        messages.append({"role": "user", "content": f"question {i} " + "q" * 20})
        messages.append({"role": "assistant", "content": f"answer {i} " + "a" * 20})
    return [*messages, {"role": "user", "content": "and now?"}]


def test_retry_drops_old_exchanges_where_a_resumed_conversation_outgrew_the_context():
    # Saved on a model of a longer context, resumed on one of 128 positions: ~330 tokens.
    session = ChatSession(ScriptedModel(reply([*b"ok", END]), 128), ByteTokenizer(), greedy())
    session.load_messages(long_conversation(8))
    assert run(session.regenerate()) == "ok"
    assert any("dropped" in n.text for n in session.take_notices())
    assert session.messages[-2:] == [
        {"role": "user", "content": "and now?"},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
    ]
    assert len(session.prompt_tokens()) < 128


def test_continue_drops_old_exchanges_too_and_refuses_a_reply_that_fills_the_context():
    session = ChatSession(ScriptedModel(reply([*b"more", END]), 128), ByteTokenizer(), greedy())
    cut = {"role": "assistant", "content": [{"type": "text", "text": "so far"}]}
    session.load_messages([*long_conversation(8), cut], [None] * 17 + ["length"])
    assert run(session.continue_reply()) == "more"
    assert session.messages[-1]["content"] == [{"type": "text", "text": "so farmore"}]
    assert len(session.prompt_tokens()) < 128
    # A reply that, with its question, leaves no room: refused, the conversation kept.
    full = {"role": "assistant", "content": [{"type": "text", "text": "x" * 120}]}
    session.load_messages([long_conversation(0)[0], full], [None, "length"])
    before = session.messages
    with pytest.raises(ContextOverflowError, match="no room to continue"):
        session.continue_reply()
    assert session.messages == before


def test_a_reply_that_ends_at_bos_keeps_no_bos():
    bos = SPECIAL_IDS["<|bos|>"]
    session = ChatSession(ScriptedModel(reply([*b"hi", bos])), ByteTokenizer(), greedy())
    run(session.send("q"))
    assert session.last_reply.tokens == list(b"hi")
    assert session.last_reply.stats.finish_reason == "stop"
    assert bos not in session.prompt_tokens()[1:]


def test_continue_with_the_tools_off_forces_nothing():
    # The model writes its own (wrong) output block; max_tokens cuts it after <|output_start|>.
    own = [SPECIAL_IDS[OUTPUT_START], *b"5", SPECIAL_IDS[OUTPUT_END], *b" ok", END]
    call = [SPECIAL_IDS[PYTHON_START], *b"2+2", SPECIAL_IDS[PYTHON_END]]
    session = ChatSession(ScriptedModel(reply([*call, *own])), ByteTokenizer(), greedy(6))
    session.options.tools = False
    run(session.send("q"))
    session.options.max_tokens = 50
    run(session.continue_reply())
    assert session.last_reply.tokens == [*call, *own[:-1]]
    assert 0 not in session.last_reply.masks  # the model's own, every token


def test_ctrl_c_while_a_turn_sets_up_still_closes_it_with_a_reply(monkeypatch):
    session = ChatSession(ScriptedModel(reply([*b"ok", END])), ByteTokenizer(), greedy())

    def interrupted(tokens):  # Ctrl-C lands before the prefill, in the turn's set-up
        raise KeyboardInterrupt

    monkeypatch.setattr(session.engine, "replay_tool_use", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(session.send("q"))
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    assert session.last_reply.stats.finish_reason == "interrupted"
