"""The server's OpenAPI document: every route, what it takes and every answer it gives.

Owns `openapi_document`: FastAPI's document of the app's routes, completed with what FastAPI
cannot see. The chat, /tokenize and /detokenize routes read their bodies themselves (so the
limits reach the validators), so their request bodies are written here from the same `Limits`; every answer's shape is written here too,
the OpenAI error body of each refusal included (the guards' 400, the API key's 401, an unknown
path's 404 and 405); GET and HEAD of one route get operation ids of their own. Schemathesis
fuzzes the server from this document (tests/test_fuzz_api.py), so a route or an answer it
leaves out is one the fuzzer never tries.

The app serves no /openapi.json or /docs (chatcli.serve.app says why): the document exists for
tests and for whoever builds a client from `create_app(...).openapi()`.

Knows nothing of models, workers or the terminal.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from chatcli.engine.logprobs import MAX_TOP_LOGPROBS
from chatcli.serve.auth import OPEN_PATHS
from chatcli.serve.requests import MAX_SEED, Limits

ERROR_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "minLength": 1},
                "type": {"type": "string", "enum": ["invalid_request_error", "server_error"]},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_COUNT = {"type": "integer", "minimum": 0}
_HEALTH = {
    "type": "object",
    "required": ["status", "model", "workers", "idle"],
    "properties": {
        "status": {"const": "ok"},
        "model": {"type": "string"},
        "workers": _COUNT,
        "idle": _COUNT,
    },
}
_STATS = {
    "type": "object",
    "required": ["model", "uptime_s", "workers", "busy", "idle", "queue_length"],
    "properties": {
        "model": {"type": "string"},
        "uptime_s": _COUNT,
        "workers": {"type": "array", "items": {"type": "object"}},
        "busy": _COUNT,
        "idle": _COUNT,
        "queue_length": _COUNT,
    },
}
_MODEL = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by", "context_length"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "model"},
        "created": _COUNT,
        "owned_by": {"type": "string"},
        "context_length": {"type": "integer", "minimum": 1},
        "chatcli_demo": {"type": "boolean"},
    },
}
_MODELS = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _MODEL}},
}
_TOOL = {
    "type": "object",
    "required": ["expression", "output", "status"],
    "properties": {
        "expression": {"type": "string"},
        "output": {"type": ["string", "null"]},
        "status": {"enum": ["ok", "failed", "cut"]},
    },
}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 1},
        "completion_tokens": _COUNT,
        "total_tokens": {"type": "integer", "minimum": 1},
        "prompt_tokens_details": {
            "type": "object",
            "required": ["cached_tokens"],
            "properties": {"cached_tokens": _COUNT},
        },
        "chatcli_decode_s": {"type": "number", "minimum": 0},
    },
}
_BYTES = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}
_ALTERNATIVE = {
    "type": "object",
    "required": ["token", "bytes", "logprob"],
    "properties": {"token": {"type": "string"}, "bytes": _BYTES, "logprob": {"type": "number"}},
}
# choices[].logprobs where the request asked: a token the calculator forced has no logprob.
_LOGPROBS = {
    "type": "object",
    "required": ["content"],
    "properties": {
        "content": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["token", "bytes", "logprob", "top_logprobs"],
                "properties": {
                    "token": {"type": "string"},
                    "bytes": _BYTES,
                    "logprob": {"type": ["number", "null"], "maximum": 0},
                    "top_logprobs": {
                        "type": "array",
                        "maxItems": MAX_TOP_LOGPROBS,
                        "items": _ALTERNATIVE,
                    },
                    "chatcli_forced": {"const": True},
                },
            },
        }
    },
}
_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": {"type": "string", "pattern": "^chatcmpl-"},
        "object": {"const": "chat.completion"},
        "created": _COUNT,
        "model": {"type": "string"},
        "choices": {
            "type": "array",
            "minItems": 1,
            "maxItems": 1,
            "items": {
                "type": "object",
                "required": ["index", "message", "finish_reason"],
                "properties": {
                    "index": {"const": 0},
                    "message": {
                        "type": "object",
                        "required": ["role", "content"],
                        "properties": {
                            "role": {"const": "assistant"},
                            "content": {"type": "string"},
                            "chatcli_tools": {"type": "array", "items": _TOOL},
                        },
                    },
                    "finish_reason": {"enum": ["stop", "length"]},
                    "logprobs": _LOGPROBS,
                },
            },
        },
        "usage": _USAGE,
    },
}
_LEGACY_LOGPROBS = {
    "type": "object",
    "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
    "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": {"type": ["number", "null"], "maximum": 0}},
        "top_logprobs": {
            "type": "array",
            "items": {"type": ["object", "null"], "additionalProperties": {"type": "number"}},
        },
        "text_offset": {"type": "array", "items": _COUNT},
    },
}
_TEXT_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": {"type": "string", "pattern": "^cmpl-"},
        "object": {"const": "text_completion"},
        "created": _COUNT,
        "model": {"type": "string"},
        "choices": {
            "type": "array",
            "minItems": 1,
            "maxItems": 1,
            "items": {
                "type": "object",
                "required": ["text", "index", "logprobs", "finish_reason"],
                "properties": {
                    "text": {"type": "string"},
                    "index": {"const": 0},
                    "logprobs": {"anyOf": [_LEGACY_LOGPROBS, {"type": "null"}]},
                    "finish_reason": {"enum": ["stop", "length"]},
                },
            },
        },
        "usage": _USAGE,
    },
}
# Each server-sent event: `data: {chunk}` (a chat.completion.chunk, or an error body when the
# generation fails after the headers), the last `data: [DONE]`; keep-alive comments between.
_EVENT_STREAM = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "minLength": 1}},
}


_TOKENIZED = {
    "type": "object",
    "required": ["count", "max_model_len", "tokens", "token_strs"],
    "properties": {
        "count": _COUNT,
        "max_model_len": {"type": "integer", "minimum": 1},
        "tokens": {"type": "array", "items": _COUNT},
        "token_strs": {"type": ["array", "null"], "items": {"type": "string"}},
    },
}
_DETOKENIZED = {
    "type": "object",
    "required": ["prompt"],
    "properties": {"prompt": {"type": "string"}},
}


def request_schema(limits: Limits) -> dict[str, Any]:
    """The chat completions body as `ChatRequest` validates it under `limits`: no stricter
    than the validators (a body this refuses, the server refuses too), and as strict as JSON
    Schema can say. What it cannot say (turns that alternate, the total length) is the
    validators' alone."""
    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"enum": ["system", "developer", "user", "assistant"]},
            "content": {
                "anyOf": [
                    {"type": "string", "maxLength": limits.max_message_chars},
                    {"type": "array", "items": text_part},
                ]
            },
        },
    }
    stop = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars}
    nothing = {"enum": [0, None]}  # asked of OpenAI's API, served here only as "none"
    return {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "messages": {
                "type": "array",
                "minItems": 1,
                "maxItems": limits.max_messages,
                "items": message,
            },
            "model": {"type": ["string", "null"]},
            "stream": {"type": ["boolean", "null"]},
            "temperature": {
                "type": ["number", "null"],
                "minimum": limits.min_temperature,
                "maximum": limits.max_temperature,
            },
            "top_k": {"type": ["integer", "null"], "minimum": 0, "maximum": limits.max_top_k},
            "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
            "max_tokens": {
                "type": ["integer", "null"],
                "minimum": 1,
                "maximum": limits.max_max_tokens,
            },
            "max_completion_tokens": {
                "type": ["integer", "null"],
                "minimum": 1,
                "maximum": limits.max_max_tokens,
            },
            "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_SEED},
            "n": {"enum": [1, None]},
            "stop": {
                "anyOf": [
                    stop,
                    {"type": "array", "maxItems": limits.max_stops, "items": stop},
                    {"type": "null"},
                ]
            },
            "tools": {"type": ["array", "null"], "maxItems": 0},
            "tool_choice": {"enum": ["none", "auto", None]},
            "logprobs": {"type": ["boolean", "null"]},
            "top_logprobs": {
                "type": ["integer", "null"],
                "minimum": 0,
                "maximum": MAX_TOP_LOGPROBS,
            },
            "response_format": response_format_schema(),
            "frequency_penalty": nothing,
            "presence_penalty": nothing,
        },
    }


