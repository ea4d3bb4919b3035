"""End to end: `chatcli arena` in a pseudo-terminal, the embedded model against nanochat's
reference checkpoint. Types into the real prompt, votes with one key, redraws with /retry,
reads the side-by-side panels off the real screen, then checks the votes the file kept."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from reference import REFERENCE, needs_reference

from chatcli.chat.conversation_reader import read_conversation

pexpect = pytest.importorskip("pexpect")

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = REFERENCE / "E"
ENTER = "\r"
VOTE = "Vote: a = A better"
PROMPT = ">>> "  # the main prompt is back: what is typed now goes to it, not to the vote

pytestmark = [pytest.mark.slow, needs_reference]


def spawn(home: Path, *args: str, columns: int = 120):
    env = {**os.environ, "CHATCLI_HOME": str(home), "NO_COLOR": "1", "TERM": "xterm"}
    env["PROMPT_TOOLKIT_NO_CPR"] = "1"  # pexpect never answers cursor-position queries
    for key in [k for k in env if k.startswith("CHATCLI_") and k != "CHATCLI_HOME"]:
        del env[key]
    return pexpect.spawn(
        sys.executable,
        ["-m", "chatcli", "arena", *args],
        cwd=str(ROOT),  # this checkout's chatcli
        env=env,
        dimensions=(40, columns),
        encoding="utf-8",
        timeout=60,
    )


def test_an_arena_in_a_real_terminal(tmp_path):
    home = tmp_path / "home"
    child = spawn(home, "-m", "embedded", "-m", str(FIXTURE), "-n", "8", "-t", "0")
    try:
        child.expect_exact("Vote a, b, t (tie) or x (both bad)")
        child.send("What is 2+2?" + ENTER)
        # Both replies in panels side by side on 120 columns: A's and B's tops on one line.
        child.expect(r"╭─ A ─[^\r\n]*╭─ B ─")
        child.expect_exact(VOTE)
        child.send("a")  # one key decides
        child.expect(r"Voted A is better\.\s+A was (.+?); B was (.+?)\.\s+A's reply")
        # The notice wraps at the terminal's width: its names without the line breaks.
        first = tuple(" ".join(child.match.group(i).split()) for i in (1, 2))
        assert set(first) <= {"embedded default model", *[str(p) for p in FIXTURE.rglob("*.pt")]}

        child.expect_exact(PROMPT)
        child.send("/stats" + ENTER)
        # NO_COLOR leaves the header bold: codes stand between its words.
        child.expect(r"wins.*losses.*ties.*both bad")
        child.expect(r"embedded default model\s+[01]\s+[01]\s+0\s+0")

        child.expect_exact(PROMPT)
        child.send("/edit" + ENTER)  # the kept reply at a prompt, the cursor at its end
        child.expect_exact("Edit the reply")
        child.send(" Right." + ENTER)
        child.expect_exact("The reply that goes on is yours now")
        child.expect_exact(PROMPT)
        child.send("Hello" + ENTER)
        child.expect_exact(VOTE)
        child.send("/retry" + ENTER)  # its letters are typed, not votes ('t' is a tie's key)
        child.expect_exact("Drawing both replies again.")
        child.expect_exact(VOTE)
        child.send("x")
        child.expect_exact("Voted both bad.")
        child.expect_exact(PROMPT)
        child.sendcontrol("d")
        child.expect(r"Saved as (\S+) with 2 votes")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0

    (path,) = (home / "conversations").glob("*.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    votes = [r["vote"] for r in records if r["type"] == "vote"]
    assert [v["outcome"] for v in votes] == ["a", "bad"]
    assert [s["model"] for s in votes[0]["sides"]] == list(first)
    messages = read_conversation(path).messages
    assert [m["content"] for m in messages if m["role"] == "user"] == ["What is 2+2?", "Hello"]
    kept = next(s["message"] for s in votes[0]["sides"] if s["label"] == "A")
    edited = messages[1]["content"]
    assert edited[-1]["text"].endswith(" Right.")
    assert votes[1]["prompt"][1] == messages[1]  # the edited reply went on
    assert kept != messages[1]  # the vote keeps the reply as it was drawn


def test_a_narrow_terminal_stacks_the_panels(tmp_path):
    child = spawn(tmp_path / "home", "-m", "embedded", "-m", "embedded", "-n", "4", columns=50)
    try:
        child.expect_exact(PROMPT)
        child.send("Hi" + ENTER)
        child.expect_exact(VOTE)
        screen = child.before
        tops = [line for line in screen.splitlines() if "╭─" in line]
        assert tops and all(line.count("╭─") == 1 for line in tops)  # one panel a line
        assert re.search(r"╭─ A ─", screen) and re.search(r"╭─ B ─", screen)
        child.send("b")
        child.expect_exact("Voted B is better.")
        child.expect_exact(PROMPT)
        child.send("Hi again" + ENTER)
        child.expect_exact(VOTE)
        child.sendintr()  # Ctrl-C at the vote: the turn goes, unsaved
        child.expect_exact("No vote: the question")  # the line wraps at 50 columns
        child.expect_exact(PROMPT)
        child.send("/exit" + ENTER)
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    (path,) = (tmp_path / "home" / "conversations").glob("*.jsonl")
    messages = read_conversation(path).messages
    assert [m["content"] for m in messages if m["role"] == "user"] == ["Hi"]
