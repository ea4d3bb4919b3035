"""The model layer: nanochat's GPT for every checkpoint era, and everything needed to load one.

Owns the GPT module (`gpt`), its attention cache layout (`kv_cache`, and `slot_cache` for
independent sequences side by side), next-token sampling from logits (`sampling`), finding
checkpoints on disk (`checkpoint_paths`), loading them safely (`checkpoint`), the tokenizer
and its special tokens, and quantized decode copies of the weights (`quantize`). May import `chatcli.errors` and `chatcli.kernels`; nothing above. Knows
nothing about conversations, terminals or HTTP.

`load_model` is re-exported lazily, so importing this package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatcli.model.checkpoint import load_model

__all__ = ["load_model"]


def __getattr__(name: str) -> Any:
    if name == "load_model":
        from chatcli.model.checkpoint import load_model

        return load_model
    raise AttributeError(f"module 'chatcli.model' has no attribute {name!r}")
