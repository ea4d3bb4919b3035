"""Finding and loading nanochat checkpoints, safely, with errors that say how to fix them.

Owns: reading meta and weights (`torch.load(weights_only=True)`: no code runs), checking
every key and shape against the meta, choosing device and dtype, and building the model.
Which files a user points at (a base dir, a folder, a file, a tag, or nothing = the embedded
default model) is chatcli.model.checkpoint_paths'; the checks made before anything is built
are chatcli.model.checkpoint_checks'; listing what is on disk is
chatcli.model.checkpoint_listing's. Knows nothing about generation or the terminal.
"""

from __future__ import annotations

import time
import warnings
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from chatcli.errors import CheckpointError, TokenizerError
from chatcli.model.checkpoint_checks import (
    check_tensors,
    config_from_meta,
)
from chatcli.model.checkpoint_paths import EMBEDDED_DIR as EMBEDDED_DIR  # imported from here
from chatcli.model.checkpoint_paths import SOURCES as SOURCES  # by tests: re-exported
from chatcli.model.checkpoint_paths import CheckpointRef, resolve_checkpoint
from chatcli.model.data_files import (
    UnreadableFileError,
    check_readable,
    read_json_file,
)
from chatcli.model.gpt import GPT, GPTConfig
from chatcli.model.hub import fetch_model
from chatcli.model.hub_layout import is_hub_id
from chatcli.model.model_build import (
    ModelInfo,
    build_model,
    device_note,
    narrow_dtype,
    pick_device,
    pick_precision,
    saved_matrix_params,
    short_keys,
)
from chatcli.model.tokenizer import Tokenizer

# A meta file is a few hundred bytes; one of megabytes is something else.
META_MAX_BYTES = 1 << 20


# ---- reading and checking -----------------------------------------------------------------


def read_meta(meta_file: Path) -> tuple[dict[str, Any], GPTConfig]:
    try:
        meta = read_json_file(meta_file, META_MAX_BYTES)
    except UnreadableFileError as e:
        if e.missing:
            raise CheckpointError(
                f"Missing meta file {meta_file} (it holds the model_config)."
            ) from None
        raise CheckpointError(f"Meta file {e}. Copy the meta saved with the weights.") from None
    except ValueError as e:
        raise CheckpointError(f"Meta file {meta_file} is not readable JSON: {e}.") from None
    cfg = meta.get("model_config") if isinstance(meta, dict) else None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"Meta file {meta_file} has no model_config object.")
    # Every number checked for its type and range here, against the weights in build_model.
    return meta, config_from_meta(cfg, meta_file)


