"""Hub model ids and which of a Hub repo's files make one runnable model.

Owns: parsing `hf:ORG/NAME[@REVISION]`, and, given the list of a repo's file paths, picking the
files to fetch: nanochat's layout (a model_<step>.pt with its meta_<step>.json and the
tokenizer.pkl the local loader would find beside it, chosen by source, tag and step as
chatcli.model.checkpoint_paths chooses on disk) or transformers' (config.json, *.safetensors,
tokenizer.json and their companions at the repo's root). Pure: it knows nothing about
huggingface_hub, the network or the cache (chatcli.model.hub's), nor about reading the files.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from chatcli.errors import CheckpointError
from chatcli.model.checkpoint_paths import SOURCES

HUB_PREFIX = "hf:"
# The Hub's own rule for a namespace or a repo name: letters, digits, - _ . ; no -- or ..,
# not starting or ending with - or . ; at most 96 characters.
_NAME_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?")
_STEP_RE = re.compile(r"model_(\d+)\.pt")
# What a transformers-format model needs, at the repo's root: no pickled .bin weights, no
# modeling .py files (chatcli runs no remote code), no README or images.
_TRANSFORMERS_NAMES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
_SAFETENSORS_RE = re.compile(r"[^/]+\.safetensors(\.index\.json)?")
_EXAMPLE = "hf:karpathy/nanochat-d32"


@dataclass(frozen=True)
class HubId:
    """A model on the Hub: `repo_id` is ORG/NAME; `revision` a branch, tag or commit (None:
    the default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return HUB_PREFIX + self.repo_id + (f"@{self.revision}" if self.revision else "")

    @property
    def name(self) -> str:
        """NAME of ORG/NAME: what a one-checkpoint repo is called where a tag would be."""
        return self.repo_id.split("/")[1]


def is_hub_id(model: object) -> bool:
    """Whether `--model` names a Hub model (it starts with hf:), well formed or not."""
    return isinstance(model, str) and model.startswith(HUB_PREFIX)


def parse_hub_id(text: str) -> HubId:
    """`hf:ORG/NAME` or `hf:ORG/NAME@REVISION`; anything else is refused in one line."""
    if not is_hub_id(text):
        raise CheckpointError(
            f"{text!r} is not a Hub model: write hf:ORG/NAME, e.g. {_EXAMPLE}, optionally "
            "@REVISION (a branch, tag or commit)."
        )
    body = text[len(HUB_PREFIX) :]
    repo_id, at, revision = body.partition("@")
    if not body:
        raise CheckpointError(
            f"hf: needs a model's Hub id after it: hf:ORG/NAME, e.g. {_EXAMPLE}, optionally "
            "@REVISION (a branch, tag or commit)."
        )
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(
        _NAME_RE.fullmatch(p) and ".." not in p and "--" not in p for p in parts
    ):
        raise CheckpointError(
            f"{text} is not a Hub model id: write hf:ORG/NAME (e.g. {_EXAMPLE}), each part "
            "letters, digits, - _ and ., optionally @REVISION. A local folder of that name is "
            f"./{text}."
        )
    if at and not _revision_ok(revision):
        raise CheckpointError(
            f"{text} names no revision after its @: write hf:{repo_id}@REVISION (a branch, "
            "tag or commit), or drop the @."
            if not revision
            else f"{text}: {revision!r} is not a revision (a branch, tag or commit name has no "
            "spaces, .. or leading /)."
        )
    return HubId(repo_id, revision or None)


def _revision_ok(revision: str) -> bool:
    # Branch and tag names may hold / (refs/pr/1); git refuses spaces, "..", and a leading or
    # trailing slash, and the Hub's URLs take no control characters.
    return (
        bool(revision)
        and not any(c.isspace() or ord(c) < 32 for c in revision)
        and ".." not in revision
        and not revision.startswith("/")
        and not revision.endswith("/")
    )


# ---- picking files ----------------------------------------------------------------------------


@dataclass(frozen=True)
class HubFiles:
    """The files of a repo that make one runnable model, and how to load them."""

    layout: str  # "nanochat" or "transformers"
    files: tuple[str, ...]  # repo paths, "/"-separated
    model_file: str | None = None  # nanochat: the model_<step>.pt to load
    step: int | None = None  # nanochat: its step


def pick_files(
    listing: Iterable[str],
    where: str,
    *,
    source: str = "sft",
    tag: str | None = None,
    step: int | None = None,
) -> HubFiles:
    """The files to fetch for one runnable model among a repo's `listing` (its file paths).

    nanochat's layout wins where a repo holds both. `where` names the repo in errors
    ("hf:org/name", or its cached copy). source, tag and step pick among several checkpoints
    as they do in a local base dir; a tag with no depth in its name (d20) is picked by name,
    the last in order, for the Hub keeps no folder times.
    """
    files = set(listing)
    # folder ("" for the root) -> step -> its model file: model_000650.pt or model_650.pt
    checkpoints: dict[str, dict[int, str]] = {}
    for path in sorted(files):
        if m := _STEP_RE.fullmatch(_name(path)):
            checkpoints.setdefault(_parent(path), {})[int(m[1])] = path
    if checkpoints:
        folder = _pick_folder(set(checkpoints), where, source, tag)
        return _pick_step(files, checkpoints[folder], folder, where, step)
    if "config.json" in files:
        return _pick_transformers(files, where, source, step)
    raise CheckpointError(
        f"{where} holds no model chatcli can run: neither nanochat's model_<step>.pt with "
        "meta_<step>.json and tokenizer.pkl, nor transformers' config.json with *.safetensors "
        "and tokenizer.json."
    )


def _parent(path: str) -> str:
    """The folder of a repo path, "" for the root."""
    return path.rpartition("/")[0]


def _pick_folder(folders: set[str], where: str, source: str, tag: str | None) -> str:
    """The checkpoint folder: the root of a flat repo, else a tag of the source's folder
    (<source>_checkpoints/<tag>/, or <tag>/ where the repo is one source's folder)."""
    if source not in SOURCES:
        raise CheckpointError(f"Unknown source {source!r}; use one of {', '.join(SOURCES)}.")
    if "" in folders:  # a flat repo: one checkpoint folder, as nanochat's downloads are
        if tag is not None:
            raise CheckpointError(
                f"{where} is one checkpoint folder, so tag {tag!r} cannot pick another: leave "
                "the tag out."
            )
        return ""
    tags = {f.rpartition("/")[2]: f for f in folders if _parent(f) == SOURCES[source]}
    if not tags:
        tags = {f: f for f in folders if "/" not in f}
    if not tags:
        have = [k for k, v in SOURCES.items() if any(_parent(f) == v for f in folders)]
        raise CheckpointError(
            f"No {SOURCES[source]} in {where}"
            + (
                f"; it has checkpoints of {', '.join(have)}: pick one with --source {have[0]}."
                if have
                else f"; its checkpoints are in {', '.join(sorted(folders))}, a layout chatcli "
                "does not know (model_*.pt at the root, or <source>_checkpoints/<tag>/)."
            )
        )
    if tag is None:
        depth = [(int(t[1:]), t) for t in tags if re.fullmatch(r"d\d+", t)]
        return tags[max(depth)[1] if depth else max(tags)]
    if tag not in tags:
        raise CheckpointError(f"No tag {tag!r} in {where}; tags there: {', '.join(sorted(tags))}.")
    return tags[tag]


def _pick_step(
    files: set[str], steps: dict[int, str], folder: str, where: str, step: int | None
) -> HubFiles:
    """One step of `folder` (the latest unless asked), its meta, and its tokenizer."""
    shown = f"{where} ({folder})" if folder else where
    if step is None:
        step = max(steps)
    elif step not in steps:
        raise CheckpointError(
            f"No step {step} in {shown}; steps there: {', '.join(map(str, sorted(steps)))}."
        )
    model_file = steps[step]
    meta_file = _meta_of(model_file)
    if meta_file not in files:
        whole = [s for s in sorted(steps) if _meta_of(steps[s]) in files]
        raise CheckpointError(
            f"{_name(model_file)} in {shown} has no {_name(meta_file)} beside it (it holds the "
            "model_config)"
            + (
                f": load a whole step with --step {whole[-1]}."
                if whole
                else ": it cannot be loaded."
            )
        )
    return HubFiles(
        "nanochat", (model_file, meta_file, _tokenizer(files, folder, shown)), model_file, step
    )


def _meta_of(model_file: str) -> str:
    """model_000650.pt's meta: meta_000650.json beside it."""
    folder, _, name = model_file.rpartition("/")
    meta = "meta_" + name[len("model_") : -len(".pt")] + ".json"
    return f"{folder}/{meta}" if folder else meta


def _name(path: str) -> str:
    return path.rpartition("/")[2]


def _tokenizer(files: set[str], folder: str, shown: str) -> str:
    """The tokenizer.pkl the local loader finds for `folder` (checkpoint_paths.find_tokenizer's
    places, first found wins), so that the downloaded files load as they would on disk."""
    prefix = f"{folder}/" if folder else ""
    candidates = [f"{prefix}tokenizer.pkl", f"{prefix}tokenizer/tokenizer.pkl"]
    if folder.count("/") >= 1:  # <source>/<tag>/: the base dir's tokenizer/ beside the sources
        base = _parent(_parent(folder))
        candidates.append(f"{base}/tokenizer/tokenizer.pkl" if base else "tokenizer/tokenizer.pkl")
    found = next((c for c in candidates if c in files), None)
    if found is None:
        raise CheckpointError(
            f"{shown} has no tokenizer.pkl where chatcli looks for one ({', '.join(candidates)})."
        )
    return found


def _pick_transformers(files: set[str], where: str, source: str, step: int | None) -> HubFiles:
    if step is not None or source != "sft":
        # A transformers folder is one model: a step or source would pick nothing.
        raise CheckpointError(
            f"{where} is a transformers-format model, one checkpoint: drop --step and --source."
        )
    weights = sorted(f for f in files if _SAFETENSORS_RE.fullmatch(f))
    if not any(f.endswith(".safetensors") for f in weights):
        raise CheckpointError(
            f"{where} has a config.json but no *.safetensors weights at its root: chatcli reads "
            "safetensors only (no pickled .bin files)."
        )
    if "tokenizer.json" not in files:
        raise CheckpointError(f"{where} has no tokenizer.json at its root: chatcli needs it.")
    return HubFiles(
        "transformers", tuple(sorted(f for f in files if f in _TRANSFORMERS_NAMES)) + tuple(weights)
    )
