"""How much memory a checkpoint needs before it is loaded, and how much there is.

Owns the estimate (the weights as they are saved, plus one batch-1 KV cache of the whole
context in fp32), the memory free where they load (the GPU's, or the machine's), and the
check that several models fit together, for commands that load more
than one (`chatcli arena`). The estimate is read from the files alone, without torch: a
model whose files are not here yet (a Hub id not downloaded) has none. Knows nothing of
sessions or terminals.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from chatcli.errors import ChatcliError

GB = 1024**3
FP32_BYTES = 4
# What a loaded model holds beyond its weights and cache: the decode step's buffers, the
# tokenizer, Python's objects. A margin, not a measurement.
OVERHEAD = 1.1


def checkpoint_bytes(spec: str | None, source: str = "sft", step: int | None = None) -> int | None:
    """About the bytes a model of `spec` (a --model value; None the embedded one) takes once
    loaded, or None where its files are not on this machine to read."""
    from chatcli.model.checkpoint import read_meta
    from chatcli.model.checkpoint_paths import resolve_checkpoint
    from chatcli.model.hf_load import is_hf_folder
    from chatcli.model.hub_layout import is_hub_id

    if is_hub_id(spec):
        return None  # fetched at load: its size is known once it is here
    if spec is not None and is_hf_folder(spec):
        weights = sum(p.stat().st_size for p in Path(spec).expanduser().glob("*.safetensors"))
        return int(weights * OVERHEAD) if weights else None
    ref = resolve_checkpoint(spec, source=source, step=step)
    _, config = read_meta(ref.meta_file)
    kv = 2 * config.n_layer * config.sequence_len * config.n_kv_head * config.head_dim
    return int((ref.model_file.stat().st_size + kv * FP32_BYTES) * OVERHEAD)


def available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The memory the OS can give without swapping (Linux's MemAvailable), or None where it
    does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable":
                return int(value.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    if hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None


def free_bytes(device: str = "auto") -> int | None:
    """The memory free where models of `device` load: the GPU's for CUDA (what
    torch.cuda.mem_get_info reports), else the machine's (available_bytes)."""
    from chatcli.model.model_build import pick_device

    dev = pick_device(device)
    if dev.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(dev)[0])
    return available_bytes()


def _gb(n: int) -> str:
    return f"{n / GB:.1f} GB" if n >= GB / 10 else f"{n / 2**20:.0f} MB"


def check_models_fit(needs: Sequence[tuple[str, int | None]], available: int | None) -> None:
    """Raise, before anything loads, when the models' estimates together exceed `available`
    bytes: one line naming what each needs and how to make room. Unknown sizes and an
    unknown `available` pass."""
    known = [(name, n) for name, n in needs if n is not None]
    if available is None or not known:
        return
    total = sum(n for _, n in known)
    if total <= available:
        return
    each = ", ".join(f"{name}: {_gb(n)}" for name, n in known)
    raise ChatcliError(
        f"The models need about {_gb(total)} of memory ({each}) and {_gb(available)} is "
        "free. Close other programs, load them smaller (--dtype bfloat16, --quantize int8), "
        "or serve one (chatcli serve) and pass its --url."
    )
