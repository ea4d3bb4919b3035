"""Test-wide set-up (runs before any test module imports torch) and shared fixtures."""

import os
import signal

# Passive OpenMP waits: spinning threads slow every op 10-60x when another process is busy on
# these 2 cores (docs/performance.md), and CI shares them.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Ctrl-C as a terminal sends it, even where the suite was started in the background (`cmd &`
# in a script, nohup), which starts it with SIGINT ignored: the Ctrl-C tests would see no
# KeyboardInterrupt, and the chats they spawn would inherit the ignoring.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
