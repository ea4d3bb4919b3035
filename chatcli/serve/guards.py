"""The guards a server on the user's own machine needs against the web pages the user visits,
and against bodies too big to read: pure HTTP, no model.

Owns: the Host names a server on a loopback address answers (HostCheck, against DNS
rebinding: a page whose own name is made to point at 127.0.0.1), reading a Content-Type's
media type (the API takes JSON only: text/plain and form posts are the ones any page may
send without the browser asking first), and reading a body no further than a limit, as JSON
(read_json: every JSON route's way in, with the 415, 413 or 400 that refuses it).
chatcli.serve.app puts them in front of the API.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
from collections.abc import Collection
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from chatcli.serve.requests import error_body

# The Host names a server on a loopback address answers to (any port).
LOOPBACK_HOSTNAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def hostname_of(host: str) -> str:
    """The name in a Host header, without its port: "localhost:8000" -> "localhost",
    "[::1]:8000" -> "::1" (starlette's TrustedHostMiddleware cuts at the first ':', which
    leaves "["). A malformed header comes back whole, so it matches no name."""
    host = host.strip().lower()
    if host.startswith("["):
        name, bracket, rest = host[1:].partition("]")
        return name if bracket and (not rest or rest.startswith(":")) else host
    return host.partition(":")[0] if host.count(":") == 1 else host


def hosts_to_check(bind_host: str) -> frozenset[str] | None:
    """The Host names a server listening on `bind_host` answers: on a loopback address only
    loopback names, or a web page could rebind its own name to 127.0.0.1 and read the
    replies; elsewhere (0.0.0.0, a LAN address) any (None), as the network names it."""
    try:
        loopback = bind_host == "localhost" or ipaddress.ip_address(bind_host).is_loopback
    except ValueError:
        loopback = False
    return LOOPBACK_HOSTNAMES | {bind_host.lower()} if loopback else None


class HostCheck:
    """ASGI middleware: a 400 for a request whose Host is not one of `allowed`."""

    def __init__(self, app: ASGIApp, allowed: Collection[str]) -> None:
        self.app = app
        self.allowed = frozenset(h.lower() for h in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if hostname_of(header) not in self.allowed:
                message = (
                    f"The Host header {header!r} is not a name of this machine: this server "
                    "listens on a loopback address and answers only localhost, 127.0.0.1 and "
                    "[::1] (a guard against DNS rebinding, by which a web page reaches local "
                    "servers). Use one of those names, or serve with --host 0.0.0.0 to take "
                    "requests for any name."
                )
                await JSONResponse(error_body(message), 400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def media_type(content_type: str) -> str:
    """A Content-Type without its parameters, lowercase: "application/json; charset=utf-8"
    -> "application/json"."""
    return content_type.partition(";")[0].strip().lower()


async def read_body(request: Request, limit: int) -> bytes | None:
    """The request's body, or None once it is over `limit` bytes: refused on its
    Content-Length, or read no further than the limit when it comes chunked without one."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    body = bytearray()
    async with contextlib.aclosing(request.stream()) as chunks:
        async for chunk in chunks:
            body += chunk
            if len(body) > limit:
                return None
    return bytes(body)


async def read_json(request: Request, limit: int) -> Any:
    """The request's body parsed as JSON, or the JSONResponse that refuses it: not sent as
    JSON (415), over `limit` bytes (413), or not valid JSON (400)."""
    # JSON only: text/plain and form posts are the ones any web page may send here
    # without the browser asking first, so taking them would let it run the model.
    sent_as = media_type(request.headers.get("content-type", ""))
    if sent_as != "application/json":
        message = (
            f"The body must be JSON, sent with Content-Type: application/json (got "
            f"{sent_as or 'no Content-Type'}). With curl, add "
            "-H 'Content-Type: application/json'."
        )
        return JSONResponse(error_body(message), status_code=415)
    raw = await read_body(request, limit)
    if raw is None:
        message = f"The body is over {limit} bytes, this server's limit. Send a shorter one."
        return JSONResponse(error_body(message), status_code=413)
    try:
        return json.loads(raw)
    except RecursionError:  # Python's JSON parser recurses once per nested [ or {
        return JSONResponse(error_body("The body's JSON is nested too deeply."), 400)
    except ValueError as e:  # bad JSON, bytes not UTF-8, or int() past its digit limit
        return JSONResponse(error_body(_not_json(e)), status_code=400)


def _not_json(error: ValueError) -> str:
    if isinstance(error, (json.JSONDecodeError, UnicodeDecodeError)):
        return "The body is not valid JSON."
    # int() refuses a number of more than 4300 digits (CVE-2020-10735): no field takes one.
    return "The body holds a number with thousands of digits; no field takes one."