def completion_request_schema(limits: Limits) -> dict[str, Any]:
    """The /v1/completions body as `CompletionRequest` validates it (serve/completions.py):
    the sampling fields as chat's; one prompt string, or a list of one."""
    chat = request_schema(limits)["properties"]
    prompt = {"type": "string", "maxLength": limits.max_total_chars}
    shared = ("model", "stream", "temperature", "top_k", "top_p", "max_tokens", "seed", "n")
    return {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "prompt": {
                "anyOf": [prompt, {"type": "array", "minItems": 1, "maxItems": 1, "items": prompt}]
            },
            **{name: chat[name] for name in shared},
            "stop": chat["stop"],
            "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
            "echo": {"enum": [False, None]},
            "best_of": {"enum": [1, None]},
            "suffix": {"enum": ["", None]},
            "frequency_penalty": chat["frequency_penalty"],
            "presence_penalty": chat["presence_penalty"],
        },
    }


def token_request_schema(path: str, limits: Limits) -> dict[str, Any] | None:
    """The body of POST /tokenize or /detokenize (chatcli.serve.tokenization), else None. Looser
    than the validators where JSON Schema cannot follow them (prompt or messages, exactly
    one; an id below the tokenizer's size, which the document does not know)."""
    nullable_bool = {"type": ["boolean", "null"]}
    if path == "/tokenize":
        chat = request_schema(limits)["properties"]
        return {
            "type": "object",
            "properties": {
                "model": chat["model"],
                "prompt": {"type": ["string", "null"], "maxLength": limits.max_total_chars},
                "messages": {**chat["messages"], "type": ["array", "null"]},
                "add_special_tokens": nullable_bool,
                "add_generation_prompt": {"type": "boolean"},
                "return_token_strs": nullable_bool,
            },
        }
    if path == "/detokenize":
        return {
            "type": "object",
            "required": ["tokens"],
            "properties": {
                "model": {"type": ["string", "null"]},
                "tokens": {"type": "array", "items": _COUNT},
            },
        }
    return None


