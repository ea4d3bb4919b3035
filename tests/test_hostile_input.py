"""Hostile and careless input through the real CLI: each kind ends in one clear line on stderr
and exit code 1, never a traceback, a panic or a hang. One test a kind, fed several inputs
of that kind: checkpoint metadata, files that are no files (too deep, a folder, a link loop,
no permission), weights that cannot be right, text the tokenizer's regex cannot take,
conversation files and settings."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference import REFERENCE, needs_reference
from typer.testing import CliRunner

from chatcli.cli.app import app
from chatcli.model import data_files
from chatcli.model.tokenizer import encoding_parts

FIXTURE = REFERENCE / "E"
ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()
DEEP_JSON = "[" * 100_000 + "]" * 100_000
DEEP_TOML = "temperature = " + "[" * 100_000 + "]" * 100_000


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    for name in [k for k in os.environ if k.startswith("CHATCLI_") and k != "CHATCLI_HOME"]:
        if name != "CHATCLI_REFERENCE_FIXTURES":
            monkeypatch.delenv(name)


def one_error_line(args: list[str], *names: str, **invoke) -> str:
    """Run chatcli in-process; it must exit 1 with one "Error:" line on stderr that names
    each of `names`, and nothing that looks like a traceback."""
    result = runner.invoke(app, args, **invoke)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output and "panicked" not in result.output
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def checkpoint(tmp_path: Path, meta: dict | None = None, sd: dict | None = None) -> Path:
    """The era-E reference checkpoint as a download folder, its meta or weights changed."""
    source = FIXTURE / "chatsft_checkpoints" / "d4"
    folder = tmp_path / "ckpt"
    folder.mkdir()
    weights = torch.load(source / "model_000001.pt", weights_only=True)
    torch.save(weights if sd is None else sd(weights), folder / "model_000001.pt")
    saved = json.loads((source / "meta_000001.json").read_text())
    saved["model_config"].update(meta or {})
    (folder / "meta_000001.json").write_text(json.dumps(saved))
    shutil.copy(FIXTURE / "tokenizer" / "tokenizer.pkl", folder / "tokenizer.pkl")
    return folder


def replace(path: Path, by: str) -> None:
    """Put a folder, a link to itself or a link to nothing where `path` was."""
    path.unlink()
    if by == "folder":
        path.mkdir()
    elif by == "loop":
        path.symlink_to(path.name)
    else:
        path.symlink_to(path.parent / "moved-away")


ONCE = ["once", "--max-tokens", "1", "hi", "--model"]


# ---- 1. checkpoint metadata ---------------------------------------------------------------


@needs_reference
@pytest.mark.parametrize(
    ("config", "said"),
    [
        ({"n_layer": 10**9}, "n_layer is 1000000000"),
        ({"sequence_len": 100_000_000}, "sequence_len is 100000000"),
        ({"n_embd": 3_000_000_000}, "n_embd is 3000000000"),
        ({"n_layer": True}, "n_layer is True, not a whole number"),
        ({"n_head": "4"}, "n_head is '4', not a whole number"),
        ({"vocab_size": 2.5}, "vocab_size is 2.5"),
        ({"n_kv_head": -2}, "n_kv_head is -2"),
        ({"n_head": 5}, "must divide by n_head (5)"),
        ({"n_layer": 7}, "says n_layer=7, but the weights have 4 layers"),
        ({"n_kv_head": 4}, "n_kv_head=4 make keys 64 wide"),
        ({"window_pattern": "SX"}, "window_pattern 'SX' is not made of S and L"),
    ],
)
def test_checkpoint_metadata_that_does_not_fit_the_weights_is_one_line(tmp_path, config, said):
    folder = checkpoint(tmp_path, meta=config)
    one_error_line([*ONCE, str(folder)], said, str(folder))


# ---- 2. files: too deep, a folder, a link loop, no permission ----------------------------


@needs_reference
@pytest.mark.parametrize(
    ("name", "by", "said"),
    [
        ("meta_000001.json", "deep", "is not readable JSON: nested too deeply"),
        ("meta_000001.json", "deep-object", "is not readable JSON: nested too deeply"),
        ("meta_000001.json", "folder", "is a folder, not a file"),
        ("meta_000001.json", "loop", "is a symbolic link that leads back to itself"),
        ("model_000001.pt", "folder", "is a folder, not a file"),
        ("model_000001.pt", "loop", "is a symbolic link that leads back to itself"),
        ("model_000001.pt", "dangling", "is not there (a link to"),
        ("tokenizer.pkl", "folder", "is a folder, not a file"),
        ("tokenizer.pkl", "loop", "is a symbolic link that leads back to itself"),
        ("tokenizer.pkl", "dangling", "is not there (a link to"),
    ],
)
def test_a_checkpoint_file_that_is_no_file_is_named_as_what_it_is(tmp_path, name, by, said):
    folder = checkpoint(tmp_path)
    path = folder / name
    if by == "deep":
        path.write_text(DEEP_JSON)
    elif by == "deep-object":
        path.write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    else:
        replace(path, by)
    one_error_line([*ONCE, str(folder)], str(path), said)


@needs_reference
@pytest.mark.parametrize("how", ["loop", "dangling", "pt-folder"])
def test_a_model_path_that_is_no_checkpoint_is_named(tmp_path, how):
    if how == "pt-folder":
        target = checkpoint(tmp_path) / "model_000001.pt"
        replace(target, "folder")
        said = "is a folder, not a model_<step>.pt file"
    else:
        target = tmp_path / "model"
        target.symlink_to(target.name if how == "loop" else tmp_path / "gone")
        said = "leads back to itself" if how == "loop" else "is not there (a link to"
    one_error_line([*ONCE, str(target)], str(target), said)


@needs_reference
@pytest.mark.parametrize("name", ["model_000001.pt", "meta_000001.json", "tokenizer.pkl"])
def test_a_checkpoint_file_without_permission_is_named(tmp_path, monkeypatch, name):
    # Tests run as root here, where a mode does not stop a read: the refusal is made at the
    # one place chatcli opens these files (test_data_files has the real one, as another user).
    folder = checkpoint(tmp_path)
    real_open = open

    def guarded_open(path, *args, **kwargs):
        if Path(path).name == name:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(data_files, "open", guarded_open, raising=False)
    one_error_line([*ONCE, str(folder)], f"{folder / name} cannot be read: permission denied")


@needs_reference
def test_a_checkpoint_folder_without_permission_is_named_not_empty(tmp_path, monkeypatch):
    folder = checkpoint(tmp_path)
    real_scandir = os.scandir

    def guarded_scandir(path="."):
        if Path(path) == folder:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(data_files.os, "scandir", guarded_scandir)
    one_error_line([*ONCE, str(folder)], f"The folder {folder} cannot be read: permission denied")


@pytest.mark.parametrize("by", ["deep", "folder", "loop", "dangling"])
def test_a_config_file_that_is_no_toml_file_is_named(tmp_path, monkeypatch, by):
    config = tmp_path / "config.toml"
    config.write_text(DEEP_TOML)
    if by != "deep":
        replace(config, by)
    monkeypatch.setenv("CHATCLI_CONFIG", str(config))
    said = {
        "deep": "is not valid TOML (nested too deeply",
        "folder": "is a folder, not a file",
        "loop": "leads back to itself",
        "dangling": "is not there (a link to",
    }[by]
    one_error_line(["once", "hi"], f"config file {config}", said)


def test_a_conversation_file_that_is_no_conversation_is_named(tmp_path):
    folder = tmp_path / "home" / "conversations"
    folder.mkdir(parents=True)
    deep = folder / "deep.jsonl"
    deep.write_text(DEEP_JSON + "\n" + DEEP_JSON + "\n")
    (folder / "box.jsonl").mkdir()
    (folder / "loop.jsonl").symlink_to("loop.jsonl")
    one_error_line(["chat", "--resume", str(deep)], str(deep), "is not JSON, and no line is")
    for name in ("box.jsonl", "loop.jsonl"):
        one_error_line(["chat", "--resume", str(folder / name)], name)


@needs_reference
def test_models_lists_every_broken_checkpoint_with_its_reason_and_goes_on(tmp_path, monkeypatch):
    base = tmp_path / "base"
    tags = base / "chatsft_checkpoints"
    for tag, change in [("d1", None), ("d2", "deep"), ("d3", "pt-folder"), ("d4", "nan")]:
        (tmp_path / tag).mkdir()
        folder = checkpoint(tmp_path / tag)
        if change == "deep":
            (folder / "meta_000001.json").write_text(DEEP_JSON)
        elif change == "pt-folder":
            replace(folder / "model_000001.pt", "folder")
        tags.mkdir(parents=True, exist_ok=True)
        shutil.move(folder, tags / tag)
    (tags / "d5").symlink_to("d5")
    (tags / "d6").mkdir()
    (tags / "d6" / "model_000001.pt").symlink_to("model_000001.pt")
    (tags / "d7").mkdir()
    real_scandir = os.scandir

    def guarded_scandir(path="."):
        if Path(path) == tags / "d7":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(data_files.os, "scandir", guarded_scandir)
    result = runner.invoke(app, ["models", "--base-dir", str(base)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    rows = {line.split()[2]: line for line in result.stdout.splitlines() if str(base) in line}
    assert sorted(rows) == ["d1", "d2", "d3", "d4", "d5", "d6", "d7"]
    assert not rows["d1"].rstrip().endswith("(unreadable)")
    assert not rows["d4"].rstrip().endswith("(unreadable)")  # NaN: found at load, not listed
    for tag in ("d2", "d3", "d5", "d6", "d7"):
        assert rows[tag].rstrip().endswith("(unreadable)"), rows[tag]
    notes = result.stderr
    assert "meta_000001.json is not readable JSON: nested too deeply" in notes
    assert f"{tags / 'd3' / 'model_000001.pt'} is a folder, not a file" in notes
    assert f"{tags / 'd5'} is a symbolic link that leads back to itself" in notes
    assert f"{tags / 'd6' / 'model_000001.pt'} is a symbolic link that leads back" in notes
    assert f"The folder {tags / 'd7'} cannot be read: permission denied" in notes


# ---- 3. weights that cannot be right ------------------------------------------------------


def _poisoned(key: str, value: float, dtype: torch.dtype = torch.float32):
    def change(sd: dict) -> dict:
        sd = {k: v.to(dtype) for k, v in sd.items()}
        sd[key][1, 2] = value
        return sd

    return change


def _stretched(sd: dict) -> dict:
    sd["lm_head.weight"] = torch.zeros(1).expand(512, 64)  # one stored value for 32768
    return sd


def _overlapping(sd: dict) -> dict:
    sd["transformer.wte.weight"] = torch.zeros(512 * 64).as_strided((512, 64), (0, 1))
    return sd


@needs_reference
@pytest.mark.parametrize(
    ("change", "said"),
    [
        (_poisoned("lm_head.weight", float("nan")), "lm_head.weight holds NaN values"),
        (_poisoned("transformer.wte.weight", float("inf")), "wte.weight holds infinite values"),
        (
            _poisoned("transformer.h.3.attn.c_q.weight", float("-inf"), torch.bfloat16),
            "transformer.h.3.attn.c_q.weight holds infinite values",
        ),
        (
            _poisoned("transformer.h.0.mlp.c_proj.weight", float("nan"), torch.float16),
            "transformer.h.0.mlp.c_proj.weight holds NaN values",
        ),
        (_stretched, "but its storage holds 1"),
        (_overlapping, "read the same stored values more than once"),
    ],
    ids=["nan", "inf", "bf16-inf", "fp16-nan", "storage-small", "overlapping"],
)
def test_weights_that_cannot_be_right_are_refused_at_load(tmp_path, change, said):
    folder = checkpoint(tmp_path, sd=change)
    one_error_line([*ONCE, str(folder)], str(folder / "model_000001.pt"), said)


# ---- 4. the tokenizer ----------------------------------------------------------------------


@needs_reference
@pytest.mark.parametrize(
    "pattern",
    [r"(a+)+$", r"""'s|\s+(?!\S)|\S+""", r"""\p{L}+|\p{N}+|[^\s\p{L}\p{N}]+|\s+"""],
    ids=["backtracking", "short", "gpt2-like"],
)
def test_a_tokenizer_with_a_foreign_split_pattern_is_refused_at_load(tmp_path, pattern):
    import pickle

    import tiktoken

    folder = checkpoint(tmp_path)
    state = pickle.loads((folder / "tokenizer.pkl").read_bytes())
    foreign = tiktoken.Encoding(
        name="foreign",
        pat_str=pattern,
        mergeable_ranks=encoding_parts(state).mergeable_ranks,
        special_tokens=encoding_parts(state).special_tokens,
    )
    (folder / "tokenizer.pkl").write_bytes(pickle.dumps(foreign))
    one_error_line([*ONCE, str(folder)], "tokenizer.pkl splits text with the pattern", "refused")


