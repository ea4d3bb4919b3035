"""`chatcli serve`: an OpenAI-compatible HTTP API (and a chat page) over a back end.

Owns: the HTTP surface: POST /v1/chat/completions (streamed as server-sent events or whole),
GET (and HEAD) /v1/models, /health, /stats and the chat page at / (and, from modules of
their own, /metrics: metrics.py; /tokenize and /detokenize: tokenization.py); turning
conversations into prompt tokens and stream events into OpenAI chunks; the
guards a server on this machine needs against web pages the user visits (JSON bodies only, so
no form or text/plain post slips past the browser's preflight; on a loopback address, only
loopback Host names, against DNS rebinding); who may use it (API keys, chatcli.serve.auth's
check, put in front of the whole app). Listening and running it are chatcli.serve.runner's.
What a valid request is, and the error bodies that name a bad field, are
chatcli.serve.requests'.

The calculator runs here, inside the engine. A call reaches clients twice over: as an inline
marker in `content` (`[calc 1234*56 = 69104]`, see chatcli.chat.calc_markers) that any OpenAI client
shows as text, and in a non-standard `chatcli_tool` field of the same chunk's delta
(`{"expression": "1234*56", "output": "69104", "status": "ok"}`; output null when the tool gave
no answer, and status "failed" for a call refused or ended by the model, "cut" for one the
length limit or the context stopped, which the marker alone cannot tell apart). A delta
carrying `chatcli_tool` has exactly the marker as its content, so a client that draws a badge
from the field can skip that content. Assistant messages sent back are read for markers,
so a multi-turn conversation replays its calculator calls exactly.

Knows nothing of devices, generation threads or clusters: it asks a Backend (backend.py),
the WorkerPool of this process's replicas or a Ray Serve deployment's (ray_backend.py), and
nothing of the terminal.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import (
    BaseModel,
    ValidationError,
)
from starlette.exceptions import HTTPException

from chatcli.chat.calc_markers import format_marker, parts_from_text
from chatcli.chat.logprob_shapes import chat_logprobs
from chatcli.chat.stream import StreamEvent, TextDelta, ToolResult
from chatcli.chat.turns import SamplingOptions, random_seed
from chatcli.engine.logprobs import TokenLogprob
from chatcli.errors import TokenizerError
from chatcli.serve.auth import ApiKeyCheck
from chatcli.serve.backend import Backend
from chatcli.serve.completions import Completion, CompletionRequest, params_of, prompt_tokens
from chatcli.serve.guards import HostCheck, read_json
from chatcli.serve.metrics import add_metrics
from chatcli.serve.openapi import openapi_document
from chatcli.serve.replies import Finished, GenerationParams
from chatcli.serve.requests import (
    ChatMessage,
    ChatRequest,
    Limits,
    error_body,
    validation_error_response,
)
from chatcli.serve.response_format import response_grammar
from chatcli.serve.tokenization import add_tokenize_routes
from chatcli.serve.worker_pool import ShuttingDown, Waiting, Worker, WorkerPool

__all__ = ["Limits", "Worker", "WorkerPool", "create_app"]

log = logging.getLogger(__name__)
# The engine says "context" when the model's context, not max_tokens, cut the reply; OpenAI
# has one word for both.
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length"}
# A queued stream says it is alive this often, so proxies that cut idle connections do not.
WAITING_EVERY_S = 10.0
WAITING_COMMENT = ": waiting for a worker\n\n"  # an SSE comment: clients skip it
RETRY_AFTER_S = 5  # a full queue's hint; a reply takes seconds, the queue drains in tens


# ---- from requests to prompts, from events to chunks --------------------------------------------


def conversation_of(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as chatcli messages: assistant text becomes parts, markers replayed."""
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m.content or ""
        if m.role == "assistant":
            out.append({"role": "assistant", "content": parts_from_text(content)})
        else:
            out.append({"role": m.role, "content": content})
    return out


