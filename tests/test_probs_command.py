"""/probs in the chat: the last reply's tokens shaded by probability (a plain marker where
there is no colour) and the alternatives at one position, from a real ChatSession whose
recorded logprobs are the model's; parsing, /help, and the errors a person can meet."""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping, Sequence

import pytest
from fakes import SPECIAL_IDS, ByteTokenizer, ScriptedModel, noisy, tool_call
from rich.console import Console

from chatcli.chat.command_parsing import CommandError, help_text, parse_command
from chatcli.chat.session import ChatSession
from chatcli.chat.settings import Settings
from chatcli.chat.token_probs import TokenProb, perplexity
from chatcli.chat.turns import SamplingOptions
from chatcli.terminal.render import CHAT_THEME, make_console
from chatcli.terminal.render_probs import render_alternatives, render_probs, shaded_text
from chatcli.terminal.slash_commands import ChatCommands

END = SPECIAL_IDS["<|assistant_end|>"]


class Screen:
    """Records what the commands draw; `probs` keeps what /probs was given."""

    markdown_mode = "never"

    def __init__(self) -> None:
        self.drawn: list[tuple[str, object]] = []

    def renderer(self, raw: bool = False):
        screen = self

        class View:
            def handle(self, event) -> None:
                screen.drawn.append(("event", event))

            def finish(self, finish_reason: str) -> None:
                screen.drawn.append(("finish", finish_reason))

        return View()

    def notice(self, message: str) -> None:
        self.drawn.append(("notice", message))

    def error(self, message: str) -> None:
        self.drawn.append(("error", message))

    def status(self, stats: Mapping[str, object]) -> None:
        self.drawn.append(("status", None))

    def text(self, message: str) -> None:
        self.drawn.append(("text", message))

    def interrupted(self) -> None: ...

    def table(self, headers: Sequence[str], rows: Iterable[Sequence[str]]) -> None: ...

    def replies(self, replies, tools: bool = True) -> None: ...

    def ask(self, question: str) -> str | None:
        return "2"

    def recap(self, messages) -> None: ...

    def probs(self, probs: Sequence[TokenProb], position: int | None = None) -> None:
        self.drawn.append(("probs", (list(probs), position)))


def _printable(generated: list[int]):
    """fakes.noisy over printable ASCII only: each token is a character of the reply."""
    logits = noisy(generated)
    logits[:32] = logits[127:] = float("-inf")
    return logits


def _chat(script, tmp_path, **options) -> tuple[ChatCommands, ChatSession, Screen]:
    opts = SamplingOptions(**{"temperature": 1.0, "max_tokens": 12, "seed": 4, **options})
    session = ChatSession(ScriptedModel(script), ByteTokenizer(), opts)
    screen = Screen()
    commands = ChatCommands(session, screen, Settings(), None, tmp_path, {})
    return commands, session, screen


def _last(screen: Screen, kind: str):
    return next(v for k, v in reversed(screen.drawn) if k == kind)


def test_probs_gives_each_token_of_the_last_reply_its_recorded_probability(tmp_path):
    commands, session, screen = _chat(_printable, tmp_path)
    commands.handle("hello there")
    commands.handle("/probs")
    probs, position = _last(screen, "probs")
    reply = session.last_reply
    assert position is None and len(probs) == len(reply.tokens) == 12
    assert "".join(p.text for p in probs) == reply.text
    for prob, entry in zip(probs, reply.logprobs, strict=True):
        assert prob.logprob == entry.logprob and not prob.forced
        assert prob.top[0][1] == max(v for _, v in entry.top)
        assert 0 < prob.prob <= 1
    # The noisy script's logits are fixed per step: the recorded probability is theirs at
    # temperature 1 (log_softmax), though the chat sampled at another temperature.
    commands.handle("/temperature 0.3")
    commands.handle("/retry")
    commands.handle("/probs 1")
    probs, position = _last(screen, "probs")
    assert position == 1
    logits = _printable([])
    want = logits[session.last_reply.tokens[0]] - logits.logsumexp(0)
    assert probs[0].logprob == pytest.approx(want.item(), abs=1e-5)