def read_state_dict(model_file: Path) -> dict[str, torch.Tensor]:
    try:  # a folder, a link to nothing or to itself, no permission: said as such
        check_readable(model_file)
    except UnreadableFileError as e:
        raise CheckpointError(f"{e}. Copy or download the weights again.") from None
    try:
        # torch warns of what it reads oddly (a pickle protocol it did not write) and then
        # reads it or fails: either way what it says is no use to the person, and the
        # failure is said below in one line.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            if zipfile.is_zipfile(model_file):
                sd = torch.load(model_file, map_location="cpu", weights_only=True, mmap=True)
            else:  # torch's legacy format (before 1.6, or saved so): read whole, no mmap
                sd = torch.load(model_file, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for truncated zips and foreign pickles
        raise CheckpointError(_unreadable_weights(model_file, e)) from e
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        held = (
            f"a dict with keys {short_keys(sorted(map(str, sd)))}"
            if isinstance(sd, dict)
            else f"a {type(sd).__name__}"
        )
        raise CheckpointError(
            f"{model_file} holds {held}, not a state_dict of tensors: nanochat's model_*.pt "
            "is the model's state_dict itself. Save model.state_dict() alone, or pass the "
            "folder of a nanochat checkpoint."
        )
    check_tensors(sd, model_file)  # names, kinds and storage sizes: no value read yet
    # torch.compile'd models save their keys under an `_orig_mod.` prefix.
    return {k.removeprefix("_orig_mod."): v for k, v in sd.items()}


def _unreadable_weights(model_file: Path, error: Exception) -> str:
    """Why torch.load failed, in our words: its own messages run on about re-saving with
    options that mean nothing to someone who downloaded the file."""
    if not zipfile.is_zipfile(model_file):  # a torch checkpoint is a zip archive
        size = model_file.stat().st_size
        why = (
            f"it is not a whole torch checkpoint ({size:,} bytes: empty, cut short or "
            "another format)"
        )
    else:
        first = str(error).splitlines()[0].split(". ")[0] if str(error) else type(error).__name__
        why = f"it is damaged, or holds more than a plain state_dict of tensors ({first})"
    return f"Cannot read the weights in {model_file}: {why}. Copy or download it again."


def read_tokenizer_for(ref: CheckpointRef, config: GPTConfig) -> Tokenizer:
    """The checkpoint's tokenizer, refused where its vocabulary is not the model's."""
    try:
        tokenizer = Tokenizer.from_file(ref.tokenizer_file)
    except TokenizerError as e:
        raise CheckpointError(str(e)) from e
    if tokenizer.get_vocab_size() != config.vocab_size:
        raise CheckpointError(
            f"Tokenizer {ref.tokenizer_file} has {tokenizer.get_vocab_size()} tokens but the model "
            f"({ref.meta_file}) expects vocab_size {config.vocab_size}: they are not from the "
            "same training run."
        )
    return tokenizer


def load_model(
    path: str | Path | None = None,
    *,
    source: str = "sft",
    tag: str | None = None,
    step: int | None = None,
    device: str = "auto",
    dtype: str = "auto",
    softcap: float | None = None,
    quantize: str = "none",
) -> tuple[GPT, Tokenizer, dict[str, Any]]:
    """Load a nanochat checkpoint: (model, tokenizer, meta).

    path: a nanochat base dir (~/.cache/nanochat layout), a checkpoint folder, a flat download
    folder (model_*.pt, meta_*.json, tokenizer.pkl side by side), a model_*.pt file, a tag in
    $NANOCHAT_BASE_DIR, hf:ORG/NAME[@REVISION] (a Hub model, fetched into the Hub cache), a
    transformers-format folder (hf_load), or None for the embedded default model. The largest
    d<N> tag and the last step are taken unless tag/step say otherwise. softcap overrides the
    logit softcap (15) for the short-lived variant that used 20, which nothing on disk reveals.
    quantize (int8, int4; CPU only) reads the matrices in that format during batch-1 decode.
    """
    from chatcli.model.hf_load import is_hf_folder, load_hf_model

    t0 = time.perf_counter()
    hub = None
    if is_hub_id(path):  # fetched, or found in the Hub cache, then loaded as any local one
        hub = fetch_model(str(path), source=source, tag=tag, step=step)
        path = hub.local_path
    if path is not None and is_hf_folder(path):  # config.json + safetensors + tokenizer.json
        model, tokenizer, meta = load_hf_model(
            Path(path),
            # A Hub model's source and step picked its files already.
            source="sft" if hub else source,
            step=None if hub else step,
            device=device,
            dtype=dtype,
            softcap=softcap,
            quantize=quantize,
        )
        if hub:  # the snapshot folder is named by its commit: name it by the repo
            model.info = replace(model.info, tag=hub.hub.name)
        return model, tokenizer, meta
    ref = resolve_checkpoint(path, source=source, tag=tag, step=step)
    meta, config = read_meta(ref.meta_file)
    tokenizer = read_tokenizer_for(ref, config)
    sd = read_state_dict(ref.model_file)
    dev = pick_device(device, saved_matrix_params(sd))
    precision = pick_precision(dev, dtype, saved_matrix_params(sd), quantize)
    model = build_model(sd, config, ref.model_file, dev, precision, softcap)
    model.info = ModelInfo(
        path=str(ref.model_file),
        tag=hub.shown_tag(ref.tag) if hub else ref.tag,
        step=ref.step,
        source=ref.source,
        era=model.arch.era,
        num_params=model.num_params(),
        device=str(dev),
        dtype=precision.describe(narrow_dtype(model)),
        sequence_len=config.sequence_len,
        load_s=time.perf_counter() - t0,
        embedded=path is None,
        device_note=device_note(device, saved_matrix_params(sd)),
    )
    return model, tokenizer, meta
