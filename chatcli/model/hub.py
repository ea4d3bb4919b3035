"""Hub models: `hf:ORG/NAME[@REVISION]` turned into a local folder through huggingface_hub.

Owns: importing huggingface_hub (one line with the pip command where it is missing), listing a
repo's files (from the Hub, or from the Hub cache when HF_HUB_OFFLINE is set or the Hub cannot
be reached), fetching the files chatcli.model.hub_layout picks with `snapshot_download`, and
saying in one line why a model cannot be had: a cache folder that is not one, a cached file
whose blob is gone. The cache, resumable downloads, progress bars,
HF_TOKEN, HF_HUB_OFFLINE, HF_HOME, HF_HUB_CACHE and HF_ENDPOINT are all huggingface_hub's: no
HTTP is written here. Knows nothing about reading the files (chatcli.model.checkpoint's).
"""

from __future__ import annotations

import importlib
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatcli.errors import CheckpointError
from chatcli.model.data_files import described
from chatcli.model.hub_layout import HubFiles, HubId, parse_hub_id, pick_files

HF_EXTRA = "pip install 'chatcli[hf]'"
OFFLINE = "HF_HUB_OFFLINE is set"
# config.json's model_type of the transformers-format models chatcli runs: transformers' own
# nanochat (era A) and chatcli's export of eras B-E (chatcli.model.hf_config's names; that
# module needs torch, which listing the Hub cache does not).
NANOCHAT_MODEL_TYPES = ("nanochat", "chatcli_nanochat")


@dataclass(frozen=True)
class HubModel:
    """A Hub model on this machine: its snapshot folder in the Hub cache and what to load."""

    hub: HubId
    commit: str
    folder: Path  # <cache>/models--ORG--NAME/snapshots/<commit>
    picked: HubFiles
    cache_only: str | None  # why only the cache was read (offline, the Hub unreachable)

    @property
    def local_path(self) -> Path:
        """What the local loader takes: the model_<step>.pt (nanochat), else the folder."""
        if self.picked.model_file is not None:
            return self.folder / self.picked.model_file
        return self.folder

    def shown_tag(self, tag: str | None) -> str | None:
        """A one-checkpoint repo's folder is named by its commit: call it NAME instead."""
        return self.hub.name if tag == self.folder.name else tag


def import_hub() -> Any:
    """huggingface_hub, or one line saying how to install it."""
    try:
        importlib.import_module("huggingface_hub.constants")  # a lazy package's submodule
        return importlib.import_module("huggingface_hub")
    except ImportError as e:
        if not (e.name or "").startswith("huggingface_hub"):
            raise  # one of its own dependencies is broken: its message says which
        raise CheckpointError(f"hf: models need huggingface_hub: {HF_EXTRA}") from None


def fetch_model(
    model: str, *, source: str = "sft", tag: str | None = None, step: int | None = None
) -> HubModel:
    """Fetch (or find in the Hub cache) the files of one runnable model of `model`,
    `hf:ORG/NAME[@REVISION]`. source, tag and step pick among a nanochat repo's checkpoints
    as they do on disk. Raises CheckpointError, in one line, where it cannot be had."""
    hub = parse_hub_id(model)
    hf = import_hub()
    check_cache_folder()
    with _plain_errors(hub):
        cache_only = OFFLINE if hf.constants.HF_HUB_OFFLINE else None
        remote = None if cache_only else _remote_listing(hf, hub)
        if isinstance(remote, str):
            cache_only, remote = remote, None
        if remote is not None:
            listing, commit = remote
            where = str(hub)
        else:
            cached = cached_revision(hub)
            if cached is None:
                raise CheckpointError(_not_cached(hf, hub, cache_only or ""))
            listing, commit = cached_files(cached), cached.commit_hash
            where = f"the cached copy of {hub}"
        picked = pick_files(listing, where, source=source, tag=tag, step=step)
        # From the cache, by the commit found; from the Hub, by the revision asked for, so
        # that the cache records which commit the branch or tag names (offline runs read it).
        revision = hub.revision if remote is not None else commit
        if picked.layout == "transformers":
            _check_model_type(hf, hub, revision, offline=remote is None)
        folder = Path(
            hf.snapshot_download(
                hub.repo_id,
                revision=revision,
                allow_patterns=list(picked.files),
                local_files_only=remote is None,
            )
        )
    missing = [f for f in picked.files if not (folder / f).is_file()]
    if missing:
        # Only where the repo changed between listing it and fetching it.
        raise CheckpointError(
            f"{hub} changed while it was fetched ({', '.join(missing)} missing from commit "
            f"{folder.name}): run the command again."
        )
    return HubModel(hub, folder.name, folder, picked, cache_only)


