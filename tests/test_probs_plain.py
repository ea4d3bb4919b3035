"""/probs where there is no colour (a pipe, NO_COLOR): the legend names only what the screen
shows. Dim is not drawn there, so the calculator's forced tokens are told by the special
tokens the result sits between, which /probs draws as they are."""

from __future__ import annotations

import io

from chatcli.chat.token_probs import TokenProb
from chatcli.terminal.render import make_console
from chatcli.terminal.render_probs import render_probs

REPLY = [
    TokenProb("<|python_start|>", -0.01),
    TokenProb("12*7", -0.02),
    TokenProb("<|python_end|>", -0.01),
    TokenProb("<|output_start|>", None, forced=True),
    TokenProb("84", None, forced=True),
    TokenProb("<|output_end|>", None, forced=True),
    TokenProb(" It is 84.", -3.0),
]


def test_a_plain_screens_legend_says_how_the_calculators_tokens_show(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    console = make_console(file=io.StringIO())
    render_probs(console, REPLY)
    lines = console.file.getvalue().splitlines()
    assert lines[0] == (
        "<|python_start|>12*7<|python_end|><|output_start|>84<|output_end|>⟦ It is 84.⟧"
    )
    assert "\x1b[" not in console.file.getvalue()  # nothing styled: dim cannot show
    assert lines[1] == (
        "⟦…⟧: under 10% likely. <|output_start|>…<|output_end|>: the calculator's, not chosen."
    )


def test_without_forced_tokens_the_plain_legend_has_only_the_marker(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    console = make_console(file=io.StringIO())
    render_probs(console, [REPLY[0], REPLY[-1]])
    assert console.file.getvalue().splitlines()[1] == "⟦…⟧: under 10% likely."
