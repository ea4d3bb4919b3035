"""The rows_step kernel, compiled for this CPU and checked: `rows_step()`, or None.

Owns: building decode_ops.c's rows_step library at first use (build.checked) and checking it
against the torch reference of its arithmetic (rows_step_reference.py) once a process: a
library that answers wrongly is never used. The library's wrapper and structs are
rows_library.py's, named here too for the kernel's callers.
"""

from __future__ import annotations

import functools

import torch

from chatcli.kernels.build import checked
from chatcli.kernels.rows_library import (
    DECODE_OPS_SOURCE,
    WEIGHT_KINDS,
    RowsLayer,
    RowsModel,
    RowsStep,
)
from chatcli.kernels.rows_step_reference import embed_errors, rows_step_errors, slots_errors

__all__ = [
    "DECODE_OPS_SOURCE",
    "WEIGHT_KINDS",
    "RowsLayer",
    "RowsModel",
    "RowsStep",
    "rows_step",
]


def check_rows_step(kernel: RowsStep) -> None:
    """The kernel against torch on a random model, with fp16, int8 and int4 matrices too
    where it reads them: a library that answers wrongly any way is not used (RuntimeError)."""
    if max(rows_step_errors(kernel)) > 1e-4:
        raise RuntimeError("rows_step disagrees with torch on a test model")
    has_embed = kernel.embeds(torch.empty(1, 1))  # an earlier revision's build may not
    if has_embed and max(embed_errors(kernel), embed_errors(kernel, bf16=True)) > 1e-5:
        raise RuntimeError("rows_step's embed disagrees with torch")
    if kernel.half_panel and max(rows_step_errors(kernel, rows=1, half=True)) > 1e-4:
        raise RuntimeError("rows_step disagrees with torch on a test model of fp16 matrices")
    if kernel.int8_panel and max(rows_step_errors(kernel, rows=1, int8=True)) > 1e-4:
        raise RuntimeError("rows_step disagrees with torch on a test model of int8 matrices")
    # int4's products round the activations to 15 bits (decode_ops.c, product_int4): ~3e-5
    # of a row's largest, which two layers and the vocabulary carry to ~2e-4 here.
    int4 = dict(rows=3, int4=True, widths=(128, 256, 100), heads=(8, 4))
    if getattr(kernel, "int4_panel", 0) and max(rows_step_errors(kernel, **int4)) > 1e-3:
        raise RuntimeError("rows_step disagrees with torch on a test model of int4 matrices")
    if kernel.has_slots and max(slots_errors(kernel)) > 1e-4:
        raise RuntimeError("rows_step_slots disagrees with rows_step on rows of their own")


@functools.cache
def rows_step() -> RowsStep | None:
    """The compiled, checked kernel, or None where it cannot run here (unavailable_reason)."""
    return checked("rows_step", DECODE_OPS_SOURCE, RowsStep, check_rows_step, needs_avx512=False)
