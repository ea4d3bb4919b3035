"""The models `chatcli bench` runs: a synthetic nanochat, the device, ours' weights on a GPU.

Owns: a random-weight nanochat of depth d4, d12 or d20 with nanochat's shapes (and the byte
tokenizer it needs), the device a bench runs on (auto: a CUDA device where there is one),
the weights ours runs on a GPU, and a copy of a model cast to them. Measures nothing.
"""

from __future__ import annotations

import math

import torch

from chatcli.model.gpt import ERAS, GPT, GPTConfig
from chatcli.model.model_build import native_bf16
from chatcli.model.special_tokens import SPECIAL_TOKENS

SYNTHETIC_DEPTHS = {"d4": 4, "d12": 12, "d20": 20}


class SyntheticTokenizer:
    """Enough of a tokenizer for a random-weight model: bytes, specials at the top."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.special = {
            name: vocab_size - len(SPECIAL_TOKENS) + i for i, name in enumerate(SPECIAL_TOKENS)
        }

    def encode(self, text: str, prepend: int | str | None = None) -> list[int]:
        ids = list(text.encode())
        if prepend is not None:
            ids.insert(0, prepend if isinstance(prepend, int) else self.special[prepend])
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode(errors="replace")

    def decode_bytes(self, ids: list[int]) -> bytes:
        return bytes(i for i in ids if i < 256)

    def encode_special(self, name: str) -> int:
        return self.special[name]

    def get_bos_token_id(self) -> int:
        return self.special["<|bos|>"]

    def get_vocab_size(self) -> int:
        return self.vocab_size

    def render_conversation(self, messages: list[dict], max_tokens: int | None = None):
        raise NotImplementedError  # ChatSession only needs it for saved assistant messages


def synthetic_config(name: str) -> GPTConfig:
    """nanochat's shapes for a depth: 64 wide per layer, 128-wide heads, vocab 65536."""
    depth = SYNTHETIC_DEPTHS[name]
    n_embd = 64 * depth
    n_head = max(1, math.ceil(n_embd / 128))
    return GPTConfig(2048, 65536, depth, n_head, n_head, n_embd, window_pattern="SSSL")


def synthetic_model(
    name: str, device: torch.device | str = "cpu"
) -> tuple[GPT, SyntheticTokenizer]:
    """A random era-E model with nanochat's shapes for that depth (synthetic_config), in
    fp32 on `device`. The same seed gives the same weights on every device (drawn on the
    CPU)."""
    config = synthetic_config(name)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(config, ERAS["E"])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02 if p.ndim == 2 else 0.1)
    model.to(device)
    model.init_rotary()
    model.eval().requires_grad_(False)
    return model, SyntheticTokenizer(config.vocab_size)


def bench_device(device: str = "auto") -> torch.device:
    """The device a bench runs on: auto is the first CUDA device where there is one, else
    the CPU. Raises ValueError with the fix for anything else (MPS: not measured)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        picked = torch.device(device)
    except RuntimeError:
        picked = None
    if picked is None or picked.type not in ("cpu", "cuda"):
        raise ValueError(f"The bench runs on auto, cpu, cuda or cuda:N; not {device!r}.")
    if picked.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: this torch sees no CUDA device "
            f"(torch {torch.__version__}). Use --device cpu."
        )
    if picked.type == "cuda" and (picked.index or 0) >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ValueError(
            f"--device {device}: this machine has {count} CUDA device{'s' if count > 1 else ''} "
            f"(cuda:0 to cuda:{count - 1})."
        )
    return picked


def gpu_weights(precision: str, device: torch.device) -> torch.dtype:
    """The weights ours runs on a CUDA device: auto as chatcli loads them there (bf16 where
    the card computes in it, checkpoint.native_bf16), float32 or bfloat16 as asked. The CPU's
    decode copies (float16, int8, int4) do not exist on a GPU: a ValueError says so."""
    if precision == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    if precision in ("float32", "bfloat16"):
        return getattr(torch, precision)
    raise ValueError(
        f"--quantize {precision} is a CPU decode copy; on a GPU the bench takes auto, "
        "float32 or bfloat16."
    )


def cast_copy(model: GPT, dtype: torch.dtype) -> GPT:
    """A copy of model with its weights in dtype, as checkpoint.load_model would give them
    (the rotary tables made again in the era's own dtype), on the model's device.

    Each weight is cast straight from the model's, so no second fp32 copy of every weight
    makes the peak the bench reports (docs/performance.md, "Measured on a GPU")."""
    with torch.device("meta"):
        cast = GPT(model.config, model.arch)
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    cast.load_state_dict(state, assign=True)
    cast.cos, cast.sin = (torch.empty(0, device=model.get_device()) for _ in range(2))
    cast.init_rotary()
    return cast.eval().requires_grad_(False)
