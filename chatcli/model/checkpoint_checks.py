"""Checking a checkpoint before anything is built from it.

Owns the rules a checkpoint must meet before chatcli allocates a module, a rotary table or a
widened copy of a weight: the meta's model_config (every number a whole number in a range
no nanochat model comes near, bool refused), the tensors torch.load hands back (strided CPU
floating-point tensors whose storage holds their shape), the config against the weights'
shapes (n_embd, n_layer, vocab_size and the key/value width read from them), and the
weights' values (no NaN or infinity).

All but the last run on the state dict as torch.load maps it (mmap): shapes and storage
sizes are known without reading the weights, so a meta that claims 10^9 layers or a 10^8
token context fails in milliseconds. Knows nothing about devices, precision or where the
files are (chatcli.model.checkpoint and checkpoint_paths).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from chatcli.errors import CheckpointError
from chatcli.model.data_files import shown
from chatcli.model.gpt import GPTConfig

CONFIG_KEYS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")
# The largest value of each, far past any nanochat model (d32: 2048, 65536, 32, 16, 16,
# 2048), that keeps every size computed from the config inside what torch indexes and a
# machine holds. The weights decide the rest (check_config_against_weights).
CONFIG_MAX = {
    "sequence_len": 1 << 20,
    "vocab_size": 1 << 22,
    "n_layer": 4096,
    "n_head": 4096,
    "n_kv_head": 4096,
    "n_embd": 1 << 16,
}
WINDOW_PATTERN_MAX = 4096  # characters: one per layer at most, and "SSSL" in practice
# The GPT keeps fp32 cos and sin tables for 10x the training context (gpt.GPT.max_positions):
# 10 * sequence_len * head_dim / 2 values each. A meta whose tables would take more than
# this share of the machine's memory cannot be the model's (sequence_len 10^8 asked 128 GB).
ROTARY_MEMORY_SHARE = 0.25
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_LAYER_KEY = re.compile(r"transformer\.h\.(\d{1,9})\.")


def config_from_meta(cfg: Mapping[str, Any], meta_file: Path) -> GPTConfig:
    """The GPTConfig a meta's model_config describes, every value checked for its type and
    range; CheckpointError naming the key otherwise."""
    missing = [k for k in CONFIG_KEYS if k not in cfg]
    if missing:
        raise CheckpointError(
            f"Meta file {meta_file}: model_config lacks {', '.join(missing)}; expected "
            f"positive whole numbers for {', '.join(CONFIG_KEYS)}."
        )
    for key in CONFIG_KEYS:
        value = cfg[key]
        # bool is an int to Python: `"n_layer": true` would pass as 1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(
                f"Meta file {meta_file}: model_config's {key} is {shown(value)}, not a whole "
                f"number; expected positive whole numbers for {', '.join(CONFIG_KEYS)}."
            )
        if not 1 <= value <= CONFIG_MAX[key]:
            raise CheckpointError(
                f"Meta file {meta_file}: model_config's {key} is {value}, outside 1 to "
                f"{CONFIG_MAX[key]:,}: no nanochat model has that. The meta is damaged or "
                "belongs to something else; copy the one saved with the weights."
            )
    pattern = cfg.get("window_pattern") or "L"
    if (
        not isinstance(pattern, str)
        or len(pattern) > WINDOW_PATTERN_MAX
        or not re.fullmatch(r"[SLsl]+", pattern)
    ):
        raise CheckpointError(
            f"Meta file {meta_file}: window_pattern {shown(pattern)} is not made of S and L."
        )
    config = GPTConfig(**{k: cfg[k] for k in CONFIG_KEYS}, window_pattern=pattern.upper())
    if config.n_embd % config.n_head or config.n_head % config.n_kv_head:
        raise CheckpointError(
            f"Meta file {meta_file}: n_embd ({config.n_embd}) must divide by n_head "
            f"({config.n_head}) and n_head by n_kv_head ({config.n_kv_head})."
        )
    _check_rotary_memory(config, meta_file)
    return config


def _check_rotary_memory(config: GPTConfig, meta_file: Path) -> None:
    need = 10 * config.sequence_len * config.head_dim * 4  # cos and sin, fp32, D/2 each
    have = physical_memory()
    if have is not None and need > ROTARY_MEMORY_SHARE * have:
        raise CheckpointError(
            f"Meta file {meta_file}: sequence_len {config.sequence_len:,} would need "
            f"{need / 2**30:.1f} GiB for the rotary tables alone (10x the context), and this "
            f"machine has {have / 2**30:.1f} GiB. nanochat models train at 2048; the meta is "
            "damaged or belongs to another model."
        )


def physical_memory() -> int | None:
    """Bytes of RAM, or None where the system does not say (the check is then skipped)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_tensors(sd: Mapping[Any, Any], model_file: Path) -> None:
    """Every entry is a name and a dense floating-point CPU tensor whose storage holds as
    many values as its shape: a crafted file can give a (10^9, 10^9) tensor one value of
    storage (stride 0), which loads, and reads garbage or past its end."""
    for key, t in sd.items():
        if not isinstance(key, str):
            raise CheckpointError(
                f"{model_file} has a key {shown(key)} that is not a name: nanochat's "
                "model_*.pt maps parameter names to tensors."
            )
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{model_file}: {key} is a {type(t).__name__}, not a tensor.")
        if t.layout != torch.strided or t.is_quantized or t.device.type != "cpu":
            raise CheckpointError(
                f"{model_file}: {key} is a {t.layout} {t.device.type} tensor, not a plain one "
                "holding its values: the file is damaged or was not saved by nanochat."
            )
        if t.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{model_file}: {key} holds {str(t.dtype).removeprefix('torch.')} values; model "
                "weights are floating point (float32, bfloat16, float16)."
            )
        held = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
        if t.numel() > held:
            raise CheckpointError(
                f"{model_file}: {key} has shape {tuple(t.shape)} ({t.numel():,} values) but its "
                f"storage holds {max(held, 0):,}: the file is damaged or crafted. Copy or "
                "download it again."
            )
        if _overlapping(t):
            raise CheckpointError(
                f"{model_file}: {key} has shape {tuple(t.shape)} but strides {t.stride()} that "
                "read the same stored values more than once: no trained weight is saved so. "
                "The file is damaged or crafted; copy or download it again."
            )


