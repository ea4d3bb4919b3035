"""Round trips through the Hub cache and `chatcli export`, tried as a careless user and a careful
attacker would: an export of every era put in the Hub cache and run as hf:ORG/NAME by every
command that takes --model; a Hub cache that is a file or has lost a blob; an OUT that is a
link, under a file or not writable; the half-written folder a killed export leaves.

The Hub cache is laid out on disk (tests/hub_fakes.py); commands that read it run in a child
process, for huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE when it is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hf_models import era_checkpoint, exported
from hub_fakes import (
    EMBEDDED_TOKENIZER,
    FakeHub,
    FakeRepo,
    commit_of,
    flat_files,
    one_line_error,
    run_cli,
    run_python,
    write_hub_cache,
)
from typer.testing import CliRunner

from chatcli.cli.app import app

pytest.importorskip("huggingface_hub", reason="needs the hf extra: pip install 'chatcli[hf]'")
pytest.importorskip("transformers", reason="needs the hf extra: pip install 'chatcli[hf]'")


QUESTION = "What is 2+3?"
LATER_ERAS = ("B", "C", "D")  # random models; E is the embedded model's era
runner = CliRunner()


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    for name in ("CHATCLI_MODEL", "CHATCLI_CONFIG", "CHATCLI_SOURCE", "CHATCLI_STEP"):
        monkeypatch.delenv(name, raising=False)


def _folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """Exports of eras B, C, D (random models) and of the embedded model (era E), by name."""
    root = tmp_path_factory.mktemp("roundtrips")
    found = {era: exported(era, root) for era in LATER_ERAS}
    out = root / "embedded"
    made = runner.invoke(app, ["export", str(out)])
    assert made.exit_code == 0, made.output
    found["embedded"] = out
    return found


@pytest.fixture(scope="module")
def cache(exports, tmp_path_factory) -> Path:
    """A Hub cache holding each export as org/<name>, and the embedded nanochat checkpoint
    as org/flat."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    for name, folder in exports.items():
        repo = f"org/{name.lower()}"
        write_hub_cache(cache, repo, _folder_files(folder), commit_of(repo))
    write_hub_cache(cache, "org/flat", flat_files(), commit_of("org/flat"))
    return cache


def offline(cache: Path) -> dict[str, str]:
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def local_answer() -> str:
    result = runner.invoke(app, ["once", QUESTION, "-t", "0"])
    assert result.exit_code == 0, result.output
    return result.stdout


# ---- an export in the Hub cache runs as hf:ORG/NAME --------------------------------------------

