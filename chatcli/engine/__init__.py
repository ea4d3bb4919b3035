"""The engine layer: token ids in, token ids out, fast.

Owns the Engine (one prefill, then decode, with warm-cache reuse across turns), the Batch
(independent generations sharing one decode step, joining and leaving between steps: a
server's requests), the decode steps that make a token cheap on a CPU or a GPU, CPU thread
planning, and the calculator tool whose results are forced into the token stream. May import `chatcli.errors`,
`chatcli.kernels` and `chatcli.model`; never the chat, terminal, serving or CLI layers. Knows
nothing about text beyond the special-token ids a tokenizer gives it.

`Engine`, `KVCache`, `RowState` and `GenerationStats` are the public names (nanochat's engine
tests import them from here); they load lazily, so importing the package stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatcli.engine.engine import Engine, GenerationStats, RowState
    from chatcli.model.kv_cache import KVCache

__all__ = ["Engine", "GenerationStats", "KVCache", "RowState"]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "GenerationStats", "RowState"):
        from chatcli.engine import engine

        return getattr(engine, name)
    if name == "KVCache":
        from chatcli.model.kv_cache import KVCache

        return KVCache
    raise AttributeError(f"module 'chatcli.engine' has no attribute {name!r}")
