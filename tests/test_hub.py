"""Hub models (hf:ORG/NAME): ids, which files of a repo make a model, and the real fetching code
(huggingface_hub's snapshot_download and cache) against a Hub cache laid out on disk and a
small Hub server on 127.0.0.1 (tests/hub_fakes.py). No network is used.

The commands run in a child process: huggingface_hub reads HF_HOME, HF_HUB_CACHE,
HF_HUB_OFFLINE, HF_ENDPOINT and HF_TOKEN when it is imported, as it does for a user.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
from hub_fakes import (
    EMBEDDED_META,
    EMBEDDED_MODEL,
    EMBEDDED_STEP,
    FakeHub,
    FakeRepo,
    base_dir_files,
    commit_of,
    flat_files,
    one_line_error,
    run_cli,
    run_python,
    safetensors_bytes,
    write_hub_cache,
)
from typer.testing import CliRunner

from chatcli.cli.app import app
from chatcli.errors import CheckpointError
from chatcli.model.checkpoint_paths import resolve_checkpoint
from chatcli.model.hub import import_hub
from chatcli.model.hub_cache import safetensors_params
from chatcli.model.hub_layout import HubId, parse_hub_id, pick_files

# The embedded checkpoint's size as `chatcli models` prints it (MB, one decimal).
EMBEDDED_MB = f"{EMBEDDED_MODEL.stat().st_size / 1e6:.1f}"

huggingface_hub = pytest.importorskip(
    "huggingface_hub", reason="needs the hf extra: pip install 'chatcli[hf]'"
)
QUESTION = "What is 2+3?"
runner = CliRunner()


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    for name in (
        "CHATCLI_MODEL",
        "CHATCLI_CONFIG",
        "CHATCLI_URL",
        "CHATCLI_SOURCE",
        "CHATCLI_STEP",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def local_answer() -> str:
    """What the embedded model answers on its own, greedy: the Hub copies must say the same."""
    result = runner.invoke(app, ["once", QUESTION, "-t", "0"])
    assert result.exit_code == 0, result.output
    return result.stdout


# ---- ids ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("hf:org/name", HubId("org/name")),
        ("hf:karpathy/nanochat-d32", HubId("karpathy/nanochat-d32")),
        ("hf:Org_1/my.model-v2@v1.0", HubId("Org_1/my.model-v2", "v1.0")),
        ("hf:org/name@refs/pr/1", HubId("org/name", "refs/pr/1")),
        ("hf:org/name@" + "a" * 40, HubId("org/name", "a" * 40)),
    ],
)
def test_a_hub_id_names_a_repo_and_a_revision(text, want):
    assert parse_hub_id(text) == want
    assert str(want) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("hf:", "hf: needs a model's Hub id after it: hf:ORG/NAME"),
        ("hf:foo", "hf:foo is not a Hub model id: write hf:ORG/NAME"),
        ("hf:a/b/c", "hf:a/b/c is not a Hub model id"),
        ("hf:-a/b", "hf:-a/b is not a Hub model id"),
        ("hf:a--b/c", "hf:a--b/c is not a Hub model id"),
        ("hf:a/b@", "hf:a/b@ names no revision after its @: write hf:a/b@REVISION"),
        ("hf:a/b@x y", "hf:a/b@x y: 'x y' is not a revision"),
        ("hf:a/b@../x", "is not a revision"),
    ],
)
def test_a_bad_hub_id_is_refused_saying_how_to_write_one(text, message):
    with pytest.raises(CheckpointError) as e:
        parse_hub_id(text)
    assert str(e.value).startswith(message) if message.startswith("hf") else message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("bad", ["hf:", "hf:foo", "hf:a/b@"])
def test_the_cli_refuses_a_bad_hub_id_in_one_line(bad):
    result = runner.invoke(app, ["once", "hi", "--model", bad])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {bad} ") or result.stderr.startswith("Error: hf: ")
    assert result.stderr.count("\n") == 1


# ---- picking a repo's files ---------------------------------------------------------------

FLAT = [
    "README.md",
    "model_000650.pt",
    "meta_000650.json",
    "model_000700.pt",
    "meta_000700.json",
    "tokenizer.pkl",
    "token_bytes.pt",
]
BASE_DIR = [
    "tokenizer/tokenizer.pkl",
    "tokenizer/token_bytes.pt",
    "chatsft_checkpoints/d12/model_000100.pt",
    "chatsft_checkpoints/d12/meta_000100.json",
    "chatsft_checkpoints/d20/model_000100.pt",
    "chatsft_checkpoints/d20/meta_000100.json",
    "chatsft_checkpoints/d20/model_000200.pt",
    "chatsft_checkpoints/d20/meta_000200.json",
    "base_checkpoints/d20/model_021400.pt",
    "base_checkpoints/d20/meta_021400.json",
]


def test_a_flat_repo_gives_its_latest_step_with_meta_and_tokenizer_only():
    got = pick_files(FLAT, "hf:o/n")
    assert got.layout == "nanochat"
    assert got.files == ("model_000700.pt", "meta_000700.json", "tokenizer.pkl")
    assert (got.model_file, got.step) == ("model_000700.pt", 700)
    assert pick_files(FLAT, "hf:o/n", step=650).files[0] == "model_000650.pt"


def test_a_base_dir_repo_picks_source_deepest_tag_and_step_as_on_disk():
    got = pick_files(BASE_DIR, "hf:o/n")
    assert got.files == (
        "chatsft_checkpoints/d20/model_000200.pt",
        "chatsft_checkpoints/d20/meta_000200.json",
        "tokenizer/tokenizer.pkl",
    )
    assert pick_files(BASE_DIR, "hf:o/n", source="base").model_file == (
        "base_checkpoints/d20/model_021400.pt"
    )
    assert pick_files(BASE_DIR, "hf:o/n", tag="d12").model_file == (
        "chatsft_checkpoints/d12/model_000100.pt"
    )
    assert pick_files(BASE_DIR, "hf:o/n", step=100).model_file == (
        "chatsft_checkpoints/d20/model_000100.pt"
    )


@pytest.mark.parametrize(
    ("listing", "kwargs"),
    [
        (FLAT, {}),
        (FLAT, {"step": 650}),
        (BASE_DIR, {}),
        (BASE_DIR, {"source": "base"}),
        (BASE_DIR, {"step": 100}),
        (["d12/model_000005.pt", "d12/meta_000005.json", "d12/tokenizer.pkl"], {}),
    ],
)
def test_the_files_picked_are_the_ones_the_local_loader_takes_from_the_same_tree(
    tmp_path, listing, kwargs
):
    picked = pick_files(listing, "hf:o/n", **kwargs)
    for path in listing:  # names are all the resolver reads
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
    ref = resolve_checkpoint(tmp_path, **kwargs)
    on_disk = tuple(
        p.relative_to(tmp_path).as_posix()
        for p in (ref.model_file, ref.meta_file, ref.tokenizer_file)
    )
    assert picked.files == on_disk


@pytest.mark.parametrize(
    ("listing", "kwargs", "message"),
    [
        (FLAT, {"step": 5}, "No step 5 in hf:o/n; steps there: 650, 700."),
        (
            ["model_000010.pt", "model_000020.pt", "meta_000010.json", "tokenizer.pkl"],
            {},
            "model_000020.pt in hf:o/n has no meta_000020.json beside it (it holds the "
            "model_config): load a whole step with --step 10.",
        ),
        (
            [p for p in BASE_DIR if p.startswith(("base", "tok"))],
            {},
            "No chatsft_checkpoints in hf:o/n; it has checkpoints of base: pick one with "
            "--source base.",
        ),
        (BASE_DIR, {"tag": "d99"}, "No tag 'd99' in hf:o/n; tags there: d12, d20."),
        (
            ["model_000001.pt", "meta_000001.json"],
            {},
            "hf:o/n has no tokenizer.pkl where chatcli looks for one (tokenizer.pkl, "
            "tokenizer/tokenizer.pkl).",
        ),
        (
            ["config.json", "pytorch_model.bin", "tokenizer.json"],
            {},
            "hf:o/n has a config.json but no *.safetensors weights at its root: chatcli reads "
            "safetensors only (no pickled .bin files).",
        ),
        (
            ["README.md", "data.csv"],
            {},
            "hf:o/n holds no model chatcli can run: neither nanochat's model_<step>.pt with "
            "meta_<step>.json and tokenizer.pkl, nor transformers' config.json with "
            "*.safetensors and tokenizer.json.",
        ),
    ],
)
def test_a_repo_that_cannot_give_the_asked_model_says_why(listing, kwargs, message):
    with pytest.raises(CheckpointError) as e:
        pick_files(listing, "hf:o/n", **kwargs)
    assert str(e.value) == message


def test_a_transformers_repo_gives_its_config_weights_and_tokenizer_and_no_code():
    listing = [
        "README.md",
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "modeling_nanochat.py",
        "pytorch_model.bin",
        "onnx/model.safetensors",
    ]
    got = pick_files(listing, "hf:o/n")
    assert got.layout == "transformers"
    assert got.model_file is None
    assert set(got.files) == {
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_safetensors_params_reads_the_header_only(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(safetensors_bytes({"a": [3, 4], "b": [5]}))
    assert safetensors_params(path) == 17
    path.write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        safetensors_params(path)


# ---- without the hf extra -------------------------------------------------------------------


def test_without_huggingface_hub_an_hf_model_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    monkeypatch.setitem(sys.modules, "huggingface_hub.constants", None)
    with pytest.raises(CheckpointError) as e:
        import_hub()
    assert str(e.value) == "hf: models need huggingface_hub: pip install 'chatcli[hf]'"
    result = runner.invoke(app, ["once", "hi", "--model", "hf:org/name"])
    assert result.exit_code == 1
    assert result.stderr == "Error: hf: models need huggingface_hub: pip install 'chatcli[hf]'\n"
    listed = runner.invoke(app, ["models"])  # the Hub cache is left out, nothing fails
    assert listed.exit_code == 0
    assert "embedded" in listed.stdout and "hf:" not in listed.stdout


# ---- the Hub cache, offline -----------------------------------------------------------------

TF_CONFIG = json.dumps({"model_type": "nanochat", "vocab_size": 8}).encode()


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A Hub cache holding nanochat models in both of nanochat's layouts, a revision other
    than main, a transformers-format nanochat model, a model of another kind and a half
    downloaded one."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    write_hub_cache(cache, "org/base", base_dir_files(), commit_of("base"))
    write_hub_cache(cache, "org/flat", flat_files(), commit_of("flat"))
    write_hub_cache(cache, "org/flat", flat_files(1000), commit_of("flat v1"), refs=("v1",))
    tf = {
        "config.json": TF_CONFIG,
        "model.safetensors": safetensors_bytes({"w": [1000, 500]}),
        "tokenizer.json": b"{}",
    }
    write_hub_cache(cache, "org/tf", tf, commit_of("tf"))
    llama = {**tf, "config.json": json.dumps({"model_type": "llama"}).encode()}
    write_hub_cache(cache, "org/llama", llama, commit_of("llama"))
    write_hub_cache(
        cache, "org/half", {"model_000005.pt": b"", "tokenizer.pkl": b""}, commit_of("half")
    )
    return cache


@pytest.mark.slow
def test_a_cached_hub_model_answers_offline_as_the_local_model_does(cache, tmp_path, local_answer):
    offline = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    base = run_cli("once", "--model", "hf:org/base", QUESTION, "-t", "0", home=tmp_path, **offline)
    assert base.returncode == 0, base.stderr
    assert base.stdout == local_answer
    flat = run_cli(
        "once", "--model", "hf:org/flat@v1", QUESTION, "-t", "0", "--json", home=tmp_path, **offline
    )
    assert flat.returncode == 0, flat.stderr
    out = json.loads(flat.stdout)
    assert out["text"] == local_answer.split("]", 1)[1].strip()
    # Loaded from the cached snapshot that the v1 tag names.
    v1_file = cache / "models--org--flat" / "snapshots" / commit_of("flat v1") / "model_001000.pt"
    assert out["model"] == str(v1_file)
    # The Python API takes the same ids; a one-checkpoint repo's tag is its name.
    code = "import chatcli; m = chatcli.load_model('hf:org/flat@v1')[0]; print(m.info)"
    api = run_python("-c", code, home=tmp_path, **offline)
    assert api.returncode == 0, api.stderr
    assert f"path='{v1_file}', tag='flat', step=1000, source=None, era='E'" in api.stdout


@pytest.mark.slow
def test_hf_home_places_the_cache(cache, tmp_path, local_answer):
    # No HF_HUB_CACHE: the cache is $HF_HOME/hub.
    home = tmp_path / "home"
    (home / "hf").mkdir(parents=True)
    (home / "hf" / "hub").symlink_to(cache)
    result = run_cli(
        "once", "--model", "hf:org/flat", QUESTION, "-t", "0", home=home, HF_HUB_OFFLINE="1"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == local_answer


@pytest.mark.slow
def test_an_uncached_model_offline_gets_one_line_saying_what_to_do(cache, tmp_path):
    offline = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    missing = run_cli("once", "--model", "hf:org/missing", "hi", home=tmp_path, **offline)
    assert one_line_error(missing) == (
        f"Error: hf:org/missing is not in the Hub cache ({cache}), and HF_HUB_OFFLINE is set, "
        "so it cannot be downloaded: unset HF_HUB_OFFLINE, or run `chatcli pull hf:org/missing` "
        "where the Hub can be reached."
    )
    step = run_cli("pull", "hf:org/flat", "--step", "5", home=tmp_path, **offline)
    assert one_line_error(step) == (
        f"Error: No step 5 in the cached copy of hf:org/flat; steps there: {EMBEDDED_STEP}."
    )
    other = run_cli("pull", "hf:org/llama", home=tmp_path, **offline)
    assert one_line_error(other) == (
        "Error: hf:org/llama is a llama model (config.json's model_type); chatcli runs "
        "nanochat models only."
    )


@pytest.mark.slow
def test_models_lists_the_runnable_models_of_the_hub_cache(cache, tmp_path):
    result = run_cli("models", home=tmp_path, HF_HUB_CACHE=str(cache), COLUMNS="250")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[2:]}
    snap = cache / "models--org--flat" / "snapshots"
    assert rows["hf:org/base"][1:7] == ["sft", "d6", str(EMBEDDED_STEP), "E", "3.6M", EMBEDDED_MB]
    assert rows["hf:org/flat"][1:8] == [
        "-",
        "flat",
        str(EMBEDDED_STEP),
        "E",
        "3.6M",
        EMBEDDED_MB,
        "MB",
    ]
    assert rows["hf:org/flat"][8] == str(snap / commit_of("flat") / EMBEDDED_MODEL.name)
    assert rows["hf:org/flat@v1"][3] == "1000"
    assert rows["hf:org/tf"][1:8] == ["-", "-", "-", "A", "0.5M", "2.0", "MB"]
    assert rows["hf:org/half"][-3:] == [
        str(cache / "models--org--half" / "snapshots" / commit_of("half") / "model_000005.pt"),
        "(not",
        "runnable)",
    ]
    assert "hf:org/llama" not in rows  # not a nanochat model: not chatcli's to list
    assert "has no meta_000005.json beside it" in result.stderr


# ---- a Hub server ---------------------------------------------------------------------------

MAIN, V1 = commit_of("main"), commit_of("v1")


@pytest.fixture
def hub() -> FakeHub:
    tf_files = {
        "config.json": TF_CONFIG,
        "model.safetensors": safetensors_bytes({"w": [4, 4]}),
        "tokenizer.json": b"{}",
        "tokenizer_config.json": b'{"model_max_length": 2048}',
        "README.md": b"# exported\n",
        "modeling_nanochat.py": b"raise SystemExit('never run')\n",
        "pytorch_model.bin": b"pickle",
    }
    repos = {
        "org/flat": FakeRepo({MAIN: flat_files(), V1: flat_files(1000)}, {"main": MAIN, "v1": V1}),
        "org/gated": FakeRepo({MAIN: flat_files()}, {"main": MAIN}, token="hf_secret"),
        "org/tf": FakeRepo({MAIN: tf_files}, {"main": MAIN}),
        "org/llama": FakeRepo(
            {MAIN: {**tf_files, "config.json": b'{"model_type": "llama"}'}}, {"main": MAIN}
        ),
    }
    with FakeHub(repos) as hub:
        yield hub


def snapshot(home: Path, repo: str, commit: str) -> Path:
    return home / "hf" / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / commit


@pytest.mark.slow
def test_pull_fetches_one_models_files_and_says_how_to_run_it(hub, tmp_path, local_answer):
    result = run_cli("pull", "hf:org/flat", home=tmp_path, HF_ENDPOINT=hub.url)
    assert result.returncode == 0, result.stderr
    folder = snapshot(tmp_path, "org/flat", MAIN)
    assert result.stdout == (
        f"Pulled hf:org/flat at commit {MAIN[:12]}: {EMBEDDED_MODEL.name} (step {EMBEDDED_STEP}), "
        f"in {folder}\n"
        "Run it: chatcli chat --model hf:org/flat\n"
    )
    assert sorted(hub.downloads()) == [EMBEDDED_META.name, EMBEDDED_MODEL.name, "tokenizer.pkl"]
    assert sorted(p.name for p in folder.iterdir()) == sorted(hub.downloads())
    assert (folder / EMBEDDED_MODEL.name).read_bytes() == EMBEDDED_MODEL.read_bytes()
    assert "Fetching 3 files" in result.stderr  # huggingface_hub's own progress bar
    # Pulled once, it runs with the Hub out of reach.
    offline = run_cli(
        "once", "--model", "hf:org/flat", QUESTION, "-t", "0", home=tmp_path, HF_HUB_OFFLINE="1"
    )
    assert offline.stdout == local_answer


@pytest.mark.slow
def test_a_revision_picks_its_commit_and_is_remembered_for_offline_runs(hub, tmp_path):
    tagged = run_cli("pull", "org/flat@v1", home=tmp_path, HF_ENDPOINT=hub.url)  # no hf: needed
    assert tagged.returncode == 0, tagged.stderr
    assert tagged.stdout.startswith(
        f"Pulled hf:org/flat@v1 at commit {V1[:12]}: model_001000.pt (step 1000), in "
        f"{snapshot(tmp_path, 'org/flat', V1)}\n"
    )
    by_commit = run_cli("pull", f"hf:org/flat@{MAIN}", home=tmp_path, HF_ENDPOINT=hub.url)
    assert (
        f"at commit {MAIN[:12]}: {EMBEDDED_MODEL.name} (step {EMBEDDED_STEP})" in by_commit.stdout
    )
    offline = run_cli(
        "once", "--model", "hf:org/flat@v1", "--json", QUESTION, "-t", "0",
        home=tmp_path, HF_HUB_OFFLINE="1",
    )  # fmt: skip
    assert json.loads(offline.stdout)["model"].endswith(f"{V1}/model_001000.pt")
    unknown = run_cli("pull", "hf:org/flat@v9", home=tmp_path, HF_ENDPOINT=hub.url)
    assert one_line_error(unknown) == (
        f"Error: org/flat has no revision 'v9': name one of its branches, tags or commits "
        f"(see {hub.url}/org/flat), or drop the @."
    )


@pytest.mark.slow
def test_source_and_step_pick_one_checkpoint_of_a_base_dir_repo(hub, tmp_path):
    files = base_dir_files()
    files["base_checkpoints/d6/model_000500.pt"] = EMBEDDED_MODEL.read_bytes()
    files["base_checkpoints/d6/meta_000500.json"] = EMBEDDED_META.read_bytes()
    files["base_checkpoints/d6/model_000900.pt"] = b"a later step, not asked for"
    files["base_checkpoints/d6/optim_000500_rank0.pt"] = b"optimizer state, never fetched"
    hub.repos["org/runs"] = FakeRepo({MAIN: files}, {"main": MAIN})
    result = run_cli(
        "pull",
        "hf:org/runs",
        "--source",
        "base",
        "--step",
        "500",
        home=tmp_path,
        HF_ENDPOINT=hub.url,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith(
        "Run it: chatcli chat --model hf:org/runs --source base --step 500\n"
    )
    assert sorted(hub.downloads()) == [
        "base_checkpoints/d6/meta_000500.json",
        "base_checkpoints/d6/model_000500.pt",
        "tokenizer/tokenizer.pkl",
    ]


@pytest.mark.slow
def test_a_missing_repo_and_a_gated_one_say_what_to_do_in_one_line(hub, tmp_path):
    login = (
        "set HF_TOKEN to an access token of an account that may read it (or run `hf auth login`)."
    )
    missing = run_cli("once", "--model", "hf:org/nothing", "hi", home=tmp_path, HF_ENDPOINT=hub.url)
    assert one_line_error(missing) == (
        f"Error: No model org/nothing on the Hub ({hub.url}): check its name; if it is "
        f"private, {login}"
    )
    gated = run_cli("pull", "hf:org/gated", home=tmp_path, HF_ENDPOINT=hub.url)
    assert one_line_error(gated) == (
        f"Error: hf:org/gated is gated: accept its terms at {hub.url}/org/gated, then {login}"
    )
    assert hub.downloads() == []
    allowed = run_cli(
        "pull", "hf:org/gated", home=tmp_path, HF_ENDPOINT=hub.url, HF_TOKEN="hf_secret"
    )
    assert allowed.returncode == 0, allowed.stderr
    assert (snapshot(tmp_path, "org/gated", MAIN) / EMBEDDED_MODEL.name).is_file()
    wrong = run_cli("pull", "hf:org/flat", home=tmp_path, HF_ENDPOINT=hub.url, HF_TOKEN="hf_old")
    assert (
        one_line_error(wrong)
        == f"Error: The Hub refused the token sent for hf:org/flat (401): {login}"
    )


@pytest.mark.slow
def test_a_dropped_connection_is_resumed_or_said_in_one_line(hub, tmp_path):
    # Past huggingface_hub's 10 MiB read size, so that a whole read arrives before the drop.
    big = hashlib.sha256(b"seed").digest() * (24 * 2**20 // 32)
    files = {"model_000001.pt": big, "meta_000001.json": b"{}", "tokenizer.pkl": b"t"}
    hub.repos["org/big"] = FakeRepo({MAIN: files}, {"main": MAIN})
    hub.cut_short.add("model_000001.pt")
    result = run_cli("pull", "hf:org/big", home=tmp_path, HF_ENDPOINT=hub.url)
    gets = [r for m, p, r in hub.requests if m == "GET" and p.endswith("/model_000001.pt")]
    if int(huggingface_hub.__version__.split(".")[0]) >= 2:
        # huggingface_hub 2 asks for the rest at once.
        assert result.returncode == 0, result.stderr
        assert gets == [None, f"bytes={10 * 2**20}-"]
        assert "Trying to resume download" in result.stderr
    else:
        # 1.x gives up: one line says to run it again, and that run finishes the download.
        assert one_line_error(result) == (
            "Error: Fetching hf:org/big stopped (RemoteProtocolError: peer closed connection "
            "without sending complete message body (received 12582912 bytes, expected "
            "25165824)): run the command again; the files fetched whole are kept."
        )
        again = run_cli("pull", "hf:org/big", home=tmp_path, HF_ENDPOINT=hub.url)
        assert again.returncode == 0, again.stderr
    assert (snapshot(tmp_path, "org/big", MAIN) / "model_000001.pt").read_bytes() == big


@pytest.mark.slow
def test_an_unreachable_hub_falls_back_to_the_cache_or_says_so(hub, tmp_path, local_answer):
    assert run_cli("pull", "hf:org/flat", home=tmp_path, HF_ENDPOINT=hub.url).returncode == 0
    closed = "http://127.0.0.1:9"  # the discard port: nothing listens there
    cached = run_cli(
        "once", "--model", "hf:org/flat", QUESTION, "-t", "0", home=tmp_path, HF_ENDPOINT=closed
    )
    assert cached.returncode == 0, cached.stderr
    assert cached.stdout == local_answer
    missing = run_cli("pull", "hf:org/other", home=tmp_path, HF_ENDPOINT=closed)
    error = one_line_error(missing)
    assert error.startswith(
        f"Error: hf:org/other is not in the Hub cache ({tmp_path / 'hf' / 'hub'}), and the Hub "
        f"at {closed} cannot be reached (ConnectError: "
    )
    assert error.endswith("): check the network (or HF_ENDPOINT) and run again.")


@pytest.mark.slow
def test_a_hub_that_fails_while_fetching_gets_one_line(hub, tmp_path):
    hub.repos["org/down"] = FakeRepo({MAIN: flat_files()}, {"main": MAIN}, files_down=True)
    result = run_cli("pull", "hf:org/down", home=tmp_path, HF_ENDPOINT=hub.url)
    assert one_line_error(result) == (
        "Error: The Hub stopped answering while hf:org/down was fetched, and the Hub cache does "
        "not hold all of it: run the command again (or `chatcli pull hf:org/down`) when the Hub "
        "can be reached."
    )


@pytest.mark.slow
def test_a_transformers_repo_is_fetched_without_its_code_and_another_kind_is_not(hub, tmp_path):
    result = run_cli("pull", "hf:org/tf", home=tmp_path, HF_ENDPOINT=hub.url)
    assert result.returncode == 0, result.stderr
    assert f"at commit {MAIN[:12]}: a transformers-format model, in " in result.stdout
    assert sorted(hub.downloads()) == [
        "config.json",  # read first, to check the model type; then found in the cache
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    other = run_cli("pull", "hf:org/llama", home=tmp_path, HF_ENDPOINT=hub.url)
    assert one_line_error(other) == (
        "Error: hf:org/llama is a llama model (config.json's model_type); chatcli runs "
        "nanochat models only."
    )
    assert not (snapshot(tmp_path, "org/llama", MAIN) / "model.safetensors").exists()


def test_pull_refuses_what_is_not_a_hub_model(tmp_path):
    result = runner.invoke(app, ["pull", str(tmp_path)])
    assert result.exit_code == 1
    assert result.stderr == (
        f"Error: chatcli pull takes a Hub model, hf:ORG/NAME[@REVISION], not {str(tmp_path)!r}: "
        "a local model needs no pull (pass it to --model as it is).\n"
    )
