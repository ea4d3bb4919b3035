"""Log-probabilities as clients read them: OpenAI's shapes, from the engine's entries.

Owns: turning TokenLogprob entries (engine/logprobs.py) into the chat completions shape
(`{"content": [{token, bytes, logprob, top_logprobs}]}`, which `chatcli once --logprobs
--json` prints too) and the legacy completions shape (`{tokens, token_logprobs,
top_logprobs, text_offset}`). A token's text is its bytes decoded on their own, a part of
a multi-byte character as U+FFFD; `bytes` holds its exact bytes. A calculator-forced token
has `logprob` null, no alternatives and `chatcli_forced: true`. The token that ends the
reply (<|assistant_end|>, <|bos|>) is not listed, as OpenAI lists no end token.

Knows nothing of HTTP, torch or the terminal.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from chatcli.chat.calc_markers import format_marker
from chatcli.chat.stream import StreamEvent, TextDelta, TokenDecoder, ToolResult
from chatcli.engine.logprobs import TokenLogprob
from chatcli.model.special_tokens import ASSISTANT_END


class TokenBytes(Protocol):
    def decode_bytes(self, ids: list[int]) -> bytes: ...

    def encode_special(self, name: str) -> int: ...

    def get_bos_token_id(self) -> int: ...


def listed(tokenizer: TokenBytes, entries: Iterable[TokenLogprob]) -> list[TokenLogprob]:
    """The entries a client sees: all but the reply's end token."""
    ends = {tokenizer.encode_special(ASSISTANT_END), tokenizer.get_bos_token_id()}
    return [e for e in entries if e.token not in ends]


def _alternative(tokenizer: TokenBytes, token: int, logprob: float) -> dict[str, Any]:
    raw = tokenizer.decode_bytes([token])
    return {"token": raw.decode("utf-8", errors="replace"), "bytes": list(raw), "logprob": logprob}


def chat_entry(tokenizer: TokenBytes, entry: TokenLogprob) -> dict[str, Any]:
    """One token in the chat completions shape."""
    out = _alternative(tokenizer, entry.token, entry.logprob)  # type: ignore[arg-type]
    out["top_logprobs"] = [_alternative(tokenizer, t, v) for t, v in entry.top]
    if entry.forced:
        out["chatcli_forced"] = True
    return out


def chat_logprobs(tokenizer: TokenBytes, entries: Iterable[TokenLogprob]) -> list[dict[str, Any]]:
    """choices[].logprobs.content of a chat completion (or of one chunk's tokens)."""
    return [chat_entry(tokenizer, e) for e in listed(tokenizer, entries)]


class LegacyLogprobs:
    """A completion's `logprobs` in the legacy shape, a chunk of tokens at a time (a whole
    reply is one chunk). text_offset: where each token's text starts in the completion's
    text, across a stream's chunks. The text is what the reply's decoder makes of the
    tokens, so the offsets follow the same decoder: a special token out of place adds no
    text, and a calculator call's tokens all start at its `[calc ...]` marker."""

    def __init__(self, tokenizer: TokenBytes) -> None:
        self.tokenizer = tokenizer
        self._decoder = TokenDecoder(tokenizer)
        self._at = 0

    def _offset(self, entry: TokenLogprob) -> int:
        """Where the entry's token's text starts; moves past the text it adds. A token that
        closes a call adds the call's marker and starts where the marker does; one whose
        text follows a failed call's marker starts after it."""
        before, start = self._at, None
        for event in self._decoder.feed(entry.token, 0 if entry.forced else 1):
            if isinstance(event, TextDelta) and start is None:
                start = self._at
            self._at += len(event_text(event))
        return before if start is None else start

    def chunk(self, entries: Iterable[TokenLogprob]) -> dict[str, Any]:
        tokenizer = self.tokenizer
        tokens, values, tops, offsets = [], [], [], []
        for e in listed(tokenizer, entries):
            raw = tokenizer.decode_bytes([e.token])
            tokens.append(raw.decode("utf-8", errors="replace"))
            values.append(e.logprob)
            # OpenAI's legacy shape always holds the sampled token beside the alternatives
            # (up to logprobs + 1 entries), as tokens drawn off the top need it.
            sampled = [] if any(t == e.token for t, _ in e.top) else [(e.token, e.logprob)]
            top: dict[str, float] = {}
            for t, v in [*e.top, *sampled]:  # tokens of the same text keep the likelier's
                top.setdefault(tokenizer.decode_bytes([t]).decode("utf-8", errors="replace"), v)
            tops.append(None if e.forced else top)
            offsets.append(self._offset(e))
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def event_text(event: StreamEvent) -> str:
    """The text an event adds to a completion's: the model's text, a calculator call as its
    marker, nothing for the rest."""
    if isinstance(event, TextDelta):
        return event.text
    if isinstance(event, ToolResult):
        return format_marker(event.expression, event.output)
    return ""
