"""Hostile and careless transformers folders through the real CLI: config.json, tokenizer.json,
the safetensors weights and their index, each damaged, crafted, nested too deeply, of the
wrong type, or not a file at all. Each ends in one line naming the file and what is wrong
with it, exit code 1: never a traceback, a hang on a named pipe, or a model that loads from
a file the safetensors package refuses. And the logit softcap, from a flag or a config.json,
is refused outside the range every step computes (a reply of NUL characters before)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hf_models import exported
from typer.testing import CliRunner

from chatcli.cli.app import app
from chatcli.errors import ConfigError
from chatcli.model.checkpoint import load_model
from chatcli.model.hf_weights import read_safetensors, write_safetensors

pytest.importorskip("safetensors", reason="needs the hf extra")
runner = CliRunner()
DEEP_JSON = "[" * 100_000 + "]" * 100_000
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    return exported("B", tmp_path_factory.mktemp("hostile-model-files"))


@pytest.fixture
def folder(export, tmp_path) -> Path:
    """A copy of an era-B export to damage."""
    return Path(shutil.copytree(export, tmp_path / "model"))


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    for name in [k for k in os.environ if k.startswith("CHATCLI_") and k != "CHATCLI_HOME"]:
        monkeypatch.delenv(name)


def one_error_line(folder: Path, *said: str, extra: tuple[str, ...] = ()) -> str:
    """`chatcli once` on the folder: exit 1, one "Error:" line that holds each of `said`."""
    result = runner.invoke(app, ["once", "hi", "--max-tokens", "2", "-m", str(folder), *extra])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for part in said:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def header_of(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header and the bytes after it."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_header(path: Path, header: dict | bytes, body: bytes) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


# ---- safetensors files ------------------------------------------------------------------------


def test_a_file_whose_tensors_overlap_is_refused(folder):
    # Two weights read the same bytes: each one's offsets fit the file and its shape, which
    # the reader written here accepted; the safetensors package does not.
    header, body = header_of(folder / WEIGHTS)
    names = sorted(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"]
    )
    first, second = names[0], names[1]
    for key in ("dtype", "shape", "data_offsets"):
        header[second][key] = header[first][key]
    write_header(folder / WEIGHTS, header, body)
    one_error_line(folder, str(folder / WEIGHTS), "not a whole safetensors file", "invalid offset")


def test_a_file_with_a_gap_between_tensors_is_refused(folder):
    header, body = header_of(folder / WEIGHTS)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    begin, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [begin + 8, end + 8]
    write_header(folder / WEIGHTS, header, body + bytes(8))
    one_error_line(folder, str(folder / WEIGHTS), "invalid offset", last)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a":' * 5_000 + b"1" + b"}" * 5_000,  # past any JSON parser's depth
        b"[" * 50_000 + b"]" * 50_000,
        b'{"w": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}',
    ],
    ids=["deep-object", "deep-list", "5000-digit-shape"],
)
def test_a_header_nested_too_deeply_or_with_huge_numbers_is_one_line(folder, raw):
    write_header(folder / WEIGHTS, raw, bytes(4))
    one_error_line(folder, str(folder / WEIGHTS), "not a whole safetensors file")


@pytest.mark.parametrize("dtype", ["I64", "F64", "U8"])
def test_a_tensor_of_a_dtype_no_nanochat_weight_has_is_refused(folder, dtype):
    header, body = header_of(folder / WEIGHTS)
    name = next(k for k in header if k != "__metadata__" and header[k]["dtype"] == "F32")
    header[name]["dtype"] = dtype
    size = {"I64": 8, "F64": 8, "U8": 1}[dtype]
    # The same bytes as a vector of the new dtype: a header the package itself accepts.
    begin, end = header[name]["data_offsets"]
    header[name]["shape"] = [(end - begin) // size]
    write_header(folder / WEIGHTS, header, body)
    one_error_line(folder, str(folder / WEIGHTS), f"'{name}' is {dtype}", "F32, BF16, F16")


@pytest.mark.parametrize("kind", ["folder", "dangling link", "link loop", "named pipe"])
@pytest.mark.parametrize("name", [WEIGHTS, "config.json", "tokenizer.json", INDEX])
def test_a_model_file_that_is_no_file_is_named_as_what_it_is(folder, name, kind):
    # Each was "no tokenizer.json", "no model.safetensors" or not a model folder at all; a
    # named pipe would have been opened, and a read of one waits for a writer forever.
    path = folder / name
    if name == INDEX:
        (folder / WEIGHTS).rename(folder / "model-00001-of-00001.safetensors")
    elif path.exists():
        path.unlink()
    if kind == "folder":
        path.mkdir()
    elif kind == "dangling link":
        path.symlink_to(folder / "gone")
    elif kind == "link loop":
        path.symlink_to(path)
    else:
        os.mkfifo(path)
    said = {
        "folder": "is a folder, not a file",
        "dangling link": f"is not there (a link to {folder / 'gone'})",
        "link loop": "is a symbolic link that leads back to itself",
        "named pipe": "is a named pipe (FIFO), not a file",
    }[kind]
    one_error_line(folder, f"{path} {said}")


@pytest.mark.parametrize(
    "weight_map, said",
    [
        (["model.safetensors"], "its weight_map must be an object"),
        ({"lm_head.weight": 5}, "its weight_map must be an object"),
        ({"lm_head.weight": ["model.safetensors"]}, "its weight_map must be an object"),
        (None, "its weight_map must be an object"),
        ({"lm_head.weight": ".."}, "names files outside its folder"),
        ({"lm_head.weight": ""}, "names files outside its folder"),
    ],
)
def test_an_index_of_the_wrong_shape_is_one_line(folder, weight_map, said):
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    one_error_line(folder, str(folder / INDEX), said)


@pytest.mark.parametrize("name", [INDEX, "config.json", "tokenizer.json"])
def test_json_nested_too_deeply_is_one_line(folder, name):
    (folder / name).write_text(DEEP_JSON)
    one_error_line(folder, str(folder / name), "nested too deeply")


def test_an_export_is_read_back_by_the_safetensors_package_as_written(tmp_path):
    from safetensors.torch import load_file

    sd = {
        "lm_head.weight": torch.randn(7, 5),
        "model.backout_lambda": torch.tensor(0.25),  # 4 bytes: the next tensors move
        "model.embed_tokens.weight": torch.randn(7, 5).bfloat16(),
        "model.layers.0.mlp.fc1.weight": torch.randn(20, 5).half(),
        "model.resid_lambdas": torch.randn(3),
    }
    assert write_safetensors(sd, tmp_path) == [WEIGHTS]
    ours, theirs = read_safetensors(tmp_path / WEIGHTS), load_file(tmp_path / WEIGHTS)
    for name, tensor in sd.items():
        assert torch.equal(ours[name], tensor) and torch.equal(theirs[name], tensor), name
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape
    ours["lm_head.weight"].add_(1)  # a view of the file mapped copy-on-write
    assert torch.equal(load_file(tmp_path / WEIGHTS)["lm_head.weight"], sd["lm_head.weight"])


# ---- config.json ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, said",
    [
        ("2", "num_key_value_heads must be a whole number written without quotes, not '2'"),
        (2.0, "num_key_value_heads must be a whole number written without quotes, not 2.0"),
        (True, "num_key_value_heads must be a whole number written without quotes, not True"),
        ([2], "num_key_value_heads must be a whole number written without quotes, not [2]"),
        (0, "num_key_value_heads is 0, outside 1 to 4,096"),
    ],
)
def test_a_size_of_the_wrong_type_is_named_as_such_not_blamed_on_divisibility(folder, value, said):
    edit_json(folder / "config.json", lambda c: c.update(num_key_value_heads=value))
    line = one_error_line(folder, str(folder / "config.json"), said)
    assert "must divide" not in line


@pytest.mark.parametrize(
    "key, value, said",
    [
        ("hidden_size", "64", "hidden_size must be a whole number written without quotes"),
        ("vocab_size", 1024.5, "vocab_size must be a whole number written without quotes"),
        ("max_position_embeddings", 10**8, "max_position_embeddings is 100,000,000, outside 1"),
        ("num_hidden_layers", 10**9, "num_hidden_layers is 1,000,000,000, outside 1 to 4,096"),
        ("nanochat_era", ["B"], "nanochat_era is ['B']; expected one of A, B, C, D, E"),
    ],
)
def test_a_config_value_of_the_wrong_type_or_size_is_one_line(folder, key, value, said):
    edit_json(folder / "config.json", lambda c: c.update({key: value}))
    one_error_line(folder, str(folder / "config.json"), said)


# ---- tokenizer.json ---------------------------------------------------------------------------


def _pre_tokenizer(value):
    return lambda t: t.update(pre_tokenizer=value)


def _steps(value):
    return lambda t: t.update(pre_tokenizer={"type": "Sequence", "pretokenizers": value})


@pytest.mark.parametrize(
    "change, said",
    [
        (_pre_tokenizer(3), "pre_tokenizer is 3, not an object"),
        (_pre_tokenizer([1, 2]), "pre_tokenizer is [1, 2], not an object"),
        (_pre_tokenizer("ByteLevel"), "pre_tokenizer is 'ByteLevel', not an object"),
        (_steps(5), "pretokenizers are 5, not a list of objects"),
        (_steps([3, "x"]), "pretokenizers are [3, 'x'], not a list of objects"),
        (_steps({"Split": 1}), "pretokenizers are {'Split': 1}, not a list of objects"),
        (_steps([{"type": 7}, {"type": "ByteLevel"}]), "pre-tokenizers [7, 'ByteLevel']"),
        (
            lambda t: t["pre_tokenizer"]["pretokenizers"][0].update(pattern="\\s+"),
            "the Split/ByteLevel settings are not nanochat's",
        ),
        (lambda t: t.update(added_tokens=5), "added_tokens is 5, not a list of tokens"),
        (lambda t: t["model"].update(type=["BPE"]), "a ['BPE'] model"),
    ],
)
def test_a_tokenizer_of_the_wrong_shape_is_one_line(folder, change, said):
    edit_json(folder / "tokenizer.json", change)
    one_error_line(folder, str(folder / "tokenizer.json"), said)


# ---- the softcap --------------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [1e39, 1e38, 0, -15, "15", None, True, 0.5])
def test_a_config_softcap_outside_its_range_is_refused_with_the_range(folder, cap):
    # 1e38 and 1e39 loaded, and every reply was token 0: NUL characters.
    edit_json(folder / "config.json", lambda c: c.update(final_logit_softcapping=cap))
    one_error_line(
        folder,
        str(folder / "config.json"),
        "final_logit_softcapping must be a number from 1 to 1,000,000",
        "pass --softcap",
    )


def test_a_softcap_flag_stands_in_for_a_config_softcap_that_cannot_be_read(folder):
    # The message says to pass --softcap; doing so must work.
    edit_json(folder / "config.json", lambda c: c.update(final_logit_softcapping="15"))
    result = runner.invoke(app, ["once", "hi", "-t", "0", "--max-tokens", "2", "-m", str(folder)])
    assert result.exit_code == 1
    args = ["once", "hi", "-t", "0", "--max-tokens", "2", "-m", str(folder), "--softcap", "15"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("cap", [1e39, 1e38, 0.0, float("nan"), float("inf"), -1.0])
def test_load_model_refuses_a_softcap_outside_its_range(folder, cap):
    # softcap=0 was taken as "none given" (15); 1e38 gave a model that replies NUL.
    for model in (None, folder):  # the embedded nanochat checkpoint and a transformers folder
        with pytest.raises(ConfigError, match="must be a number from 1 to 1,000,000"):
            load_model(model, device="cpu", softcap=cap)