def _remote_listing(hf: Any, hub: HubId) -> tuple[list[str], str] | str:
    """The repo's file paths and commit from the Hub, or why the Hub cannot be asked (a
    refused connection, a timeout, a server error: the cache may still hold the model).
    Errors that say the model is not there, or not ours to read, go to _plain_errors."""
    from huggingface_hub.errors import HfHubHTTPError

    unreachable = f"the Hub at {hf.constants.ENDPOINT} cannot be reached"
    try:
        # The default branch by name, as snapshot_download asks for it.
        revision = hub.revision or hf.constants.DEFAULT_REVISION
        info = hf.HfApi().model_info(hub.repo_id, revision=revision)
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status is not None and (status >= 500 or status == 429):
            return f"{unreachable} (it answered {status})"
        raise
    except (ConnectionError, TimeoutError, *_transport_errors()) as e:
        return f"{unreachable} ({_first_line(e)})"
    return [s.rfilename for s in info.siblings or []], str(info.sha)


def _transport_errors() -> tuple[type[Exception], ...]:
    """The HTTP client's could-not-talk-to-the-server errors: huggingface_hub 1.x runs on
    httpx, 2.x on its fork httpx2 (OfflineModeIsEnabled is a ConnectionError)."""
    found = []
    for name in ("httpx2", "httpx"):
        try:
            found.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _not_cached(hf: Any, hub: HubId, why: str) -> str:
    cache = hf.constants.HF_HUB_CACHE
    if why == OFFLINE:
        return (
            f"{hub} is not in the Hub cache ({cache}), and {OFFLINE}, so it cannot be "
            f"downloaded: unset HF_HUB_OFFLINE, or run `chatcli pull {hub}` where the Hub can "
            "be reached."
        )
    return (
        f"{hub} is not in the Hub cache ({cache}), and {why}: check the network (or "
        "HF_ENDPOINT) and run again."
    )


def _check_model_type(hf: Any, hub: HubId, revision: str | None, offline: bool) -> None:
    """Refuse a transformers model that is not nanochat's before fetching its weights."""
    config = hf.hf_hub_download(
        hub.repo_id, "config.json", revision=revision, local_files_only=offline
    )
    try:
        model_type = json.loads(Path(config).read_text(encoding="utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, RecursionError) as e:
        raise CheckpointError(f"{hub}'s config.json is not readable JSON ({e}).") from None
    if model_type not in NANOCHAT_MODEL_TYPES:
        raise CheckpointError(
            f"{hub} is a {model_type or 'untyped'} model (config.json's model_type); chatcli "
            "runs nanochat models only."
        )


@contextmanager
def _plain_errors(hub: HubId) -> Iterator[None]:
    """huggingface_hub's errors (multi-line, with URLs and advice for its own API) as one
    line for the person who typed the model's name."""
    import huggingface_hub.constants as constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    page = f"{constants.ENDPOINT}/{hub.repo_id}"
    login = (
        "set HF_TOKEN to an access token of an account that may read it (or run `hf auth login`)"
    )
    try:
        yield
    except GatedRepoError:
        raise CheckpointError(
            f"{hub} is gated: accept its terms at {page}, then {login}."
        ) from None
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"No model {hub.repo_id} on the Hub ({constants.ENDPOINT}): check its name; if it is "
            f"private, {login}."
        ) from None
    except RevisionNotFoundError:
        raise CheckpointError(
            f"{hub.repo_id} has no revision {hub.revision!r}: name one of its branches, tags or "
            f"commits (see {page}), or drop the @."
        ) from None
    except LocalEntryNotFoundError:
        # The Hub stopped answering between the listing and the download, and the cache has
        # not every file (huggingface_hub's message is about its own arguments).
        raise CheckpointError(
            f"The Hub stopped answering while {hub} was fetched, and the Hub cache does not "
            f"hold all of it: run the command again (or `chatcli pull {hub}`) when the Hub can "
            "be reached."
        ) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):  # a token that is wrong, expired, or may not read this repo
            raise CheckpointError(
                f"The Hub refused the token sent for {hub} ({status}): {login}."
            ) from None
        raise CheckpointError(
            f"The Hub answered {status or 'an error'} for {hub} ({_first_line(e)[:160]}): try "
            "again later."
        ) from None
    except (ConnectionError, TimeoutError, *_transport_errors()) as e:
        raise CheckpointError(
            f"Fetching {hub} stopped ({_first_line(e)}): run the command again; the files "
            "fetched whole are kept."
        ) from None


# ---- the Hub cache ------------------------------------------------------------------------------


