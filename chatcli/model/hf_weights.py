"""A nanochat state_dict under transformers' names, in safetensors files, and back.

Owns: the one table of names (nanochat's `transformer.h.3.attn.c_q.weight` is transformers'
`model.layers.3.self_attn.q_proj.weight`; era B-E's extra weights get names in the same
style), the vocabulary padding (left out on export: no token reaches those rows and their
logits are cut off, so the model computes exactly the same), writing safetensors files
(sharded past max_shard_size, with transformers' index) and reading them back.

Reading is the safetensors package's (`safe_open`): it checks the header (size, JSON, dtypes
and shapes against offsets, tensors that overlap or leave gaps, a file cut short) and gives
each tensor as a view of the file mapped copy-on-write, as `torch.load(mmap=True)` gives for
nanochat's files, so loading costs no copy and big embedding tables stay in the page cache.
Here: an index that names only plain files beside it, nanochat's dtypes, and every failure as
one CheckpointError naming the file. Writing is ours, on a 64-byte boundary per tensor
(write_aligned says why; the package's own layout cannot give it, and reading its files
costs a copy of every misaligned matrix: docs/robustness.md has the numbers), and each file
written is read back by the package before the export goes on. Nothing in a safetensors
file can run code. Knows nothing about configs or tokenizers.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from chatcli.errors import CheckpointError
from chatcli.model.data_files import (
    UnreadableFileError,
    described,
    read_json_file,
    regular_file,
    shown,
)
from chatcli.model.hub import HF_EXTRA

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_SIZE = "5GB"  # transformers' default: the Hub's largest comfortable file
# The dtypes a nanochat weight may have, by safetensors' names.
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
MAX_INDEX_BYTES = 64 * 2**20  # an index of thousands of weights is a few hundred KB
ALIGN = 64  # bytes: where torch's CPU allocator starts every tensor
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# (nanochat, transformers) name patterns; {i} is a layer index.
_LAYER_NAMES = (
    ("transformer.h.{i}.attn.c_q.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("transformer.h.{i}.attn.c_k.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("transformer.h.{i}.attn.c_v.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("transformer.h.{i}.attn.c_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("transformer.h.{i}.attn.ve_gate.weight", "model.layers.{i}.self_attn.ve_gate.weight"),
    ("transformer.h.{i}.mlp.c_fc.weight", "model.layers.{i}.mlp.fc1.weight"),
    ("transformer.h.{i}.mlp.c_proj.weight", "model.layers.{i}.mlp.fc2.weight"),
    ("value_embeds.{i}.weight", "model.value_embeds.{i}.weight"),
)
_PLAIN_NAMES = {
    "transformer.wte.weight": "model.embed_tokens.weight",
    "lm_head.weight": "lm_head.weight",
    "resid_lambdas": "model.resid_lambdas",
    "x0_lambdas": "model.x0_lambdas",
    "smear_gate.weight": "model.smear_gate.weight",
    "smear_lambda": "model.smear_lambda",
    "backout_lambda": "model.backout_lambda",
}
# Tables with a row per token: their padding rows are left out on export.
_VOCAB_ROWS = re.compile(
    r"model\.embed_tokens\.weight|lm_head\.weight|model\.value_embeds\.\d+\.weight"
)


def _patterns(src: int) -> list[tuple[re.Pattern[str], str]]:
    """(regex over one side's names, template of the other's); src 0: from nanochat."""
    out = []
    for pair in _LAYER_NAMES:
        pattern = re.escape(pair[src]).replace(r"\{i\}", r"(\d+)")
        out.append((re.compile(pattern), pair[1 - src]))
    return out


_TO_HF, _FROM_HF = _patterns(0), _patterns(1)
_PLAIN_FROM_HF = {v: k for k, v in _PLAIN_NAMES.items()}


def _rename(key: str, plain: Mapping[str, str], patterns: list) -> str | None:
    if key in plain:
        return plain[key]
    for pattern, template in patterns:
        m = pattern.fullmatch(key)
        if m:
            return template.format(i=m[1])
    return None


def to_hf_names(sd: Mapping[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """nanochat's state_dict under transformers' names, vocabulary padding rows left out.
    Every key must be known (load_model's checks have run): an unknown one is a bug here."""
    out = {}
    for key, tensor in sd.items():
        name = _rename(key, _PLAIN_NAMES, _TO_HF)
        if name is None:
            raise CheckpointError(f"No transformers name for the weight {key}.")
        if _VOCAB_ROWS.fullmatch(name) and tensor.shape[0] > vocab_size:
            # A copy: safetensors refuses to write part of a tensor's storage.
            tensor = tensor[:vocab_size].clone()
        out[name] = tensor
    return out


def from_hf_names(sd: Mapping[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """A transformers-named state_dict under nanochat's names; unknown names are refused."""
    out, unknown = {}, []
    for key, tensor in sd.items():
        name = _rename(key, _PLAIN_FROM_HF, _FROM_HF)
        if name is None:
            unknown.append(key)
        else:
            out[name] = tensor
    if unknown:
        shown = ", ".join(sorted(unknown)[:5]) + (
            f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else ""
        )
        raise CheckpointError(
            f"{where} holds weights no nanochat model has: {shown}. chatcli runs nanochat "
            "models only; it leaves nothing out."
        )
    return out


def cast_for_export(sd: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """keep: each tensor as saved (lossless); float32 (lossless too) or bfloat16 (rounds)."""
    if dtype == "keep":
        return sd
    target = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    return {k: v.to(target) for k, v in sd.items()}


def config_dtype(sd: Mapping[str, torch.Tensor]) -> str:
    """The dtype a config names for these weights: float32 where any is (nanochat's mixed
    checkpoints: fp32 matrices, bf16 tables, which widen exactly), else the one they share."""
    kinds = {v.dtype for v in sd.values()}
    if torch.float32 in kinds or len(kinds) != 1:
        return "float32"
    return str(kinds.pop()).removeprefix("torch.")


# ---- writing ----------------------------------------------------------------------------------


def write_safetensors(
    sd: dict[str, torch.Tensor], folder: Path, max_shard_size: int | str = MAX_SHARD_SIZE
) -> list[str]:
    """Write `sd` as model.safetensors, or past max_shard_size as the shards and the index
    transformers' own saving would name (huggingface_hub plans them); returns the names."""
    from huggingface_hub import split_torch_state_dict_into_shards

    plan = split_torch_state_dict_into_shards(sd, max_shard_size=max_shard_size)
    for filename, names in plan.filename_to_tensors.items():
        write_aligned(folder / filename, {n: sd[n] for n in names})
        read_safetensors(folder / filename)  # a file the package would refuse is never left
    if plan.is_sharded:
        index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return sorted(p.name for p in folder.glob("model*.safetensors*"))


def write_aligned(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """One safetensors file whose tensors each start on a 64-byte boundary, as torch's own
    allocations and checkpoints do: MKL's products can round differently on data aligned
    otherwise (d20's logits moved by 2e-6), so a file read in place computes bit for bit
    what the checkpoint it came from computes. Tensors whose size keeps the alignment go
    first, the few small ones after; the header is padded with spaces (which safetensors
    allows) up to the boundary. Each tensor is written from its own memory, not copied."""
    order = sorted(tensors, key=lambda n: (_nbytes(tensors[n]) % ALIGN != 0, n))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name in order:
        t = tensors[name]
        size = _nbytes(t)
        header[name] = {
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [at, at + size],
        }
        at += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in order:
            t = tensors[name].detach().contiguous()
            if t.numel():
                f.write((ctypes.c_char * _nbytes(t)).from_address(t.data_ptr()))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---- reading ----------------------------------------------------------------------------------


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a transformers folder: the index's shards, or the one file.
    Each is checked to be a readable plain file (not a folder, a link to nothing, a FIFO)."""
    index = folder / INDEX_FILE
    if os.path.lexists(index):
        return [_weight_file(folder / n, index) for n in _shard_names(index, folder)]
    if os.path.lexists(folder / SINGLE_FILE):
        return [_weight_file(folder / SINGLE_FILE, None)]
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(
        p.name for p in folder.glob("*.pt")
    )
    hint = (
        f" It has {', '.join(pickles)}: chatcli reads transformers-format weights only as "
        "safetensors (a pickle can run code). Convert them with transformers' "
        "save_pretrained(..., safe_serialization=True)."
        if pickles
        else ""
    )
    raise CheckpointError(f"No {SINGLE_FILE} (or {INDEX_FILE}) in {folder}.{hint}")


def _shard_names(index: Path, folder: Path) -> list[str]:
    """The shard files an index names, each a plain name of a file beside it."""
    try:
        data = read_json_file(regular_file(index), MAX_INDEX_BYTES)
    except UnreadableFileError as e:
        raise CheckpointError(f"{e}: copy or download the model again.") from None
    except ValueError as e:
        raise CheckpointError(f"{index} is not readable JSON ({e}).") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"{index} is not a safetensors index: its weight_map must be an object naming, "
            f"for each weight, the file that holds it (it is {shown(weight_map)}). Copy or "
            "download the model again."
        )
    names = sorted(set(weight_map.values()))
    bad = [n for n in names if Path(n).name != n or n in ("", ".", "..")]
    if bad:
        raise CheckpointError(
            f"{index} names files outside its folder ({shown(bad[0])}); an index names the "
            "shards beside it."
        )
    missing = [n for n in names if not os.path.lexists(folder / n)]
    if missing:
        raise CheckpointError(
            f"{index} names {', '.join(missing)}, not in {folder}: copy or download every shard."
        )
    return names


def _weight_file(path: Path, index: Path | None) -> Path:
    try:
        return regular_file(path)
    except UnreadableFileError as e:
        named = f" (named by {index.name})" if index is not None else ""
        raise CheckpointError(f"{e}{named}: copy or download the model again.") from None


def _package() -> tuple[Any, type[Exception]]:
    """safetensors' safe_open and its error type, or one line saying how to install it."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise CheckpointError(
            f"Reading a transformers folder's weights needs the safetensors package: {HF_EXTRA}"
        ) from None
    return safe_open, SafetensorError


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, read by the safetensors package: views of the
    file mapped copy-on-write (no copy, writes never reach the file). The package refuses a
    header that is not whole (sizes, JSON, shapes against offsets, tensors that overlap or
    leave gaps); here only nanochat's dtypes are let through."""
    safe_open, SafetensorError = _package()
    try:
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            for name in names:
                kind = f.get_slice(name).get_dtype()
                if kind not in DTYPES:
                    raise CheckpointError(
                        f"{path}: {shown(name)} is {kind}; nanochat weights are "
                        f"{', '.join(DTYPES)}."
                    )
            return {name: f.get_tensor(name) for name in names}
    except SafetensorError as e:
        said = str(e).removeprefix("Error while deserializing header: ")
        raise CheckpointError(_broken(path, f"a header safetensors refuses ({said})")) from None
    except OSError as e:
        raise CheckpointError(f"{described(e)}: copy or download the model again.") from None


def _broken(path: Path, what: str) -> str:
    return f"{path} is not a whole safetensors file: it has {what}. Copy or download it again."


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers folder's safetensors files, under their own names.
    A weight that other writers left off the 64-byte alignment is copied (write_aligned
    says why), except the embedding tables, which are only looked up by row."""
    out: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        for name, tensor in read_safetensors(path).items():
            if name in out:
                raise CheckpointError(f"{folder}: {name} is in two of its safetensors files.")
            table = name != "lm_head.weight" and _VOCAB_ROWS.fullmatch(name)
            aligned = tensor.data_ptr() % (tensor.element_size() if table else ALIGN) == 0
            out[name] = tensor if aligned else tensor.clone()
    return out
