"""The decode step paths every exactness test runs on, and the tokenizer those tests give a
random model: one place for what tests/test_batching.py, test_logprobs.py and
test_speculative.py each check on every path."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from chatcli.engine.engine import Engine
from chatcli.engine.static_step import ModuleStep, StaticDecodeStep
from chatcli.kernels.build import unavailable_reason
from chatcli.kernels.rows_step import rows_step
from chatcli.model.special_tokens import SPECIAL_TOKENS

# Our C kernel, torch's ops, the model's own forward (a row at a time), the module step, and
# the static step a GPU graphs (run eagerly on a CPU).
STEP_PATHS = ["kernel", "torch", "forward", "module", "static"]


class NoStopsTokenizer:
    """Special ids outside the random models' 200-token vocabulary: no row stops early."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i % 256 for i in ids).decode(errors="replace")

    def encode_special(self, name: str) -> int:
        return 1000 + SPECIAL_TOKENS.index(name)

    def get_bos_token_id(self) -> int:
        return 999


def engine_on_path(model: Any, path: str, tokenizer: Any = None, **options: Any) -> Engine:
    """An Engine (`options` passed on) whose decode step takes `path` of STEP_PATHS; the
    kernel's path skips where the kernel does not build."""
    engine = Engine(model, tokenizer or NoStopsTokenizer(), **options)
    if path == "kernel":
        if rows_step() is None:
            pytest.skip(f"no native kernel: {unavailable_reason('rows_step')}")
        assert engine.decode_step is not None and engine.decode_step.kernel is not None
    elif path == "torch":
        assert engine.decode_step is not None
        engine.decode_step.use_kernel(False)
    elif path == "forward":
        engine.decode_step = None
    elif path == "module":
        engine.decode_step = ModuleStep(model)
    elif path == "static":
        engine.decode_step = StaticDecodeStep(model)
    else:
        raise ValueError(f"no step path {path!r}: one of {STEP_PATHS}")
    return engine


def random_prompt(n: int, seed: int) -> list[int]:
    """`n` ids below the random models' special ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 190, (n,), generator=g).tolist()