LOGITS = """
import json, sys, torch
from chatcli.model.checkpoint import load_model
ids = torch.tensor([[1, 5, 200, 31, 7, 900, 12, 3]])
out = {}
for hub_id, local in json.loads(sys.argv[1]).items():
    a, _, _ = load_model(hub_id, device="cpu")
    b, _, _ = load_model(local, device="cpu")
    with torch.no_grad():
        diff = (a(ids)[0] - b(ids)[0]).abs().max().item()
    out[hub_id] = [a.info.era, a.info.tag, diff]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_an_export_of_every_era_loads_from_the_hub_cache_as_its_checkpoint(
    exports, cache, tmp_path
):
    root = exports["B"].parents[1]  # where hf_models made the checkpoints it exported
    pairs = {f"hf:org/{e.lower()}": str(era_checkpoint(e, root)) for e in LATER_ERAS}
    pairs["hf:org/embedded"] = None  # the embedded model itself
    result = run_python("-c", LOGITS, json.dumps(pairs), home=tmp_path, **offline(cache))
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert got == {
        "hf:org/b": ["B", "b", 0.0],
        "hf:org/c": ["C", "c", 0.0],
        "hf:org/d": ["D", "d", 0.0],
        "hf:org/embedded": ["E", "embedded", 0.0],
    }


@pytest.mark.slow
def test_once_and_chat_answer_from_a_cached_export_as_from_the_embedded_model(
    cache, tmp_path, local_answer
):
    once = run_cli(
        "once", "--model", "hf:org/embedded", QUESTION, "-t", "0", home=tmp_path, **offline(cache)
    )
    assert once.returncode == 0, once.stderr
    assert once.stdout == local_answer
    chat = subprocess.run(
        [sys.executable, "-m", "chatcli", "chat", "--model", "hf:org/embedded", "-t", "0"],
        input=QUESTION + "\n",
        capture_output=True,
        text=True,
        timeout=180,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "CHATCLI_HOME": str(tmp_path / "chat"), **offline(cache)},
    )
    assert chat.returncode == 0, chat.stderr
    assert "chatcli · embedded · step 0 · era E" in chat.stderr  # named by its repo
    assert chat.stdout == local_answer


@pytest.mark.slow
def test_models_lists_the_exports_in_the_hub_cache(exports, cache, tmp_path):
    from safetensors.torch import load_file

    result = run_cli("models", home=tmp_path, HF_HUB_CACHE=str(cache), COLUMNS="250")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[2:]}
    for name, folder in exports.items():
        weights = load_file(folder / "model.safetensors")
        params = sum(t.numel() for t in weights.values())
        era = "E" if name == "embedded" else name
        assert rows[f"hf:org/{name.lower()}"][4:6] == [era, f"{params / 1e6:.1f}M"]
    assert rows["hf:org/embedded"][5] == "3.6M"
    assert rows["hf:org/embedded"][8] == str(
        cache / "models--org--embedded" / "snapshots" / commit_of("org/embedded")
    )
    assert result.stderr == ""


@pytest.mark.slow
def test_export_takes_a_hub_id_as_every_other_command_does(exports, cache, tmp_path):
    from safetensors.torch import load_file

    again = tmp_path / "again"
    result = run_cli(
        "export", "--model", "hf:org/embedded", str(again), home=tmp_path, **offline(cache)
    )
    assert result.returncode == 0, result.stderr
    assert "Exporting era E from the transformers-format model hf:org/embedded at commit" in (
        result.stderr
    )
    want, got = (
        load_file(exports["embedded"] / "model.safetensors"),
        load_file(again / "model.safetensors"),
    )
    assert want.keys() == got.keys()
    assert all(want[k].equal(got[k]) for k in want)
    # A nanochat checkpoint on the Hub exports as it does from its folder.
    flat = tmp_path / "flat"
    result = run_cli("export", "--model", "hf:org/flat", str(flat), home=tmp_path, **offline(cache))
    assert result.returncode == 0, result.stderr
    got = load_file(flat / "model.safetensors")
    assert all(want[k].equal(got[k]) for k in want)
    assert "the nanochat checkpoint hf:org/flat at commit" in (flat / "README.md").read_text()


@pytest.mark.slow
def test_pull_fetches_an_export_of_a_later_era_without_its_code(exports, tmp_path, local_answer):
    main = commit_of("main")
    files = _folder_files(exports["embedded"])
    with FakeHub({"org/exp": FakeRepo({main: files}, {"main": main})}) as hub:
        pulled = run_cli("pull", "hf:org/exp", home=tmp_path, HF_ENDPOINT=hub.url)
        assert pulled.returncode == 0, pulled.stderr
        assert sorted(hub.downloads()) == [
            "config.json",  # read first, to check the model type; then found in the cache
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    answer = run_cli(
        "once", "--model", "hf:org/exp", QUESTION, "-t", "0", home=tmp_path, HF_HUB_OFFLINE="1"
    )
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout == local_answer


# ---- --source and --step where a folder has one checkpoint -------------------------------------


def test_a_source_for_a_transformers_folder_is_refused_as_a_step_is(exports, tmp_path):
    folder = exports["embedded"]
    for command in (["once", "hi"], ["export", str(tmp_path / "out")]):
        result = runner.invoke(app, [*command, "--model", str(folder), "--source", "base"])
        assert result.exit_code == 1, result.output
        assert result.stderr == (
            f"Error: {folder} is a transformers-format model: it holds one set of weights, not "
            "checkpoints of sft, base, ...; source 'base' picks nothing. Leave the source at sft "
            "(--source, CHATCLI_SOURCE or the config's source).\n"
        )
        result = runner.invoke(app, [*command, "--model", str(folder), "--step", "3"])
        assert result.exit_code == 1, result.output
        assert result.stderr == (
            f"Error: {folder} is a transformers-format model: it holds one set of weights, not "
            "steps. Leave the step out (--step, CHATCLI_STEP or the config's step).\n"
        )
    assert not (tmp_path / "out").exists()


# ---- a Hub cache that is not what it should be -------------------------------------------------


@pytest.mark.slow
def test_a_hub_cache_that_is_a_file_is_one_line_in_every_command(tmp_path):
    file = tmp_path / "cache"
    file.write_text("not a folder")
    env = {"HF_HUB_CACHE": str(file), "HF_HUB_OFFLINE": "1"}
    want = (
        f"Error: The Hub cache {file} is a file, not a folder: point HF_HUB_CACHE at a folder, "
        "or unset it."
    )
    for args in (["once", "--model", "hf:org/flat", "hi"], ["models"], ["pull", "hf:org/flat"]):
        assert one_line_error(run_cli(*args, home=tmp_path, **env)) == want, args
    assert file.read_text() == "not a folder"
    # The default place, under HF_HOME: that variable is the one to change.
    home = tmp_path / "other"
    (home / "hf").mkdir(parents=True)
    (home / "hf" / "hub").write_text("not a folder")
    listed = run_cli("models", home=home)  # HF_HOME is home/hf
    assert one_line_error(listed) == (
        f"Error: The Hub cache {home / 'hf' / 'hub'} is a file, not a folder: set HF_HUB_CACHE to a "
        "folder, or point HF_HOME (whose hub it is) elsewhere."
    )
    under = run_cli("pull", "hf:org/flat", home=tmp_path, HF_HUB_CACHE=str(file / "hub"))
    assert one_line_error(under) == (
        f"Error: The Hub cache {file / 'hub'} cannot be made: {file} is a file, not a folder: "
        "point HF_HUB_CACHE at a folder, or unset it."
    )


@pytest.fixture
def damaged(tmp_path) -> Path:
    """A Hub cache whose copy of org/flat has lost its weights' blob."""
    cache = tmp_path / "hub"
    snapshot = write_hub_cache(cache, "org/flat", flat_files(), commit_of("main"))
    weights = next(snapshot.glob("model_*.pt"))
    weights.resolve().unlink()
    return cache


