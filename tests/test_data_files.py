"""The one reader of each format: every way a file can fail is one error that says what is in
the way (a folder, a link loop, no permission) or what is wrong with its text (too deep)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from chatcli.model import data_files
from chatcli.model.data_files import (
    TOO_DEEP,
    UnreadableFileError,
    check_readable,
    described,
    list_folder,
    parse_json,
    parse_toml,
    read_bytes,
    read_json_file,
    shown,
)

AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def odd_paths(tmp_path: Path) -> dict[str, Path]:
    """A path of each kind that cannot be read as a file."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "ping").symlink_to(tmp_path / "pong")
    (tmp_path / "pong").symlink_to(tmp_path / "ping")
    (tmp_path / "dangling").symlink_to(tmp_path / "moved")
    return {
        "folder": tmp_path / "folder",
        "loop": tmp_path / "loop",
        "two-link-loop": tmp_path / "ping",
        "dangling": tmp_path / "dangling",
        "missing": tmp_path / "missing",
    }


WHY = {
    "folder": "is a folder, not a file",
    "loop": "is a symbolic link that leads back to itself",
    "two-link-loop": "is a symbolic link that leads back to itself",
    "dangling": "is not there (a link to ",
    "missing": "does not exist",
}


@pytest.mark.parametrize("kind", list(WHY))
@pytest.mark.parametrize("reader", [read_bytes, check_readable, read_json_file])
def test_what_stands_in_the_way_of_reading_is_named(tmp_path, kind, reader):
    path = odd_paths(tmp_path)[kind]
    with pytest.raises(UnreadableFileError) as info:
        reader(path)
    assert str(info.value).startswith(f"{path} {WHY[kind]}")
    assert info.value.missing == (kind == "missing")


@pytest.mark.parametrize("kind", ["loop", "two-link-loop", "dangling", "missing"])
def test_a_folder_that_is_no_folder_is_named_too(tmp_path, kind):
    path = odd_paths(tmp_path)[kind]
    with pytest.raises(UnreadableFileError, match=WHY[kind].replace("(", r"\(")):
        list_folder(path)
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(UnreadableFileError, match="is a file, not a folder"):
        list_folder(file)


def _denied(path: Path):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    return refuse


def test_a_file_without_permission_is_named(tmp_path, monkeypatch):
    # Tests run as root here, where chmod does not stop a read: the refusal is simulated at
    # the one place this module opens files (the real one: the test below, as another user).
    path = tmp_path / "secret.json"
    path.write_text("{}")
    monkeypatch.setattr(data_files, "open", _denied(path), raising=False)
    with pytest.raises(
        UnreadableFileError, match=r"secret\.json cannot be read: permission denied"
    ):
        read_bytes(path)


def test_a_folder_without_permission_is_named_not_empty(tmp_path, monkeypatch):
    monkeypatch.setattr(data_files.os, "scandir", _denied(tmp_path))
    with pytest.raises(UnreadableFileError, match="cannot be read: permission denied"):
        list_folder(tmp_path)


@pytest.mark.skipif(AS_ROOT, reason="root reads files whatever their mode")
def test_a_file_and_a_folder_without_permission_for_real(tmp_path):
    path = tmp_path / "secret.json"
    path.write_text("{}")
    path.chmod(0)
    folder = tmp_path / "closed"
    folder.mkdir()
    folder.chmod(0)
    try:
        with pytest.raises(UnreadableFileError, match="permission denied"):
            read_bytes(path)
        with pytest.raises(UnreadableFileError, match="permission denied"):
            list_folder(folder)
    finally:
        folder.chmod(0o700)


def test_a_file_far_bigger_than_its_kind_is_refused_unread(tmp_path):
    path = tmp_path / "meta.json"
    path.write_bytes(b" " * 2000)
    with pytest.raises(UnreadableFileError, match="is 2,000 bytes, far more than"):
        read_bytes(path, max_bytes=1000)
    assert read_bytes(path, max_bytes=2000) == b" " * 2000


def test_an_os_error_from_anywhere_is_said_with_its_path():
    error = PermissionError(errno.EACCES, "Permission denied", "/srv/models/d20")
    assert described(error) == (
        "/srv/models/d20 cannot be read: permission denied (see its owner and mode with ls -l)"
    )
    assert described(OSError(errno.EIO, "Input/output error")) == (
        "A file cannot be read (Input/output error)"
    )


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"a":' * 100_000 + "1" + "}" * 100_000,
        "[" * 100_000,  # never closed
        '{"model_config": ' + "[" * 50_000 + "]" * 50_000 + "}",
    ],
    ids=["arrays", "objects", "unclosed", "inside"],
)
def test_json_nested_too_deep_is_a_value_error(text):
    with pytest.raises(ValueError, match=TOO_DEEP):
        parse_json(text)


@pytest.mark.parametrize(
    "text",
    [
        "a = " + "[" * 100_000 + "]" * 100_000,
        "a = " + "{b = " * 100_000 + "1" + "}" * 100_000,
        "a = " + "[" * 100_000,
    ],
    ids=["arrays", "inline-tables", "unclosed"],
)
def test_toml_nested_too_deep_is_a_value_error(text):
    with pytest.raises(ValueError, match=TOO_DEEP):
        parse_toml(text)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b'{"a": "\x80"}', r"not UTF-8 text \(byte 7\)"),
        (b"1" * 5000, "a number with thousands of digits"),
        (b"{not json", "Expecting property name"),
    ],
)
def test_json_that_is_not_json_says_why(data, why):
    with pytest.raises(ValueError, match=why):
        parse_json(data)


def test_toml_that_is_not_toml_says_why():
    with pytest.raises(ValueError, match="a number with thousands of digits"):
        parse_toml("a = " + "1" * 5000)
    with pytest.raises(ValueError, match="Invalid value"):
        parse_toml("a = ")


def test_values_are_shown_short_however_long_or_deep():
    assert shown("x" * 1000) == "'" + "x" * 58 + "…"
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert shown(deep) == "a list nested too deeply to show"
    assert shown(True) == "True"