def test_the_calculators_tokens_are_forced_and_a_sample_kept_keeps_its_probs(tmp_path):
    done = [*b" ok", END]
    commands, session, screen = _chat(tool_call("12*7", done), tmp_path, max_tokens=40)
    commands.handle("what is 12*7?")
    commands.handle("/probs")
    probs, _ = _last(screen, "probs")
    forced = "".join(p.text for p in probs if p.forced)
    assert forced == "<|output_start|>84<|output_end|>"
    assert all(p.logprob is None for p in probs if p.forced)
    assert perplexity(probs) == pytest.approx(1.0, abs=1e-4)  # the script is sure of each
    # /samples: the reply kept (the screen answers "2") has its own row's probabilities.
    commands.handle("/samples 2")
    commands.handle("and again?")
    assert session.last_reply.logprobs is not None
    assert [e.token for e in session.last_reply.logprobs] == session.last_reply.tokens


def test_probs_errors_say_what_to_do(tmp_path):
    commands, session, screen = _chat(noisy, tmp_path)
    commands.handle("/probs")
    assert "No reply yet" in _last(screen, "error")
    commands.handle("hi")
    commands.handle("/probs 13")
    assert _last(screen, "error") == ("/probs 13 is past the last reply's 12 tokens: give 1 to 12.")
    # A conversation loaded from a file keeps no probabilities.
    session.load_messages(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    )
    commands.handle("/probs")
    assert "no probabilities" in _last(screen, "error") and "/retry" in _last(screen, "error")
    # /retry writes one that has; /undo takes it back, and there is no reply to show.
    commands.handle("/retry")
    commands.handle("/probs")
    assert len(_last(screen, "probs")[0]) == 12
    commands.handle("/undo")
    commands.handle("/probs")
    assert "No reply yet" in _last(screen, "error")


def test_probs_parses_a_position_and_is_in_help():
    assert parse_command("/probs").arg is None
    assert parse_command("/probs 7").arg == 7
    for bad in ("/probs 0", "/probs x", "/probs -2"):
        with pytest.raises(CommandError, match="position in the last reply"):
            parse_command(bad)
    assert "/probs [N]" in help_text(None)
    assert "temperature 1" in help_text("probs")


def _probs() -> list[TokenProb]:
    return [
        TokenProb("The", math.log(0.95), top=(("The", math.log(0.95)), ("A", math.log(0.03)))),
        TokenProb(" cat", math.log(0.6)),
        TokenProb(" sat", math.log(0.2)),
        TokenProb(" upside", math.log(0.02), top=(("on", -0.5), (" upside", math.log(0.02)))),
        TokenProb("84", None, forced=True),
    ]


def test_shading_follows_the_probability_and_the_calculators_tokens_are_dim():
    text = shaded_text(_probs(), marks=False)
    styles = [(text.plain[s.start : s.end], str(s.style)) for s in text.spans]
    assert styles == [
        ("The", "prob.high"),
        (" cat", "prob.mid"),
        (" sat", "prob.low"),
        (" upside", "prob.rare"),
        ("84", "prob.forced"),
    ]
    colour = Console(
        file=io.StringIO(), width=200, force_terminal=True, color_system="standard",
        theme=CHAT_THEME,
    )  # fmt: skip
    render_probs(colour, _probs())
    out = colour.file.getvalue()
    assert "\x1b[7;31m upside" in out and "⟦" not in out  # reversed red, no marker needed


def test_without_colour_unlikely_tokens_get_a_plain_marker(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    console = make_console(file=io.StringIO())
    render_probs(console, _probs())
    lines = console.file.getvalue().splitlines()
    assert lines[0] == "The cat sat⟦ upside⟧84"
    assert lines[1] == (
        "⟦…⟧: under 10% likely. <|output_start|>…<|output_end|>: the calculator's, not chosen."
    )
    assert lines[2].startswith("5 tokens, perplexity 4.58.")
    assert "Least likely: #4 “ upside” 2%, #3 “ sat” 20%, #2 “ cat” 60%, #1 “The” 95%." in lines[2]


def test_the_alternatives_at_a_position_mark_the_chosen_token(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    console = make_console(file=io.StringIO())
    render_alternatives(console, _probs(), 4)
    out = console.file.getvalue().splitlines()
    assert out[0] == "Token 4 of 5: “ upside”, after “The cat sat”: 2% (logprob -3.912)."
    assert "“on”" in out[3] and "61%" in out[3] and "chosen" not in out[3]
    assert "“ upside”" in out[4] and "← chosen" in out[4]
    render_alternatives(console, _probs(), 5)
    assert (
        console.file.getvalue()
        .splitlines()[-1]
        .endswith("the calculator's, forced in; no probability.")
    )
