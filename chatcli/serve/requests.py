"""The chat completions request as `chatcli serve` takes it: its limits, its validation
(pydantic: types checked strictly, a client's mistake never guessed at, what is not served
refused rather than ignored), the messages as nanochat's turns (`developer` read as
`system`, neighbouring messages of one role joined) and the OpenAI-style error bodies that
name the field at fault.

Knows nothing of workers, models or streaming: server.py turns a valid request into a
generation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)

from chatcli.engine.logprobs import MAX_TOP_LOGPROBS

MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (nanochat's chat_web limits by default), and how many may
    wait: they keep one client from taking all the memory or a worker for minutes."""

    max_messages: int = 500
    max_message_chars: int = 8000
    max_total_chars: int = 32000
    min_temperature: float = 0.0
    max_temperature: float = 2.0
    max_top_k: int = 200  # top_k 0 means off
    max_max_tokens: int = 4096
    max_stops: int = 4  # OpenAI's limit
    max_stop_chars: int = 200
    # 32000 characters escaped as JSON take at most 12 bytes each ("\ud83d\ude00" is one
    # emoji): 384 KB, plus the messages' framing. A larger body is refused unread.
    max_body_bytes: int = 1024 * 1024
    # Requests waiting for a worker: more get a 429 (the client retries) rather than a
    # wait with no end.
    max_queue: int = 64


# ---- requests -----------------------------------------------------------------------------------


def _limits(info: ValidationInfo) -> Limits:
    context = info.context or {}
    return context.get("limits") or Limits()


class ContentPart(BaseModel):
    type: str
    text: str

    @field_validator("type")
    @classmethod
    def _type(cls, value: str) -> str:
        if value != "text":
            raise ValueError(f"only text parts are supported, not {value!r}")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # "developer" is OpenAI's newer name for the system message (o1 and later clients send it).
    role: Literal["system", "developer", "user", "assistant"]
    # validate_default: a missing content reaches the validator as None, so missing and null
    # get the same error. "" is a message (OpenAI takes it; a reply can be empty and come back).
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        return "system" if value == "developer" else value

    @field_validator("content")
    @classmethod
    def _content(cls, value: str | list[ContentPart] | None, info: ValidationInfo) -> str:
        if value is None:
            raise ValueError(
                'is missing or null; send the message\'s text as a string ("" for none) or a '
                "list of text parts"
            )
        # OpenAI allows a list of content parts; only text ones mean anything here.
        text = "".join(p.text for p in value) if isinstance(value, list) else value
        limit = _limits(info).max_message_chars
        if len(text) > limit:
            raise ValueError(f"the message is {len(text)} characters; the limit is {limit}")
        return text


