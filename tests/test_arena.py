"""The arena's votes: typed answers, the record a vote leaves in its conversation's file,
reading them back (damaged lines skipped), the two exports, this session's tally, and the
memory check before two models load."""

from __future__ import annotations

import json

import pytest

from chatcli.chat.arena import (
    Side,
    dpo_record,
    export_lines,
    kept_label,
    parse_vote,
    read_votes,
    session_tally,
    vote_record,
)
from chatcli.chat.conversation_reader import read_conversation
from chatcli.chat.conversation_store import NewConversation
from chatcli.chat.ratings import Battle
from chatcli.errors import ChatcliError
from chatcli.model.memory_need import GB, available_bytes, check_models_fit, checkpoint_bytes

CALC = [
    {"type": "text", "text": "Let me work it out: "},
    {"type": "python", "text": "12*7"},
    {"type": "python_output", "text": "84"},
    {"type": "text", "text": " so 84."},
]
PROMPT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
    {"role": "user", "content": "What is 12*7?"},
]


def side(label: str, model: str, parts: list, tokens: int = 9) -> Side:
    stats = {"tokens_out": tokens, "finish_reason": "stop", "seed": 3}
    return Side(label, model, {"role": "assistant", "content": parts}, stats)


def a_vote(outcome: str, a: str = "sft", b: str = "rl") -> dict:
    sides = [side("A", a, CALC), side("B", b, [{"type": "text", "text": "It is 86."}])]
    settings = {"temperature": 0.6, "top_k": 50, "seed": 3}
    return vote_record(PROMPT, sides, outcome, settings)


@pytest.mark.parametrize(
    ("typed", "outcome"),
    [
        ("a", "a"),
        ("A", "a"),
        ("b", "b"),
        ("t", "tie"),
        ("tie", "tie"),
        ("x", "bad"),
        ("both bad", "bad"),
        ("  Both   Bad ", "bad"),
        ("c", None),
        ("", None),
        ("ab", None),
    ],
)
def test_typed_votes(typed, outcome):
    assert parse_vote(typed) == outcome


def test_the_kept_reply_is_the_winners_else_as():
    assert [kept_label(o) for o in ("a", "b", "tie", "bad")] == ["A", "B", "A", "A"]


def test_dpo_record_is_trls_conversational_preference_format():
    record = dpo_record(a_vote("b"))
    assert record == {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "What is 12*7?"},
        ],
        "chosen": [{"role": "assistant", "content": "It is 86."}],
        # the calculator call as its text marker, as the server's clients send it
        "rejected": [
            {"role": "assistant", "content": "Let me work it out: [calc 12*7 = 84] so 84."}
        ],
    }
    assert dpo_record(a_vote("tie")) is None
    assert dpo_record(a_vote("bad")) is None


def test_votes_are_saved_with_the_conversation_and_read_back(tmp_path):
    folder = tmp_path / "conversations"
    conversation = NewConversation(folder, model={"arena": ["sft", "rl"]})
    conversation.append_message({"role": "user", "content": "What is 12*7?"})
    conversation.append_message({"role": "assistant", "content": CALC})
    conversation.append_vote(a_vote("a"))
    conversation.append_message({"role": "user", "content": "Again"})
    conversation.append_message({"role": "assistant", "content": "86"})
    conversation.append_vote(a_vote("tie"))
    path = conversation.path
    # A killed process's half line, and a vote missing its sides: both skipped.
    with path.open("a") as f:
        f.write(json.dumps({"type": "vote", "vote": {"outcome": "a"}}) + "\n")
        f.write('{"type": "vote", "vote": {"outc')
    loaded = read_conversation(path)
    # The votes change nothing in the messages; the cut line is the reader's one warning.
    assert [m["role"] for m in loaded.messages] == ["user", "assistant", "user", "assistant"]
    assert len(loaded.warnings) == 1
    votes = read_votes(folder)
    assert [v.record["outcome"] for v in votes] == ["a", "tie"]
    assert {v.conversation for v in votes} == {path.stem}
    assert [v.battle for v in votes] == [Battle("sft", "rl", "a"), Battle("sft", "rl", "tie")]
    assert read_votes(tmp_path / "none") == []


def test_exports_dpo_keeps_decisive_votes_jsonl_keeps_all(tmp_path):
    conversation = NewConversation(tmp_path)
    conversation.append_message({"role": "user", "content": "What is 12*7?"})
    for outcome in ("a", "tie", "b", "bad"):
        conversation.append_vote(a_vote(outcome))
    votes = read_votes(tmp_path)
    dpo = [json.loads(line) for line in export_lines(votes, "dpo")]
    assert [r["chosen"][0]["content"] for r in dpo] == [
        "Let me work it out: [calc 12*7 = 84] so 84.",
        "It is 86.",
    ]
    full = [json.loads(line) for line in export_lines(votes, "jsonl")]
    assert [r["outcome"] for r in full] == ["a", "tie", "b", "bad"]
    assert [r["winner"] for r in full] == ["sft", None, "rl", None]
    first = full[0]
    assert [s["model"] for s in first["sides"]] == ["sft", "rl"]
    assert first["sides"][1]["content"] == "It is 86."
    assert first["sides"][0]["message"]["content"] == CALC  # the parts, whole
    assert first["settings"] == {"temperature": 0.6, "top_k": 50, "seed": 3}
    assert first["sides"][0]["stats"]["tokens_out"] == 9