@pytest.mark.slow
def test_a_cached_model_with_a_missing_blob_is_said_to_be_damaged(damaged, tmp_path):
    snapshot = damaged / "models--org--flat" / "snapshots" / commit_of("main")
    [weights] = snapshot.glob("model_*.pt")
    blob = os.path.normpath(weights.parent / os.readlink(weights))
    result = run_cli("once", "--model", "hf:org/flat", "hi", home=tmp_path, **offline(damaged))
    assert one_line_error(result) == (
        f"Error: The Hub cache's copy of hf:org/flat is damaged: {weights.name} (in {snapshot}) "
        f"links to {blob}, which is missing. Run `chatcli pull hf:org/flat` where the Hub can be "
        f"reached to download it again (or delete {damaged / 'models--org--flat'} and pull it "
        "afresh)."
    )
    listed = run_cli("models", home=tmp_path, HF_HUB_CACHE=str(damaged), COLUMNS="300")
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith("hf:org/flat"))
    assert row.split()[-3:] == [str(weights), "(not", "runnable)"]
    assert (
        f"{weights}: links to {blob}, which is missing: run `chatcli pull hf:org/flat` to "
        "download it again." in " ".join(listed.stderr.split())
    )


@pytest.mark.slow
def test_pull_mends_a_damaged_copy_as_the_message_says(damaged, tmp_path, local_answer):
    main = commit_of("main")
    with FakeHub({"org/flat": FakeRepo({main: flat_files()}, {"main": main})}) as hub:
        pulled = run_cli(
            "pull", "hf:org/flat", home=tmp_path, HF_HUB_CACHE=str(damaged), HF_ENDPOINT=hub.url
        )
    assert pulled.returncode == 0, pulled.stderr
    again = run_cli(
        "once", "--model", "hf:org/flat", QUESTION, "-t", "0", home=tmp_path, **offline(damaged)
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout == local_answer


def test_a_safetensors_header_nested_past_jsons_reach_is_one_problem(tmp_path):
    from chatcli.errors import CheckpointError
    from chatcli.model.hub_cache import safetensors_params

    header = b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError) as e:
        safetensors_params(path)
    assert str(e.value) == (
        f"{path} is not a readable safetensors file (its header is nested too deeply)."
    )


# ---- where an export may not write -------------------------------------------------------------


def export_to(out: Path) -> str:
    """The one error line `chatcli export OUT` gives (exit 1, no traceback)."""
    result = runner.invoke(app, ["export", str(out)])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 or lines[0].startswith("Exporting"), result.stderr
    return lines[-1]


def test_an_export_never_writes_through_a_link(tmp_path):
    target = tmp_path / "elsewhere"
    (tmp_path / "dangling").symlink_to(target)
    assert export_to(tmp_path / "dangling") == (
        f"Error: {tmp_path / 'dangling'} is a link to {target}, which does not exist: chatcli "
        "export writes a new folder, never through a link. Remove the link, or pass a new OUT."
    )
    assert not target.exists()
    target.mkdir()
    (tmp_path / "to-folder").symlink_to(target)
    assert export_to(tmp_path / "to-folder") == (
        f"Error: {tmp_path / 'to-folder'} is a link to {target}: chatcli export writes a new "
        f"folder, never through a link. Pass the folder it leads to ({target}), or a new OUT."
    )
    assert list(target.iterdir()) == []
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    assert export_to(tmp_path / "gone" / "out") == (
        f"Error: {tmp_path / 'gone' / 'out'} cannot be made: {tmp_path / 'gone'} is a link to "
        f"{tmp_path / 'nowhere'}, which does not exist. Make that folder, or pick another OUT."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "dangling",
        "elsewhere",
        "gone",
        "to-folder",
    ]


