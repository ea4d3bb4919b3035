"""Helpers shared by the server, remote-session and web tests: workers with scripted models on
a byte-level tokenizer, the tiny reference checkpoint, and a real server on a loopback port.

The scripted workers use the real Tokenizer class over 256 single-byte tokens: its special
tokens then take ids 256..264, exactly the layout of fakes.ByteTokenizer, so fakes' scripts
(tool calls included) drive the real engine through the real server.
"""

from __future__ import annotations

import time

import pytest
from reference import REFERENCE

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("uvicorn", reason="needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("httpx", reason="needs the serve extra: pip install -e '.[serve]'")

import torch
from fakes import ByteTokenizer, Script, ScriptedModel

from chatcli.model.special_tokens import ASSISTANT_END
from chatcli.model.tokenizer import Tokenizer
from chatcli.serve.app import Limits, Worker, create_app
from chatcli.serve.runner import BackgroundServer

REFERENCE_E = REFERENCE / "E"
END = 256 + 4  # <|assistant_end|> in the byte layout
assert ByteTokenizer().encode_special(ASSISTANT_END) == END


def byte_tokenizer() -> Tokenizer:
    return Tokenizer.from_ranks({bytes([i]): i for i in range(256)})


def text_tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


class SlowModel(ScriptedModel):
    """A scripted model that takes `delay` seconds per forward: time for a client to act."""

    def __init__(self, script: Script, delay: float, sequence_len: int = 256) -> None:
        super().__init__(script, sequence_len=sequence_len)
        self.delay = delay

    def forward(self, idx: torch.Tensor, kv_cache=None) -> torch.Tensor:
        time.sleep(self.delay)
        return super().forward(idx, kv_cache=kv_cache)


def scripted_worker(
    script: Script, name: str = "0", delay: float = 0.0, sequence_len: int = 256
) -> Worker:
    model = SlowModel(script, delay, sequence_len) if delay else ScriptedModel(script, sequence_len)
    return Worker(model, byte_tokenizer(), name=name)


def serve_workers(
    workers: list[Worker], limits: Limits | None = None, name: str = "scripted"
) -> BackgroundServer:
    return BackgroundServer(create_app(workers, limits or Limits(), name)).start()


def reference_worker(name: str = "0") -> Worker:
    if not REFERENCE_E.is_dir():
        pytest.skip(f"reference fixture not found at {REFERENCE_E}")
    from chatcli.model.checkpoint import load_model

    model, tokenizer, _ = load_model(REFERENCE_E, device="cpu")
    return Worker(model, tokenizer, name=name)


def wait_until(condition, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()
