"""Test-wide set-up (runs before any test module imports torch) and shared fixtures."""

import os

# Passive OpenMP waits: spinning threads slow every op 10-60x when another process is busy on
# these 2 cores (docs/performance.md), and CI shares them.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


import pytest


@pytest.fixture(scope="session")
def reference_tokenizer():
    """The reference checkpoints' tokenizer (era E's), which decodes every id of
    builders.random_chat_gpt's vocabulary; skips where the shared fixtures are absent."""
    from reference import REFERENCE

    from chatcli.model.tokenizer import Tokenizer

    if not REFERENCE.is_dir():
        pytest.skip("shared fixtures not present")
    return Tokenizer.from_file(REFERENCE / "E" / "tokenizer" / "tokenizer.pkl")
