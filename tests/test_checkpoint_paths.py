"""Resolving what a user points at into one checkpoint's files (chatcli.model.checkpoint_paths):
empty files stand in for weights, as only paths are read here."""

import pytest

from chatcli.errors import CheckpointError
from chatcli.model.checkpoint_paths import resolve_checkpoint


def test_a_newest_step_without_its_meta_names_the_whole_steps(tmp_path):
    # nanochat saves the weights, then the meta: a run stopped between the two leaves this.
    for step in (1, 2):
        (tmp_path / f"model_{step:06d}.pt").touch()
    (tmp_path / "meta_000001.json").touch()
    (tmp_path / "tokenizer.pkl").touch()
    with pytest.raises(
        CheckpointError,
        match=r"model_000002\.pt .* has no meta_000002\.json .* --step 1 \(steps with a meta: 1\)",
    ):
        resolve_checkpoint(tmp_path)
    assert resolve_checkpoint(tmp_path, step=1).step == 1


def test_a_source_without_checkpoints_points_at_the_sources_that_have_them(tmp_path):
    (tmp_path / "chatsft_checkpoints" / "d20").mkdir(parents=True)  # an SFT run that crashed
    (tmp_path / "base_checkpoints" / "d20").mkdir(parents=True)
    (tmp_path / "base_checkpoints" / "d20" / "model_000100.pt").touch()
    with pytest.raises(CheckpointError, match=r"Checkpoints of base are there: .*--source base"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"No tag 'd32' .*; tags there: d20\."):
        resolve_checkpoint(tmp_path, source="base", tag="d32")


def test_a_tag_cannot_repick_a_checkpoint_folder_and_its_parent_names_the_source(tmp_path):
    folder = tmp_path / "base_checkpoints" / "d4"
    folder.mkdir(parents=True)
    (folder / "model_000001.pt").touch()
    (folder / "meta_000001.json").touch()
    (folder / "tokenizer.pkl").touch()
    ref = resolve_checkpoint(folder)
    assert (ref.tag, ref.source) == ("d4", "base")
    assert resolve_checkpoint(folder / "model_000001.pt").source == "base"
    with pytest.raises(CheckpointError, match=r"tag 'd32' cannot pick another"):
        resolve_checkpoint(folder, tag="d32")


def test_a_bare_tag_found_only_under_another_source_names_it(tmp_path, monkeypatch):
    (tmp_path / "base_checkpoints" / "d8").mkdir(parents=True)
    (tmp_path / "chatsft_checkpoints" / "d4").mkdir(parents=True)
    (tmp_path / "chatsft_checkpoints" / "d4" / "model_000001.pt").touch()
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        CheckpointError, match=r"No tag 'd8' .* base_checkpoints has one: add --source base"
    ):
        resolve_checkpoint("d8")
    # Not a path under the current folder: the word was a tag, and the tags are listed.
    with pytest.raises(CheckpointError, match=r"No model named 'd9': .*\(tags there: d4\)"):
        resolve_checkpoint("d9")
