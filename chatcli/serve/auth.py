"""Who may use a server: API keys.

Owns: the check every request passes on its way in (ApiKeyCheck, ASGI middleware: the
header `Authorization: Bearer KEY` compared in constant time against every key), its 401 in
OpenAI's error shape, and the warning for a server open to the network without a key.

Open without a key: /health (load balancers and uptime monitors ask it) and the chat page's
HTML at / (it holds no data; it asks the person for the key and sends it on its own calls).
Everything else needs one: every /v1 route, /stats, an unknown path, and any route added to
the app later, whichever back end answers it. chatcli.serve.app puts the check in front of the
whole app, once.

Where the keys come from, and what a key may be, is chatcli.serve.keys'. Knows nothing of
models, workers or the terminal.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from chatcli.serve.guards import hosts_to_check
from chatcli.serve.requests import error_body

OPEN_PATHS = frozenset({"/", "/health"})


def _digest(key: bytes) -> bytes:
    # Compared as digests, every comparison is of 32 bytes: no key's length shows in its time.
    return hashlib.sha256(key).digest()


def key_matches(given: bytes, digests: Sequence[bytes]) -> bool:
    """Whether `given` is one of the keys whose digests these are. Every key is compared,
    each in constant time, whichever matches: the time says nothing of which or how much."""
    mine = _digest(given)
    found = False
    for digest in digests:
        found |= hmac.compare_digest(mine, digest)
    return found


def bearer_token(header: bytes) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` header (the scheme in any case), or
    None when the header is another scheme or empty."""
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    token = token.strip()
    return token or None


MISSING = "This server needs an API key, sent as the header Authorization: Bearer KEY."
NOT_BEARER = "The Authorization header must be Bearer KEY, with this server's API key."
WRONG = "The API key sent is not one this server takes."


class ApiKeyCheck:
    """ASGI middleware: a 401 in OpenAI's error shape for a request without one of `keys`,
    but for the OPEN_PATHS."""

    def __init__(self, app: ASGIApp, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("ApiKeyCheck needs at least one key")
        self.app = app
        self._digests = tuple(_digest(k.encode("ascii")) for k in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _path(scope) not in OPEN_PATHS:
            header = dict(scope["headers"]).get(b"authorization")
            token = None if header is None else bearer_token(header)
            if token is None or not key_matches(token, self._digests):
                message = MISSING if header is None else NOT_BEARER if token is None else WRONG
                body = error_body(message, code="invalid_api_key")
                # WWW-Authenticate: HTTP's way to say which scheme a 401 wants.
                response = JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _path(scope: Scope) -> str:
    """The path within the app: a mount point (root_path) in front of it left out."""
    path, root = scope.get("path", "/"), scope.get("root_path", "")
    return (path[len(root) :] or "/") if root and path.startswith(root) else path


def open_server_warning(host: str, port: int, keys: Sequence[str]) -> str | None:
    """The warning for a server that listens beyond this machine without a key, or None."""
    if keys or hosts_to_check(host) is not None:  # a key, or a loopback address
        return None
    return (
        f"Warning: listening on {host}:{port} without an API key: anyone who can reach this "
        "port can run the model (on this machine's CPU or GPU, as often as they like) and "
        "use the chat page. Pass --api-key KEY (or --api-key-file) to let in only those with "
        "a key."
    )
