"""Drawing /probs: a reply's tokens shaded by how likely the model found them, and the
alternatives at one position.

Owns: the shading levels (likely tokens plain, less likely ones yellow, then red, the
unlikely reversed; the calculator's forced tokens dim), the summary under the shaded reply
(perplexity, the least likely tokens with their positions, for `/probs N`), and the plain
marker that stands in for colour where there is none (NO_COLOR, a pipe): an unlikely token
is drawn as ⟦token⟧.

Does not know: tokens, logprobs' origin, commands. What it draws comes in as TokenProbs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.console import Console
from rich.text import Text

from chatcli.chat.token_probs import TokenProb, perplexity
from chatcli.model.special_tokens import OUTPUT_END, OUTPUT_START
from chatcli.terminal.render import print_line, visible
from chatcli.terminal.render_panels import render_table

# (lowest probability, style): a token takes the first level its probability reaches.
LEVELS = ((0.9, "prob.high"), (0.5, "prob.mid"), (0.1, "prob.low"), (0.0, "prob.rare"))
UNLIKELY = 0.1  # below this a token is marked where there is no colour
MARK_OPEN, MARK_CLOSE = "⟦", "⟧"
LEAST_SHOWN = 5  # the least likely tokens the summary names


def style_of(prob: TokenProb) -> str:
    if prob.forced:
        return "prob.forced"
    p = prob.prob
    if p is None:
        return "prob.unknown"
    return next(style for floor, style in LEVELS if p >= floor)


def _quoted(text: str) -> str:
    return "“" + visible(text).replace("\n", "↵") + "”"


def _percent(p: float) -> str:
    return f"{p:.0%}" if p >= 0.01 else f"{p:.1e}"


def shaded_text(probs: Sequence[TokenProb], marks: bool) -> Text:
    """The reply's text, each token in its level's style; `marks`: unlikely tokens also in
    ⟦ ⟧, for a screen without colour."""
    text = Text()
    for prob in probs:
        shown = visible(prob.text)
        p = prob.prob
        if marks and p is not None and p < UNLIKELY and shown:
            shown = f"{MARK_OPEN}{shown}{MARK_CLOSE}"
        text.append(shown, style=style_of(prob))
    return text


def render_probs(console: Console, probs: Sequence[TokenProb]) -> None:
    """The shaded reply, then one line of legend and one of summary."""
    marks = console.no_color or console.color_system is None
    print_line(console, shaded_text(probs, marks))
    if marks:
        legend = f"{MARK_OPEN}…{MARK_CLOSE}: under {UNLIKELY:.0%} likely."
    else:
        legend = "plain: 90% likely or more; yellow: 50%; red: 10%; reversed: under 10%."
    if any(p.forced for p in probs) and marks:
        # No style shows here; the result's own special tokens, drawn as they are, bound it.
        legend += f" {OUTPUT_START}…{OUTPUT_END}: the calculator's, not chosen."
    elif any(p.forced for p in probs):
        legend += " Dim: the calculator's, not chosen."
    print_line(console, Text(legend, style="status"))
    chosen = [(i, p) for i, p in enumerate(probs, start=1) if p.prob is not None]
    ppl = perplexity(probs)
    summary = f"{len(probs)} tokens"
    if ppl is not None:
        summary += f", perplexity {ppl:.2f}"
    least = sorted(chosen, key=lambda item: item[1].prob or 0.0)[:LEAST_SHOWN]
    if least:
        names = ", ".join(f"#{i} {_quoted(p.text)} {_percent(p.prob or 0.0)}" for i, p in least)
        summary += f". Least likely: {names}. /probs N shows the alternatives at token N."
    print_line(console, Text(summary, style="status"))


def render_alternatives(
    console: Console, probs: Sequence[TokenProb], position: int, context: int = 30
) -> None:
    """Token `position` (from 1) of the reply: where it is, how likely it was, and the
    likeliest tokens the model had there, the chosen one marked."""
    prob = probs[position - 1]
    before = "".join(p.text for p in probs[: position - 1])[-context:]
    where = f"Token {position} of {len(probs)}: {_quoted(prob.text)}, after {_quoted(before)}"
    if prob.forced:
        print_line(console, Text(f"{where}: the calculator's, forced in; no probability."))
        return
    if prob.logprob is None:
        print_line(console, Text(f"{where}: from before a /continue; nothing recorded."))
        return
    print_line(
        console, Text(f"{where}: {_percent(prob.prob or 0.0)} (logprob {prob.logprob:.3f}).")
    )
    rows = []
    for rank, (text, logprob) in enumerate(prob.top, start=1):
        chosen = "← chosen" if text == prob.text and abs(logprob - prob.logprob) < 1e-9 else ""
        rows.append(
            (str(rank), _quoted(text), _percent(math.exp(logprob)), f"{logprob:.3f}", chosen)
        )
    if rows:
        render_table(console, ("#", "token", "p", "logprob", ""), rows)
