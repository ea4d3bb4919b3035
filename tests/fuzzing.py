"""What the fuzz tests share: their example budget, the contract every case is held to, and
strategies that start from a valid value and damage it.

The contract (`loads_or_one_error`): reading hostile input either gives a value, or raises one
ChatcliError whose message says something; any other exception, or no answer within the time
limit, fails the test with the example that caused it. `Untouched` checks that a case wrote
nothing where it had no business writing.

Budget: each test names its number of examples, multiplied by CHATCLI_FUZZ_SCALE (1 in the
suite; scripts/fuzz.sh raises it for long runs). Hypothesis keeps the examples that failed in
.hypothesis/ (ignored by git) and tries them first next time; a failure prints the example and
the `@reproduce_failure` line that replays it.
"""

from __future__ import annotations

import copy
import os
import signal
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from chatcli.errors import ChatcliError

T = TypeVar("T")
SCALE = float(os.environ.get("CHATCLI_FUZZ_SCALE", "1"))
# The suite draws the same examples every run, so that CI's verdict changes only with the code
# (a finding there is a real defect anyone can replay, not a roll of the dice on someone
# else's change); scripts/fuzz.sh sets CHATCLI_FUZZ_RANDOM=1 to explore fresh examples.
RANDOM = os.environ.get("CHATCLI_FUZZ_RANDOM") == "1"
CASE_SECONDS = 20.0  # per example: the slowest (a model loaded from a mutated folder) takes ~1 s

fuzz = pytest.mark.fuzz


def budget(examples: int) -> settings:
    """Hypothesis settings for a fuzz test of `examples` examples (times CHATCLI_FUZZ_SCALE).
    No deadline: each case has its own hard time limit instead, which a slow machine shared by
    other jobs does not trip the way a 200 ms deadline would."""
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        deadline=None,
        derandomize=not RANDOM,
        print_blob=True,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
            HealthCheck.filter_too_much,
        ],
    )


class Hang(BaseException):
    """No answer within a case's time limit. A BaseException, so that code under test that
    catches Exception cannot swallow it."""


@contextmanager
def time_limit(seconds: float = CASE_SECONDS) -> Iterator[None]:
    """Raise Hang in the main thread when the block runs past `seconds` (SIGALRM: Python
    code is interrupted at once; a C call at its end)."""

    def fire(signum: int, frame: object) -> None:
        raise Hang(f"no answer within {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def loads_or_one_error(
    call: Callable[[], T], seconds: float = CASE_SECONDS, one_line: bool = True
) -> T | ChatcliError:
    """call()'s value, or the ChatcliError it raised (its message must say something, on one
    line where `one_line`). Any other exception, or a hang, propagates: a finding."""
    with time_limit(seconds), warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        try:
            return call()
        except ChatcliError as e:
            message = str(e).strip()
            assert message, f"{type(e).__name__} with no message"
            assert "Traceback" not in message, message
            if one_line:
                assert "\n" not in message, f"a message of several lines: {message!r}"
            return e
        finally:
            # Python prints these on stderr, beside (or instead of) chatcli's one line.
            seen = [w for w in shown if issubclass(w.category, (UserWarning, RuntimeWarning))]
            assert not seen, (
                f"a warning a user would see: {seen[0].category.__name__}: {seen[0].message}"
            )


class Untouched:
    """A folder's tree as it was (names, kinds, sizes, contents' mtimes): `check()` fails on any
    file made, changed or removed since, except under the `allowed` folders."""

    def __init__(self, root: Path, allowed: tuple[Path, ...] = ()) -> None:
        self.root = root
        self.allowed = tuple(a.resolve() for a in allowed)
        self.before = self._snapshot()

    def _snapshot(self) -> dict[str, tuple[str, int, int]]:
        seen: dict[str, tuple[str, int, int]] = {}
        for folder, dirs, files in os.walk(self.root):
            for name in dirs + files:
                path = Path(folder) / name
                if any(path.resolve().is_relative_to(a) for a in self.allowed):
                    continue
                st_ = path.lstat()
                kind = "link" if path.is_symlink() else "dir" if path.is_dir() else "file"
                size = 0 if kind == "dir" else st_.st_size
                seen[str(path.relative_to(self.root))] = (kind, size, st_.st_mtime_ns)
        return seen

    def check(self) -> None:
        after = self._snapshot()
        made = sorted(set(after) - set(self.before))
        gone = sorted(set(self.before) - set(after))
        changed = sorted(k for k in set(after) & set(self.before) if after[k] != self.before[k])
        assert not (made or gone or changed), (
            f"wrote outside its folder under {self.root}: made {made}, removed {gone}, "
            f"changed {changed}"
        )


