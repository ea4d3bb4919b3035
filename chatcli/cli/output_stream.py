"""Standard output that cannot be written: full (`> /dev/full`, a full disk), closed before
chatcli starts (`>&-`), or closed by its reader while chatcli writes (`| head -1`).

Owns telling a failed write to stdout apart from any other OSError (the stream is wrapped
so that its own failures say they are its), the one line each case ends in, and quieting
stdout afterwards so that the interpreter's last flush does not fail a second time with a
traceback. `chatcli.cli.app.main` uses it around the whole command.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from typing import Any, TextIO

CLOSED_AT_START = (
    "Standard output is closed, and chatcli writes its replies and lists there. Run it with "
    "stdout open, or send it to /dev/null (> /dev/null) to drop them."
)


class OutputFailed(Exception):
    """A write to stdout failed; the message says why, in words. Not an OSError, so that no
    handler of a file's errors on the way mistakes it for its own."""

    def __init__(self, error: OSError) -> None:
        self.error = error
        if error.errno == errno.EPIPE:
            why = "its reader closed it before chatcli finished writing (Broken pipe)"
        elif error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            why = "the disk or device it goes to is full (No space left on device)"
        else:
            why = error.strerror or str(error)
        super().__init__(f"Cannot write to standard output: {why}. The output is incomplete.")


class GuardedStdout:
    """sys.stdout, but a failed write or flush raises OutputFailed. Everything else is the
    stream's own (isatty, fileno, encoding...), so Rich, click and prompt-toolkit see it."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            raise OutputFailed(e) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            raise OutputFailed(e) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def guard_stdout() -> bool:
    """Wraps sys.stdout in GuardedStdout; False when there is no stdout at all (closed
    before the process started: Python then sets sys.stdout to None)."""
    if sys.stdout is None:
        return False
    if not isinstance(sys.stdout, GuardedStdout):
        sys.stdout = GuardedStdout(sys.stdout)  # type: ignore[assignment]
    return True


def drop_stdout() -> None:
    """Points stdout at the null device: what is left in its buffer goes nowhere, so the
    interpreter's flush at exit cannot fail again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.__stdout__.fileno())
        os.close(null)
