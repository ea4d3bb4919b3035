"""Reading the files people hand chatcli, each way a file can fail said once, in words.

Owns: opening a file for reading and saying what stands in the way (a folder where a file
belongs, a symbolic link that leads back to itself or to nothing, no permission), listing a
folder likewise, and parsing JSON and TOML so that every failure, nesting deeper than the
parser can follow included, is one ValueError saying what is wrong. The checkpoint loader,
the settings and the conversation files all read through here; they add the file's role and
the fix ("Meta file X is a folder, not a file. Copy ...").

Knows nothing about what the files mean.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

from chatcli.errors import ChatcliError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

# Python's JSON and TOML parsers recurse once per nested [ or {: past the interpreter's
# recursion limit (about 1000) they raise RecursionError, which is not a ValueError.
TOO_DEEP = "nested too deeply to read: more brackets inside brackets than any real file has"


class UnreadableFileError(ChatcliError):
    """A file or folder that cannot be opened; `why` completes "<path> ...", `missing` says
    nothing is there at all (not even a broken link)."""

    def __init__(self, path: Path, why: str, missing: bool = False) -> None:
        super().__init__(f"{path} {why}")
        self.path = path
        self.why = why
        self.missing = missing


def why_unreadable(path: Path, error: OSError) -> str:
    """What an OSError from opening or listing `path` means, completing "<path> ...": a
    folder, a link loop, no permission, not there."""
    code = error.errno
    if isinstance(error, IsADirectoryError) or code == errno.EISDIR:
        return "is a folder, not a file"
    if isinstance(error, NotADirectoryError) or code == errno.ENOTDIR:
        return "is a file, not a folder (or a part of its path is)"
    if code == errno.ELOOP:
        return "is a symbolic link that leads back to itself (a loop of links)"
    if isinstance(error, PermissionError) or code in (errno.EACCES, errno.EPERM):
        return "cannot be read: permission denied (see its owner and mode with ls -l)"
    if isinstance(error, FileNotFoundError) or code == errno.ENOENT:
        if path.is_symlink():
            return f"is not there (a link to {os.readlink(path)})"
        return "does not exist"
    if code == errno.ENAMETOOLONG:
        return "has a name too long for this system"
    return f"cannot be read ({error.strerror or error})"


def described(error: OSError) -> str:
    """ "<path> <why>" for an OSError from anywhere a path was stat'ed, opened or listed (a
    folder on the way without permission makes even Path.exists() raise)."""
    if error.filename is None:
        return f"A file cannot be read ({error.strerror or error})"
    path = Path(os.fsdecode(error.filename))
    try:
        return f"{path} {why_unreadable(path, error)}"
    except OSError:  # asking whether it is a link failed too
        return f"{path} cannot be read ({error.strerror or error})"


def read_bytes(path: Path, max_bytes: int | None = None) -> bytes:
    """The whole file, or UnreadableFileError saying why not. max_bytes refuses a file far
    bigger than its kind ever is (a meta file of gigabytes), before reading it."""
    try:
        with open(path, "rb") as f:
            if max_bytes is not None:
                size = os.fstat(f.fileno()).st_size
                if size > max_bytes:
                    raise UnreadableFileError(
                        path, f"is {size:,} bytes, far more than a file of its kind holds"
                    )
            return f.read()
    except OSError as e:
        missing = isinstance(e, FileNotFoundError) and not path.is_symlink()
        raise UnreadableFileError(path, why_unreadable(path, e), missing) from None


def read_small_file(path: Path, max_bytes: int) -> bytes:
    """A small file a person names (a config or key file), whole (/dev/null: empty);
    UnreadableFileError for anything else but a regular file of at most `max_bytes`. Never
    waits, never reads past the cap: a FIFO would block open() until someone writes to it,
    and /dev/zero never ends."""
    try:
        # O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        missing = isinstance(e, FileNotFoundError) and not path.is_symlink()
        raise UnreadableFileError(path, why_unreadable(path, e), missing) from None
    try:
        info = os.fstat(fd)
        if _is_devnull(info):
            return b""  # the one device that means "nothing here", as GIT_CONFIG=/dev/null
        if not stat.S_ISREG(info.st_mode):
            raise UnreadableFileError(path, f"is {_kind(info.st_mode)}, not a file")
        chunks: list[bytes] = []
        left = max_bytes + 1  # one past the cap: a file that grows while read is cut too
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    except OSError as e:
        raise UnreadableFileError(path, why_unreadable(path, e)) from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise UnreadableFileError(
            path, f"is more than {max_bytes:,} bytes, far more than a file of its kind holds"
        )
    return data


def _is_devnull(info: os.stat_result) -> bool:
    if not stat.S_ISCHR(info.st_mode):
        return False
    try:
        return info.st_rdev == os.stat(os.devnull).st_rdev
    except OSError:
        return False


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_readable(path: Path) -> None:
    """Open `path` for reading and close it: the way to ask before a library that reports
    failures worse (torch.load) opens it."""
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        missing = isinstance(e, FileNotFoundError) and not path.is_symlink()
        raise UnreadableFileError(path, why_unreadable(path, e), missing) from None


def list_folder(path: Path) -> list[Path]:
    """The entries of a folder, sorted; UnreadableFileError where it cannot be listed, so a
    folder without permission is reported rather than looking empty (glob says nothing)."""
    try:
        with os.scandir(path) as entries:
            return sorted(Path(e.path) for e in entries)
    except OSError as e:
        missing = isinstance(e, FileNotFoundError) and not path.is_symlink()
        raise UnreadableFileError(path, why_unreadable(path, e), missing) from None


def parse_json(data: bytes | str) -> Any:
    """JSON text to Python values; ValueError for anything that is not JSON (bad syntax,
    bytes that are not UTF-8, a number too long, too deep), whose message says what is
    wrong and completes "X is not readable JSON: ..."."""
    try:
        # Bytes are UTF-8, as JSON files are: json.loads would guess UTF-16 from some bytes.
        return json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except RecursionError:
        raise ValueError(TOO_DEEP) from None
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte {e.start})") from None
    except ValueError as e:  # JSONDecodeError, and int() refusing a 5000-digit number
        raise ValueError(_said(e)) from None


def parse_toml(text: str) -> dict[str, Any]:
    """TOML text to a table; ValueError for anything that is not TOML, too deep included."""
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise ValueError(TOO_DEEP) from None
    except ValueError as e:  # TOMLDecodeError, and int() refusing a 5000-digit number
        raise ValueError(_said(e)) from None


def _said(error: ValueError) -> str:
    # int()'s own words advise sys.set_int_max_str_digits, which means nothing to a reader.
    if "integer string conversion" in str(error):
        return "a number with thousands of digits"
    return str(error)


def read_json_file(path: Path, max_bytes: int | None = None) -> Any:
    """A JSON file's value; UnreadableFileError when it cannot be opened, ValueError when it
    is not JSON (both say why)."""
    return parse_json(read_bytes(path, max_bytes))


def shown(value: object, limit: int = 60) -> str:
    """repr(value) cut to `limit` characters, for messages: a value from a file may be a
    megabyte long or nested a thousand deep."""
    try:
        text = repr(value)
    except RecursionError:
        return f"a {type(value).__name__} nested too deeply to show"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def regular_file(path: Path) -> Path:
    """`path`, where it is a plain file (through any links) that can be opened; otherwise
    UnreadableFileError saying what is there instead: a folder, a link loop or a link to
    nothing, a named pipe or a device (which are never opened: reading one can wait forever
    or never end), a file without permission."""
    try:
        kind = os.stat(path).st_mode
    except OSError as e:
        missing = isinstance(e, FileNotFoundError) and not path.is_symlink()
        raise UnreadableFileError(path, why_unreadable(path, e), missing) from None
    if stat.S_ISDIR(kind):
        raise UnreadableFileError(path, "is a folder, not a file")
    if not stat.S_ISREG(kind):
        what = (
            "a named pipe (FIFO)"
            if stat.S_ISFIFO(kind)
            else "a socket"
            if stat.S_ISSOCK(kind)
            else "a device"
        )
        raise UnreadableFileError(path, f"is {what}, not a file")
    check_readable(path)
    return path
