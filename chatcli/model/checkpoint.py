"""Finding and loading nanochat checkpoints, safely, with errors that say how to fix them.

Owns: reading meta and weights (`torch.load(weights_only=True)`: no code runs), checking
every key and shape against the meta, choosing device and dtype, and building the model.
Which files a user points at (a base dir, a folder, a file, a tag, or nothing = the embedded
default model) is chatcli.model.checkpoint_paths'; the checks made before anything is built
are chatcli.model.checkpoint_checks'; listing what is on disk is
chatcli.model.checkpoint_listing's. Knows nothing about generation or the terminal.
"""

from __future__ import annotations

import re
import time
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from chatcli.errors import CheckpointError, TokenizerError
from chatcli.model.checkpoint_checks import (
    check_config_against_weights,
    check_finite,
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
from chatcli.model.gpt import GPT, GPTConfig, infer_architecture
from chatcli.model.hub import fetch_model
from chatcli.model.hub_layout import is_hub_id
from chatcli.model.linear import is_embedding_table
from chatcli.model.quantize import default_half_kind
from chatcli.model.tokenizer import Tokenizer

# A meta file is a few hundred bytes; one of megabytes is something else.
META_MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class ModelInfo:
    """What was loaded, for the banner and /model."""

    path: str
    tag: str | None
    step: int
    source: str | None
    era: str
    num_params: int
    device: str
    dtype: str
    sequence_len: int
    load_s: float
    embedded: bool


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device not in ("cpu", "mps") and not re.fullmatch(r"cuda(:(0|[1-9]\d*))?", device):
        raise CheckpointError(f"Unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps.")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise CheckpointError(
                f"Device {device!r} was asked for, but no CUDA GPU is available. "
                "Use --device auto or cpu."
            )
        index = device.partition(":")[2]
        if index and int(index) >= torch.cuda.device_count():  # digits: the pattern above
            raise CheckpointError(
                f"Device {device!r} was asked for, but this machine has "
                f"{torch.cuda.device_count()} CUDA GPU(s): cuda:0 to "
                f"cuda:{torch.cuda.device_count() - 1}."
            )
    if device == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise CheckpointError(
                "Device 'mps' was asked for, but this machine has no Apple GPU that torch "
                "can use. Use --device auto or cpu."
            )
    return torch.device(device)


# Above this many matrix weights (the embedding tables, looked up a row at a time, not
# counted), CPU decode streams the matrices from memory, and a 16-bit copy halves the bytes
# read per token; below it the copies measured no faster (docs/performance-notes.md,
# "Large models").
LARGE_MODEL_MATRIX_PARAMS = 16_000_000
# Entries of narrow embedding tables from which they stay narrow (_narrow_tables): 64 MB
# widened to fp32. The embedded model's four bf16 tables hold 0.8M, d4's 50M, d20's 922M.
NARROW_TABLES_AT = 16 * 2**20
# What --quantize takes when loading (16-bit copies come by default or with --dtype).
QUANTIZE_CHOICES = ("none", "int8", "int4")


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype  # activations, norms, softmax, the KV cache, the weights (big
    # embedding tables saved narrower may stay so on the CPU: _narrow_tables)
    decode: str | None = None  # a compact copy batch-1 decode reads (quantize.QUANTIZE_KINDS)

    def describe(self, tables: torch.dtype | None = None) -> str:
        """e.g. "float32 (decode weights float16), embeddings bfloat16" (tables: the embedding
        tables' dtype, said where it is not the compute dtype: _narrow_tables)."""
        c = str(self.compute).removeprefix("torch.")
        text = c if self.decode is None else f"{c} (decode weights {self.decode})"
        if tables is not None and tables != self.compute:
            text += f", embeddings {str(tables).removeprefix('torch.')}"
        return text


def pick_precision(
    device: torch.device, dtype: str = "auto", matrix_params: int = 0, quantize: str = "none"
) -> Precision:
    """bf16 end to end on CUDA; on CPU fp32, plus a compact copy of the matrices for the
    batch-1 decode of large models (1.5x the memory of fp32): 16-bit by default, fp16 where
    it reads faster (quantize.default_half_kind) else bf16, and bf16 when dtype says so; or
    int8/int4 when asked for (quantize), whatever the size.

    Small models keep fp32 weights on CPU: they are dispatch-bound, not bandwidth-bound, and
    fp32 keeps their greedy output identical to the reference.
    """
    if dtype not in ("auto", "float32", "bfloat16"):
        raise CheckpointError(f"Unknown dtype {dtype!r}; use auto, float32 or bfloat16.")
    if quantize not in QUANTIZE_CHOICES:
        raise CheckpointError(
            f"Unknown quantize {quantize!r}; use {', '.join(QUANTIZE_CHOICES[:-1])} or "
            f"{QUANTIZE_CHOICES[-1]}."
        )
    if quantize != "none":
        if device.type != "cpu":
            raise CheckpointError(
                f"--quantize {quantize} is for CPU decode; on {device.type} the model runs in "
                "bf16 already. Drop --quantize, or add --device cpu."
            )
        return Precision(torch.float32, quantize)
    if dtype == "float32":
        return Precision(torch.float32)
    if device.type == "cuda":
        if dtype == "bfloat16" or native_bf16(device):
            return Precision(torch.bfloat16)
        return Precision(torch.float32)
    if device.type != "cpu":  # MPS: decode copies are a CPU kernel choice
        return Precision(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    if dtype == "bfloat16":
        return Precision(torch.float32, "bfloat16")
    if matrix_params > LARGE_MODEL_MATRIX_PARAMS:
        return Precision(torch.float32, default_half_kind())
    return Precision(torch.float32)


def native_bf16(device: torch.device) -> bool:
    """Whether this GPU computes in bf16 itself (compute capability 8.0, Ampere, or later).
    torch.cuda.is_bf16_supported() also says yes where bf16 is emulated (Volta, Turing),
    and of the current device, not this one: there flash attention refuses bf16 and every
    product runs without bf16 units, so fp32 is the faster choice."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


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
        if zipfile.is_zipfile(model_file):
            sd = torch.load(model_file, map_location="cpu", weights_only=True, mmap=True)
        else:  # torch's legacy format (before 1.6, or saved so): read whole, no mmap
            sd = torch.load(model_file, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for truncated zips and foreign pickles
        raise CheckpointError(_unreadable_weights(model_file, e)) from e
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        held = (
            f"a dict with keys {_short(sorted(map(str, sd)))}"
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


def check_state_dict(
    model: GPT, sd: dict[str, torch.Tensor], model_file: Path, config: GPTConfig
) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(sd))
    unknown = sorted(set(sd) - set(expected))
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing keys {_short(missing)}")
        if unknown:
            parts.append(f"unknown keys {_short(unknown)}")
        raise CheckpointError(
            f"{model_file} does not match a nanochat model (era {model.arch.era}): "
            + "; ".join(parts)
            + "."
        )
    for k, want in expected.items():
        if tuple(sd[k].shape) != tuple(want.shape):
            raise CheckpointError(
                f"{model_file}: {k} has shape {tuple(sd[k].shape)} but the meta's model_config "
                f"(n_layer={config.n_layer}, n_embd={config.n_embd}, n_head={config.n_head}, "
                f"n_kv_head={config.n_kv_head}, vocab_size={config.vocab_size}) implies "
                f"{tuple(want.shape)}."
            )


def _short(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else "")


def saved_matrix_params(sd: dict[str, torch.Tensor]) -> int:
    """Weights of the matrices a decode step reads whole (pick_precision's size): the
    embedding tables are looked up a row at a time, so they do not count."""
    return sum(v.numel() for k, v in sd.items() if v.ndim == 2 and not is_embedding_table(k))


def _narrow_tables(
    sd: dict[str, torch.Tensor], precision: Precision, device: torch.device
) -> set[str]:
    """The embedding tables kept as saved rather than widened to the compute dtype: tables
    saved narrower (nanochat's CUDA runs save wte and the value embeddings in bf16), for
    fp32 compute on the CPU, where they are big enough to matter (NARROW_TABLES_AT). They
    stay mapped from the file (read_state_dict's mmap), and each looked-up row widens
    (model.look_up, exact). Widened at load, a big model's tables take gigabytes where a
    decode step reads a row of each; a small model's step, made of dispatched ops, would
    only pay one op more per lookup."""
    if device.type != "cpu" or precision.compute != torch.float32:
        return set()
    narrow = {
        k
        for k, v in sd.items()
        if is_embedding_table(k) and v.dtype in (torch.bfloat16, torch.float16)
    }
    return narrow if sum(sd[k].numel() for k in narrow) >= NARROW_TABLES_AT else set()


def _read_through(table: torch.Tensor) -> None:
    """Read every page of a table mapped from the file once, so that the first lookup of
    each token does not wait on the disk: a row per table, each a random read. The pages
    stay the file's, which the OS may drop again under pressure (kernels that honour madvise
    would read ahead by themselves; some ignore MADV_WILLNEED and fadvise)."""
    table.view(torch.uint8).amax()


def _narrow_dtype(model: GPT) -> torch.dtype | None:
    """The dtype of the embedding tables kept narrower than the compute dtype, if any."""
    compute = model.compute_dtype
    kept = (p.dtype for n, p in model.named_parameters() if is_embedding_table(n))
    return next((d for d in kept if d != compute), None)


def build_model(
    sd: dict[str, torch.Tensor],
    config: GPTConfig,
    model_file: Path,
    device: torch.device,
    precision: Precision,
    softcap: float | None = None,
) -> GPT:
    # Before a module is allocated: the config's sizes against the weights' shapes (a meta
    # claiming 10^9 layers fails here at once), and the values (NaN or inf load and babble).
    check_config_against_weights(config, sd, model_file)
    check_finite(sd, model_file)
    arch = infer_architecture(sd, config, softcap=softcap)
    with torch.device("meta"):
        model = GPT(config, arch)
    check_state_dict(model, sd, model_file, config)
    narrow = _narrow_tables(sd, precision, device)
    stored = {k: v if k in narrow else v.to(precision.compute) for k, v in sd.items()}
    model.load_state_dict(stored, assign=True)
    for k in narrow:
        _read_through(stored[k])
    if precision.decode is not None:
        model.add_decode_weights(precision.decode)
    model.cos, model.sin = torch.empty(0), torch.empty(0)  # the meta-device placeholders
    model.to(device)
    model.init_rotary()
    model.eval()
    model.requires_grad_(False)
    return model


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
    dev = pick_device(device)
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
        dtype=precision.describe(_narrow_dtype(model)),
        sequence_len=config.sequence_len,
        load_s=time.perf_counter() - t0,
        embedded=path is None,
    )
    return model, tokenizer, meta