def test_an_export_under_a_file_is_refused_before_the_model_is_read(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    for out in (file / "out", file / "a" / "b"):
        assert export_to(out) == (
            f"Error: {out} cannot be made: {file} is a file, not a folder. Pick an OUT inside "
            "a folder."
        )
    assert file.read_text() == "mine"


def test_an_export_into_the_folder_one_is_in_is_refused(tmp_path, monkeypatch):
    # It would be renamed into place: the shell left in a folder that no longer exists.
    here = tmp_path / "empty"
    here.mkdir()
    monkeypatch.chdir(here)
    for out in (Path("."), here, Path("..") / "empty"):
        assert export_to(out).endswith(
            "is the folder you are in: chatcli export puts a new folder in OUT's place. Pick "
            "a new OUT folder (e.g. ./model)."
        )
    assert here.is_dir() and list(here.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder")
def test_an_export_into_a_folder_it_may_not_write_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        assert export_to(locked / "out") == (
            f"Error: {locked / 'out'} cannot be made: {locked} is not writable by this user. "
            "Pick an OUT in a folder you can write to."
        )
    finally:
        locked.chmod(0o755)


def test_an_export_the_system_refuses_is_one_line_and_leaves_nothing(tmp_path):
    # Even root may not make folders in /sys: the refusal comes from mkdir itself.
    place = Path("/sys/kernel")
    if not place.is_dir():
        pytest.skip("no /sys/kernel here")
    out = place / "chatcli-export-test"
    line = export_to(out)
    assert line.startswith(f"Error: {out} cannot ") and line.endswith(". Pick another OUT.")
    assert not out.exists()


# ---- a half-written export left by a killed process --------------------------------------------


def test_a_killed_exports_partial_is_removed_and_a_running_ones_left(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f".out.partial-{gone.pid}"
    (stale / "half").mkdir(parents=True)
    (stale / "half" / "model.safetensors").write_bytes(b"\0" * 100)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        running = tmp_path / f".out.partial-{alive.pid}"
        running.mkdir()
        other = tmp_path / f".other.partial-{gone.pid}"  # another OUT's: not this export's
        other.mkdir()
        # A link named as a partial is no folder an export made: never followed nor removed.
        mine = tmp_path / "mine"
        (mine / "keep").mkdir(parents=True)
        planted = tmp_path / ".out.partial-4194305"  # past any pid_max: no such process
        planted.symlink_to(mine)
        result = runner.invoke(app, ["export", str(tmp_path / "out")])
        assert result.exit_code == 0, result.output
        assert result.stderr.splitlines()[0] == (
            f"Removed {stale}: a half-written export left by process {gone.pid}, which is no "
            "longer running."
        )
        assert not stale.exists()
        assert running.is_dir() and other.is_dir()
        assert planted.is_symlink() and (mine / "keep").is_dir()
        assert (tmp_path / "out" / "model.safetensors").is_file()
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.slow
def test_an_export_killed_midway_is_cleaned_by_the_next(tmp_path):
    out = tmp_path / "out"
    killed = subprocess.Popen(
        [sys.executable, "-m", "chatcli", "export", str(out)],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    partial = tmp_path / f".out.partial-{killed.pid}"
    deadline = time.monotonic() + 120
    while not partial.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    killed.kill()  # SIGKILL: no except clause or finally runs
    killed.wait()
    if out.exists():
        pytest.skip("the export finished before it could be killed")
    assert partial.is_dir()
    result = runner.invoke(app, ["export", str(out)])
    assert result.exit_code == 0, result.output
    assert f"Removed {partial}: a half-written export left by process {killed.pid}" in (
        result.stderr
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---- the exported tokenizer in transformers ----------------------------------------------------


def test_an_exports_tokenizer_loads_in_transformers_and_encodes_as_ours(exports):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from chatcli.model.hf_tokenizer import probe_texts
    from chatcli.model.tokenizer import Tokenizer

    ours = Tokenizer.from_file(EMBEDDED_TOKENIZER)
    texts = [*probe_texts(ours), "<|bos|><|user_start|>What is 2+3?<|user_end|>", "héllo 🙂"]
    for folder in (exports["B"], exports["embedded"]):
        config = json.loads((folder / "tokenizer_config.json").read_text())
        assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # built in: no code
        # The built-in class loads it without running or asking about any code; AutoTokenizer
        # reads config.json first, whose auto_map names the export's config code (eras B-E).
        for theirs in (
            PreTrainedTokenizerFast.from_pretrained(folder),
            AutoTokenizer.from_pretrained(folder, trust_remote_code=True),
        ):
            for text in texts:
                want = ours.enc.encode(text, allowed_special="all")
                assert theirs(text, add_special_tokens=False)["input_ids"] == want, text
                assert theirs.decode(want) == ours.decode(want)