def run_real_cli(args: list[str], stdin: str, home: Path) -> subprocess.CompletedProcess:
    """The CLI as a person runs it: a panic in tiktoken prints from Rust, past Python."""
    env = {**os.environ, "CHATCLI_HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "chatcli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


PASTES = {
    "spaces": "x" + " " * 1_000_000 + "x",
    "tabs": "tab\t" + "\t" * 1_200_000 + "end",
    "ideographic": "a" + "\u3000" * 1_100_000 + "!",
    "mixed": "x" + " \u00a0" * 600_000 + "y",
    "after-a-line": "first line\n" + " " * 1_000_000 + "last",
}


@pytest.mark.slow
@pytest.mark.parametrize("paste", list(PASTES))
def test_any_pasted_text_is_tokenized_not_a_panic(tmp_path, paste):
    result = run_real_cli(["once", "--max-tokens", "1", "-"], PASTES[paste], tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr[-2000:]
    assert lines == [lines[0]] and "more than the model's 1280-token context" in lines[0]
    assert "panicked" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_chat_goes_on_after_a_paste_of_a_million_spaces(tmp_path):
    stdin = "x" + " " * 1_000_000 + "x\nWhat is 2+2?\n"
    result = run_real_cli(["chat", "--max-tokens", "3", "--temperature", "0"], stdin, tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]  # piped: a message failed
    assert "panicked" not in result.stderr and "Traceback" not in result.stderr
    assert "more than the model's 1280-token context" in result.stderr
    assert result.stdout.strip()  # the second message was answered


# ---- 5. conversation files ---------------------------------------------------------------


def _conversation(path: Path, turns: int, header: str | None = None) -> None:
    lines = [header or json.dumps({"type": "header", "version": 1, "id": path.stem})]
    for i in range(turns):
        for role in ("user", "assistant"):
            message = {"role": role, "content": f"{role} {i}"}
            lines.append(json.dumps({"type": "message", "message": message}))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    "header",
    ['{"type": "header", "vers', DEEP_JSON, "\x00\x01garbage", "[1, 2, 3]", '{"type": "x"}'],
    ids=["cut", "deep", "garbage", "array", "not-a-header"],
)
def test_a_damaged_header_loses_that_line_only(tmp_path, header):
    folder = tmp_path / "home" / "conversations"
    folder.mkdir(parents=True)
    _conversation(folder / "long.jsonl", 75, header)
    result = runner.invoke(app, ["chat", "--resume", "long"], input="")
    assert result.exit_code == 0, result.output
    assert "Resumed long.jsonl: 150 messages." in result.stderr
    assert sum("line 1:" in line for line in result.stderr.splitlines()) == 1
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("bad_lines", "warnings"),
    [
        ([DEEP_JSON], ["line 4: unreadable record skipped (nested too deeply to read"]),
        (['{"type": "message", "message": ' * 50_000], ["line 4: unreadable record skipped"]),
        ([json.dumps({"type": "stray", "n": i}) for i in range(400)], ["400 lines skipped"]),
        (["not json"] * 6, ["6 lines skipped, damaged or not a conversation's records"]),
        (["not json"] * 5, ["line 4:", "line 5:", "line 6:", "line 7:", "line 8:"]),
    ],
    ids=["deep", "deep-unclosed", "400-stray", "6-garbage", "5-garbage"],
)
def test_bad_lines_are_skipped_with_one_warning_each_or_one_for_many(tmp_path, bad_lines, warnings):
    folder = tmp_path / "home" / "conversations"
    folder.mkdir(parents=True)
    path = folder / "c.jsonl"
    _conversation(path, 1)
    with path.open("a") as f:
        f.write("\n".join(bad_lines) + "\n")
        f.write(json.dumps({"type": "message", "message": {"role": "user", "content": "q"}}))
        f.write("\n")
    result = runner.invoke(app, ["chat", "--resume", "c"], input="")
    assert result.exit_code == 0, result.output
    assert "Resumed c.jsonl: 3 messages." in result.stderr
    notes = [line for line in result.stderr.splitlines() if "line" in line or "skipped" in line]
    assert len(notes) == len(warnings), notes
    for note, warning in zip(notes, warnings, strict=True):
        assert warning in note