def _overlapping(t: torch.Tensor) -> bool:
    """Whether two indices of `t` reach one stored value (a stride of 0, say): from the
    smallest stride up, each must step past everything the smaller ones span."""
    spanned = 1
    for stride, size in sorted(
        (st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz > 1
    ):
        if stride < spanned:
            return True
        spanned = stride * size
    return False


def check_config_against_weights(
    config: GPTConfig, sd: Mapping[str, torch.Tensor], model_file: Path
) -> None:
    """The config's sizes against the shapes of the weights, before the model is built from
    it: n_embd and vocab_size against the token embedding, n_layer against the layers there
    are, n_kv_head/n_head against the first key projection. What is left (every key and
    shape) check_state_dict compares against the built model."""
    wte = sd.get("transformer.wte.weight")
    if wte is None:
        raise CheckpointError(f"{model_file}: missing key transformer.wte.weight.")
    if wte.ndim != 2:
        raise CheckpointError(
            f"{model_file}: transformer.wte.weight has shape {tuple(wte.shape)}; the token "
            "embedding is a (vocabulary, n_embd) table."
        )
    rows, width = wte.shape
    if width != config.n_embd:
        raise CheckpointError(
            f"{model_file}: the meta's model_config says n_embd={config.n_embd}, but the "
            f"token embedding is {width} wide. The meta file belongs to another model: copy "
            "the one saved with these weights."
        )
    if rows < config.vocab_size:
        raise CheckpointError(
            f"{model_file}: transformer.wte.weight has {rows} rows but the meta's vocab_size is "
            f"{config.vocab_size}."
        )
    layers = {int(m[1]) for k in sd if (m := _LAYER_KEY.match(k))}
    found = max(layers) + 1 if layers else 0
    if found != config.n_layer:
        # Said first: otherwise the keys of the layers one side lacks read as a broken file.
        raise CheckpointError(
            f"{model_file}: the meta's model_config says n_layer={config.n_layer}, but the "
            f"weights have {found} layers. The meta file belongs to another model: copy the "
            "one saved with these weights."
        )
    c_k = sd.get("transformer.h.0.attn.c_k.weight")
    kv_width = config.n_kv_head * config.head_dim
    if c_k is not None and c_k.ndim == 2 and c_k.shape[0] != kv_width:
        raise CheckpointError(
            f"{model_file}: the meta's n_head={config.n_head} and n_kv_head={config.n_kv_head} "
            f"make keys {kv_width} wide, but transformer.h.0.attn.c_k.weight has "
            f"{c_k.shape[0]} rows. The meta file belongs to another model: copy the one saved "
            "with these weights."
        )


# Elements looked at a time where values are checked one by one (check_finite): a few MB.
FINITE_CHUNK = 1 << 22


def check_finite(sd: Mapping[str, torch.Tensor], model_file: Path) -> None:
    """No weight is NaN or infinite: such a model loads, and prints garbage. A sum is NaN or
    infinite when any value is, and sums read memory at its full speed (an elementwise
    isfinite is ~30x slower on the CPU); only a tensor whose sum is not finite is looked at
    value by value (finite values whose sum overflows are not refused)."""
    for key, t in sd.items():
        if t.numel() == 0 or _sums_finite(t):
            continue
        flat = t.reshape(-1)
        for start in range(0, flat.numel(), FINITE_CHUNK):
            chunk = flat[start : start + FINITE_CHUNK]
            bad = (~torch.isfinite(chunk)).nonzero()
            if bad.numel():
                first = chunk[int(bad[0])]
                what = "NaN" if torch.isnan(first) else "infinite"
                raise CheckpointError(
                    f"{model_file}: {key} holds {what} values (the first at index "
                    f"{start + int(bad[0]):,}): the weights are damaged, or were saved from a "
                    "training run that diverged. Load an earlier step, or copy the file again."
                )


def _sums_finite(t: torch.Tensor) -> bool:
    if t.dtype == torch.bfloat16 and t.is_contiguous() and t.numel() > 2:
        # A bfloat16 is the upper half of a float32 with the same sign and exponent, so it
        # is finite exactly where that float32 is, whatever the lower half holds. The values
        # read as float32 pairs from the first byte and from the third have every element
        # but the first (or, big-endian, the last) as an upper half: two float32 sums, ~8x
        # faster than summing bfloat16.
        ends = t.reshape(-1)[[0, -1]]
        return bool(
            torch.isfinite(ends).all()
            and torch.isfinite(_as_float32(t, 0).sum())
            and torch.isfinite(_as_float32(t, 1).sum())
        )
    if t.dtype in (torch.float32, torch.float64):
        return bool(torch.isfinite(t.sum()))
    return all(  # float16, or not contiguous: float32 copies, a chunk at a time
        bool(torch.isfinite(chunk.float().sum())) for chunk in t.reshape(-1).split(FINITE_CHUNK)
    )


def _as_float32(t: torch.Tensor, skip: int) -> torch.Tensor:
    """The bytes of a contiguous 16-bit tensor, from its element `skip` on, as float32s (no
    copy): the storage is sliced at a byte, which a dtype view cannot start at."""
    count = (t.numel() - skip) // 2
    begin = (t.storage_offset() + skip) * 2
    region = t.untyped_storage()[begin : begin + 4 * count]
    return torch.empty(0, dtype=torch.float32).set_(region, 0, (count,), (1,))
