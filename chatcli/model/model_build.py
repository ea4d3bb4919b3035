"""Building a GPT from a state dict: the device, the precision, and the model itself.

Owns: ModelInfo (what was loaded, for the banner), choosing the device and the precision
(fp32, bf16, or compact decode copies for a big model on the CPU), checking a state dict's
keys and shapes against the model its config builds, and build_model, which every loader
uses: the nanochat checkpoint's (checkpoint.py) and the transformers folder's (hf_load.py).
Knows nothing about where the weights came from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from chatcli.errors import CheckpointError
from chatcli.model.checkpoint_checks import check_config_against_weights, check_finite
from chatcli.model.data_files import shown
from chatcli.model.device_choice import apple_device, on_apple_silicon
from chatcli.model.gpt import GPT, GPTConfig, infer_architecture
from chatcli.model.linear import is_embedding_table
from chatcli.model.quantize import default_half_kind


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
    device_note: str | None = None  # why --device auto chose this device, where it weighed


def pick_device(device: str = "auto", matrix_params: int | None = None) -> torch.device:
    """The device asked for, checked. auto: a CUDA GPU where there is one; on Apple Silicon
    our CPU kernels or MPS by the model's size (device_choice.py) where matrix_params is
    known, MPS where it is not; else the CPU."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            if matrix_params is not None and on_apple_silicon():
                return torch.device(apple_device(matrix_params).device)
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


def device_note(asked: str, matrix_params: int) -> str | None:
    """Why `--device auto` chose what it did, where it weighed the CPU against MPS (Apple
    Silicon with an Apple GPU), for the banner; None elsewhere."""
    mps = getattr(torch.backends, "mps", None)
    if asked != "auto" or torch.cuda.is_available() or not on_apple_silicon():
        return None
    if mps is None or not mps.is_available():
        return None
    return apple_device(matrix_params).why


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


def check_state_dict(
    model: GPT, sd: dict[str, torch.Tensor], model_file: Path, config: GPTConfig
) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(sd))
    unknown = sorted(set(sd) - set(expected))
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing keys {short_keys(missing)}")
        if unknown:
            parts.append(f"unknown keys {short_keys(unknown)}")
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


def short_keys(keys: list[str]) -> str:
    """The first five keys for a message. A key read from a damaged file may hold a newline
    or control characters: those are shown quoted and escaped, so the message stays one
    line."""
    names = [k if k.isprintable() else shown(k) for k in keys[:5]]
    return ", ".join(names) + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else "")


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


def narrow_dtype(model: GPT) -> torch.dtype | None:
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