def cached_revision(hub: HubId) -> Any | None:
    """The cached snapshot (huggingface_hub's CachedRevisionInfo) of `hub`'s revision: the
    branch or tag its refs name, or the commit (a unique prefix of 7+ hex digits will do);
    None where the cache does not hold it. A copy with a file whose blob is gone is said so."""
    hf = import_hub()
    wanted = hub.revision or hf.constants.DEFAULT_REVISION
    repo = next((r for r in scan_cache() if r.repo_id == hub.repo_id), None)
    if repo is None:
        _check_not_damaged(hub)
        return None
    for revision in repo.revisions:
        if wanted in revision.refs or revision.commit_hash == wanted:
            return revision
    if re.fullmatch(r"[0-9a-f]{7,40}", wanted):
        found = [r for r in repo.revisions if r.commit_hash.startswith(wanted)]
        if len(found) == 1:
            return found[0]
    return None


def check_cache_folder() -> Path:
    """The Hub cache's folder, where it is one (or not made yet); else one line saying which
    variable names what instead. huggingface_hub would raise a ValueError, or make folders
    through it."""
    hf = import_hub()
    cache = Path(hf.constants.HF_HUB_CACHE).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        fix = "point HF_HUB_CACHE at a folder, or unset it"
    elif os.environ.get("HF_HOME"):
        fix = "set HF_HUB_CACHE to a folder, or point HF_HOME (whose hub it is) elsewhere"
    else:
        fix = "set HF_HUB_CACHE to a folder, or move that one away"
    try:
        if cache.exists() and not cache.is_dir():
            raise CheckpointError(f"The Hub cache {cache} is a file, not a folder: {fix}.")
        if cache.is_symlink() and not cache.exists():
            raise CheckpointError(
                f"The Hub cache {cache} is a link to {os.readlink(cache)}, which does not exist: "
                f"make that folder, or {fix}."
            )
        parent = next((p for p in cache.parents if p.exists()), None)
        if not cache.exists() and parent is not None and not parent.is_dir():
            raise CheckpointError(
                f"The Hub cache {cache} cannot be made: {parent} is a file, not a folder: {fix}."
            )
    except OSError as e:
        raise CheckpointError(f"The Hub cache: {described(e)}.") from None
    return cache


def scan_cache() -> list[Any]:
    """The model repos in the Hub cache (huggingface_hub's CachedRepoInfo), none where the
    cache folder does not exist yet. A repo the scan finds damaged is left out (see
    damaged_files)."""
    hf = import_hub()
    from huggingface_hub.errors import CacheNotFound

    check_cache_folder()
    try:
        info = hf.scan_cache_dir()
    except CacheNotFound:
        return []
    except OSError as e:  # a folder in it that cannot be listed
        raise CheckpointError(f"The Hub cache cannot be read: {described(e)}.") from None
    return sorted((r for r in info.repos if r.repo_type == "model"), key=lambda r: r.repo_id)


def cached_files(revision: Any) -> list[str]:
    """A cached snapshot's files, as repo paths ("/"-separated)."""
    root = Path(revision.snapshot_path)
    return sorted(Path(f.file_path).relative_to(root).as_posix() for f in revision.files)


def repo_folder(repo_id: str) -> Path:
    """Where the Hub cache keeps a model repo: <cache>/models--ORG--NAME."""
    cache = Path(import_hub().constants.HF_HUB_CACHE).expanduser()
    return cache / ("models--" + repo_id.replace("/", "--"))


def damaged_files(repo_id: str) -> list[tuple[Path, str]]:
    """The files of a cached repo whose link leads nowhere (a blob deleted, a copy cut short):
    (snapshot folder, repo path). huggingface_hub's scan leaves such a repo out whole."""
    snapshots = repo_folder(repo_id) / "snapshots"
    found = []
    try:
        for snapshot in sorted(p for p in snapshots.iterdir() if p.is_dir()):
            for path in sorted(snapshot.rglob("*")):
                if path.is_symlink() and not path.exists():
                    found.append((snapshot, path.relative_to(snapshot).as_posix()))
    except OSError:  # no snapshots, or a folder that cannot be listed: nothing to name
        return found
    return found


def _check_not_damaged(hub: HubId) -> None:
    """Where the cache holds `hub` but a file of it leads nowhere, say which file and how to
    mend it, rather than that the model is not cached."""
    damaged = damaged_files(hub.repo_id)
    if not damaged:
        return
    snapshot, path = damaged[0]
    link = snapshot / path
    blob = os.path.normpath(link.parent / os.readlink(link))
    more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
    raise CheckpointError(
        f"The Hub cache's copy of {hub} is damaged: {path} (in {link.parent}) links to {blob}, "
        f"which is missing{more}. Run `chatcli pull {hub}` where "
        "the Hub can be reached to download it again (or delete "
        f"{repo_folder(hub.repo_id)} and pull it afresh)."
    )
