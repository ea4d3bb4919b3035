"""Any text can be tokenized: long runs of blanks go around tiktoken's regex, with exactly the
tokens it gives where it can; and a tokenizer that splits with another pattern is refused."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import pytest
import tiktoken

from chatcli.errors import TokenizerError
from chatcli.model import long_runs
from chatcli.model.long_runs import LONG_RUN, encode_ordinary
from chatcli.model.special_tokens import SPECIAL_TOKENS
from chatcli.model.tokenizer import (
    COPY_SPLIT_PATTERN,
    GPT4_SPLIT_PATTERN,
    KNOWN_SPLIT_PATTERNS,
    SPLIT_PATTERN,
    Tokenizer,
)

EMBEDDED_TOKENIZER = (
    Path(__file__).resolve().parent.parent / "chatcli/default_model/tokenizer/tokenizer.pkl"
)
# Blanks as the regex crate's \s has them, spelled out (BLANKS holds a range).
BLANK_CHARS = sorted(
    {c for c in "\t\x0b\x0c \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"}
    | {chr(c) for c in range(0x2000, 0x200B)}
)


def merging_ranks() -> dict[bytes, int]:
    """Byte-level ranks with merges for runs of blanks and a few pieces beside them, so that
    BPE inside a run of blanks and across its ends shows in the tokens."""
    ranks = {bytes([i]): i for i in range(256)}

    def add(piece: bytes) -> None:
        ranks.setdefault(piece, len(ranks))

    for blank in (" ", "\t", "\u3000", "\xa0"):
        data = blank.encode()
        for k in range(1, len(data)):
            add(data[:k])
        for k in range(1, 24):
            add(data * k)
    for piece in (" x", "xx", "\n\n", " !", "!\n", "  x", "'s", "12"):
        add(piece.encode())
    return ranks


def encodings() -> list[tiktoken.Encoding]:
    ranks = merging_ranks()
    made = [
        tiktoken.Encoding(name="t", pat_str=p, mergeable_ranks=ranks, special_tokens={})
        for p in KNOWN_SPLIT_PATTERNS
    ]
    return [*made, Tokenizer.from_file(EMBEDDED_TOKENIZER).enc]


ENCODINGS = encodings()
NEIGHBOURS = ["x", "ab", "!", "!!", "'s", "'", "1", "12345", "\n", "\r\n", "\r", "中", "😀"]
NEIGHBOURS += ["\x1c", " x", " !", "\n\n", "é", "\u200b", '"', "\n ", " \n"]


def random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 6)):
        if rng.random() < 0.5:
            length = rng.choice(
                [1, 2, LONG_RUN - 2, LONG_RUN - 1, LONG_RUN, LONG_RUN + 1, rng.randint(2, 60_000)]
            )
            if rng.random() < 0.7:
                parts.append(rng.choice(BLANK_CHARS) * length)
            else:
                parts.append("".join(rng.choice(BLANK_CHARS) for _ in range(length)))
        else:
            parts.append("".join(rng.choice(NEIGHBOURS) for _ in range(rng.randint(1, 4))))
    return "".join(parts)


@pytest.mark.parametrize("seed", range(8))
def test_encoding_around_long_runs_gives_tiktokens_own_tokens(seed, monkeypatch):
    """Where tiktoken can encode a text, the split gives the same ids: random texts of runs
    of every blank, alone and mixed, at and around LONG_RUN, beside letters, digits,
    punctuation, line breaks and other runs, under every known pattern."""
    split = []
    single_piece = tiktoken.Encoding._encode_single_piece
    monkeypatch.setattr(
        tiktoken.Encoding,
        "_encode_single_piece",
        lambda self, piece: split.append(len(piece)) or single_piece(self, piece),
    )
    rng = random.Random(seed)
    for _ in range(25):
        text = random_text(rng)
        for enc in ENCODINGS:
            assert encode_ordinary(enc, text) == enc.encode_ordinary(text), (seed, text[:40])
    assert len(split) > 20  # the runs did go around the regex


@pytest.mark.parametrize(
    "text",
    [
        "x" + " " * LONG_RUN + "x",
        " " * LONG_RUN,
        "x" + " " * LONG_RUN,
        " " * (LONG_RUN + 5) + "!",
        "a\n" + "\t" * LONG_RUN + "b",
        "!" + "\n" * 3 + " " * LONG_RUN + "'s",
        "x" + " " * LONG_RUN + "\n" + " " * LONG_RUN + "x",
        "x" + "\u3000 " * LONG_RUN + "1",
        ("word " * 10 + " " * LONG_RUN) * 3,
    ],
    ids=range(9),
)
def test_each_shape_of_a_long_run_keeps_its_tokens(text):
    for enc in ENCODINGS:
        assert encode_ordinary(enc, text) == enc.encode_ordinary(text)


@pytest.mark.parametrize(
    "text",
    [
        "x" + " " * 1_000_000 + "x",
        "\t" * 1_200_000,
        "x" + "\u3000" * 1_100_000 + "!",
        "a\n" + "\xa0" * 1_000_000 + "b\n" + " " * 1_000_000,
        ("x" + " " * 1_000_001) * 2,
    ],
    ids=["spaces", "tabs", "ideographic", "after-newline", "twice"],
)
def test_a_million_blanks_are_tokenized_not_a_panic(text):
    tok = Tokenizer.from_file(EMBEDDED_TOKENIZER)
    ids = tok.encode(text)
    assert tok.decode(ids) == text


def test_short_and_ordinary_texts_go_straight_to_tiktoken(monkeypatch):
    def never(*args):
        raise AssertionError("searched for long runs")

    monkeypatch.setattr(long_runs, "_encode_around_runs", never)
    enc = ENCODINGS[0]
    prose = "Some text, with spaces  and\ttabs.\n" * 3000  # 100k characters
    assert encode_ordinary(enc, prose) == enc.encode_ordinary(prose)
    assert encode_ordinary(enc, " " * (LONG_RUN - 1)) == enc.encode_ordinary(" " * (LONG_RUN - 1))


def _whitespace_to_the_pattern(candidates: list[str], pattern: str) -> set[str]:
    """Which characters the split pattern's \\s takes, found from its pieces: with a merge
    for every doubled character, "x" c c "x" is 4 tokens only where c c is cut in two (the
    look-ahead of \\s+(?!\\S) before a letter, or single digits), and "x" c c at the end of
    the text 2 tokens only where c c stays whole (whitespace at the end, or any run)."""
    ranks = {bytes([i]): i for i in range(256)}
    for c in candidates:
        data = c.encode()
        for k in range(2, len(data) + 1):
            ranks.setdefault(data[:k], len(ranks))
        ranks.setdefault(data * 2, len(ranks))
    enc = tiktoken.Encoding(name="probe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    return {
        c
        for c in candidates
        if len(enc.encode_ordinary(f"x{c}{c}x")) == 4 and len(enc.encode_ordinary(f"x{c}{c}")) == 2
    }


@pytest.mark.parametrize("pattern", KNOWN_SPLIT_PATTERNS, ids=["nanochat", "gpt4", "copy"])
def test_blanks_are_exactly_the_patterns_whitespace_but_line_breaks(pattern):
    # Line breaks are whitespace too, but `\s*[\r\n]` takes a doubled one whole; and
    # \x1c-\x1f, which str.isspace() counts, are not whitespace to the pattern.
    candidates = [chr(c) for c in range(0x3100) if not 0xD800 <= c < 0xE000] + ["\ufeff"]
    assert _whitespace_to_the_pattern(candidates, pattern) == set(BLANK_CHARS)
    assert all(long_runs.LONG_BLANKS.fullmatch(c * LONG_RUN) for c in BLANK_CHARS)


def test_a_panic_left_is_one_tokenizer_error_not_a_crash():
    PanicException = type("PanicException", (BaseException,), {})  # pyo3's, by name

    class Raising:
        def __init__(self, error: BaseException) -> None:
            self.error = error

        def encode_ordinary(self, text: str) -> list[int]:
            raise self.error

    panic = PanicException("called `Result::unwrap()` on an `Err` value: StackOverflow")
    with pytest.raises(TokenizerError, match=r"could not split this text \(called"):
        encode_ordinary(Raising(panic), "hi")  # type: ignore[arg-type]
    with pytest.raises(KeyboardInterrupt):  # any other BaseException passes through
        encode_ordinary(Raising(KeyboardInterrupt()), "hi")  # type: ignore[arg-type]


# ---- the split pattern of a tokenizer.pkl --------------------------------------------------


GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@pytest.mark.parametrize(
    "pattern",
    [
        GPT2_PATTERN,  # a real tokenizer's, but its runs of newlines backtrack too
        r"(a+)+$",  # backtracks without end
        r"(\s+\s+)+(?!\S)",
        r".",
        SPLIT_PATTERN + "|x",  # nanochat's, changed
        SPLIT_PATTERN.replace("{1,2}", "{1,4}"),
    ],
    ids=["gpt2", "nested-plus", "nested-whitespace", "dot", "extended", "four-digits"],
)
def test_a_tokenizer_with_a_pattern_nanochat_does_not_use_is_refused(tmp_path, pattern):
    ranks = {bytes([i]): i for i in range(256)}
    specials = {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}
    enc = tiktoken.Encoding(
        name="x", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
    )
    path = tmp_path / "tokenizer.pkl"
    path.write_bytes(pickle.dumps(enc))
    with pytest.raises(
        TokenizerError, match=r"tokenizer\.pkl splits text with the pattern .* not one"
    ):
        Tokenizer.from_file(path)
    with pytest.raises(TokenizerError, match="not one nanochat uses"):
        Tokenizer(enc)


@pytest.mark.parametrize("pattern", [SPLIT_PATTERN, GPT4_SPLIT_PATTERN, COPY_SPLIT_PATTERN])
def test_nanochats_patterns_load(tmp_path, pattern):
    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, pattern=pattern)
    tok.save(tmp_path / "tokenizer.pkl")
    assert Tokenizer.from_file(tmp_path / "tokenizer.pkl").encode("hi there") == list(b"hi there")
