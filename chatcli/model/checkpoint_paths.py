"""Where a checkpoint is: what a user points at, turned into the files of one checkpoint.

Owns: nanochat's layouts (a base dir with chatsft_checkpoints/<tag>/model_<step>.pt, a tag
folder, a flat download folder, a model_*.pt file, a tag under NANOCHAT_BASE_DIR, or nothing:
the embedded default model), picking the newest step and the deepest tag, finding the
tokenizer, and the errors that say what to pass instead. Paths only: reading the files is
chatcli.model.checkpoint's.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from chatcli.errors import CheckpointError
from chatcli.model.data_files import (
    UnreadableFileError,
    check_readable,
    described,
    list_folder,
)

SOURCES = {
    "sft": "chatsft_checkpoints",
    "rl": "chatrl_checkpoints",
    "base": "base_checkpoints",
    "mid": "mid_checkpoints",
}
EMBEDDED_DIR = Path(__file__).parent.parent / "default_model"
_STEP_RE = re.compile(r"model_(\d+)\.pt$")


@dataclass(frozen=True)
class CheckpointRef:
    """One checkpoint on disk: where its files are and what it is."""

    model_file: Path
    meta_file: Path
    tokenizer_file: Path
    step: int
    tag: str | None
    source: str | None


def default_base_dir() -> Path:
    """nanochat's base dir: $NANOCHAT_BASE_DIR, else ~/.cache/nanochat."""
    env = os.environ.get("NANOCHAT_BASE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nanochat"


# ---- resolving paths ----------------------------------------------------------------------


def folder_entries(folder: Path) -> list[Path]:
    """What a folder holds; none where it is not a folder, and CheckpointError where it is
    one that cannot be listed (no permission): glob would make it look empty."""
    try:
        if not folder.is_dir():
            return []
        return list_folder(folder)
    except UnreadableFileError as e:
        raise CheckpointError(f"The folder {e}.") from None
    except OSError as e:  # the folder above it may not be read
        raise CheckpointError(f"{described(e)}.") from None


def steps_in(folder: Path) -> list[int]:
    return sorted(
        int(m.group(1))
        for p in folder_entries(folder)
        if p.name.startswith("model_") and (m := _STEP_RE.search(p.name))
    )


def _tag_folders(checkpoints_dir: Path) -> list[Path]:
    """The folders of `checkpoints_dir` that hold a model_*.pt (none where it is missing)."""
    return [p for p in folder_entries(checkpoints_dir) if p.is_dir() and steps_in(p)]


def _pick_tag(checkpoints_dir: Path) -> str:
    tags = _tag_folders(checkpoints_dir)
    if not tags:
        raise CheckpointError(
            f"No checkpoints (model_*.pt) in any folder of {checkpoints_dir}."
            + _other_sources_hint(checkpoints_dir.parent)
        )
    depth = [(int(p.name[1:]), p.name) for p in tags if re.fullmatch(r"d\d+", p.name)]
    if depth:
        return max(depth)[1]
    return max(tags, key=lambda p: p.stat().st_mtime).name


def _other_sources_hint(base: Path) -> str:
    """' Checkpoints of base are there: pick one with --source base.' where another source of
    this base dir holds checkpoints (an SFT run that crashed leaves base and mid ones)."""
    have = [k for k, name in SOURCES.items() if _tag_folders(base / name)]
    if not have:
        return ""
    return f" Checkpoints of {', '.join(have)} are there: pick one with --source {have[0]}."


def _tag_names(checkpoints_dir: Path) -> str:
    return ", ".join(p.name for p in _tag_folders(checkpoints_dir))


def find_tokenizer(folder: Path) -> Path:
    candidates = [
        folder / "tokenizer.pkl",
        folder / "tokenizer" / "tokenizer.pkl",
        folder.parent.parent / "tokenizer" / "tokenizer.pkl",  # base/<source>/<tag>/
    ]
    for c in candidates:
        if os.path.lexists(c):  # a folder or a broken link is named by the tokenizer's reader
            return c
    raise CheckpointError(
        f"No tokenizer.pkl found for the checkpoint in {folder}. Looked at: "
        + ", ".join(str(c) for c in candidates)
        + ". Put the model's tokenizer.pkl beside its model_*.pt file."
    )


def step_file(folder: Path, step: int) -> Path:
    """The model_*.pt of `step` in `folder` (model_000650.pt or model_650.pt), one of
    steps_in's."""
    return next(
        p
        for p in folder_entries(folder)
        if p.name.startswith("model_") and (m := _STEP_RE.search(p.name)) and int(m[1]) == step
    )


def ref_in_folder(
    folder: Path, step: int | None, tag: str | None, source: str | None
) -> CheckpointRef:
    steps = steps_in(folder)
    if not steps:
        raise CheckpointError(f"No model_*.pt file in {folder}.")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(
            f"No step {step} in {folder}; steps there: {', '.join(map(str, steps))}."
        )
    model_file = step_file(folder, step)
    if not model_file.exists():  # a link to nothing or to itself: said before what else lacks
        try:
            check_readable(model_file)
        except UnreadableFileError as e:
            raise CheckpointError(f"{e}. Copy or download the weights again.") from None
    meta_file = _meta_file(model_file)
    tokenizer_file = find_tokenizer(folder)
    if model_file.exists() and not os.path.lexists(meta_file):
        # nanochat writes the weights before the meta: a run stopped between the two, or a
        # download that missed the meta, leaves this. Loading an older step unasked would
        # answer as another model, so say which steps are whole.
        whole = [s for s in steps if os.path.lexists(_meta_file(step_file(folder, s)))]
        fix = (
            f", or load a whole step with --step {whole[-1]} (steps with a meta: "
            f"{', '.join(map(str, whole))})"
            if whole
            else ""
        )
        raise CheckpointError(
            f"{model_file.name} in {folder} has no {meta_file.name} beside it (it holds the "
            f"model_config): a save cut short, or a download without it. Copy {meta_file.name} "
            f"there{fix}."
        )
    return CheckpointRef(model_file, meta_file, tokenizer_file, step, tag, source)


def _no_tag_for(p: Path, tag: str | None) -> None:
    """A tag picks a folder in a base dir; a checkpoint folder or file has picked already."""
    folder = p.parent if p.is_file() else p
    if tag is not None and tag != folder.name:
        raise CheckpointError(
            f"{p} is one checkpoint already, so tag {tag!r} cannot pick another: leave the "
            "tag out, or pass the base dir that holds the tag."
        )


def _source_of(folder: Path) -> str | None:
    """'base' for base_checkpoints/d20: a tag folder's parent says which training it is."""
    return next((k for k, v in SOURCES.items() if v == folder.parent.name), None)


def _meta_file(model_file: Path) -> Path:
    return model_file.with_name(f"meta_{model_file.name[len('model_') : -len('.pt')]}.json")


def resolve_checkpoint(
    path: str | Path | None = None,
    *,
    source: str = "sft",
    tag: str | None = None,
    step: int | None = None,
) -> CheckpointRef:
    """Turn what the user named into the files of one checkpoint."""
    try:
        return _resolve(path, source, tag, step)
    except OSError as e:  # a folder on the way without permission: even exists() raises
        raise CheckpointError(f"{described(e)}.") from None


def _resolve(
    path: str | Path | None, source: str, tag: str | None, step: int | None
) -> CheckpointRef:
    if source not in SOURCES:
        raise CheckpointError(f"Unknown source {source!r}; use one of {', '.join(SOURCES)}.")
    if path is None:
        if not (EMBEDDED_DIR / SOURCES["sft"]).is_dir():
            raise CheckpointError(
                "The embedded default model is not in this installation. Pass --model PATH "
                "to a nanochat checkpoint, or retrain it: python -m chatcli.training.train."
            )
        if source != "sft":
            # Quietly loading the sft model would answer as if the asked-for one had.
            raise CheckpointError(
                f"The embedded default model has only an sft checkpoint, not {source!r}. "
                "Leave the source at sft (--source, CHATCLI_SOURCE or the config's source), "
                "or pass --model PATH to a nanochat checkpoint that has it."
            )
        return resolve_checkpoint(EMBEDDED_DIR, source="sft", tag=tag, step=step)
    p = Path(path).expanduser().absolute()  # "." names its folder, as a tag and in /model
    if p.is_symlink() and not p.exists():  # a link to nothing, or to itself
        try:
            check_readable(p)
        except UnreadableFileError as e:
            raise CheckpointError(f"{e}. Pass the checkpoint itself, or fix the link.") from None
    if not p.exists():
        base = default_base_dir()
        if (
            isinstance(path, str)
            and os.sep not in path
            and (base / SOURCES[source] / path).is_dir()
        ):
            return ref_in_folder(base / SOURCES[source] / path, step, path, source)
        if isinstance(path, str) and os.sep not in path:  # a bare word: meant as a tag
            elsewhere = [k for k, v in SOURCES.items() if (base / v / path).is_dir()]
            if elsewhere:
                raise CheckpointError(
                    f"No tag {path!r} in {base / SOURCES[source]}, but "
                    + " and ".join(f"{SOURCES[k]} has one" for k in elsewhere)
                    + f": add --source {elsewhere[0]}."
                )
            tags = _tag_names(base / SOURCES[source])
            raise CheckpointError(
                f"No model named {path!r}: no such file or folder here, and no such tag in "
                f"{base / SOURCES[source]}"
                + (f" (tags there: {tags})" if tags else "")
                + ". Pass a checkpoint's path, or a tag (NANOCHAT_BASE_DIR names another "
                "base dir)."
            )
        raise CheckpointError(
            f"No model at {p}. Pass a nanochat base dir, a checkpoint folder, a model_*.pt "
            f"file, or a tag found in {base / SOURCES[source]}."
        )
    if p.is_dir() and _STEP_RE.search(p.name) and p.name.startswith("model_"):
        raise CheckpointError(
            f"{p} is a folder, not a model_<step>.pt file: pass the folder that holds the "
            "checkpoint's files, or copy the weights again."
        )
    if p.is_file():
        m = _STEP_RE.search(p.name)
        if not m:
            raise CheckpointError(f"{p} is not a model_<step>.pt file.")
        if step is not None and step != int(m.group(1)):
            raise CheckpointError(
                f"{p.name} is step {int(m.group(1))}, but step {step} was asked (--step, "
                f"CHATCLI_STEP or the config's step): pass its folder ({p.parent}) to pick a "
                "step, or leave the step out."
            )
        _no_tag_for(p, tag)
        return ref_in_folder(p.parent, int(m.group(1)), p.parent.name, _source_of(p.parent))
    if steps_in(p):  # a checkpoint folder or a flat download folder
        _no_tag_for(p, tag)
        return ref_in_folder(p, step, p.name, _source_of(p))
    if (p / SOURCES[source]).is_dir():  # a base dir
        ckpts = p / SOURCES[source]
        tag = tag or _pick_tag(ckpts)
        if not (ckpts / tag).is_dir():
            tags = _tag_names(ckpts)
            raise CheckpointError(
                f"No tag {tag!r} in {ckpts}; "
                + (f"tags there: {tags}." if tags else "it holds no checkpoints.")
            )
        return ref_in_folder(ckpts / tag, step, tag, source)
    if any(steps_in(c) for c in folder_entries(p) if c.is_dir()):  # base/chatsft_checkpoints
        tag = tag or _pick_tag(p)
        # The folder's name says its source (base_checkpoints: base), whatever --source says.
        named = next((k for k, v in SOURCES.items() if v == p.name), source)
        return ref_in_folder(p / tag, step, tag, named)
    found = [name for name in SOURCES.values() if (p / name).is_dir()]
    if found:
        raise CheckpointError(
            f"No {SOURCES[source]} in {p}; it has {', '.join(found)}: pick one with --source "
            f"({', '.join(k for k, v in SOURCES.items() if v in found)})."
        )
    raise CheckpointError(
        f"No nanochat checkpoint found in {p}: expected model_*.pt files, or a base dir with "
        f"{SOURCES[source]}/<tag>/."
    )
