"""The nanochat special tokens, defined once.

They take the last 9 ids of every nanochat vocabulary, in exactly this order.
"""

from __future__ import annotations

BOS = "<|bos|>"
USER_START = "<|user_start|>"
USER_END = "<|user_end|>"
ASSISTANT_START = "<|assistant_start|>"
ASSISTANT_END = "<|assistant_end|>"
PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
OUTPUT_START = "<|output_start|>"
OUTPUT_END = "<|output_end|>"

SPECIAL_TOKENS: tuple[str, ...] = (
    BOS,
    USER_START,
    USER_END,
    ASSISTANT_START,
    ASSISTANT_END,
    PYTHON_START,
    PYTHON_END,
    OUTPUT_START,
    OUTPUT_END,
)
