"""The keyboard around a streamed reply: what the terminal does with keys and Ctrl-C while the
model writes, and while the turn closes.

Owns: turning the terminal's echo off while a reply streams (`quiet_keyboard`), letting a
Ctrl-C go while a turn is being closed (`interrupts_held`), and holding one back until a
block of the reply is drawn whole (`interrupts_deferred`). Standard library only. The echo
is left alone where there is no terminal of this job's (pipes, tests, a background job);
the signals are handled on the main thread only, where Python delivers them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import TextIO

try:
    import termios
except ImportError:  # Windows: its console does not echo into the reply the same way
    termios = None  # type: ignore[assignment]


@contextmanager
def quiet_keyboard(stream: TextIO | None = None) -> Iterator[None]:
    """Echo off on the terminal behind `stream` (stdin by default) until the block ends.

    In the terminal's normal (cooked) mode every key typed while a reply streams is drawn
    into the reply, and Ctrl-C draws "^C": the live view then erases the wrong rows and
    leaves duplicate lines in scrollback. With echo off the keys are still kept, in the
    terminal's input queue, and the next prompt reads them (type-ahead is not lost)."""
    fd = _terminal_fd(sys.stdin if stream is None else stream)
    if fd is None:
        yield
        return
    try:
        before = termios.tcgetattr(fd)
        quiet = list(before)
        quiet[3] &= ~(termios.ECHO | getattr(termios, "ECHOCTL", 0))  # the local modes
        termios.tcsetattr(fd, termios.TCSANOW, quiet)  # TCSANOW: keep what was typed ahead
    except (termios.error, OSError):
        yield
        return
    try:
        yield
    finally:
        # Put back unless the job went to the background meanwhile (Ctrl-Z, bg): SIGTTOU.
        with suppress(termios.error, OSError):  # or the terminal went away (a closed window)
            if os.tcgetpgrp(fd) == os.getpgrp():
                termios.tcsetattr(fd, termios.TCSANOW, before)


def _terminal_fd(stream: TextIO | None) -> int | None:
    if termios is None or stream is None:
        return None
    try:
        fd = stream.fileno()
        # Only the terminal's foreground job may set its modes: from a background one
        # (`chatcli once ... &`) tcsetattr stops the whole process with SIGTTOU, and a
        # background job's keys are not read anyway.
        if not os.isatty(fd) or os.tcgetpgrp(fd) != os.getpgrp():
            return None
    except (AttributeError, OSError, ValueError):  # pytest's capture, a closed stream
        return None
    return fd


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C is let go until the block ends.

    For closing a turn a Ctrl-C already stopped (commit the reply's last lines, mark it
    interrupted, show its status, save it): a second, impatient Ctrl-C there would leave the
    reply unmarked and the saved file a message behind the session. The turn is stopping
    anyway, and closing it takes milliseconds."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread gets signals, and only it may set their handlers
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:  # a handler Python did not install: it could not be put back
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """A Ctrl-C that comes while the block runs is raised when it ends, not inside it.

    For drawing a finished block of a reply (a 1000-line code block takes ~0.3 s): cut
    halfway, the block would be half on the screen and gone from the renderer's hands. The
    Ctrl-C still stops the reply, a block later."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or previous is signal.SIG_IGN:  # held already: it stays let go
        yield
        return
    pressed = []
    signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt
