"""A nanochat state_dict under transformers' names, in safetensors files, and back.

Owns: the one table of names (nanochat's `transformer.h.3.attn.c_q.weight` is transformers'
`model.layers.3.self_attn.q_proj.weight`; era B-E's extra weights get names in the same
style), the vocabulary padding (left out on export: no token reaches those rows and their
logits are cut off, so the model computes exactly the same), writing safetensors files
(sharded past max_shard_size, with transformers' index) and reading them back.

Both directions are ours, not the safetensors package's. Writing puts every tensor on a
64-byte boundary (write_aligned says why). Reading checks the header (size, dtypes, shapes,
offsets inside the file, an index that names only files beside it) and makes each tensor a
view of the file mapped copy-on-write, as `torch.load(mmap=True)` gives for nanochat's files,
so loading costs no copy and big embedding tables stay in the page cache. Nothing in a
safetensors file can run code. Knows nothing about configs or tokenizers.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import re
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

from chatcli.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_SIZE = "5GB"  # transformers' default: the Hub's largest comfortable file
# The dtypes a nanochat weight may have, by safetensors' names.
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
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
    """The safetensors files of a transformers folder: the index's shards, or the one file."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index ({e}).") from None
        bad = [n for n in names if not isinstance(n, str) or Path(n).name != n]
        if bad:
            raise CheckpointError(
                f"{index} names files outside its folder ({bad[0]!r}); an index names the "
                "shards beside it."
            )
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CheckpointError(
                f"{index} names {', '.join(missing)}, not in {folder}: copy or download "
                "every shard."
            )
        return [folder / n for n in names]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
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


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, as views of the file mapped copy-on-write."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(_broken(path, "shorter than a safetensors header"))
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(_broken(path, f"a header of {n:,} bytes"))
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, ValueError) as e:
                raise CheckpointError(_broken(path, f"a header that is not JSON ({e})")) from None
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + n else b""
    except OSError as e:
        raise CheckpointError(f"Cannot read {path}: {e.strerror or e}.") from None
    if not isinstance(header, dict):
        raise CheckpointError(_broken(path, "a header that is not a JSON object"))
    start, end = 8 + n, size
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out[name] = _tensor(buf, path, name, info, start, end)
    return out


def _tensor(
    buf: mmap.mmap | bytes, path: Path, name: str, info: object, start: int, end: int
) -> torch.Tensor:
    if not isinstance(info, dict):
        raise CheckpointError(_broken(path, f"an entry for {name} that is not an object"))
    dtype = DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if dtype is None:
        raise CheckpointError(
            f"{path}: {name} is {info.get('dtype')!r}; nanochat weights are {', '.join(DTYPES)}."
        )
    ints = lambda xs, k: (  # noqa: E731
        isinstance(xs, list)
        and len(xs) in k
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)
    )
    if not ints(shape, range(0, 9)) or not ints(offsets, (2,)):
        raise CheckpointError(_broken(path, f"a bad shape or offsets for {name}"))
    count = 1
    for d in shape:
        count *= d
    itemsize = torch.empty(0, dtype=dtype).element_size()
    begin, stop = offsets
    if stop - begin != count * itemsize or start + stop > end:
        raise CheckpointError(
            _broken(path, f"{name}'s data at bytes {begin}-{stop}, which do not hold {shape}")
        )
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(buf, dtype=dtype, count=count, offset=start + begin).view(shape)
    # A tensor after an odd-length bf16 one may sit off its alignment: copied, not viewed.
    return t if (start + begin) % itemsize == 0 else t.clone()


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
            aligned = tensor.data_ptr() % ALIGN == 0
            out[name] = tensor if aligned or table else tensor.clone()
    return out
