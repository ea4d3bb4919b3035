"""POST /tokenize and POST /detokenize, in vLLM's request and response shapes.

Owns: the two requests (a prompt's text, or a conversation's messages rendered as the chat
route renders them, special tokens included; a list of token ids back to text) and their
validation, with the 400 in OpenAI's error shape naming the field (a token id the tokenizer
does not have among them), and the two routes. The API key guards them as every route
(chatcli.serve.auth sits in front of the whole app).

Knows nothing of generation: it is handed the back end only for its tokenizer and context,
and the chat route's rendering of messages (so a conversation counts here exactly the
tokens its completion request would prefill).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from chatcli.errors import TokenizerError
from chatcli.model.special_tokens import ASSISTANT_START
from chatcli.serve.backend import Backend
from chatcli.serve.guards import read_json
from chatcli.serve.requests import ChatMessage, ChatRequest, Limits, error_body

RenderChat = Callable[[Any, Sequence[ChatMessage]], list[int]]


class TokenizeRequest(BaseModel):
    """vLLM's two tokenize requests in one: `prompt` (text; `add_special_tokens`, true by
    default, puts <|bos|> first) or `messages` (a conversation, rendered with the chat
    template, <|bos|> always first; `add_generation_prompt`, true by default, ends it with
    <|assistant_start|> as a completion request's prompt ends)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None  # checked as the chat route checks them
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool | None = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str | None, info: ValidationInfo) -> str | None:
        limit = _limits(info).max_total_chars
        if value is not None and len(value) > limit:
            raise ValueError(f"the prompt is {len(value)} characters; the limit is {limit}")
        return value

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(
                "send either prompt (a text) or messages (a conversation), exactly one of them"
            )
        if self.messages is not None and self.add_special_tokens:
            raise ValueError(
                "add_special_tokens is for a prompt; messages always get the chat template's "
                "special tokens (leave it out)"
            )
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt] = Field(...)

    @field_validator("tokens")
    @classmethod
    def _tokens(cls, value: list[int], info: ValidationInfo) -> list[int]:
        vocab = (info.context or {})["vocab_size"]
        for i, token in enumerate(value):
            if not 0 <= token < vocab:
                raise ValueError(
                    f"tokens[{i}] is {token}, not a token of this model's tokenizer: ids are "
                    f"0 to {vocab - 1}"
                )
        return value


def _limits(info: ValidationInfo) -> Limits:
    return (info.context or {}).get("limits") or Limits()


def add_tokenize_routes(
    app: FastAPI, backend: Backend, limits: Limits, render_chat: RenderChat
) -> None:
    """POST /tokenize and /detokenize. `render_chat(tokenizer, messages)`: the chat route's
    prompt for a conversation (ending in <|assistant_start|>)."""

    @app.post("/tokenize", response_model=None)
    async def tokenize(request: Request) -> dict[str, Any] | JSONResponse:
        body = await read_json(request, limits.max_body_bytes)
        if isinstance(body, JSONResponse):
            return body
        req = _validated(TokenizeRequest, body, {"limits": limits})
        tokenizer = backend.tokenizer
        if req.messages is not None:
            chat = _validated(ChatRequest, {"messages": req.messages}, {"limits": limits})
            try:
                ids = await asyncio.to_thread(render_chat, tokenizer, chat.messages)
            except TokenizerError as e:
                return JSONResponse(error_body(str(e), "messages"), status_code=400)
            if not req.add_generation_prompt:
                assert ids[-1] == tokenizer.encode_special(ASSISTANT_START)
                ids = ids[:-1]
        else:
            assert req.prompt is not None
            bos = tokenizer.get_bos_token_id() if req.add_special_tokens is not False else None
            ids = await asyncio.to_thread(tokenizer.encode, req.prompt, bos)
        return {
            "count": len(ids),
            "max_model_len": backend.context_len,
            "tokens": ids,
            # Each token alone: a piece of a character that spans tokens reads as U+FFFD.
            "token_strs": [tokenizer.decode([t]) for t in ids] if req.return_token_strs else None,
        }

    @app.post("/detokenize", response_model=None)
    async def detokenize(request: Request) -> dict[str, Any] | JSONResponse:
        body = await read_json(request, limits.max_body_bytes)
        if isinstance(body, JSONResponse):
            return body
        tokenizer = backend.tokenizer
        req = _validated(DetokenizeRequest, body, {"vocab_size": tokenizer.get_vocab_size()})
        try:
            text = tokenizer.decode(req.tokens)
        except KeyError:  # an id inside the range that the vocabulary skips
            message = "The tokens hold an id this model's tokenizer does not have."
            return JSONResponse(error_body(message, "tokens"), status_code=400)
        return {"prompt": text}


def _validated(model: type[Any], body: Any, context: dict[str, Any]) -> Any:
    """`body` as `model`, or RequestValidationError for the app's 400 handler."""
    try:
        return model.model_validate(body, context=context)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
