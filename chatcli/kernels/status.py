"""What our C kernels do in this process, in one line for a person: the chat banner's and
`chatcli bench`'s.

Owns: kernels_line (None where the decode kernels run; else which do not and why, with the
command that fixes it where build.py knows one) and toolchain_line (what built them: the
compiler, its CPU flag, OpenMP or our own threads). Knows nothing about models: a caller on
the CPU asks, one on a GPU does not.
"""

from __future__ import annotations

from chatcli.kernels.build import toolchain, unavailable_reason
from chatcli.kernels.rows_step import rows_step
from chatcli.kernels.sample_rows import sample_rows

# The kernels every CPU decode step uses where they load (f16_matvec and f16_rows serve
# some compact copies only, and f16_matvec is AVX-512's alone on x86 by design).
DECODE_KERNELS = {"rows_step": rows_step, "sample_rows": sample_rows}


def kernels_line() -> str | None:
    """None where the decode kernels loaded (building them if this process has not yet);
    else one line: which did not, the first one's reason, and what that costs."""
    missing = [name for name, load in DECODE_KERNELS.items() if load() is None]
    if not missing:
        return None
    reason = unavailable_reason(missing[0]) or "not loaded"
    return (
        f"C kernels off ({', '.join(missing)}): {reason}; "
        "decoding with torch's ops: correct, several times slower for a small model"
    )


def toolchain_line() -> str:
    """What builds the kernels here, e.g. 'gcc (cc) -march=native, OpenMP, x86_64-linux-gnu',
    or why nothing can."""
    try:
        tools = toolchain()
    except RuntimeError as e:
        return str(e)
    flags = " ".join(tools.cpu_flags) or "no CPU flag"
    return f"{tools.kind} ({tools.compiler}) {flags}, {tools.threads}, {tools.target}"
