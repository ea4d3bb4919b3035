"""The byte-level parsers as fuzz targets: each takes any bytes, feeds them to chatcli as the
file (or text) it reads, and fails only where chatcli breaks its contract: an exception other
than one ChatcliError, or a wrong answer. Atheris drives them coverage-guided
(scripts/fuzz_atheris.py); the suite drives them with Hypothesis (tests/test_fuzz_bytes.py),
from the same seeds.

Targets: the safetensors header (`safetensors`), the tokenizer's restricted unpickler
(`tokenizer`), the conversation reader (`conversation`) and the calculator's parser
(`calculator`).
"""

from __future__ import annotations

import json
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

from chatcli.chat.conversation_format import message_problem
from chatcli.chat.conversation_reader import read_conversation
from chatcli.engine.calculator import MAX_ABS_VALUE, use_calculator
from chatcli.errors import ChatcliError
from chatcli.model.checkpoint_paths import EMBEDDED_DIR
from chatcli.model.hf_weights import read_weights
from chatcli.model.tokenizer import Tokenizer

_FOLDER = Path(tempfile.mkdtemp(prefix="chatcli-fuzz-"))


def _one_error(call: Callable[[], object]) -> object:
    try:
        return call()
    except ChatcliError as e:
        assert str(e).strip(), f"{type(e).__name__} with no message"
        return e


def safetensors(data: bytes) -> None:
    folder = _FOLDER / "safetensors"
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors").write_bytes(data)
    tensors = _one_error(lambda: read_weights(folder))
    if isinstance(tensors, dict):
        for name, t in tensors.items():
            assert isinstance(name, str)
            t.sum()  # every value it claims to have is readable


def tokenizer(data: bytes) -> None:
    path = _FOLDER / "tokenizer.pkl"
    path.write_bytes(data)
    loaded = _one_error(lambda: Tokenizer.from_file(path))
    if isinstance(loaded, Tokenizer):
        text = "Hi there, 12 + 30?"
        ids = _one_error(lambda: loaded.encode(text))
        if isinstance(ids, list):
            assert loaded.decode(ids) == text


def conversation(data: bytes) -> None:
    path = _FOLDER / "c.jsonl"
    path.write_bytes(data)
    loaded = _one_error(lambda: read_conversation(path))
    if not isinstance(loaded, ChatcliError):
        assert all(message_problem(m) is None for m in loaded.messages)
        assert len(loaded.finishes) == len(loaded.messages)


def calculator(data: bytes) -> None:
    value = use_calculator(data.decode("utf-8", errors="replace"))  # never raises
    assert value is None or (type(value) in (int, float) and abs(value) <= MAX_ABS_VALUE)


TARGETS: dict[str, Callable[[bytes], None]] = {
    "safetensors": safetensors,
    "tokenizer": tokenizer,
    "conversation": conversation,
    "calculator": calculator,
}


def _safetensors_seed() -> bytes:
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]},
    }
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(22)


def seeds(target: str) -> list[bytes]:
    """Valid inputs each target starts from."""
    if target == "safetensors":
        return [_safetensors_seed()]
    if target == "tokenizer":
        return [(EMBEDDED_DIR / "tokenizer" / "tokenizer.pkl").read_bytes()]
    if target == "conversation":
        records = [
            {"type": "header", "version": 1, "id": "c"},
            {"type": "name", "name": "n"},
            {"type": "message", "message": {"role": "user", "content": "2+2?"}},
            {
                "type": "message",
                "message": {
                    "role": "assistant",
                    "content": [{"type": "python", "text": "2+2"}, {"type": "text", "text": "4"}],
                },
                "meta": {"finish_reason": "stop"},
            },
            {"type": "undo"},
        ]
        return ["\n".join(json.dumps(r) for r in records).encode() + b"\n"]
    return [b"1234*56", b'"strawberry".count("r")', b"(1,000 + 2.5) / -3", b"10/0"]