# ---- 6. settings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ('max_tokens = "512"', "max_tokens is the string '512', not a number"),
        ('temperature = "0.7"', "temperature is the string '0.7', not a number"),
        ('top_k = " 40 "', "top_k is the string ' 40 ', not a number"),
        ("seed = true", "seed must be a whole number from 0 to 2**63-1, or random, got True"),
        ("temprature = 0.5", "unknown key 'temprature' (did you mean temperature?)"),
        ("max_tokens = " + "[" * 100_000, "is not valid TOML (nested too deeply"),
    ],
)
def test_a_config_value_of_the_wrong_kind_is_one_line(tmp_path, line, said):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(line + "\n")
    one_error_line(["once", "hi"], "config.toml", said)


def test_quoted_words_stay_words_in_the_config_file(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text('seed = "random"\nstep = "latest"\ntop_k = "off"\n')
    result = runner.invoke(app, ["once", "--max-tokens", "1", "hi"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("variable", "meant"),
    [
        ("CHATCLI_TEMPRATURE", "CHATCLI_TEMPERATURE"),
        ("CHATCLI_MAXTOKENS", "CHATCLI_MAX_TOKENS"),
        ("CHATCLI_MODLE", "CHATCLI_MODEL"),
        ("CHATCLI_TOPK", "CHATCLI_TOP_K"),
        ("CHATCLI_CONVERSATION_DIR", "CHATCLI_CONVERSATIONS_DIR"),
    ],
)
def test_a_misspelt_variable_is_named_with_the_one_meant(variable, meant):
    result = runner.invoke(app, ["once", "--max-tokens", "1", "hi"], env={variable: "3"})
    assert result.exit_code == 0, result.output
    assert (
        f"{variable} is not a chatcli variable, so it changes nothing; did you mean {meant}?"
        in result.stderr
    )