def deltas_of(events: Sequence[StreamEvent]) -> list[dict[str, Any]]:
    """Stream events as chunk deltas: neighbouring text merged, each calculator call its own
    delta (marker as content, plus the chatcli_tool field). The call's opening and expression
    events are not sent on their own: the finished call says it all."""
    deltas: list[dict[str, Any]] = []
    text = ""
    for event in events:
        if isinstance(event, TextDelta):
            text += event.text
        elif isinstance(event, ToolResult):
            if text:
                deltas.append({"content": text})
                text = ""
            deltas.append(
                {
                    "content": format_marker(event.expression, event.output),
                    "chatcli_tool": {
                        "expression": event.expression,
                        "output": event.output,
                        "status": event.status,  # "ok", "failed" or "cut": see the docstring
                    },
                }
            )
    if text:
        deltas.append({"content": text})
    return deltas


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


@dataclass(frozen=True)
class _Turn:
    """One accepted request, ready for a worker."""

    id: str
    created: int
    model: str
    prompt: list[int]
    params: GenerationParams

    def chunk(
        self,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        usage: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        out = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }
        if usage is not None:
            out["usage"] = usage
        return out


def usage_of(finished: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
        # OpenAI's field: the prompt's tokens served from the worker's cache, not prefilled.
        "prompt_tokens_details": {"cached_tokens": finished.cached_tokens},
        # chatcli's own: the server's decode time, from the first token to the last, from
        # which a client tells its wait for the first token from the decode's speed.
        "chatcli_decode_s": round(finished.decode_s, 6),
    }


# ---- the app ------------------------------------------------------------------------------------


_DEFAULTS = SamplingOptions()  # what a request leaves unset: the chat's own defaults


def _page() -> str:
    return (resources.files("chatcli.serve") / "web" / "index.html").read_text(encoding="utf-8")


def _prompt_of(tokenizer: Any, messages: Sequence[ChatMessage]) -> list[int]:
    """A conversation's prompt tokens. Tens of milliseconds for a long one: run it in a
    thread, so open streams go on meanwhile."""
    return tokenizer.render_for_completion(conversation_of(messages))


def create_app(
    workers: Sequence[Worker] | Backend,
    limits: Limits = Limits(),
    model_name: str = "chatcli",
    *,
    allowed_hosts: Collection[str] | None = None,
    waiting_every: float = WAITING_EVERY_S,
    api_keys: Sequence[str] = (),
    demo: bool = False,
) -> FastAPI:
    """The HTTP app over `workers` (all replicas of one model) or any other Backend.

    allowed_hosts: the Host names (any port) it answers, others get a 400; None for any.
    serve() fills it from --host (hosts_to_check). waiting_every: seconds between the
    keep-alive comments of a stream queued for a worker. api_keys: with any, every request
    but /health and the page's HTML needs one of them (chatcli.serve.auth). demo: the model
    is chatcli's embedded demo, as its model entry says (`chatcli_demo`), so the chat page
    says what it can do.
    """
    pool: Backend = WorkerPool(workers) if isinstance(workers, Sequence) else workers
    started = int(time.time())
    # No /docs, /redoc or /openapi.json: public pages the API does not need, and /docs pulls
    # its scripts from a CDN.
    app = FastAPI(title="chatcli", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    # Not served, but built on request for clients and the schema fuzzer (serve/openapi.py).
    app.openapi = lambda: openapi_document(app, limits, keys=bool(api_keys))  # type: ignore[method-assign]
    app.state.pool = pool
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=allowed_hosts)
    if api_keys:  # in front of the whole app: routes added to it later are covered too
        app.add_middleware(ApiKeyCheck, keys=api_keys)
    _add_error_handlers(app)
    _add_info_routes(app, pool, model_name, started, demo)
    pool = add_metrics(app, pool, model_name)  # every generation below is counted
    add_tokenize_routes(app, pool, limits, _prompt_of)
    _add_completions_route(app, pool, limits, model_name, waiting_every)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _read_request(request, limits)
        if isinstance(req, JSONResponse):
            return req
        try:
            prompt = await asyncio.to_thread(_prompt_of, pool.tokenizer, req.messages)
        except TokenizerError as e:
            return JSONResponse(error_body(str(e), "messages"), status_code=400)
        room = pool.context_len - len(prompt)
        if room < 1:
            message = (
                f"The conversation is {len(prompt)} tokens; the model's context is "
                f"{pool.context_len}. Send fewer or shorter messages."
            )
            return JSONResponse(
                error_body(message, "messages", code="context_length_exceeded"), status_code=400
            )
        turn = _turn_of(req, prompt, room, model_name)
        refused = _refusal(pool, limits)
        if refused is not None:
            return refused
        if req.stream:
            return StreamingResponse(
                _stream(pool, turn, waiting_every),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _complete(pool, turn, request)

    return app


def _get(app: FastAPI, path: str, **kwargs: Any) -> Callable[..., Any]:
    """app.get that answers HEAD too, as Starlette's own routes do (FastAPI's GET does not):
    uptime monitors ask with HEAD. uvicorn sends the headers and leaves out the body."""
    return app.api_route(path, methods=["GET", "HEAD"], **kwargs)


def _add_error_handlers(app: FastAPI) -> None:
    """Errors in OpenAI's shape: a request's fields (400), an unknown path or method."""

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc.errors())

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # An unknown path or method, in OpenAI's error shape rather than FastAPI's {"detail"}.
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return JSONResponse(error_body(message), exc.status_code, headers=exc.headers)


