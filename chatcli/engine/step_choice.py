"""Which decode step a model gets: the fastest one-token-per-row step that reproduces it.

Owns: the Step protocol the Engine runs a decode step through, picking a model's step (the
fused step on the CPU, a CUDA graph of the static step on a GPU, or none: the model's own
forward), and --compile's compiled forward where no faster step is kept. Knows nothing about
generation (engine.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from chatcli.engine.cpu_plan import SMALL_MODEL_PARAMS
from chatcli.engine.decode_step import DecodeStep
from chatcli.engine.fallback import compiled_or_eager
from chatcli.engine.static_step import CudaGraphStep, ModuleStep, StaticDecodeStep, StepWithFallback
from chatcli.model.kv_cache import KVCache, SharedPrefixCache
from chatcli.model.slot_cache import SlotRows


def compiled_forward(model: Any) -> Callable[..., torch.Tensor]:
    """model.forward through torch.compile (dynamic shapes), eager for good if compiling
    fails (fallback.compiled_or_eager)."""
    return compiled_or_eager(model.forward, dynamic=True)


class Step(Protocol):
    """A decode step: ids (N, 1), one token a cache row, -> logits (N, V), the cache
    advanced by one, as model.forward would."""

    wants_full_cache: bool  # its shapes are the cache's: one-row caches span the context
    reads_whole_cache: bool  # it reads past the written positions (under a mask): zeroed
    takes_prompt_rows: bool  # step_rows takes a prompt's chunk as rows of one slot

    def __call__(self, ids: torch.Tensor, cache: KVCache | SharedPrefixCache) -> torch.Tensor: ...

    def step_rows(
        self, ids: torch.Tensor, rows: SlotRows, out: list[int] | None = None
    ) -> torch.Tensor:
        """ids (N, 1), row i's token for slot rows.slots[i], each row at its own position
        (a server's conversations together) -> the logits (len(out), V) of the rows `out`
        names (None: all); every slot advanced by its rows."""
        ...


def pick_decode_step(model: Any, compile: bool = False) -> Step | None:
    """The fastest one-token-per-row step that reproduces this model, or None (the forward).

    - CUDA: the static step captured as a CUDA graph (one launch per token instead of
      hundreds), falling back to the module's forward if capture fails. --compile does not
      change it (compiled, the step replayed slower).
    - CPU, fp32 activations: the fused step (decode_step.py), reading a big model's compact
      decode copies. A small model keeps it with --compile too: it decodes faster than a
      compiled forward or static step. A big model with --compile compiles its forward
      instead, as asked, unless its step runs through our kernel (its fp16 copies read in one
      call a token, at the memory's speed), which a compiled fp32 forward cannot approach.
      The figures: docs/performance-notes.md, "Choosing the step".
    """
    device = model.get_device().type
    if device == "cuda" and StaticDecodeStep.supports(model):
        # --compile is not taken here: compiled, the captured step replayed slower.
        return StepWithFallback(
            CudaGraphStep(StaticDecodeStep(model)), ModuleStep(model), "CUDA graph capture"
        )
    if device == "cpu" and DecodeStep.supports(model):
        step = DecodeStep(model)
        if compile and model.num_params() >= SMALL_MODEL_PARAMS and step.kernel is None:
            return None
        return step
    return None