class ChatRequest(BaseModel):
    """The OpenAI chat completions request, as far as chatcli reads it; unknown fields (user,
    metadata, ...) are ignored, as OpenAI-compatible servers commonly do."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    messages: list[ChatMessage]
    model: str | None = None
    stream: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    # Asked of OpenAI's API but not served here: refused rather than silently ignored, so a
    # client that relies on them learns it at once.
    tools: list[Any] | None = None
    tool_choice: Any = None
    # Each token's log-probability and top_logprobs alternatives (0 to 20) in the reply.
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    frequency_penalty: float | None = None  # 0 (OpenAI's default) asks for nothing
    presence_penalty: float | None = None

    @field_validator("stream", "logprobs", mode="before")
    @classmethod
    def _a_bool(cls, value: Any) -> bool:
        # pydantic's lax bool would take "yes", "false" and 1 (the string "false" as False, but
        # "yes" as True): guessing a client's intent there hides its bug. null is the default.
        if value is None:
            return False
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, not {_json_kind(value)}")
        return value

    @field_validator(
        "temperature",
        "top_k",
        "top_p",
        "max_tokens",
        "max_completion_tokens",
        "seed",
        "n",
        "top_logprobs",
        "frequency_penalty",
        "presence_penalty",
        mode="before",
    )
    @classmethod
    def _a_number(cls, value: Any) -> Any:
        # pydantic's lax mode reads "0.5" as 0.5 and true as 1; only JSON numbers are numbers.
        # (2.0 stays an acceptable int: JSON has one number type.)
        if isinstance(value, bool | str):
            raise ValueError(f"must be a number, not {_json_kind(value)}")
        return value

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[ChatMessage], info: ValidationInfo) -> list[ChatMessage]:
        limits = _limits(info)
        if not value:
            raise ValueError("at least one message is required")
        if len(value) > limits.max_messages:
            raise ValueError(f"{len(value)} messages; the limit is {limits.max_messages}")
        total = sum(len(m.content or "") for m in value)
        if total > limits.max_total_chars:
            raise ValueError(
                f"the conversation is {total} characters; the limit is {limits.max_total_chars}"
            )
        value = _merged(value)
        # nanochat knows one optional system message, then strict user/assistant turns.
        turns = value[1:] if value[0].role == "system" else value
        for i, m in enumerate(turns):
            expected = "user" if i % 2 == 0 else "assistant"
            if m.role != expected:
                raise ValueError(
                    "expected an optional system message, then user and assistant messages "
                    f"taking turns, starting and ending with user; got {m.role!r} where "
                    f"{expected!r} belongs"
                )
        if not turns or turns[-1].role != "user":
            raise ValueError("the last message must be from the user")
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float | None, info: ValidationInfo) -> float | None:
        lo, hi = _limits(info).min_temperature, _limits(info).max_temperature
        if value is not None and not lo <= value <= hi:
            raise ValueError(f"must be between {lo:g} and {hi:g}")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None, info: ValidationInfo) -> int | None:
        hi = _limits(info).max_top_k
        if value is not None and not 0 <= value <= hi:
            raise ValueError(f"must be between 0 (off) and {hi}")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float | None) -> float | None:
        if value is not None and not 0 < value <= 1:
            raise ValueError("must be in (0, 1]")
        return value

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        hi = _limits(info).max_max_tokens
        if value is not None and not 1 <= value <= hi:
            raise ValueError(f"must be between 1 and {hi}")
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_SEED:
            raise ValueError(f"must be between 0 and {MAX_SEED}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None, info: ValidationInfo) -> tuple[str, ...]:
        limits = _limits(info)
        stops = (value,) if isinstance(value, str) else tuple(value or ())
        if len(stops) > limits.max_stops:
            raise ValueError(f"{len(stops)} stop sequences; the limit is {limits.max_stops}")
        for stop in stops:
            if not stop:
                raise ValueError("a stop sequence must not be empty")
            if len(stop) > limits.max_stop_chars:
                raise ValueError(
                    f"a stop sequence is {len(stop)} characters; the limit is "
                    f"{limits.max_stop_chars}"
                )
        return stops

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError(
                "function tools are not supported: the model's one tool is its calculator, "
                "which the server runs itself (each call is in the reply's chatcli_tool)"
            )
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value not in (None, "none", "auto"):
            raise ValueError('function tools are not supported: leave it out, "none" or "auto"')
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        return top_logprobs_checked(value, bool(info.data.get("logprobs")))

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError(
                "repetition penalties are not supported: leave it out or 0 (temperature, "
                "top_k and top_p shape the sampling here)"
            )
        return value

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        from chatcli.errors import SchemaError
        from chatcli.serve.response_format import response_grammar

        try:
            response_grammar(value)  # built once: app.py's _turn_of gets it from the cache
        except SchemaError as e:
            raise ValueError(str(e)) from None
        return value

    @field_validator("n")
    @classmethod
    def _n(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("only n=1 is supported")
        return value


def top_logprobs_checked(value: int | None, asked: bool) -> int | None:
    """top_logprobs within 0..20, and only beside logprobs: true (OpenAI's rule)."""
    if value is None:
        return None
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ValueError(f"must be between 0 and {MAX_TOP_LOGPROBS}")
    if not asked:
        raise ValueError("needs logprobs: true beside it (or leave top_logprobs out)")
    return value


def _merged(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Neighbouring messages of one role as one (their texts a blank line apart): OpenAI
    takes two user messages in a row, or a system and a developer message, and clients
    send them; nanochat's turns alternate."""
    out: list[ChatMessage] = []
    for m in messages:
        if out and out[-1].role == m.role:
            out[-1] = ChatMessage.model_construct(
                role=m.role, content=f"{out[-1].content}\n\n{m.content}"
            )
        else:
            out.append(m)
    return out


def _json_kind(value: Any) -> str:
    """How a JSON value reads in an error: `"yes"` (a string), true, a list."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"a string ({json.dumps(value[:20])})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a number ({value})" if isinstance(value, int | float) else type(value).__name__


def param_of(loc: Sequence[str | int]) -> str | None:
    """A pydantic error location as OpenAI names a field: ("body", "messages", 2, "content")
    -> "messages[2].content"."""
    name = ""
    for part in loc:
        if part == "body" and not name:
            continue
        if isinstance(part, int):
            name += f"[{part}]"
        else:
            # Union members show up in the location ("str", "list[ContentPart]"): not fields.
            if "[" in part or part in ("str", "int", "float", "bool", "none"):
                continue
            name += f".{part}" if name else part
    return name or None


def error_body(
    message: str, param: str | None = None, type_: str = "invalid_request_error", code: Any = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_error_response(errors: Sequence[Any]) -> JSONResponse:
    first = _most_telling(errors)
    param = param_of(first.get("loc", ()))
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    text = f"Invalid '{param}': {message}" if param else f"Invalid request: {message}"
    return JSONResponse(error_body(text, param), status_code=400)


def _most_telling(errors: Sequence[Any]) -> Any:
    """The error to report: the first, unless errors deeper inside the same field say more.
    A field of several types is tried as each: a list of content parts fails first as a
    string ("Input should be a valid string") and then, more to the point, at its part."""
    if not errors:
        return {}
    field = param_of(errors[0].get("loc", ())) or ""
    same = [e for e in errors if (param_of(e.get("loc", ())) or "").startswith(field)]
    return max(same, key=lambda e: len(param_of(e.get("loc", ())) or ""))
