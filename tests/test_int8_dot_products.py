"""int8 products as integer dot products (decode_ops.c's product_int8_dot): the interleaved
layout they read, their precision against fp64, and which build reads which layout."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from chatcli.kernels import build as kernel_build
from chatcli.kernels.panels import Int8Panels, int8_rows
from chatcli.kernels.rows_step import DECODE_OPS_SOURCE, RowsStep, rows_step
from chatcli.kernels.rows_step_reference import rows_step_errors

_ROWS = rows_step()
needs_int8_rows = pytest.mark.skipif(
    _ROWS is None or not _ROWS.int8_panel, reason="rows_step reads no int8 here (no AVX2)"
)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_interleaved_panels_hold_a_columns_four_inputs_together_each_plus_128():
    weight = torch.randn(32, 6)  # (out, in): 6 inputs, two groups of four, two of padding
    codes, scales = int8_rows(weight)
    panels = Int8Panels.of(codes, scales, 16, interleave=4)
    assert panels.buffer.numel() == 4 * 32 + 32 * 8
    raw = panels.buffer[4 * 32 :].view(torch.uint8).view(2, 2, 16, 4)  # panel, group, col, in
    assert raw[1, 0, 3, 2].item() == codes[16 + 3, 2].item() + 128
    assert raw[0, 1, 5, 1].item() == codes[5, 5].item() + 128
    assert bool((raw[:, 1, :, 2:] == 128).all())  # the padding inputs' code is 0
    assert torch.equal(panels.scales, scales)
    assert torch.equal(panels.codes(), codes.t())
    assert torch.equal(panels.matrix(), codes.t().float() * scales)
    plain = Int8Panels.of(codes, scales, 16)
    assert torch.equal(plain.codes(), panels.codes())
    with pytest.raises(ValueError, match="interleave 1 or 4"):
        Int8Panels.of(codes, scales, 16, interleave=2)


def _relative_error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """The largest error against the fp64 product, over the size of the terms summed."""
    exact = x.double() @ w.double()
    scale = (x.double().abs() @ w.double().abs()).clamp(min=1e-30)
    return ((got.double() - exact).abs() / scale).max().item()


# The 23-bit integers a row's activations become: its largest |x| is this many units.
DIGIT_LIMIT = 127 * 65536


def _outside_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """How far the product is past what rounding each activation to the nearest unit (its
    row's largest |x| / DIGIT_LIMIT) and fp32's rounding of the result allow: <= 1 within."""
    exact = x.double() @ w.double()
    unit = x.double().abs().amax(dim=1, keepdim=True) / DIGIT_LIMIT
    allowed = 0.5 * unit * w.double().abs().sum(dim=0) + 2e-7 * (
        x.double().abs() @ w.double().abs()
    )
    return ((got.double() - exact).abs() / allowed.clamp(min=1e-30)).max().item()


@needs_int8_rows
@pytest.mark.parametrize("n_in", [1, 3, 42, 1281])
@pytest.mark.parametrize("rows", [1, 3, 5, 9])
def test_the_int8_product_rounds_activations_to_23_bits_of_their_rows_largest(n_in, rows):
    # Any width (padded to groups of four), any rows (passes of DOT_ROWS), three panels (the
    # last block has no pair), one and two threads. A row of inputs of one size matches the
    # fp64 product to fp32's rounding; one with an outlier 10^4 times the rest counts those
    # in units of the outlier's 2^-23, and stays within that rounding.
    g = torch.Generator().manual_seed(n_in * 10 + rows)
    panels = Int8Panels.of(
        *int8_rows(torch.randn(3 * _ROWS.int8_panel, n_in, generator=g)),
        _ROWS.int8_panel,
        _ROWS.int8_interleave,
    )
    x = torch.randn(rows, n_in, generator=g)
    x[-1, 0] = 1e4
    for threads in (1, 2):
        got = _ROWS.int8_product(panels, x, threads)
        assert _outside_rounding(got, x, panels.matrix()) <= 1.0
        if rows > 1:
            assert _relative_error(got[:-1], x[:-1], panels.matrix()) < 2e-6


@needs_int8_rows
def test_an_int8_product_past_the_32_bit_sums_reach_is_still_exact():
    # 32804 inputs: the integer sums are flushed to doubles every 32768, before they could
    # overflow; the largest codes and digits there would wrap a 32-bit sum otherwise.
    g = torch.Generator().manual_seed(7)
    n_in = 32768 + 36
    weight = torch.randn(_ROWS.int8_panel, n_in, generator=g).sign()  # every code +-127
    panels = Int8Panels.of(*int8_rows(weight), _ROWS.int8_panel, _ROWS.int8_interleave)
    x = weight[:1].clone().repeat(2, 1)  # every product the largest, one sign
    got = _ROWS.int8_product(panels, x, 1)
    assert _relative_error(got, x, panels.matrix()) < 2e-6
    assert got[0, 0].item() == pytest.approx(n_in, rel=1e-6)


@needs_int8_rows
def test_the_step_reads_the_layout_its_build_multiplies():
    assert max(rows_step_errors(_ROWS, rows=1, int8=True)) < 1e-5
    assert max(rows_step_errors(_ROWS, rows=6, int8=True, threads=2)) < 1e-5
    other = 5 - _ROWS.int8_interleave  # 1 <-> 4
    w = torch.randn(2 * _ROWS.int8_panel, 8)
    with pytest.raises(ValueError, match="interleaving"):
        _ROWS.int8_product(Int8Panels.of(*int8_rows(w), _ROWS.int8_panel, other), w[:1])


_BUILDS = [
    # (-march, CPU flag it needs here, int8 panel, interleave)
    ("haswell", "avx2", 8, 1),  # AVX2: widening
    ("alderlake", "avx_vnni", 8, 4),  # AVX-VNNI on 8 lanes
    ("skylake-avx512", "avx512f", 16, 1),  # AVX-512 without VNNI
    ("icelake-server", "avx512_vnni", 16, 4),
]


@pytest.mark.skipif(
    shutil.which("cc") is None or platform.machine() not in ("x86_64", "AMD64"),
    reason="needs cc on x86-64",
)
@pytest.mark.parametrize(("march", "flag", "panel", "interleave"), _BUILDS)
def test_each_x86_build_multiplies_int8_in_the_layout_it_says(
    tmp_path, march, flag, panel, interleave
):
    if flag not in _cpu_flags():
        pytest.skip(f"this CPU has no {flag} to run a -march={march} build")
    lib = tmp_path / "decode_ops.so"
    tools = kernel_build.toolchain()
    flags = [f if f != "-march=native" else f"-march={march}" for f in tools.flags]
    subprocess.run([tools.path, *flags, str(DECODE_OPS_SOURCE), "-o", str(lib)], check=True)
    kernel = RowsStep(ctypes.CDLL(str(lib)))
    assert (kernel.int8_panel, kernel.int8_interleave) == (panel, interleave)
    g = torch.Generator().manual_seed(3)
    panels = Int8Panels.of(*int8_rows(torch.randn(3 * panel, 45, generator=g)), panel, interleave)
    for rows in (1, 2, 3, 9):
        x = torch.randn(rows, 45, generator=g)
        assert _relative_error(kernel.int8_product(panels, x, 2), x, panels.matrix()) < 2e-6
    assert max(rows_step_errors(kernel, rows=3, int8=True)) < 1e-5
