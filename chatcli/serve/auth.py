"""Who may use a server: API keys.

Owns: reading the keys a server takes (`--api-key`, CHATCLI_API_KEY, `--api-key-file` with one
key a line), the check every request passes on its way in (ApiKeyCheck, ASGI middleware: the
header `Authorization: Bearer KEY` compared in constant time against every key), its 401 in
OpenAI's error shape, and the warning for a server open to the network without a key.

Open without a key: /health (load balancers and uptime monitors ask it) and the chat page's
HTML at / (it holds no data; it asks the person for the key and sends it on its own calls).
Everything else needs one: every /v1 route, /stats, an unknown path, and any route added to
the app later, whichever back end answers it. chatcli.serve.app puts the check in front of the
whole app, once.

Knows nothing of models, workers or the terminal.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from chatcli.errors import ConfigError
from chatcli.serve.guards import hosts_to_check
from chatcli.serve.requests import error_body

OPEN_PATHS = frozenset({"/", "/health"})
# What a key may hold: the visible ASCII characters, which every HTTP client sends unchanged
# in a header (a space would end the token; non-ASCII is encoded differently by each).
_KEY = re.compile(r"[\x21-\x7e]+")
KEY_FILE_COMMENT = "#"


def _check_key(key: str, where: str) -> str:
    if not _KEY.fullmatch(key):
        raise ConfigError(
            f"{where}: an API key is letters, digits and punctuation (visible ASCII, no "
            "spaces), as an Authorization header carries it. Pick another key."
        )
    return key


def read_key_file(path: Path) -> list[str]:
    """The keys in a file of one key a line; blank lines and lines starting with # are
    skipped. A missing, unreadable or keyless file is a ConfigError that names it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"--api-key-file {path}: no such file. Write one key a line into it."
        ) from None
    except IsADirectoryError:
        raise ConfigError(
            f"--api-key-file {path} is a folder; it takes a file of one key a line."
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--api-key-file {path} cannot be read ({e}).") from None
    keys = []
    for number, line in enumerate(text.splitlines(), start=1):
        key = line.strip()
        if key and not key.startswith(KEY_FILE_COMMENT):
            # The line, never the key: an error message may end up in a shared log.
            keys.append(_check_key(key, f"--api-key-file {path}, line {number}"))
    if not keys:
        raise ConfigError(
            f"--api-key-file {path} holds no key. Write one key a line (# starts a comment)."
        )
    return keys


def api_keys(given: Iterable[str] = (), key_file: Path | None = None) -> tuple[str, ...]:
    """Every key a server takes: those given (--api-key, or CHATCLI_API_KEY) and those in
    `key_file`, each once, in order. Empty: the server takes requests without a key."""
    keys: list[str] = []
    for key in given:
        if not key.strip():
            raise ConfigError(
                "--api-key (or CHATCLI_API_KEY) is empty. Give a key, or leave it out to "
                "serve without one."
            )
        keys.append(_check_key(key.strip(), "--api-key (or CHATCLI_API_KEY)"))
    if key_file is not None:
        keys += read_key_file(key_file)
    return tuple(dict.fromkeys(keys))


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
