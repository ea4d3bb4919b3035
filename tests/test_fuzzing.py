"""The fuzz tests' own contract (tests/fuzzing.py) fails where it must: a check that cannot
fail would let every finding through."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("hypothesis", reason="needs the dev extra: pip install -e '.[dev]'")

from fuzzing import Hang, Untouched, loads_or_one_error, mutated, mutated_bytes
from hypothesis import given

from chatcli.errors import ChatcliError, ConfigError


def test_a_value_or_a_chatcli_error_pass_the_contract():
    assert loads_or_one_error(lambda: 3) == 3
    error = loads_or_one_error(lambda: (_ for _ in ()).throw(ConfigError("x is wrong")))
    assert isinstance(error, ChatcliError)


@pytest.mark.parametrize(
    "raised",
    [KeyError("k"), TypeError("unhashable"), RecursionError(), ValueError("v")],
)
def test_any_other_exception_fails_the_contract(raised):
    def call():
        raise raised

    with pytest.raises(type(raised)):
        loads_or_one_error(call)


@pytest.mark.parametrize("message", ["", "   ", "two\nlines"])
def test_a_chatcli_error_without_a_one_line_message_fails_the_contract(message):
    def call():
        raise ConfigError(message)

    with pytest.raises(AssertionError):
        loads_or_one_error(call)


def test_a_hang_fails_the_contract_even_inside_except_exception():
    def call():
        try:
            time.sleep(5)
        except Exception:  # code under test that swallows errors does not swallow a hang
            return "swallowed"

    started = time.monotonic()
    with pytest.raises(Hang):
        loads_or_one_error(call, seconds=0.2)
    assert time.monotonic() - started < 2


def test_a_write_outside_the_allowed_folders_fails_the_check(tmp_path):
    (tmp_path / "allowed").mkdir()
    (tmp_path / "input").write_text("x")
    untouched = Untouched(tmp_path, allowed=(tmp_path / "allowed",))
    (tmp_path / "allowed" / "ok").write_text("fine")
    untouched.check()
    (tmp_path / "stray").write_text("not fine")
    with pytest.raises(AssertionError, match="stray"):
        untouched.check()
    (tmp_path / "stray").unlink()
    (tmp_path / "input").write_text("changed!")
    with pytest.raises(AssertionError, match="input"):
        untouched.check()


VALID = {"a": [1, 2, {"b": "c"}], "d": 4.5}


def test_mutations_damage_a_copy_and_mostly_change_it():
    changed, bytes_changed = [], []

    @given(mutated(VALID, max_changes=1), mutated_bytes(b'{"a": 1}'))
    def collect(value, data):
        changed.append(repr(value) != repr(VALID))
        bytes_changed.append(data != b'{"a": 1}')

    collect()
    assert VALID == {"a": [1, 2, {"b": "c"}], "d": 4.5}  # the valid value itself is untouched
    assert sum(changed) > len(changed) / 2 and sum(bytes_changed) > len(bytes_changed) / 2


def test_a_warning_a_user_would_see_fails_the_contract():
    import warnings

    def call():
        warnings.warn("please file an issue", UserWarning, stacklevel=1)
        return 1

    with pytest.raises(AssertionError, match="a warning a user would see"):
        loads_or_one_error(call)