def test_session_tally_counts_each_models_record():
    rows = session_tally(
        [("sft", "rl", "a"), ("rl", "sft", "a"), ("sft", "rl", "tie"), ("rl", "sft", "bad")]
    )
    assert sorted(rows) == [("rl", 1, 1, 1, 1), ("sft", 1, 1, 1, 1)]


def test_two_models_that_do_not_fit_are_refused_with_what_they_need():
    with pytest.raises(ChatcliError) as e:
        check_models_fit([("runs/a", 6 * GB), ("runs/b", 5 * GB)], 8 * GB)
    assert str(e.value) == (
        "The models need about 11.0 GB of memory (runs/a: 6.0 GB, runs/b: 5.0 GB) and 8.0 GB "
        "is free. Close other programs, load them smaller (--dtype bfloat16, --quantize int8), "
        "or serve one (chatcli serve) and pass its --url."
    )
    check_models_fit([("runs/a", 6 * GB), ("runs/b", 5 * GB)], 12 * GB)  # they fit
    check_models_fit([("hf:org/big", None), ("runs/b", 5 * GB)], 6 * GB)  # not known: tried
    check_models_fit([("runs/a", 6 * GB), ("runs/b", 5 * GB)], None)


def test_the_embedded_models_estimate_is_its_weights_and_cache(tmp_path):
    from chatcli.model.checkpoint_paths import resolve_checkpoint

    weights = resolve_checkpoint(None).model_file.stat().st_size
    need = checkpoint_bytes(None)
    assert weights < need < 2 * weights + 64 * 2**20
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  16000000 kB\nMemAvailable:    8000000 kB\n")
    assert available_bytes(meminfo) == 8000000 * 1024


def test_a_local_session_takes_the_other_models_reply_and_keeps_its_cache():
    from chatcli.chat.session import ChatSession
    from chatcli.chat.turns import SamplingOptions
    from chatcli.model.checkpoint import load_model

    model, tokenizer, _ = load_model(None, device="cpu")
    options = SamplingOptions(temperature=0.0, max_tokens=6)
    session = ChatSession(model, tokenizer, options)
    list(session.send("What is 12*7?"))
    other = {"role": "assistant", "content": CALC}
    session.put_reply(other, "stop")
    assert session.messages == [{"role": "user", "content": "What is 12*7?"}, other]
    # Its tokens are the other reply's, rendered: the calculator call as the model writes one.
    alone = ChatSession(model, tokenizer, options)
    alone.load_messages(session.messages)
    assert session.prompt_tokens() == alone.prompt_tokens()
    list(session.send("And 6*7?"))
    stats = session.last_reply.stats
    # The question and the reply it took were in the warm cache already, but for the reply.
    assert 0 < stats.prefill_tokens < stats.tokens_in
    session.clear()
    with pytest.raises(ChatcliError, match="no question waiting"):
        session.put_reply(other)


def test_a_server_session_sends_the_reply_it_was_given():
    pytest.importorskip("httpx")
    from chatcli.serve.client import RemoteSession

    session = RemoteSession("http://127.0.0.1:9", model="m")
    session.load_messages(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Its own."}]
    )
    session.put_reply({"role": "assistant", "content": CALC}, "stop")
    assert session.messages == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": CALC},
    ]
    assert session.transcript[1] == [None, "stop"]


def test_a_duel_taller_than_the_screen_ends_with_both_replies_whole():
    from io import StringIO

    from rich.console import Console

    from chatcli.chat.stream import TextDelta
    from chatcli.terminal.arena_view import DuelView

    out = StringIO()
    console = Console(file=out, force_terminal=True, width=80, height=10, color_system=None)
    view = DuelView(console, ["A", "B"])
    for i in range(30):  # three times the screen's height
        view.handle(0, TextDelta(f"line {i:02d}\n"))
        view.handle(1, TextDelta(f"row {i:02d} "))
    view.finish(["30 tok · stop", "30 tok · length"])
    final = out.getvalue().rsplit("╭─ A", 1)[1]  # the last frame: Live's whole one
    assert all(f"line {i:02d}" in final for i in range(30))
    assert "row 00" in final and "row 29" in final
    assert "30 tok · stop" in final and "30 tok · length" in final
