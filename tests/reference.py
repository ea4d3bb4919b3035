"""Where the reference fixtures are: checkpoints of eras A and E, made by nanochat itself,
with the logits and greedy replies it gave (`shared/fixtures/nanochat-reference`).

They live beside the repository, not in it. A clone elsewhere (CI's clean clone) finds them
through CHATCLI_REFERENCE_FIXTURES, or at the workspace's fixed place; where none is found the
tests that need them skip, and only those.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_PLACES = [
    Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "nanochat-reference",
    Path("/work/shared/fixtures/nanochat-reference"),
]


def _find() -> Path:
    named = os.environ.get("CHATCLI_REFERENCE_FIXTURES")
    if named:
        return Path(named)
    return next((p for p in _PLACES if p.is_dir()), _PLACES[0])


REFERENCE = _find()
needs_reference = pytest.mark.skipif(
    not REFERENCE.is_dir(),
    reason=f"reference fixtures not found at {REFERENCE} (set CHATCLI_REFERENCE_FIXTURES)",
)
