"""`chatcli export`: a nanochat model as a transformers folder that other tools load.

Owns: reading the model to export (a nanochat checkpoint, exactly as saved, or a transformers
folder, on disk or from the Hub as hf:ORG/NAME), and writing the folder: config.json,
model.safetensors (sharded past 5 GB, with its index), generation_config.json, tokenizer.json
+ tokenizer_config.json (with the chat template), chatcli's modeling file for eras B-E, and a
README.md model card. The folder is written beside OUT (.OUT.partial-PID) and renamed into
place at the end, so a failed export leaves nothing half-written, and one killed before its
end is removed by the next export into OUT. Refuses what it cannot write exactly (a tokenizer
the fast tokenizer would not reproduce, an OUT that is not empty, a link, or under a file).
Needs the hf extra (tokenizers builds the fast tokenizer, huggingface_hub plans the shards);
knows nothing about the command line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chatcli.errors import ChatcliError, CheckpointError, TokenizerError
from chatcli.model.checkpoint import read_meta, read_state_dict, read_tokenizer_for
from chatcli.model.checkpoint_paths import resolve_checkpoint
from chatcli.model.gpt import GPT, Architecture, GPTConfig, infer_architecture
from chatcli.model.hf_chat_template import chat_template
from chatcli.model.hf_config import CODE_FILES, TokenIds, hf_config, uses_native_class
from chatcli.model.hf_load import check_one_checkpoint, is_hf_folder, read_hf_folder
from chatcli.model.hf_model_card import model_card
from chatcli.model.hf_tokenizer import agreement, probe_texts, write_hf_tokenizer
from chatcli.model.hf_weights import (
    MAX_SHARD_SIZE,
    cast_for_export,
    config_dtype,
    to_hf_names,
    write_safetensors,
)
from chatcli.model.hub import fetch_model
from chatcli.model.hub_layout import is_hub_id
from chatcli.model.model_build import check_state_dict
from chatcli.model.special_tokens import ASSISTANT_END
from chatcli.model.tokenizer import Tokenizer

HF_EXTRA = "pip install 'chatcli[hf]'"
DTYPES = ("keep", "float32", "bfloat16")
CODE_SOURCE = Path(__file__).parent / "hf_modeling"


@dataclass(frozen=True)
class ExportSource:
    """The model to export, in nanochat's names, weights as saved."""

    state_dict: dict[str, torch.Tensor]
    config: GPTConfig
    arch: Architecture
    tokenizer: Tokenizer
    origin: str  # what it was read from, for the model card


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling a generation_config.json proposes (chatcli's defaults, from the caller)."""

    temperature: float
    top_k: int | None
    top_p: float | None = None


@dataclass(frozen=True)
class ExportResult:
    folder: Path
    era: str
    native: bool  # transformers' own NanoChatForCausalLM, no remote code
    files: list[str]
    num_params: int
    size_bytes: int
    seconds: float
    removed: list[tuple[Path, int]]  # stale half-written exports removed, with their PIDs


def require_hf_extra() -> None:
    """Raise the one-line fix where the libraries an export writes with are missing."""
    missing = []
    for name in ("tokenizers", "huggingface_hub"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ChatcliError(f"chatcli export needs {', '.join(missing)}: {HF_EXTRA}")


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ChatcliError(f"Unknown --dtype {dtype!r}; use {', '.join(DTYPES)}.")


def check_out_folder(out: Path) -> Path:
    """OUT as an absolute path, where an export may write it: missing (its folders are made)
    or an empty folder, never a link (the export would land elsewhere), under folders that
    exist or can be made and written."""
    out = out.expanduser().absolute()
    try:
        if out.is_symlink():
            target = os.readlink(out)
            real = Path(os.path.normpath(out.parent / target))
            fix = (
                f"Pass the folder it leads to ({real}), or a new OUT"
                if real.exists()
                else "Remove the link, or pass a new OUT"
            )
            raise ChatcliError(
                f"{out} is a link to {target}"
                + ("" if real.exists() else ", which does not exist")
                + f": chatcli export writes a new folder, never through a link. {fix}."
            )
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ChatcliError(f"{out} exists and is not an empty folder: pick a new OUT folder.")
        here = Path.cwd().resolve()
        if out.exists() and (here == out.resolve() or out.resolve() in here.parents):
            # The export is renamed into OUT's place: the shell would be left in a folder
            # that no longer exists.
            raise ChatcliError(
                f"{out} is the folder you are in: chatcli export puts a new folder in OUT's "
                "place. Pick a new OUT folder (e.g. ./model)."
            )
        _check_parent(out)
    except OSError as e:
        raise ChatcliError(f"{out} cannot be written: {_why(e)}. Pick another OUT.") from None
    return out


def _check_parent(out: Path) -> None:
    """The nearest folder above OUT that exists must be one this process can write in."""
    above = out.parent
    while not os.path.lexists(above) and above != above.parent:
        above = above.parent
    if above.is_symlink() and not above.exists():
        raise ChatcliError(
            f"{out} cannot be made: {above} is a link to {os.readlink(above)}, which does not "
            "exist. Make that folder, or pick another OUT."
        )
    if not above.is_dir():
        raise ChatcliError(
            f"{out} cannot be made: {above} is a file, not a folder. Pick an OUT inside a folder."
        )
    if not os.access(above, os.W_OK | os.X_OK):
        raise ChatcliError(
            f"{out} cannot be made: {above} is not writable by this user. Pick an OUT in a "
            "folder you can write to."
        )


def _why(e: OSError) -> str:
    where = f" ({os.fsdecode(e.filename)})" if e.filename is not None else ""
    return f"{e.strerror or e}{where}"


def remove_stale_partials(out: Path) -> list[tuple[Path, int]]:
    """Remove the half-written exports into `out` (.OUT.partial-PID beside it) whose process
    is no longer running: what an export killed before its end leaves. Returns them, with
    their PIDs. A running export's folder is left alone."""
    out = out.expanduser().absolute()
    pattern = re.compile(rf"\.{re.escape(out.name)}\.partial-(\d+)")
    try:
        entries = sorted(out.parent.iterdir())
    except OSError:  # no parent yet, or one that cannot be listed: nothing of ours there
        return []
    removed = []
    for path in entries:
        m = pattern.fullmatch(path.name)
        if m is None or path.is_symlink() or not path.is_dir():
            continue  # not a folder an export made
        pid = int(m[1])
        if pid <= 0 or (pid != os.getpid() and _running(pid)):
            continue
        try:
            shutil.rmtree(path)
        except OSError as e:
            raise ChatcliError(
                f"{path} is a half-written export left by process {pid}, which is no longer "
                f"running, and it cannot be removed ({_why(e)}): remove it yourself."
            ) from None
        removed.append((path, pid))
    return removed


def _running(pid: int) -> bool:
    """Whether a process `pid` exists (signal 0 checks without sending anything; POSIX)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    except (OverflowError, ValueError, OSError):  # not a PID this system can have
        return False
    return True


def read_source(
    model: str | Path | None, source: str, step: int | None, softcap: float | None
) -> ExportSource:
    """The model as saved: a nanochat checkpoint (what load_model would run), a transformers
    folder, or either of them from the Hub (hf:ORG/NAME, as load_model fetches it). Checked as
    load_model checks it; nothing is cast."""
    hub = None
    if is_hub_id(model):
        hub = fetch_model(str(model), source=source, step=step)
        model, source, step = hub.local_path, "sft", None  # the files are picked
    if model is not None and is_hf_folder(model):
        folder = Path(model).expanduser()
        check_one_checkpoint(folder.absolute(), source, step)
        found = read_hf_folder(folder, softcap)
        origin = (
            f"the transformers-format folder {folder.absolute().name}"
            if hub is None
            else f"the transformers-format model {hub.hub} at commit {hub.commit[:12]}"
        )
        return ExportSource(found.state_dict, found.config, found.arch, found.tokenizer, origin)
    ref = resolve_checkpoint(model, source=source, step=step)
    _, config = read_meta(ref.meta_file)
    tokenizer = read_tokenizer_for(ref, config)
    sd = read_state_dict(ref.model_file)
    if "transformer.wte.weight" not in sd:
        raise CheckpointError(f"{ref.model_file}: missing key transformer.wte.weight.")
    arch = infer_architecture(sd, config, softcap=softcap)
    with torch.device("meta"):
        check_state_dict(GPT(config, arch), sd, ref.model_file, config)
    # Said without the local path, which is the exporter's business, not the card's reader's.
    if model is None:
        origin = f"chatcli's embedded demo model (step {ref.step})"
    elif hub is not None:
        origin = f"the nanochat checkpoint {hub.hub} at commit {hub.commit[:12]}, step {ref.step}"
    else:
        origin = f"the {ref.source or 'nanochat'} checkpoint {ref.tag} at step {ref.step}"
    return ExportSource(sd, config, arch, tokenizer, origin)


def export_model(
    out: Path,
    src: ExportSource,
    generation: GenerationDefaults,
    *,
    dtype: str = "keep",
    remote_code: bool = False,
    max_shard_size: int | str = MAX_SHARD_SIZE,
) -> ExportResult:
    """Write `src` as a transformers folder at `out` (which must not exist, or be empty).
    remote_code: chatcli's modeling file for era A too (exact rotary rounding)."""
    require_hf_extra()
    t0 = time.perf_counter()
    check_dtype(dtype)
    out = check_out_folder(out)
    removed = remove_stale_partials(out)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        partial.mkdir(parents=True)
    except OSError as e:
        raise ChatcliError(f"{out} cannot be written: {_why(e)}. Pick another OUT.") from None
    try:
        native = uses_native_class(src.arch) and not remote_code
        _write(partial, src, generation, dtype, native, max_shard_size)
        if out.exists() and not out.is_symlink():
            out.rmdir()  # still empty: checked above; another writer's files make this fail
        partial.rename(out)
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise ChatcliError(
            f"Writing {out} failed: {_why(e)}. Nothing was left behind; free the space or fix "
            "the folder, then export again."
        ) from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    files = sorted(p.name for p in out.iterdir())
    return ExportResult(
        folder=out,
        era=src.arch.era,
        native=native,
        files=files,
        num_params=sum(v.numel() for v in src.state_dict.values()),
        size_bytes=sum(p.stat().st_size for p in out.iterdir()),
        seconds=time.perf_counter() - t0,
        removed=removed,
    )


def _write(
    folder: Path,
    src: ExportSource,
    generation: GenerationDefaults,
    dtype: str,
    native: bool,
    max_shard_size: int | str,
) -> None:
    tok, config = src.tokenizer, src.config
    # The tokenizer first: it is quick, and a mismatch stops the export before gigabytes.
    fast = write_hf_tokenizer(tok, folder, chat_template(), config.sequence_len)
    wrong = agreement(tok, fast, probe_texts(tok))
    if wrong:
        raise TokenizerError(
            f"The fast tokenizer would encode {wrong[0]!r} otherwise than this model's own "
            "tokenizer, so the export would not be exact; nothing was written."
        )
    ids = TokenIds(
        bos=tok.get_bos_token_id(),
        eos=tok.encode_special(ASSISTANT_END),
        pad=tok.encode_special(ASSISTANT_END),
    )
    sd = cast_for_export(to_hf_names(src.state_dict, config.vocab_size), dtype)
    hf = hf_config(config, src.arch, ids, config_dtype(sd), native=native)
    _write_json(folder / "config.json", hf)
    _write_json(folder / "generation_config.json", generation_config(ids, generation))
    write_safetensors(sd, folder, max_shard_size)
    if not native:
        for name in CODE_FILES:
            shutil.copyfile(CODE_SOURCE / name, folder / name)
    card = model_card(hf, src.origin, sum(v.numel() for v in sd.values()), dtype)
    (folder / "README.md").write_text(card, encoding="utf-8")


def generation_config(ids: TokenIds, defaults: GenerationDefaults) -> dict[str, Any]:
    """chatcli's default sampling; a turn ends at <|assistant_end|> (or a stray <|bos|>, as
    chatcli's engine stops)."""
    out: dict[str, Any] = {
        "bos_token_id": ids.bos,
        "eos_token_id": [ids.eos, ids.bos],
        "pad_token_id": ids.pad,
        "do_sample": defaults.temperature > 0,
        "temperature": defaults.temperature if defaults.temperature > 0 else 1.0,
    }
    if defaults.top_k:
        out["top_k"] = defaults.top_k
    if defaults.top_p is not None and defaults.top_p < 1.0:
        out["top_p"] = defaults.top_p
    return out


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
