"""The model layer: nanochat's GPT for every checkpoint era, and everything needed to load one.

Owns the GPT module (`gpt`), its attention cache layout (`kv_cache`, and `slot_cache` for
independent sequences side by side), next-token sampling from logits (`sampling`), finding
checkpoints on disk (`checkpoint_paths`) and on the Hugging Face Hub (`hub_layout`, `hub`,
`hub_cache`: hf:ORG/NAME, fetched by huggingface_hub), checking them before anything is built
(`checkpoint_checks`), loading them safely (`checkpoint`), listing them
(`checkpoint_listing`), reading the JSON and TOML files people hand chatcli (`data_files`), the
tokenizer, its special tokens and the long runs it encodes around tiktoken's regex
(`long_runs`), quantized decode copies of the weights (`quantize`), and the transformers
format both ways (`hf_*`: export, and loading transformers-format folders; `hf_modeling/` holds
the remote code an export ships), and a checkpoint's memory before it loads (`memory_need`).
May import `chatcli.errors` and `chatcli.kernels`; nothing
above. Knows nothing about conversations, terminals or HTTP (the Hub's is huggingface_hub's).

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
