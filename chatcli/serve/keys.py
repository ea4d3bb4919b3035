"""What an API key is, and where a server's keys come from.

Owns the rule a key must meet (printable ASCII, spaces inside allowed: what every HTTP client
sends unchanged in an Authorization header), reading the keys a server takes from
`--api-key`, CHATCLI_API_KEY (one key, whole: a pass phrase of four words is one key, never
four) and `--api-key-file` (one key a line), and the warning for a key file that others on
the machine may read. Checking requests against the keys is chatcli.serve.auth's.

Knows nothing of HTTP frameworks, models or the terminal: it returns warnings, never prints.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

from chatcli.errors import ConfigError
from chatcli.model.data_files import UnreadableFileError, read_small_file

ENV_API_KEY = "CHATCLI_API_KEY"
# Printable ASCII, not starting or ending in a space: a header's value is trimmed by every
# server, and non-ASCII is encoded differently by each client. Spaces inside are kept.
_KEY = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")
KEY_FILE_COMMENT = "#"
# A key file holds a few keys, or a team's hundreds: a megabyte is far beyond either.
KEY_FILE_MAX_BYTES = 1 << 20
# Group or others may read (or write) it: ssh refuses a private key so; a server warns.
_OPEN_TO_OTHERS = stat.S_IRWXG | stat.S_IRWXO


def check_key(key: str, where: str) -> str:
    """`key` without the spaces around it, or ConfigError (naming `where`, never the key:
    a message may end up in a shared log) when it is blank or no header can carry it."""
    key = key.strip()
    if not key:
        raise ConfigError(f"{where} is blank. Give a key, or leave it out to serve without one.")
    if not _KEY.fullmatch(key):
        raise ConfigError(
            f"{where}: an API key is letters, digits, punctuation and spaces (printable "
            "ASCII: no tabs, line breaks or accented letters), as an Authorization header "
            "carries it. Pick another key."
        )
    return key


def env_key(env: Mapping[str, str] | None = None) -> str | None:
    """The one key CHATCLI_API_KEY holds, whole; None when it is unset. Set but blank is a
    ConfigError: `export CHATCLI_API_KEY=$(cat lost-file)` must not open a server."""
    value = (os.environ if env is None else env).get(ENV_API_KEY)
    if value is None:
        return None
    return check_key(value, f"{ENV_API_KEY} (one key, spaces inside kept)")


def read_key_file(path: Path) -> list[str]:
    """The keys in a file of one key a line (spaces inside a line are part of its key);
    blank lines and lines starting with # are skipped. A missing, unreadable, keyless or
    oversized file, or one that is no regular file (a FIFO, /dev/zero), is a ConfigError
    that names it."""
    try:
        data = read_small_file(path, KEY_FILE_MAX_BYTES)
    except UnreadableFileError as e:
        if e.missing:
            raise ConfigError(
                f"--api-key-file {path}: no such file. Write one key a line into it."
            ) from None
        raise ConfigError(
            f"--api-key-file {e.path} {e.why}; it takes a file of one key a line."
        ) from None
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark, as Notepad writes, is no key
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"--api-key-file {path} cannot be read (not UTF-8 text, byte {e.start}). Write "
            "one key a line into it."
        ) from None
    keys = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip() and not line.strip().startswith(KEY_FILE_COMMENT):
            keys.append(check_key(line, f"--api-key-file {path}, line {number}"))
    if not keys:
        raise ConfigError(
            f"--api-key-file {path} holds no key. Write one key a line (# starts a comment)."
        )
    return keys


def key_file_warning(path: Path) -> str | None:
    """The warning for a key file that group or others may read or change, as ssh gives for
    a private key, or None. Only a warning: a shared box may mean it."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None  # read_key_file says what is wrong with it
    if not mode & _OPEN_TO_OTHERS:
        return None
    return (
        f"Warning: --api-key-file {path} has permissions {stat.S_IMODE(mode):04o}: other "
        f"users of this machine can read (or change) its keys. Run chmod 600 {path}."
    )


def api_keys(given: Iterable[str] = (), key_file: Path | None = None) -> tuple[str, ...]:
    """Every key a server takes: those given (--api-key, or CHATCLI_API_KEY) and those in
    `key_file`, each once, in order. Empty: the server takes requests without a key."""
    keys = [check_key(key, "--api-key (or CHATCLI_API_KEY)") for key in given]
    if key_file is not None:
        keys += read_key_file(key_file)
    return tuple(dict.fromkeys(keys))