def _add_info_routes(
    app: FastAPI, pool: Backend, model_name: str, started: int, demo: bool
) -> None:
    """The chat page, /health, /stats and the model list: what needs no generation."""

    @_get(app, "/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(_page())

    @_get(app, "/health")
    async def health() -> dict[str, Any]:
        state = pool.describe()
        return {
            "status": "ok",
            "model": model_name,
            "workers": len(state["workers"]),
            "idle": state["idle"],
        }

    @_get(app, "/stats")
    async def stats() -> dict[str, Any]:
        return {"model": model_name, "uptime_s": int(time.time()) - started, **pool.describe()}

    model_entry = {
        "id": model_name,
        "object": "model",
        "created": started,
        "owned_by": "chatcli",
        "context_length": pool.context_len,
    }
    if demo:
        model_entry["chatcli_demo"] = True

    @_get(app, "/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_entry]}

    @_get(app, "/v1/models/{model_id:path}", response_model=None)
    async def model(model_id: str) -> dict[str, Any] | JSONResponse:
        if model_id == model_name:
            return model_entry
        message = f"The model {model_id!r} does not exist here; this server serves {model_name!r}."
        return JSONResponse(error_body(message, "model", code="model_not_found"), 404)


async def _read_request(
    request: Request, limits: Limits, schema: type[BaseModel] = ChatRequest
) -> Any:
    """The request's body as a `schema` (a ChatRequest), or the error response that refuses
    it (a field's error raises RequestValidationError, for the app's 400 handler)."""
    # The body is validated here rather than by a typed parameter so the limits can be
    # handed to the validators as context; errors go through the same 400 handler.
    body = await read_json(request, limits.max_body_bytes)
    if isinstance(body, JSONResponse):
        return body
    try:
        return schema.model_validate(body, context={"limits": limits})
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def _turn_of(req: ChatRequest, prompt: list[int], room: int, model_name: str) -> _Turn:
    """The generation a request asks for, its unset options the chat's defaults, its token
    budget within the `room` left in the context."""
    defaults = _DEFAULTS
    wanted = req.max_tokens or req.max_completion_tokens or defaults.max_tokens
    temperature = defaults.temperature if req.temperature is None else req.temperature
    top_k = defaults.top_k if req.top_k is None else req.top_k
    return _Turn(
        id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
        created=int(time.time()),
        model=model_name,
        prompt=prompt,
        params=GenerationParams(
            max_tokens=min(wanted, room),
            temperature=temperature,
            top_k=top_k or None,
            top_p=req.top_p if req.top_p is not None and req.top_p < 1 else None,
            seed=req.seed if req.seed is not None else random_seed(),
            stop=tuple(req.stop or ()),
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            grammar=response_grammar(req.response_format),
        ),
    )


def _refusal(pool: Backend, limits: Limits) -> JSONResponse | None:
    """A 503 while the server shuts down, a 429 past the queue's limit, else None."""
    if pool.closed:
        return _shutting_down()
    if pool.queue_full(limits.max_queue):
        message = (
            f"{pool.waiting} requests are already waiting for a worker, this server's "
            "limit. Try again in a few seconds."
        )
        return JSONResponse(
            error_body(message, type_="server_error", code="queue_full"),
            status_code=429,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    return None


def _shutting_down_body() -> dict[str, Any]:
    return error_body(str(ShuttingDown()), type_="server_error", code="server_shutting_down")


def _shutting_down() -> JSONResponse:
    return JSONResponse(_shutting_down_body(), status_code=503)


def _with_logprobs(
    pool: Backend, turn: _Turn, chunks: list[dict[str, Any]], events: Sequence[Any]
) -> list[dict[str, Any]]:
    """The chunks of one batch of events, the first carrying the batch's tokens'
    logprobs where the request asked (a chunk of its own where the text is held back)."""
    if turn.params.logprobs is None:
        return chunks
    content = chat_logprobs(pool.tokenizer, (e for e in events if isinstance(e, TokenLogprob)))
    if not content:
        return chunks
    if not chunks:
        chunks = [turn.chunk({"content": ""})]
    chunks[0]["choices"][0]["logprobs"] = {"content": content}
    return chunks


async def _stream(pool: Backend, turn: _Turn, waiting_every: float) -> AsyncIterator[str]:
    """The SSE body. When the client disconnects, Starlette cancels this generator at its
    current await; leaving `pool.generate` then stops the generation and frees the worker."""
    yield sse(turn.chunk({"role": "assistant", "content": ""}))
    try:
        async for item in pool.generate(turn.prompt, turn.params, waiting_every):
            if isinstance(item, Waiting):
                yield WAITING_COMMENT
            elif isinstance(item, Finished):
                reason = FINISH_REASONS.get(item.finish_reason, item.finish_reason)
                yield sse(turn.chunk({}, finish_reason=reason, usage=usage_of(item)))
            else:
                chunks = [turn.chunk(delta) for delta in deltas_of(item)]
                for chunk in _with_logprobs(pool, turn, chunks, item):
                    yield sse(chunk)
    except ShuttingDown:  # the headers are gone: report in-band, as OpenAI servers do
        yield sse(_shutting_down_body())
    except Exception as e:
        log.exception("generation failed")
        yield sse(error_body(f"Generation failed: {e}", type_="server_error"))
    yield sse("[DONE]")


async def _collected(
    pool: Backend, prompt: list[int], params: GenerationParams, request: Request
) -> tuple[list[StreamEvent], Finished] | Response:
    """A whole reply's events and its Finished, or the response that ends it instead (the
    client left meanwhile, which stops it; the server shuts down; the generation failed)."""

    async def collect() -> tuple[list[StreamEvent], Finished]:
        events: list[StreamEvent] = []
        async for item in pool.generate(prompt, params):
            if isinstance(item, Finished):
                return events, item
            assert not isinstance(item, Waiting)  # only sent when asked for
            events += item
        raise AssertionError("a generation always ends with Finished")

    task = asyncio.ensure_future(collect())
    while not task.done():
        await asyncio.wait({task}, timeout=0.25)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            return Response(status_code=499)
    try:
        return task.result()
    except ShuttingDown:
        return _shutting_down()
    except Exception as e:
        log.exception("generation failed")
        return JSONResponse(
            error_body(f"Generation failed: {e}", type_="server_error"), status_code=500
        )


async def _complete(pool: Backend, turn: _Turn, request: Request) -> Response:
    """A whole reply as one chat.completion; a client that leaves meanwhile stops it."""
    collected = await _collected(pool, turn.prompt, turn.params, request)
    if isinstance(collected, Response):
        return collected
    events, finished = collected
    deltas = deltas_of(events)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(d["content"] for d in deltas),
    }
    tools = [d["chatcli_tool"] for d in deltas if "chatcli_tool" in d]
    if tools:
        message["chatcli_tools"] = tools
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": FINISH_REASONS.get(finished.finish_reason, finished.finish_reason),
    }
    if turn.params.logprobs is not None:
        entries = (e for e in events if isinstance(e, TokenLogprob))
        choice["logprobs"] = {"content": chat_logprobs(pool.tokenizer, entries)}
    return JSONResponse(
        {
            "id": turn.id,
            "object": "chat.completion",
            "created": turn.created,
            "model": turn.model,
            "choices": [choice],
            "usage": usage_of(finished),
        }
    )


# ---- /v1/completions: raw text in, text out -------------------------------------------------------


def _add_completions_route(
    app: FastAPI, pool: Backend, limits: Limits, model_name: str, waiting_every: float
) -> None:
    """POST /v1/completions (completions.py: the request, the prompt, the answer's shape),
    behind the same guards, queue and error bodies as chat completions."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _read_request(request, limits, CompletionRequest)
        if isinstance(req, JSONResponse):
            return req
        prompt = await asyncio.to_thread(prompt_tokens, pool.tokenizer, req.prompt)
        room = pool.context_len - len(prompt)
        if room < 1:
            message = (
                f"The prompt is {len(prompt)} tokens; the model's context is "
                f"{pool.context_len}. Send a shorter prompt."
            )
            return JSONResponse(
                error_body(message, "prompt", code="context_length_exceeded"), status_code=400
            )
        completion = Completion(model_name, prompt, params_of(req, room), pool.tokenizer)
        refused = _refusal(pool, limits)
        if refused is not None:
            return refused
        if req.stream:
            return StreamingResponse(
                _stream_completion(pool, completion, waiting_every),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _complete_text(pool, completion, request)


async def _stream_completion(
    pool: Backend, completion: Completion, waiting_every: float
) -> AsyncIterator[str]:
    """A completion's SSE body: a chunk a batch of events, the last with the finish reason
    and usage, then [DONE]; a failure after the headers is reported in-band, as for chat."""
    try:
        async for item in pool.generate(completion.prompt, completion.params, waiting_every):
            if isinstance(item, Waiting):
                yield WAITING_COMMENT
            elif isinstance(item, Finished):
                reason = FINISH_REASONS.get(item.finish_reason, item.finish_reason)
                yield sse(completion.chunk([], reason, usage_of(item)))
            else:
                yield sse(completion.chunk(item))
    except ShuttingDown:
        yield sse(_shutting_down_body())
    except Exception as e:
        log.exception("generation failed")
        yield sse(error_body(f"Generation failed: {e}", type_="server_error"))
    yield sse("[DONE]")


async def _complete_text(pool: Backend, completion: Completion, request: Request) -> Response:
    """A whole completion as one text_completion; a client that leaves meanwhile stops it."""
    collected = await _collected(pool, completion.prompt, completion.params, request)
    if isinstance(collected, Response):
        return collected
    events, finished = collected
    reason = FINISH_REASONS.get(finished.finish_reason, finished.finish_reason)
    return JSONResponse(completion.chunk(list(events), reason, usage_of(finished)))
