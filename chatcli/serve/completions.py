"""Raw completions: OpenAI's legacy /v1/completions request and answer, text in and text out.

Owns: CompletionRequest (the body as chatcli takes it: one prompt string, no chat template;
what is not served refused with a 400 naming the field), the prompt's tokens (<|bos|> and
the text encoded as ordinary text: a "<|user_start|>" typed into it stays text), and the
`text_completion` object and chunks, with the legacy `logprobs` (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`). It is the way to run a base checkpoint,
which has no chat template. The route itself, its guards and its stream are app.py's, as
for chat completions.

Knows nothing of workers, models or the terminal.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from chatcli.chat.logprob_shapes import LegacyLogprobs, event_text
from chatcli.chat.turns import SamplingOptions, random_seed
from chatcli.engine.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from chatcli.serve.replies import GenerationParams, ReplyEvent
from chatcli.serve.requests import ChatRequest, Limits

# OpenAI's default for the legacy endpoint: a completion is short unless asked otherwise.
DEFAULT_MAX_TOKENS = 16


def _limits(info: ValidationInfo) -> Limits:
    return (info.context or {}).get("limits") or Limits()


class CompletionRequest(BaseModel):
    """The legacy completions request, as far as chatcli reads it; unknown fields (user,
    suffix-less clients' extras) are ignored, as for chat completions."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    # Checked below: a string, or a list of one; missing is an error too.
    prompt: Any = Field(default=None, validate_default=True)
    model: str | None = None
    stream: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    # An integer here: the alternatives listed beside each token (0 to 20).
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    logit_bias: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    # The checks chat completions makes of the fields both take, word for word.
    _a_bool = field_validator("stream", "echo", mode="before")(ChatRequest._a_bool.__func__)  # type: ignore[attr-defined]
    _a_number = field_validator(
        "temperature", "top_k", "top_p", "max_tokens", "seed", "n", "logprobs", "best_of",
        "frequency_penalty", "presence_penalty", mode="before",
    )(ChatRequest._a_number.__func__)  # type: ignore[attr-defined]  # fmt: skip
    _temperature = field_validator("temperature")(ChatRequest._temperature.__func__)  # type: ignore[attr-defined]
    _top_k = field_validator("top_k")(ChatRequest._top_k.__func__)  # type: ignore[attr-defined]
    _top_p = field_validator("top_p")(ChatRequest._top_p.__func__)  # type: ignore[attr-defined]
    _max_tokens = field_validator("max_tokens")(ChatRequest._max_tokens.__func__)  # type: ignore[attr-defined]
    _seed = field_validator("seed")(ChatRequest._seed.__func__)  # type: ignore[attr-defined]
    _stop = field_validator("stop")(ChatRequest._stop.__func__)  # type: ignore[attr-defined]
    _n = field_validator("n", "best_of")(ChatRequest._n.__func__)  # type: ignore[attr-defined]
    _penalty = field_validator("frequency_penalty", "presence_penalty")(
        ChatRequest._penalty.__func__  # type: ignore[attr-defined]
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any, info: ValidationInfo) -> str:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
            value = value[0]
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            raise ValueError(f"{len(value)} prompts; send one prompt a request")
        if isinstance(value, list) and value and not isinstance(value[0], str):
            raise ValueError("token-id prompts are not taken; send the prompt's text")
        if not isinstance(value, str):
            raise ValueError("must be the prompt's text, a string")
        limit = _limits(info).max_total_chars
        if len(value) > limit:
            raise ValueError(f"the prompt is {len(value)} characters; the limit is {limit}")
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise ValueError(f"must be between 0 and {MAX_TOP_LOGPROBS} (alternatives a token)")
        return value

    @field_validator("echo")
    @classmethod
    def _echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported: the prompt is yours already; leave it out")
        return value

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (insertion) is not supported: leave it out")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            raise ValueError("logit_bias is not supported: leave it out")
        return value


def prompt_tokens(tokenizer: Any, text: str) -> list[int]:
    """<|bos|> and the text as ordinary text: no chat template, no special token from text."""
    return tokenizer.encode(text, prepend=tokenizer.get_bos_token_id())


def params_of(req: CompletionRequest, room: int) -> GenerationParams:
    """The generation a request asks for: chat's defaults for the sampling it leaves unset,
    OpenAI's 16 tokens for max_tokens, within the `room` the context leaves."""
    defaults = SamplingOptions()
    temperature = defaults.temperature if req.temperature is None else req.temperature
    top_k = defaults.top_k if req.top_k is None else req.top_k
    return GenerationParams(
        max_tokens=min(req.max_tokens or DEFAULT_MAX_TOKENS, room),
        temperature=temperature,
        top_k=top_k or None,
        top_p=req.top_p if req.top_p is not None and req.top_p < 1 else None,
        seed=req.seed if req.seed is not None else random_seed(),
        stop=tuple(req.stop or ()),
        logprobs=req.logprobs,
    )


def text_of(events: list[ReplyEvent]) -> str:
    """The completion's text: the model's text, a calculator call as its marker's text."""
    return "".join(event_text(e) for e in events if not isinstance(e, TokenLogprob))


@dataclass
class Completion:
    """One accepted completion request: its id, and its chunks and whole object as they are
    made (the logprobs' text offsets run on across a stream's chunks)."""

    model: str
    prompt: list[int]
    params: GenerationParams
    tokenizer: Any
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self._logprobs = LegacyLogprobs(self.tokenizer)

    def _choice(self, events: list[ReplyEvent], finish_reason: str | None) -> dict[str, Any]:
        logprobs = None
        if self.params.logprobs is not None:
            entries = [e for e in events if isinstance(e, TokenLogprob)]
            logprobs = self._logprobs.chunk(entries)
        return {
            "text": text_of(events),
            "index": 0,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    def chunk(
        self,
        events: list[ReplyEvent],
        finish_reason: str | None = None,
        usage: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A streamed `text_completion` chunk of these events' text (and logprobs)."""
        out = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._choice(events, finish_reason)],
        }
        if usage is not None:
            out["usage"] = usage
        return out
