"""Listing the checkpoints on disk, for `chatcli models`: every step of every tag of every
source in a base dir (or what --model takes: a source's folder, a download's folder), and
the embedded model.

Owns the summary of each (era and size read from the shapes alone: the weights are mapped,
never read) and the rule that a checkpoint that cannot be read, a folder that cannot be
listed and a link that leads nowhere are listed with their problem, never skipped in
silence or ending the listing. Reading and checking each file is chatcli.model.checkpoint's;
knows nothing about the terminal.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from chatcli.errors import ChatcliError, CheckpointError
from chatcli.model.checkpoint import read_meta, read_state_dict
from chatcli.model.checkpoint_paths import (
    EMBEDDED_DIR,
    SOURCES,
    CheckpointRef,
    default_base_dir,
    folder_entries,
    ref_in_folder,
    resolve_checkpoint,
    step_file,
    steps_in,
)
from chatcli.model.data_files import UnreadableFileError, check_readable, described
from chatcli.model.gpt import infer_architecture


@dataclass(frozen=True)
class CheckpointSummary:
    name: str  # "embedded" or the base dir
    source: str | None
    tag: str | None
    step: int | None  # None for a folder that could not be listed
    era: str
    num_params: int
    size_bytes: int
    path: Path
    problem: str | None = None  # why it could not be read (then era and num_params are empty)


def _summarize(name: str, ref: CheckpointRef) -> CheckpointSummary:
    # mmap: only the zip index and the shapes are read, even for multi-GB checkpoints.
    sd = read_state_dict(ref.model_file)
    _, config = read_meta(ref.meta_file)
    try:
        era = infer_architecture(sd, config).era
    except (KeyError, ValueError) as e:  # tensors of something other than a nanochat GPT
        raise CheckpointError(
            f"{ref.model_file} does not hold a nanochat model (looked for {e})."
        ) from None
    return CheckpointSummary(
        name=name,
        source=ref.source,
        tag=ref.tag,
        step=ref.step,
        era=era,
        num_params=sum(v.numel() for v in sd.values()),
        size_bytes=ref.model_file.stat().st_size,
        path=ref.model_file,
    )


def list_checkpoints(
    base_dir: Path | None = None, *, embedded: bool = True
) -> list[CheckpointSummary]:
    """The embedded model (unless `embedded` is False), then every step of every tag of every source in the base dir.
    A checkpoint that cannot be read, a folder that cannot be listed and a link that leads
    nowhere are listed with their problem: one broken file never ends or thins the listing."""
    found: list[CheckpointSummary] = []
    base = base_dir or default_base_dir()

    def problem(source: str | None, tag: str | None, step: int | None, path: Path, e: Exception):
        why = described(e) if isinstance(e, OSError) else str(e)
        if not isinstance(e, (OSError, ChatcliError)):  # whatever torch raised for this file
            why = f"{type(e).__name__}: {e}"
        size = _size(path)
        name = "embedded" if path.is_relative_to(EMBEDDED_DIR) else str(base)
        found.append(CheckpointSummary(name, source, tag, step, "-", 0, size, path, why))

    def folders_in(folder: Path, source: str | None) -> list[Path]:
        try:
            entries = folder_entries(folder)
            for link in [p for p in entries if p.is_symlink() and not p.exists()]:
                try:
                    check_readable(link)  # says whether it leads to nothing or to itself
                except UnreadableFileError as e:
                    problem(source, link.name, None, link, e)
            return [p for p in entries if p.is_dir()]
        except (CheckpointError, OSError) as e:
            problem(source, folder.name, None, folder, e)
            return []

    def steps_of(folder: Path, source: str | None) -> list[int]:
        try:
            return steps_in(folder)
        except (CheckpointError, OSError) as e:
            problem(source, folder.name, None, folder, e)
            return []

    if embedded and (EMBEDDED_DIR / SOURCES["sft"]).is_dir():
        try:
            found.append(_summarize("embedded", resolve_checkpoint(None)))
        except Exception as e:  # listed, as any checkpoint: see below
            problem("sft", None, None, EMBEDDED_DIR, e)
    # What --model takes, listed alike: a base dir's sources, one source's folder of tags
    # (base/chatsft_checkpoints), or one folder of steps (a download, a tag's folder).
    named = next((k for k, v in SOURCES.items() if v == base.name), None)
    places: list[tuple[str | None, list[Path]]] = []
    if steps_of(base, None):
        places.append((None, [base]))
    if named is not None:
        tags = folders_in(base, named)
        places.append((named, [t for t in tags if t.name not in SOURCES.values()]))
    places += [(source, folders_in(base / name, source)) for source, name in SOURCES.items()]
    for source, tags in places:
        for tag_dir in tags:
            for step in steps_of(tag_dir, source):
                try:
                    ref = ref_in_folder(tag_dir, step, tag_dir.name, source)
                    found.append(_summarize(str(base), ref))
                except Exception as e:
                    # Whatever a file holds, it is listed with its problem: a checkpoint
                    # left out looked like none at all, and one raising ended the listing.
                    problem(source, tag_dir.name, step, _step_path(tag_dir, step), e)
    return found


def _size(path: Path) -> int:
    try:
        return path.stat().st_size if path.is_file() else 0
    except OSError:  # a link to nothing, or a folder without permission on the way
        return 0


def _step_path(folder: Path, step: int) -> Path:
    try:
        return step_file(folder, step)
    except (CheckpointError, StopIteration):  # gone since it was listed
        return folder
