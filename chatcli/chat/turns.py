"""What a chat turn is made of, independent of where it runs (local engine or a server).

Owns: the sampling options of a session (chatcli's sampling defaults and seed range), a reply (its message parts, tokens and masks) and a
turn's statistics. Pure Python: the REPL, `chatcli once` and the HTTP client use these without
importing torch.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatcli.engine.logprobs import TokenLogprob

Message = dict[str, Any]
_ESCAPED_BYTES = re.compile("[\udc80-\udcff]+")
_SURROGATE = re.compile("[\ud800-\udfff]")


def readable_text(text: str) -> str:
    """`text` as UTF-8 can hold it. Python keeps bytes that were not UTF-8 (in argv, a pipe
    in the C locale, a file) as lone surrogates, which the tokenizer and the conversation
    file cannot encode: a turn would fail halfway, its reply saved without its question.
    Escaped bytes are read again as UTF-8 (a character split across escapes comes back
    whole), and what still is not a character becomes U+FFFD, as a terminal shows it."""
    if text.isascii():
        return text
    text = _ESCAPED_BYTES.sub(
        lambda m: bytes(ord(c) - 0xDC00 for c in m[0]).decode("utf-8", "replace"), text
    )
    return _SURROGATE.sub("\ufffd", text)


CONTEXT_WARN_FRACTION = 0.8  # warn when a prompt takes more of the context than this


# A turn without a fixed seed draws one below this; a fixed seed's retries wrap at it.
SEED_RANGE = 2**31


def random_seed() -> int:
    """A fresh seed, for a turn or request that has no fixed one."""
    return random.randrange(SEED_RANGE)


@dataclass
class SamplingOptions:
    """How a session samples its replies; the defaults are chatcli's (Settings reads them)."""

    temperature: float = 0.6
    top_k: int | None = 50  # None: off
    top_p: float | None = None  # None: off
    max_tokens: int = 512
    seed: int | None = None  # None: a fresh random seed each turn (shown in the stats)
    tools: bool = True
    # The JSON Schema every reply follows (structured output; {"type": "object"}: any JSON
    # object); None: free text. Such a reply does not call the calculator.
    json_schema: dict[str, Any] | None = None

    def turn_seed(self) -> int:
        """The seed a turn samples with: the fixed one, else a fresh random one."""
        return self.seed if self.seed is not None else random_seed()


@dataclass
class TurnStats:
    ttft_s: float = 0.0
    prefill_tokens: int = 0  # tokens actually prefilled (after cache reuse)
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    tokens_in: int = 0  # the prompt, as the model saw it
    tokens_out: int = 0
    context_used: int = 0
    context_len: int = 0
    finish_reason: str = "stop"
    seed: int = 0
    # Drafting (--speculate auto; engine/speculation.py): verify forwards, drafts they
    # checked and drafts taken; zeros where the reply did not draft.
    verifications: int = 0
    drafted: int = 0
    accepted: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Reply:
    parts: list[dict[str, str]]
    tokens: list[int]
    masks: list[int]
    stats: TurnStats
    # Each token's log-probability and likeliest alternatives, as generated (None for the
    # tokens of a reply a /continue went on from, and for a reply whose were not recorded).
    logprobs: list[TokenLogprob | None] | None = None

    @property
    def text(self) -> str:
        return "".join(p["text"] for p in self.parts if p["type"] == "text")

    @property
    def message(self) -> Message:
        return {"role": "assistant", "content": self.parts}


def turn_stats(
    gen: Any, tokens_in: int, tokens_out: int, finish: str, seed: int, context_len: int
) -> TurnStats:
    """A reply's statistics from its generation's (the engine's GenerationStats): a prompt
    of `tokens_in`, `tokens_out` of its own."""
    return TurnStats(
        ttft_s=gen.first_token_s,
        prefill_tokens=gen.prefill_tokens,
        prefill_tps=gen.prefill_tps,
        decode_tps=gen.decode_tps,
        tokens_in=tokens_in,
        tokens_out=tokens_out,
        context_used=tokens_in + tokens_out,
        context_len=context_len,
        finish_reason=finish,
        seed=seed,
        verifications=gen.speculation.verifications,
        drafted=gen.speculation.drafted,
        accepted=gen.speculation.accepted,
    )


@dataclass
class TurnNotice:
    """Something the user should hear about before the reply (context warnings, drops)."""

    text: str


def split_system(messages: list[Message]) -> tuple[str | None, list[Message]]:
    """(the system prompt or None, the other messages): how sessions hold a conversation."""
    system, rest = None, []
    for m in messages:
        if m["role"] == "system":
            system = m["content"] or None
        else:
            rest.append(m)
    return system, rest
