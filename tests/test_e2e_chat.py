"""End to end: the installed `chatcli chat` in a pseudo-terminal, on the embedded model.

Types into the real prompt and reads the real screen with pexpect: a calculator answer, a
setting change, Ctrl-C in the middle of a reply, /undo, /retry and /exit, then checks the
conversation file the session left behind.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from chatcli.chat.conversation_store import read_conversation
from chatcli.model.checkpoint import EMBEDDED_DIR, SOURCES
from chatcli.terminal.render import HELP_LINE

pexpect = pytest.importorskip("pexpect")

# The venv's scripts sit next to its python, whether or not the venv is activated.
CHATCLI = shutil.which(
    "chatcli", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
)
EMBEDDED = EMBEDDED_DIR / SOURCES["sft"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHATCLI is None, reason="the chatcli command is not installed"),
    pytest.mark.skipif(
        not EMBEDDED.is_dir(), reason=f"no embedded model yet ({EMBEDDED} does not exist)"
    ),
]

ENTER = "\r"
# prompt-toolkit turns bracketed paste off when the prompt hands the terminal back.
PROMPT_DONE = "\x1b[?2004l"
STORY = "Tell me a long story about a dragon."
SGR = r"(?:\x1b\[[\d;]*m)*"  # any run of style codes
STATUS = re.compile(r"\d+ in / \d+ out · ctx \d+/\d+ · (\w+)")


def type_line(child, text: str) -> None:
    child.send(text + ENTER)


def test_chat_session_in_a_real_terminal(tmp_path):
    home = tmp_path / "home"
    env = {**os.environ, "CHATCLI_HOME": str(home), "NO_COLOR": "1", "TERM": "xterm"}
    env["PROMPT_TOOLKIT_NO_CPR"] = "1"  # pexpect never answers cursor-position queries
    for key in [k for k in env if k.startswith("CHATCLI_") and k != "CHATCLI_HOME"]:
        del env[key]  # the test's own settings only
    child = pexpect.spawn(
        CHATCLI, ["chat"], env=env, dimensions=(40, 120), encoding="utf-8", timeout=30
    )
    try:
        child.expect_exact(HELP_LINE)

        type_line(child, "What is 1234*56?")
        # NO_COLOR leaves attributes (the badge is dim): codes may stand between its pieces.
        child.expect(rf"calc {SGR}1234 ?\* ?56{SGR} = {SGR}69104")
        assert child.expect(STATUS) == 0

        type_line(child, "/temperature 0.3")
        child.expect_exact("temperature = 0.3")

        # A rambling reply, so it goes on long enough to be stopped.
        for line, echo in (
            ("/temperature 2", "temperature = 2.0"),
            ("/top_k 0", "top_k = off"),
            ("/max_tokens 400", "max_tokens = 400"),
        ):
            type_line(child, line)
            child.expect_exact(echo)
        for _ in range(20):
            type_line(child, STORY)
            child.expect_exact(PROMPT_DONE)
            time.sleep(0.02)  # until the terminal is back in cooked mode, Ctrl-C is a key
            child.sendintr()
            # The demo model's replies are short and its decode fast (~0.1 s for 400 tokens
            # here): Ctrl-C can come after this one ended (it then lands at the next prompt).
            # Drop that turn and try again.
            if child.expect([r"\[interrupted\]", r"\(Press Ctrl-D", r"Interrupted\."]) == 0:
                # Stopped mid-turn: its status line. Stopped before the turn began (the
                # Ctrl-C beat the reply's first step): the question was dropped; again.
                if child.expect([STATUS, "Stopped before the reply began"]) == 0:
                    break
                continue
            type_line(child, "/undo")
            child.expect_exact("Undone:")
        else:
            pytest.fail("every reply ended before Ctrl-C could stop it")
        assert child.match.group(1) == "interrupted"

        for line, echo in (("/temperature 0.3", "temperature = 0.3"), ("/top_k 50", "top_k = 50")):
            type_line(child, line)
            child.expect_exact(echo)
        type_line(child, "What is 2+3?")
        child.expect(STATUS)
        assert child.match.group(1) in ("stop", "length")

        type_line(child, "/undo")
        child.expect_exact('Undone: "What is 2+3?" and its reply.')
        type_line(child, "/retry")
        child.expect(r"retry with seed \d+")
        child.expect(STATUS)

        type_line(child, "/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0

    (path,) = (home / "conversations").glob("*.jsonl")
    messages = read_conversation(path).messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[0]["content"] == "What is 1234*56?"
    assert {"type": "python_output", "text": "69104"} in messages[1]["content"]
    assert messages[2]["content"] == STORY