# ---- values that start valid and are damaged ------------------------------------------------

# Keys a mutation may add: real ones from the files chatcli reads, and strangers.
KEYS = [
    "model_config",
    "n_layer",
    "n_head",
    "n_kv_head",
    "n_embd",
    "vocab_size",
    "sequence_len",
    "window_pattern",
    "type",
    "version",
    "message",
    "role",
    "content",
    "text",
    "dtype",
    "shape",
    "data_offsets",
    "weight_map",
    "__metadata__",
    "model",
    "",
    "x",
    "\x00",
    "ü",
]
EDGE_NUMBERS = [0, 1, -1, 2, 3, 7, 64, 255, 256, 2**31, 2**32 + 1, 2**63, -(2**63), 10**30]


def hostile_values() -> st.SearchStrategy[Any]:
    """JSON-like values a careless or crafted file holds: wrong types, edge numbers, NaN and
    infinities (Python's JSON reads and writes them), empty, odd and long strings, small
    nests."""
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(EDGE_NUMBERS),
        st.integers(),
        st.floats(),
        st.sampled_from([0.5, 1.5, -0.0, 1e300, float("nan"), float("inf"), float("-inf")]),
        st.text(max_size=12),
        st.sampled_from(
            ["", " ", "4", "1e400", "SSSL", "S", "X", "../x", "\x00", "\ud800", "a" * 500]
        ),
    )
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=4)
        ),
        max_leaves=8,
    )


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*path, i))


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


def _set(root: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    _get(root, path[:-1])[path[-1]] = new
    return root


@st.composite
def mutated(draw: st.DrawFn, valid: Any, max_changes: int = 3) -> Any:
    """`valid` (a JSON-like value) with one to `max_changes` changes, each at a node drawn
    anywhere in it: replaced by a hostile value, a number nudged (off by one, doubled,
    negated, zero), removed, a key or item added, or wrapped in a list or an object."""
    value = copy.deepcopy(valid)
    for _ in range(draw(st.integers(1, max_changes))):
        path = draw(st.sampled_from(list(_paths(value))))
        node = _get(value, path)
        how = draw(st.sampled_from(["replace", "nudge", "remove", "add", "wrap"]))
        if how == "nudge" and isinstance(node, int | float) and not isinstance(node, bool):
            change = draw(st.sampled_from([1, -1, 2, -2]))
            factor = draw(st.sampled_from([None, 0, 2, -1]))
            value = _set(value, path, node * factor if factor is not None else node + change)
        elif how == "remove" and path:
            parent = _get(value, path[:-1])
            del parent[path[-1]]
        elif how == "add" and isinstance(node, dict):
            node[draw(st.sampled_from(KEYS))] = draw(hostile_values())
        elif how == "add" and isinstance(node, list):
            item = copy.deepcopy(draw(st.sampled_from(node))) if node else draw(hostile_values())
            node.insert(draw(st.integers(0, len(node))), item)
        elif how == "wrap":
            value = _set(value, path, draw(st.sampled_from([[node], {"x": node}])))
        else:
            value = _set(value, path, draw(hostile_values()))
    return value


@st.composite
def mutated_bytes(draw: st.DrawFn, valid: bytes, max_changes: int = 4) -> bytes:
    """`valid` with a few byte-level changes: a byte flipped or set, a run cut out, inserted
    or repeated, or the end cut off."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, max_changes))):
        if not data:
            data += draw(st.binary(min_size=1, max_size=16))
            continue
        at = draw(st.integers(0, len(data) - 1))
        how = draw(st.sampled_from(["flip", "set", "cut", "insert", "repeat", "truncate"]))
        if how == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif how == "set":
            data[at] = draw(st.sampled_from([0, 0x7F, 0x80, 0xFF, ord("{"), ord('"'), ord("\n")]))
        elif how == "cut":
            del data[at : at + draw(st.integers(1, 16))]
        elif how == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif how == "repeat":
            data[at:at] = data[at : at + draw(st.integers(1, 64))] * draw(st.integers(1, 8))
        else:
            del data[at:]
    return bytes(data)
