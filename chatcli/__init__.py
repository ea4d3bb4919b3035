"""chatcli: a terminal chat and inference engine for nanochat-family GPT models.

Importing the package is cheap: torch is only imported when a model is loaded, so
`chatcli --help` stays fast.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

# torch warns at import that it "Failed to initialize NumPy" where numpy is not installed,
# which chatcli does not need: every command printed it to stderr, before its own output.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

__version__ = "0.1.0"
__all__ = ["__version__", "load_model"]

if TYPE_CHECKING:
    from chatcli.model.checkpoint import load_model


def __getattr__(name: str) -> Any:
    # Lazy re-export: `chatcli.load_model` without importing torch at package import time.
    if name == "load_model":
        from chatcli.model.checkpoint import load_model

        return load_model
    raise AttributeError(f"module 'chatcli' has no attribute {name!r}")
