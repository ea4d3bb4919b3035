"""The runnable models in the Hub cache, for `chatcli models`.

Owns: walking huggingface_hub's cache (`scan_cache_dir`, through chatcli.model.hub), naming
each cached snapshot as `--model` takes it (hf:ORG/NAME, or @REF / @COMMIT for a revision
other than the default branch), and telling which snapshots are models chatcli runs: nanochat's
checkpoints (summarized as local ones are, by chatcli.model.checkpoint) and transformers-format
folders whose config.json says nanochat (or chatcli_nanochat, an export of eras B-E); a
damaged one is listed with its problem. Other cached repos (other architectures, datasets)
are left out: they are not chatcli's to list. Knows nothing about tables or terminals.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from chatcli.errors import CheckpointError
from chatcli.model.checkpoint_listing import CheckpointSummary, list_checkpoints
from chatcli.model.checkpoint_paths import SOURCES
from chatcli.model.hub import (
    NANOCHAT_MODEL_TYPES,
    cached_files,
    check_cache_folder,
    damaged_files,
    import_hub,
    scan_cache,
)
from chatcli.model.hub_layout import HubId


@dataclass(frozen=True)
class CachedHubModel:
    """One runnable model in the Hub cache: a nanochat checkpoint (`checkpoint` says which)
    or a transformers-format folder (`checkpoint` None)."""

    name: str  # what --model takes: hf:ORG/NAME[@REVISION]
    checkpoint: CheckpointSummary | None
    num_params: int | None
    size_bytes: int
    path: Path  # the model_*.pt, or the snapshot folder of a transformers one
    problem: str | None = None  # why it cannot run as it is cached (then num_params is None)
    era: str | None = None  # a transformers folder's, as its config.json says


def list_cached_models() -> list[CachedHubModel]:
    """Every runnable model in the Hub cache ($HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub): each checkpoint of each cached revision. Nothing where
    huggingface_hub is not installed or the cache does not exist."""
    try:
        hf = import_hub()
    except CheckpointError:
        return []
    found: dict[Path, CachedHubModel] = {}  # by path: a folder is listed once
    repos = scan_cache()
    for repo in repos:
        for revision in repo.revisions:
            name = _name(repo.repo_id, revision.refs, revision.commit_hash, hf)
            for model in _runnable(name, repo.repo_id, revision):
                found.setdefault(model.path, model)
    for model in _damaged({r.repo_id for r in repos}):
        found.setdefault(model.path, model)
    return sorted(found.values(), key=lambda m: (m.name, str(m.path)))


def _damaged(scanned: set[str]) -> list[CachedHubModel]:
    """The nanochat models the scan left out because a file of theirs leads nowhere (a blob
    deleted): listed with that problem, as a local checkpoint that cannot be read is."""
    try:
        folders = sorted(check_cache_folder().glob("models--*--*"))
    except OSError:  # the cache cannot be listed: scan_cache said so already
        return []
    listed = []
    for folder in folders:
        repo_id = folder.name.removeprefix("models--").replace("--", "/", 1)
        broken = [] if repo_id in scanned else damaged_files(repo_id)
        if not broken or not _looks_like_ours(broken[0][0]):
            continue
        snapshot, path = broken[0]
        link = snapshot / path
        problem = (
            f"links to {os.path.normpath(link.parent / os.readlink(link))}, which is missing: "
            f"run `chatcli pull hf:{repo_id}` to download it again."
        )
        name = str(HubId(repo_id))
        listed.append(CachedHubModel(name, None, None, 0, snapshot / path, problem))
    return listed


def _looks_like_ours(snapshot: Path) -> bool:
    """A nanochat checkpoint, or a config.json of ours (or one too damaged to tell)."""
    if any(_is_model_file(p.name) for p in snapshot.rglob("model_*.pt")):
        return True
    config = snapshot / "config.json"
    if not config.exists():
        return config.is_symlink()
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("model_type") in (
            NANOCHAT_MODEL_TYPES
        )
    except (OSError, ValueError, AttributeError, RecursionError):
        return False


def _name(repo_id: str, refs: frozenset[str], commit: str, hf: Any) -> str:
    """hf:ORG/NAME for the default branch's snapshot; else @ a ref of it, else @ its commit."""
    if hf.constants.DEFAULT_REVISION in refs:
        return str(HubId(repo_id))
    return str(HubId(repo_id, sorted(refs)[0] if refs else commit))


def _runnable(name: str, repo_id: str, revision: Any) -> list[CachedHubModel]:
    files = cached_files(revision)
    root = Path(revision.snapshot_path)
    folders = sorted({(root / f).parent for f in files if _is_model_file(f)})
    if folders:
        return [m for folder in folders for m in _checkpoints(name, repo_id, root, folder)]
    if "config.json" in files:
        return _transformers(name, root, files)
    return []


def _is_model_file(path: str) -> bool:
    last = path.rsplit("/", 1)[-1]
    return last.startswith("model_") and last.endswith(".pt") and last[6:-3].isdigit()


def _checkpoints(name: str, repo_id: str, root: Path, folder: Path) -> list[CachedHubModel]:
    # Summarized as a local folder of steps; its source is its parent's (chatsft_checkpoints:
    # sft), and a one-checkpoint repo's folder is named by the commit: NAME it instead.
    source = next((k for k, v in SOURCES.items() if v == folder.parent.name), None)
    tag = HubId(repo_id).name if folder == root else folder.name
    return [
        CachedHubModel(
            name,
            replace(c, name=name, source=source, tag=tag),
            c.num_params if c.problem is None else None,
            c.size_bytes,
            c.path,
            c.problem,
        )
        for c in list_checkpoints(folder, embedded=False)
    ]


def _transformers(name: str, root: Path, files: list[str]) -> list[CachedHubModel]:
    try:
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return []  # not a model of ours to list: nothing says it is nanochat
    if not isinstance(config, dict) or config.get("model_type") not in NANOCHAT_MODEL_TYPES:
        return []
    weights = [root / f for f in files if "/" not in f and f.endswith(".safetensors")]
    size = sum(w.stat().st_size for w in weights if w.exists())
    problem = None
    if not weights:
        problem = "no *.safetensors weights are cached"
    elif "tokenizer.json" not in files:
        problem = "no tokenizer.json is cached"
    if problem is not None:
        problem += f": run `chatcli pull {name}` to fetch the rest."
    params = None
    if problem is None:
        try:
            params = sum(safetensors_params(w) for w in weights)
        except CheckpointError as e:  # a file of the repo's as it is: pulling again won't mend it
            problem = str(e)
    # Era A is transformers' own nanochat; chatcli's exports of later eras name theirs.
    era = "A" if config["model_type"] == NANOCHAT_MODEL_TYPES[0] else config.get("nanochat_era")
    shown = era if isinstance(era, str) and len(era) == 1 else None
    return [CachedHubModel(name, None, params, size, root, problem, shown)]


def safetensors_params(path: Path) -> int:
    """How many weights a .safetensors file holds, from its header alone: 8 bytes of header
    length (little-endian), then JSON naming each tensor's shape."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100_000_000:  # a real header is KBs; this is not a safetensors file
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
        total = 0
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            n = 1
            for dim in entry["shape"]:
                n *= int(dim)
            total += n
        return total
    except RecursionError:  # a header nested past what json can parse: no tensor list
        raise CheckpointError(
            f"{path} is not a readable safetensors file (its header is nested too deeply)."
        ) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}).") from None
