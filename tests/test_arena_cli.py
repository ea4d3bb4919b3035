"""`chatcli arena` through the real CLI with piped input: two local models (the embedded one
and nanochat's reference checkpoint), then a local model against a server on 127.0.0.1;
the votes exported and loaded with `datasets` as TRL's DPO trainer reads them, and the
leaderboard."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
from reference import REFERENCE, needs_reference
from typer.testing import CliRunner

from chatcli.chat.conversation_reader import read_conversation
from chatcli.chat.settings import conversations_dir
from chatcli.cli.app import app

FIXTURE = REFERENCE / "E"
EMBEDDED = "embedded default model"
REVEAL = re.compile(r"Voted (.+?)\. A was (.+?); B was (.+?)\. ([AB])'s reply goes on\.")
runner = CliRunner()


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    for name in ("CHATCLI_TEMPERATURE", "CHATCLI_MODEL", "CHATCLI_CONFIG", "CHATCLI_URL"):
        monkeypatch.delenv(name, raising=False)


def arena(*args: str, input: str):
    return runner.invoke(app, ["arena", *args], input=input)


def saved() -> list:
    files = sorted(conversations_dir().glob("*.jsonl"))
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


def once(model: str | None, prompt: str) -> str:
    """The reply the model gives alone, greedy, in 8 tokens (None: the embedded model)."""
    chosen = ["-m", model] if model else []
    result = runner.invoke(app, ["once", prompt, *chosen, "-t", "0", "-n", "8", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["text"]


def test_one_side_or_three_is_a_usage_error():
    result = arena("-m", "embedded", input="")
    assert result.exit_code == 2
    assert result.stderr == (
        "Error: An arena has two sides; 1 given. Name two: -m A -m B (a checkpoint, "
        "hf:ORG/NAME or embedded), or -m A --url URL for a server.\n"
    )
    result = arena("-m", "embedded", "-m", "embedded", "--url", "http://127.0.0.1:9", input="")
    assert result.exit_code == 2
    assert "3 given" in result.stderr


@needs_reference
def test_two_local_models_vote_through_a_conversation_then_export_and_rank(tmp_path):
    script = "\n".join(
        [
            "/temperature 0",
            "What is 2+2?",
            "/retry",  # at the vote: both drawn again (greedy: the same replies)
            "a",
            "/system Be brief.",
            "Hello",
            "/vote b",
            "/samples 2",  # a chat command the arena does not take: one red line
            "Tell me more",
            "hmm",  # not a vote: said, and asked again
            "t",
            "/stats",
            "/edit Four, as [calc 2+2 = 4] says.",  # the kept reply, rewritten for both
            "And then?",
            "a",
        ]
    )
    result = arena("-m", "embedded", "-m", str(FIXTURE), "-n", "8", input=script + "\n")
    assert result.exit_code == 1  # piped input with errors: 1, as a script expects
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [
        "Error: /samples is chatcli chat's, not the arena's: /help lists these.",
        "Error: Vote with a (A is better), b (B is better), t (tie) or x (both bad) (or /vote "
        "a|b|tie|bad); /retry draws both again, /undo drops the question. Got 'hmm'.",
    ]
    assert "Drawing both replies again." in result.stderr
    reveals = REVEAL.findall(result.stderr)
    assert [r[0] for r in reveals] == ["A is better", "B is better", "a tie", "A is better"]
    assert [r[3] for r in reveals] == ["A", "B", "A", "A"]
    fixture_name = next(n for r in reveals for n in r[1:3] if n != EMBEDDED)
    assert fixture_name.startswith(str(FIXTURE)) and fixture_name.endswith(".pt")
    for _, a, b, _ in reveals:
        assert {a, b} == {EMBEDDED, fixture_name}
    # Four turns and the retry's redraw, each as two panels on stdout.
    assert result.stdout.count("╭─ A ") == 5 and result.stdout.count("╭─ B ") == 5
    assert "embedded default model" in result.stdout  # the /stats table

    [records] = saved()
    assert records[0]["model"] == f"arena: {EMBEDDED} vs {fixture_name}"
    votes = [r["vote"] for r in records if r["type"] == "vote"]
    assert [v["outcome"] for v in votes] == ["a", "b", "tie", "a"]
    edited = {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Four, as "},
            {"type": "python", "text": "2+2"},
            {"type": "python_output", "text": "4"},
            {"type": "text", "text": " says."},
        ],
    }
    assert votes[3]["prompt"][-2:] == [edited, {"role": "user", "content": "And then?"}]
    assert all(v["settings"]["temperature"] == 0.0 for v in votes)
    # The same conversation, the same settings: each side answers as its model alone does.
    first = {s["model"]: s for s in votes[0]["sides"]}
    for model, spec in ((EMBEDDED, None), (fixture_name, str(FIXTURE))):
        text = "".join(p["text"] for p in first[model]["message"]["content"] if p["type"] == "text")
        assert text == once(spec, "What is 2+2?")
    # The kept reply continues the conversation for both; the votes' prompts hold it.
    conversation = read_conversation(conversations_dir() / f"{records[0]['id']}.jsonl")
    kept = [
        s["message"]
        for v in votes
        for s in v["sides"]
        if s["label"] == {"a": "A", "b": "B", "tie": "A"}[v["outcome"]]
    ]
    # The file replays to the replies that went on, the tie's as /edit rewrote it.
    assert [m for m in conversation.messages if m["role"] == "assistant"] == [
        *kept[:2],
        edited,
        kept[3],
    ]
    assert votes[1]["prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        kept[0],
        {"role": "user", "content": "Hello"},
    ]

    # Both keep their warm caches across turns, the side whose reply lost too (it takes
    # the kept one in its place): a later turn prefills less than its whole prompt. Turn 2
    # set a system prompt, which changes the first message: the third turn shows it.
    for side in votes[2]["sides"]:
        assert 0 < side["stats"]["prefill_tokens"] < side["stats"]["tokens_in"], side["model"]

    out = tmp_path / "prefs.jsonl"
    result = runner.invoke(app, ["arena", "export", str(out), "--format", "dpo"])
    assert result.exit_code == 0, result.output
    assert result.stderr == f"Wrote 3 preference pairs to {out}.\n"
    datasets = pytest.importorskip("datasets")
    data = datasets.load_dataset("json", data_files=str(out), split="train")
    assert data.num_rows == 3
    assert set(data.column_names) == {"prompt", "chosen", "rejected"}
    decisive = [votes[0], votes[1], votes[3]]
    for row, vote in zip(data, decisive, strict=True):
        # TRL's conversational preference format: the prompt's messages end with the user's
        # turn; chosen and rejected are one assistant message each, as strings.
        assert row["prompt"][-1]["role"] == "user"
        assert all(set(m) == {"role", "content"} for m in row["prompt"])
        for key in ("chosen", "rejected"):
            assert [m["role"] for m in row[key]] == ["assistant"]
            assert isinstance(row[key][0]["content"], str)
        won = {"a": "A", "b": "B"}[vote["outcome"]]
        sides = {s["label"]: s for s in vote["sides"]}
        lost = "B" if won == "A" else "A"
        texts = [
            "".join(p["text"] for p in sides[x]["message"]["content"] if p["type"] == "text")
            for x in (won, lost)
        ]
        assert texts[0] in row["chosen"][0]["content"]
        assert texts[1] in row["rejected"][0]["content"]
    assert data[1]["prompt"][0] == {"role": "system", "content": "Be brief."}

    result = runner.invoke(app, ["arena", "export", "-", "--format", "jsonl"])
    assert [json.loads(line)["outcome"] for line in result.stdout.splitlines()] == [
        "a",
        "b",
        "tie",
        "a",
    ]

    result = runner.invoke(app, ["arena", "stats", "--json"])
    board = json.loads(result.stdout)
    assert board["votes"] == 4
    assert {r["model"] for r in board["ratings"]} == {EMBEDDED, fixture_name}
    # Which model won each vote, from what the arena revealed after it.
    wins = {EMBEDDED: 0, fixture_name: 0}
    for said, a, b, _ in reveals:
        if said != "a tie":
            wins[a if said == "A is better" else b] += 1
    # Each model's score (a tie half, the virtual tie half) sets the odds, and the gap.
    score = {m: w + 0.5 + 0.5 for m, w in wins.items()}
    gap = 400 * math.log10(score[EMBEDDED] / score[fixture_name])
    ratings = {r["model"]: r["rating"] for r in board["ratings"]}
    assert ratings[EMBEDDED] == pytest.approx(1000 + gap / 2, abs=0.05)
    assert ratings[fixture_name] == pytest.approx(1000 - gap / 2, abs=0.05)
    assert all(r["ci_low"] <= r["rating"] <= r["ci_high"] for r in board["ratings"])
    [pair] = board["pairs"]
    first, second = pair["model"], pair["opponent"]
    assert sorted([first, second]) == [first, second]
    counts = (pair["wins"], pair["losses"], pair["ties"], pair["both_bad"])
    assert counts == (wins[first], wins[second], 1, 0)
    result = runner.invoke(app, ["arena", "stats"])
    assert result.exit_code == 0
    top = board["ratings"][0]
    row = rf"^1\s+{re.escape(top['model'])}\s+{top['rating']:.0f}\s+-?\d+ to \d+\s+4\s*$"
    assert re.search(row, result.stdout, re.MULTILINE), result.stdout


@needs_reference
def test_a_local_model_against_a_server_at_url():
    from serving import reference_worker, serve_workers

    server = serve_workers([reference_worker()], name="reference-e")
    try:
        result = arena(
            "-m",
            "embedded",
            "--url",
            server.url,
            "-t",
            "0",
            "-n",
            "6",
            "--open",
            input="What is 12*7?\nx\nAnd 3+3?\n/vote a\n",
        )
    finally:
        server.stop()
    assert result.exit_code == 0, result.output
    remote = f"{server.url} · reference-e"
    reveals = REVEAL.findall(result.stderr)
    assert [r[0] for r in reveals] == ["both bad", "A is better"]
    assert all({a, b} == {EMBEDDED, remote} for _, a, b, _ in reveals)
    # --open: each panel's title names its model from the start.
    assert "A · embedded default model" in result.stdout or "B · embedded default model" in (
        result.stdout
    )
    assert re.search(r"[AB] · http://127\.0\.0\.1:\d+ · ref", result.stdout)
    [records] = saved()
    votes = [r["vote"] for r in records if r["type"] == "vote"]
    assert [v["outcome"] for v in votes] == ["bad", "a"]
    # Both bad: A's reply goes on, for the server's side too (the next request sends it).
    kept = next(s["message"] for s in votes[0]["sides"] if s["label"] == "A")
    assert votes[1]["prompt"][1] == kept
    result = runner.invoke(app, ["arena", "export", "-"])
    [pair] = [json.loads(line) for line in result.stdout.splitlines()]
    assert pair["prompt"][-1] == {"role": "user", "content": "And 3+3?"}


def test_input_that_ends_before_the_vote_saves_nothing():
    result = arena("-m", "embedded", "-m", "embedded", "-n", "4", input="Hello\n")
    assert result.exit_code == 0
    assert "No vote: the question and both replies were dropped." in result.stderr
    assert saved() == []
    result = runner.invoke(app, ["arena", "export", "out.jsonl"])
    assert result.exit_code == 1
    assert "No arena votes in" in result.stderr


@needs_reference
def test_a_turn_the_server_refuses_is_dropped_from_both_sides():
    from serving import reference_worker, serve_workers

    server = serve_workers([reference_worker()], name="reference-e")
    script = ["Hi", "a", "/top_k 500", "Again", "/top_k 50", "Third", "b"]
    try:
        result = arena(
            "-m", "embedded", "--url", server.url, "-n", "4", input="\n".join(script) + "\n"
        )
    finally:
        server.stop()
    assert result.exit_code == 1  # the refusal, as one line
    [error] = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert "top_k" in error and "refused" in error
    [records] = saved()
    votes = [r["vote"] for r in records if r["type"] == "vote"]
    assert [v["outcome"] for v in votes] == ["a", "b"]
    # The refused question left neither side: the next turn follows the first exchange.
    kept = next(s["message"] for s in votes[0]["sides"] if s["label"] == "A")
    assert votes[1]["prompt"] == [
        {"role": "user", "content": "Hi"},
        kept,
        {"role": "user", "content": "Third"},
    ]
    # The local side's warm cache kept the first exchange: it prefilled less than its prompt.
    local = next(s for s in votes[1]["sides"] if s["model"] == EMBEDDED)
    assert 0 < local["stats"]["prefill_tokens"] < local["stats"]["tokens_in"]


def test_two_models_that_do_not_fit_are_refused_before_loading(monkeypatch):
    import chatcli.model.memory_need as memory_need

    monkeypatch.setattr(memory_need, "available_bytes", lambda: 4 * 2**20)  # a CPU's
    result = arena("-m", "embedded", "-m", "embedded", input="Hello\n")
    assert result.exit_code == 1
    need = memory_need.checkpoint_bytes(None)  # the embedded model's estimate
    each, total = f"{need / 2**20:.0f} MB", f"{2 * need / 2**20:.0f} MB"
    assert result.stderr == (
        f"Error: The models need about {total} of memory (embedded: {each}, embedded: "
        f"{each}) and 4 MB is free. Close other programs, load them smaller (--dtype "
        "bfloat16, --quantize int8), or serve one (chatcli serve) and pass its --url.\n"
    )
    assert "Arena:" not in result.stderr  # nothing loaded
    assert saved() == []


def test_stats_of_self_play_only_ranks_nothing():
    result = arena("-m", "embedded", "-m", "embedded", "-n", "4", input="Hi\na\n")
    assert result.exit_code == 0
    result = runner.invoke(app, ["arena", "stats"])
    assert result.exit_code == 0
    assert result.stderr == "All 1 votes are of a model against itself: nothing to rank.\n"
    assert json.loads(runner.invoke(app, ["arena", "stats", "--json"]).stdout)["ratings"] == []


def test_save_names_the_arena_and_clear_starts_another():
    script = ["/save my duel", "Hi", "a", "/save", "/clear", "Second", "b", "/undo"]
    result = arena("-m", "embedded", "-m", "embedded", "-n", "4", input="\n".join(script) + "\n")
    assert result.exit_code == 0, result.output
    assert 'Named this arena "my duel".' in result.stderr
    assert re.search(r"Saved with its votes as \S+ \(.+\.jsonl\)\.", result.stderr)
    assert "New conversation." in result.stderr
    assert "Undone: the last question and its reply (its vote stays counted)." in result.stderr
    files = sorted(conversations_dir().glob("*.jsonl"))
    assert len(files) == 2
    # Two files of one second sort by their random suffix: told apart by what they hold.
    held = {}
    for f in files:
        conversation = read_conversation(f)
        votes = [json.loads(line) for line in f.read_text().splitlines()]
        outcomes = [r["vote"]["outcome"] for r in votes if r["type"] == "vote"]
        held[conversation.name] = (len(conversation.messages), outcomes)
    # The second's turn undone: its messages go, its vote stays.
    assert held == {"my duel": (2, ["a"]), None: (0, ["b"])}


@needs_reference
def test_a_server_side_with_an_api_key():
    from serving import reference_worker

    from chatcli.serve.app import Limits, create_app
    from chatcli.serve.runner import BackgroundServer

    app_ = create_app([reference_worker()], Limits(), "keyed", api_keys=["sesame-1234567890"])
    server = BackgroundServer(app_).start()
    try:
        args = ("-m", "embedded", "--url", server.url, "-n", "4")
        refused = arena(*args, input="Hi\na\n")
        allowed = arena(*args, "--api-key", "sesame-1234567890", input="Hi\na\n")
    finally:
        server.stop()
    assert refused.exit_code == 1
    assert "refused the request (401)" in refused.stderr
    assert "--api-key KEY or CHATCLI_API_KEY" in refused.stderr
    assert allowed.exit_code == 0, allowed.output
    assert "Voted A is better." in allowed.stderr
    [records] = saved()
    assert f"{server.url} · keyed" in records[0]["model"]


@pytest.mark.slow
def test_a_hub_model_is_named_by_its_id_and_step(tmp_path):
    from hub_fakes import EMBEDDED_STEP, ROOT, commit_of, flat_files, write_hub_cache

    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    write_hub_cache(cache, "org/flat", flat_files(), commit_of("flat"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "CHATCLI_"))}
    env.update(CHATCLI_HOME=str(tmp_path / "home"), HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    args = ["-m", "chatcli", "arena", "-m", "hf:org/flat", "-m", "embedded", "-n", "4"]
    result = subprocess.run(
        [sys.executable, *args],
        input="Hi\nx\n",
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    name = f"hf:org/flat step {EMBEDDED_STEP}"
    assert f"Arena: {name} vs {EMBEDDED}." in " ".join(result.stderr.split())
    [vote] = [
        json.loads(line)["vote"]
        for f in (tmp_path / "home" / "conversations").glob("*.jsonl")
        for line in f.read_text().splitlines()
        if '"vote"' in line
    ]
    assert {s["model"] for s in vote["sides"]} == {name, EMBEDDED}