def response_format_schema() -> dict[str, Any]:
    """`response_format` as serve/response_format.py reads it: free text, any JSON object, or
    a named JSON Schema (the grammar library refuses some schemas' keywords with a 400)."""
    kind = {"type": "object", "required": ["type"]}
    json_schema = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
            "description": {"type": ["string", "null"]},
            "schema": {"type": ["object", "null"]},
            "strict": {"type": ["boolean", "null"]},
        },
    }
    return {
        "anyOf": [
            {**kind, "properties": {"type": {"const": "text"}}},
            {**kind, "properties": {"type": {"const": "json_object"}}},
            {
                "type": "object",
                "required": ["type", "json_schema"],
                "properties": {"type": {"const": "json_schema"}, "json_schema": json_schema},
            },
            {"type": "null"},
        ]
    }


def _json(schema: dict[str, Any], what: str) -> dict[str, Any]:
    return {"description": what, "content": {"application/json": {"schema": schema}}}


_ERROR = ERROR_BODY
# What every route may answer before it runs: a Host not this machine's (400, on a loopback
# address), no key or a wrong one (401), a method the path does not take (405).
_GUARDS = {
    "400": _json(_ERROR, "The Host header is not a name of this machine"),
    "401": _json(_ERROR, "No API key, or not one of the server's"),
    "405": _json(_ERROR, "A method this path does not take"),
}
_ANSWERS: dict[tuple[str, str], dict[str, Any]] = {
    ("/", "get"): {
        "200": {"description": "The chat page", "content": {"text/html": {"schema": {}}}}
    },
    ("/health", "get"): {"200": _json(_HEALTH, "The server is up")},
    ("/stats", "get"): {"200": _json(_STATS, "The workers and their counts")},
    ("/v1/models", "get"): {"200": _json(_MODELS, "The one model served")},
    ("/v1/models/{model_id}", "get"): {
        "200": _json(_MODEL, "The model"),
        "404": _json(_ERROR, "No model of that id here"),
    },
    ("/tokenize", "post"): {
        "200": _json(_TOKENIZED, "The tokens"),
        "400": _json(_ERROR, "A field is wrong"),
        "413": _json(_ERROR, "The body is over the server's limit"),
        "415": _json(_ERROR, "The body is not sent as JSON"),
    },
    ("/detokenize", "post"): {
        "200": _json(_DETOKENIZED, "The text"),
        "400": _json(_ERROR, "A field is wrong, or an id is not one of the tokenizer's"),
        "413": _json(_ERROR, "The body is over the server's limit"),
        "415": _json(_ERROR, "The body is not sent as JSON"),
    },
    ("/metrics", "get"): {
        "200": {
            "description": "Prometheus' text format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
        "501": _json(_ERROR, "prometheus_client is not installed"),
    },
    ("/v1/chat/completions", "post"): {
        "200": {
            "description": "The reply, whole or streamed as server-sent events",
            "content": {
                "application/json": {"schema": _COMPLETION},
                "text/event-stream": {"schema": _EVENT_STREAM},
            },
        },
        "400": _json(_ERROR, "A field is wrong, or the conversation does not fit the context"),
        "413": _json(_ERROR, "The body is over the server's limit"),
        "415": _json(_ERROR, "The body is not sent as JSON"),
        "429": _json(_ERROR, "Too many requests are waiting; try again after Retry-After"),
        "500": _json(_ERROR, "The generation failed"),
        "503": _json(_ERROR, "The server is shutting down"),
    },
    ("/v1/completions", "post"): {
        "200": {
            "description": "The continuation, whole or streamed as server-sent events",
            "content": {
                "application/json": {"schema": _TEXT_COMPLETION},
                "text/event-stream": {"schema": _EVENT_STREAM},
            },
        },
        "400": _json(_ERROR, "A field is wrong, or the prompt does not fit the context"),
        "413": _json(_ERROR, "The body is over the server's limit"),
        "415": _json(_ERROR, "The body is not sent as JSON"),
        "429": _json(_ERROR, "Too many requests are waiting; try again after Retry-After"),
        "500": _json(_ERROR, "The generation failed"),
        "503": _json(_ERROR, "The server is shutting down"),
    },
}


def openapi_document(app: FastAPI, limits: Limits, keys: bool) -> dict[str, Any]:
    """The app's OpenAPI document; `keys`: the server takes API keys, so every operation but
    /health and the page's needs `Authorization: Bearer KEY`."""
    with warnings.catch_warnings():  # GET and HEAD share an id here; each gets its own below
        warnings.simplefilter("ignore", UserWarning)
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    if keys:
        schemes = doc.setdefault("components", {}).setdefault("securitySchemes", {})
        schemes["apiKey"] = {"type": "http", "scheme": "bearer"}
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            operation["operationId"] = re.sub(r"\W+", "_", f"{method}{path}").strip("_")
            answers = _ANSWERS.get((path, "get" if method == "head" else method), {})
            operation["responses"] = {**_GUARDS, **answers}
            if method == "head":  # uvicorn sends a GET's headers and no body
                operation["responses"] = {
                    code: {"description": answer["description"]}
                    for code, answer in operation["responses"].items()
                }
            if keys and path not in OPEN_PATHS:
                operation["security"] = [{"apiKey": []}]
            token_body = token_request_schema(path, limits) if method == "post" else None
            if token_body is not None:
                operation["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": token_body}},
                }
            if (path, method) == ("/v1/chat/completions", "post"):
                operation["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": request_schema(limits)}},
                }
            if (path, method) == ("/v1/completions", "post"):
                operation["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": completion_request_schema(limits)}},
                }
    return doc
