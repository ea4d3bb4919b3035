"""A reply's tokens with their probabilities, as text, for /probs.

Owns: TokenProb (one token of a reply: its text, how likely the model found it and its
likeliest alternatives) and `token_probs`, which reads them off a Reply's recorded
logprobs (engine/logprobs.py: the model's own distribution at temperature 1, whatever the
sampling settings). A character split across tokens shows with the token that completes
it; an alternative's text is its own bytes (U+FFFD for part of a character).

Knows nothing of the terminal or torch.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatcli.engine.logprobs import TokenLogprob


@dataclass(frozen=True)
class TokenProb:
    """One token of a reply. logprob None: forced by the calculator (`forced`), or not
    recorded (the part of a reply a /continue went on from)."""

    text: str
    logprob: float | None
    forced: bool = False
    top: tuple[tuple[str, float], ...] = ()  # (text, logprob), likeliest first

    @property
    def prob(self) -> float | None:
        return None if self.logprob is None else math.exp(self.logprob)


def token_probs(
    tokenizer: Any, tokens: Sequence[int], entries: Sequence[TokenLogprob | None]
) -> list[TokenProb]:
    """The reply `tokens` with their recorded entries (one a token, None where none was
    recorded) as TokenProbs."""
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = []
    for token, entry in zip(tokens, entries, strict=True):
        text = utf8.decode(tokenizer.decode_bytes([token]))
        if entry is None:
            out.append(TokenProb(text, None))
            continue
        top = tuple((_text_of(tokenizer, t), v) for t, v in entry.top)
        out.append(TokenProb(text, entry.logprob, entry.forced, top))
    tail = utf8.decode(b"", final=True)  # a character the reply left unfinished: U+FFFD
    if tail and out:
        out[-1] = replace(out[-1], text=out[-1].text + tail)
    return out


def _text_of(tokenizer: Any, token: int) -> str:
    return tokenizer.decode_bytes([token]).decode("utf-8", errors="replace")


def perplexity(probs: Sequence[TokenProb]) -> float | None:
    """exp of the mean negative logprob over the tokens the model chose (None: none)."""
    chosen = [p.logprob for p in probs if p.logprob is not None]
    return math.exp(-sum(chosen) / len(chosen)) if chosen else None
