"""Encoding text whose long runs of blanks tiktoken's regex engine cannot take, with the
very tokens it gives where it can.

tiktoken splits text into pieces with fancy-regex before BPE. Its backtracking machine keeps
one entry per character of a run that `\\s+(?!\\S)` matches, and past a million it panics
(a Rust stack overflow, not a Python error): "x", a million spaces and "x" cannot be encoded,
and a pasted log padded with blanks ends a chat. Tried shape by shape at 2 and 8 million
characters (letters, digits, punctuation, runs of newlines or of CR LF, spaces between
newlines, CJK, emoji, combining marks, zero-width spaces, apostrophes, alternations of these),
no other run grows that stack: the rest take linear time.

Which runs, and why the split is exact: in nanochat's split patterns
(tokenizer.KNOWN_SPLIT_PATTERNS), a run of whitespace is taken by `\\s*[\\r\\n]` up to its
last line break (the regex crate's automaton, no backtracking), and what follows that break
(a run of blanks: whitespace other than CR and LF) by `\\s+(?!\\S)`, which takes all of it
but its last blank when text follows, all of it at the end of the text. The other
alternatives take whitespace only as one leading character (" x", " !") or as line breaks
after punctuation, so the pieces of the text before the run end where the run begins, and
the last blank starts a piece of its own reading only what follows (the pattern has no
look-behind). A long run is therefore encoded as the one piece it is, by tiktoken's own BPE
without its regex (`_encode_single_piece`: the BPE that encode_ordinary applies to each
piece), and the text on either side by encode_ordinary. Tests hold the result equal to
tiktoken's on hundreds of random texts it can encode, under each known pattern, and check
BLANKS against the pattern's own \\s for every character below U+3100; a tiktoken that
renamed `_encode_single_piece` fails them.

Knows nothing about special tokens or conversations (chatcli.model.tokenizer).
"""

from __future__ import annotations

import re

import tiktoken

from chatcli.errors import TokenizerError

# Whitespace to the regex crate (Unicode's White_Space) other than \r and \n: Python's
# str.isspace() also counts \x1c-\x1f, which the pattern's \s does not.
BLANKS = "\t\x0b\x0c \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# Runs of blanks at least this long are encoded apart: far below the million the regex
# engine overflows at, far above what typed text holds. Shorter texts are not searched.
LONG_RUN = 20_000
# A run starts where no blank precedes it (the look-behind keeps the search linear: it never
# restarts inside a run) and takes every blank that follows. The search costs ~20 ns a
# character, a tenth of encoding, so it runs only where _may_hold_a_long_run says so.
LONG_BLANKS = re.compile(f"(?<![{BLANKS}])[{BLANKS}]{{{LONG_RUN},}}")
_BLANKS_FROM = re.compile(f"[{BLANKS}]*")
_STRIDE = LONG_RUN // 2


def encode_ordinary(enc: tiktoken.Encoding, text: str) -> list[int]:
    """enc.encode_ordinary(text), for any text: long runs of blanks go around the regex."""
    try:
        if len(text) < LONG_RUN or not _may_hold_a_long_run(text):
            return enc.encode_ordinary(text)
        return _encode_around_runs(enc, text)
    except BaseException as e:  # a Rust panic is a BaseException (pyo3's PanicException)
        if type(e).__name__ != "PanicException":
            raise
        raise TokenizerError(
            f"The tokenizer could not split this text ({str(e).splitlines()[0][:120]}). "
            "Shorten the runs of repeated characters in it."
        ) from None


def _may_hold_a_long_run(text: str) -> bool:
    """Whether a stretch of _STRIDE blanks starts at a multiple of _STRIDE: every run of
    LONG_RUN = 2 * _STRIDE blanks holds one, and ordinary text fails at the first character
    of each of its len/_STRIDE stretches (tens of microseconds for megabytes)."""
    return any(
        _BLANKS_FROM.match(text, at, at + _STRIDE).end() == at + _STRIDE
        for at in range(0, len(text) - _STRIDE + 1, _STRIDE)
    )


def _encode_around_runs(enc: tiktoken.Encoding, text: str) -> list[int]:
    ids: list[int] = []
    start = 0
    for run in LONG_BLANKS.finditer(text):
        begin, end = run.span()
        if end < len(text) and text[end] in "\r\n":
            continue  # `\s*[\r\n]` takes the run with its line break, without backtracking
        if end < len(text):
            end -= 1  # the last blank begins the next piece (" x", " !", or alone)
        ids += enc.encode_ordinary(text[start:begin])
        ids += enc._encode_single_piece(text[begin:end])
        start = end
    ids += enc.encode_ordinary(text[start:])
    return ids
