"""Transformers-format folders as chatcli models: config.json + safetensors + tokenizer.json.

Owns: telling such a folder from nanochat's layouts, reading it into nanochat's names and
shapes (hf_config, hf_weights, hf_tokenizer do the parts), checking that the config, the
weights and the tokenizer agree with each other, and loading it into chatcli's own GPT and
engine through checkpoint.build_model, with the same device, precision and speed choices as a
nanochat checkpoint. A folder's Python files (auto_map's modeling code) are never imported:
chatcli computes the era itself, and reads weights from safetensors only.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from chatcli.errors import CheckpointError, TokenizerError
from chatcli.model.checkpoint_paths import steps_in
from chatcli.model.data_files import UnreadableFileError, read_json_file, regular_file
from chatcli.model.gpt import Architecture, GPTConfig, infer_era
from chatcli.model.hf_config import read_hf_config
from chatcli.model.hf_tokenizer import TOKENIZER_FILE, read_hf_tokenizer
from chatcli.model.hf_weights import from_hf_names, read_weights, weight_files
from chatcli.model.model_build import (
    ModelInfo,
    build_model,
    device_note,
    narrow_dtype,
    pick_device,
    pick_precision,
    saved_matrix_params,
)
from chatcli.model.softcap import checked_softcap
from chatcli.model.tokenizer import Tokenizer

CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = 16 * 2**20  # a config.json is a few KB


def is_hf_folder(path: str | Path) -> bool:
    """A folder with a config.json and no nanochat model_*.pt (which would win). A config.json
    that is a folder or a broken link counts: reading it then says what is wrong with it."""
    p = Path(path).expanduser()
    return p.is_dir() and os.path.lexists(p / CONFIG_FILE) and not steps_in(p)


@dataclass(frozen=True)
class HFFolder:
    """A transformers-format nanochat, in nanochat's names (vocabulary rows as stored)."""

    folder: Path
    state_dict: dict[str, torch.Tensor]
    config: GPTConfig
    arch: Architecture
    tokenizer: Tokenizer
    native: bool  # transformers' own nanochat config, else chatcli's

    @property
    def weights_path(self) -> Path:
        return weight_files(self.folder)[0]


def read_hf_folder(folder: Path, softcap: float | None = None) -> HFFolder:
    """Read and cross-check a transformers folder. softcap overrides the config's."""
    checked_softcap(softcap)
    config_file = folder / CONFIG_FILE
    try:
        raw = read_json_file(regular_file(config_file), MAX_CONFIG_BYTES)
    except UnreadableFileError as e:
        raise CheckpointError(f"{e}: a transformers folder's config.json is a JSON file.") from None
    except ValueError as e:
        raise CheckpointError(f"{config_file} is not readable JSON ({e}).") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_file} does not hold a JSON object.")
    described = read_hf_config(raw, str(config_file), softcap)
    tokenizer_file = folder / TOKENIZER_FILE
    if not os.path.lexists(tokenizer_file):
        raise CheckpointError(
            f"No {TOKENIZER_FILE} in {folder}: chatcli needs the fast tokenizer's file beside "
            "config.json (transformers' save_pretrained writes it)."
        )
    try:
        tokenizer = read_hf_tokenizer(tokenizer_file)
    except TokenizerError as e:
        raise CheckpointError(str(e)) from e
    sd = from_hf_names(read_weights(folder), str(folder))
    config, arch = described.config, described.arch
    rows = sd.get("transformer.wte.weight")
    if rows is not None and rows.shape[0] != config.vocab_size:
        raise CheckpointError(
            f"{config_file} says vocab_size {config.vocab_size}, but the token embedding has "
            f"{rows.shape[0]} rows: the config belongs to another model."
        )
    vocab = tokenizer.get_vocab_size()
    if vocab > config.vocab_size:
        raise CheckpointError(
            f"{tokenizer_file} has {vocab} tokens but the model ({config_file}) has "
            f"{config.vocab_size}: they are not from the same model."
        )
    # Rows past the tokenizer's vocabulary are padding (as nanochat pads to a multiple of 64):
    # kept as stored, their logits cut off.
    config = GPTConfig(**{**asdict(config), "vocab_size": vocab})
    era = infer_era(sd, config)
    if era != arch.era:
        raise CheckpointError(
            f"{config_file} describes a nanochat of era {arch.era}, but the weights in {folder} "
            f"are those of era {era}: the config belongs to another model."
        )
    return HFFolder(folder, sd, config, arch, tokenizer, described.native)


def check_one_checkpoint(folder: Path, source: str, step: int | None) -> None:
    """Refuse a step or a source other than the default for a transformers folder: it holds
    one set of weights, and a choice it cannot make would be ignored in silence."""
    if step is not None:
        raise CheckpointError(
            f"{folder} is a transformers-format model: it holds one set of weights, not steps. "
            "Leave the step out (--step, CHATCLI_STEP or the config's step)."
        )
    if source != "sft":
        raise CheckpointError(
            f"{folder} is a transformers-format model: it holds one set of weights, not "
            f"checkpoints of sft, base, ...; source {source!r} picks nothing. Leave the source at "
            "sft (--source, CHATCLI_SOURCE or the config's source)."
        )


def load_hf_model(
    folder: Path,
    *,
    source: str = "sft",
    step: int | None = None,
    device: str = "auto",
    dtype: str = "auto",
    softcap: float | None = None,
    quantize: str = "none",
) -> tuple[Any, Tokenizer, dict[str, Any]]:
    """load_model for a transformers folder: (model, tokenizer, meta)."""
    t0 = time.perf_counter()
    folder = folder.expanduser().absolute()
    check_one_checkpoint(folder, source, step)
    found = read_hf_folder(folder, softcap)
    dev = pick_device(device, saved_matrix_params(found.state_dict))
    precision = pick_precision(dev, dtype, saved_matrix_params(found.state_dict), quantize)
    model = build_model(
        found.state_dict, found.config, found.weights_path, dev, precision, found.arch.softcap
    )
    model.info = ModelInfo(
        path=str(folder),
        tag=folder.name,
        step=0,
        source=None,
        era=model.arch.era,
        num_params=model.num_params(),
        device=str(dev),
        dtype=precision.describe(narrow_dtype(model)),
        sequence_len=found.config.sequence_len,
        load_s=time.perf_counter() - t0,
        embedded=False,
        device_note=device_note(device, saved_matrix_params(found.state_dict)),
    )
    meta = {
        "model_config": asdict(found.config),
        "format": "transformers",
        "native": found.native,
    }
    return model, found.tokenizer, meta
