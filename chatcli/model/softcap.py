"""The logit softcap: nanochat's value and the range chatcli takes.

Owns: SOFTCAP and SOFTCAP_RANGE, and saying what is wrong with a softcap from a flag, a
config.json or a caller. Knows nothing about tensors (torch-free, so the command line checks
--softcap without importing torch).
"""

from __future__ import annotations

from chatcli.errors import ConfigError
from chatcli.model.data_files import shown

SOFTCAP = 15.0  # nanochat's; its March 2026 variant used 20, which nothing on disk records
# Every step computes cap * tanh(logits / cap) in float32 (the fused CPU step also
# eps * cap**2): far past this range logits / cap underflows to 0 and every reply is token 0,
# NUL characters (from about 1e36); below 1 a model's logits all sit within 1 of each other.
SOFTCAP_RANGE = (1.0, 1e6)


def softcap_problem(cap: object) -> str | None:
    """What is wrong with `cap` as a logit softcap ("must be ..."), or None where nothing is."""
    low, high = SOFTCAP_RANGE
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not low <= cap <= high:
        return (
            f"must be a number from {low:,.0f} to {high:,.0f} (nanochat's is 15; its March 2026 "
            f"variant's 20), not {shown(cap)}"
        )
    return None


def checked_softcap(cap: float | None) -> float:
    """The softcap to build with: SOFTCAP for None, else `cap` if it is in SOFTCAP_RANGE."""
    if cap is None:
        return SOFTCAP
    problem = softcap_problem(cap)
    if problem is not None:
        raise ConfigError(f"The logit softcap {problem}: pass --softcap 15, or leave it out.")
    return float(cap)
