"""int4 copies in our kernels (decode_ops.c's product_int4): the panels' layout, the
products' precision against fp64, the whole step over int4 matrices, and the copies that
choose them."""

from __future__ import annotations

import shutil

import pytest
import torch

from chatcli.kernels.build import unavailable_reason
from chatcli.kernels.panels import INT4_GROUP, Int4Panels, int4_groups
from chatcli.kernels.rows_step import rows_step
from chatcli.kernels.rows_step_reference import rows_step_errors
from chatcli.model.quantize import NATIVE_INT4_MAX_ROWS, Int4Weight

_ROWS = rows_step()
needs_int4_rows = pytest.mark.skipif(
    _ROWS is None or not _ROWS.int4_panel,
    reason=f"rows_step reads no int4 here: {unavailable_reason('rows_step') or 'no VNNI/sdot'}",
)


def _dequantized(weight: torch.Tensor) -> torch.Tensor:
    """(in, out): int4_groups' codes times their scales plus their lows, both rounded to fp16
    as the panels keep them, written without the panels' code."""
    codes, scales, lows = int4_groups(weight)
    scales = scales.half().float().repeat_interleave(INT4_GROUP, dim=1)
    lows = lows.half().float().repeat_interleave(INT4_GROUP, dim=1)
    return (lows + codes.float() * scales).t()


def test_int4_panels_hold_each_groups_fp16_scales_and_lows_then_paired_quads():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 256, generator=g)  # (out, in): 2 panels of 16, 2 groups
    panels = Int4Panels.of(weight, 16)
    codes, scales, lows = int4_groups(weight)
    group_bytes = 4 * 16 + 64 * 16
    assert panels.buffer.numel() == 2 * 2 * group_bytes
    one = panels.buffer[(1 * 2 + 1) * group_bytes : (1 * 2 + 2) * group_bytes]  # panel 1, group 1
    assert torch.equal(one[:32].view(torch.float16), scales[16:, 1].half())
    assert torch.equal(one[32:64].view(torch.float16), lows[16:, 1].half())
    quads = one[64:].view(16, 16, 4)  # (quad pair, column, input)
    column, t, i = 5, 3, 2
    byte = quads[t, column, i].item()
    assert byte & 15 == codes[16 + column, 128 + 4 * t + i].item()  # quad t: low nibble
    assert byte >> 4 == codes[16 + column, 128 + 64 + 4 * t + i].item()  # quad t + 16: high
    assert torch.equal(panels.matrix(), _dequantized(weight))
    assert (panels.matrix() - weight.t()).abs().max() <= (scales.max() / 2 + 1e-3)
    with pytest.raises(ValueError, match="groups of 128 inputs"):
        Int4Panels.of(torch.randn(32, 192), 16)
    with pytest.raises(ValueError, match="fp16"):
        Int4Panels.of(torch.full((16, 128), 1e6).index_fill(1, torch.tensor([0]), -1e6), 16)


# The 15-bit integers a row's activations become: its largest |x| is this many units.
DIGIT_LIMIT = 127 * 256


def _outside_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """How far the product is past what rounding each activation to the nearest unit (its
    row's largest |x| / DIGIT_LIMIT) and fp32's adds allow: <= 1 within."""
    exact = x.double() @ w.double()
    unit = x.double().abs().amax(dim=1, keepdim=True) / DIGIT_LIMIT
    terms = x.double().abs() @ w.double().abs()
    allowed = 0.5 * unit * w.double().abs().sum(dim=0) + 1e-6 * terms
    return ((got.double() - exact).abs() / allowed.clamp(min=1e-30)).max().item()


@needs_int4_rows
@pytest.mark.parametrize("n_in", [128, 384, 1280])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
def test_the_int4_product_rounds_activations_to_15_bits_of_their_rows_largest(n_in, rows):
    # Three panels (the last block without a pair), rows in passes of DOT_ROWS, one and two
    # threads; a row with an outlier 100 times its other inputs counts them in its units.
    g = torch.Generator().manual_seed(n_in + rows)
    panels = Int4Panels.of(torch.randn(3 * _ROWS.int4_panel, n_in, generator=g), _ROWS.int4_panel)
    x = torch.randn(rows, n_in, generator=g)
    x[-1, 7] = 100.0
    for threads in (1, 2):
        got = _ROWS.int4_product(panels, x, threads)
        assert _outside_rounding(got, x, panels.matrix()) <= 1.0


@needs_int4_rows
def test_the_int4_product_refuses_what_it_does_not_read():
    panels = Int4Panels.of(torch.randn(_ROWS.int4_panel, 128), _ROWS.int4_panel)
    with pytest.raises(ValueError, match=r"takes \(rows, 128\)"):
        _ROWS.int4_product(panels, torch.randn(1, 129))
    other = Int4Panels.of(torch.randn(2 * _ROWS.int4_panel, 128), 2 * _ROWS.int4_panel)
    with pytest.raises(ValueError, match="no int4 panels"):
        _ROWS.int4_product(other, torch.randn(1, 128))


@needs_int4_rows
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_whole_step_reads_int4_matrices_as_what_they_stand_for(rows):
    # Widths of whole groups (model 128, MLP 256, 8 heads of 16); the reference multiplies
    # by the matrices the panels stand for in fp32. The activations' 15 bits leave ~2e-4.
    case = dict(widths=(128, 256, 100), heads=(8, 4), int4=True)
    assert max(rows_step_errors(_ROWS, rows=rows, **case)) < 1e-3
    assert max(rows_step_errors(_ROWS, rows=rows, prompt=None, threads=1, **case)) < 1e-3


@needs_int4_rows
def test_an_int4_copy_reads_our_kernel_for_its_products_and_rows():
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(384, 256, generator=g) * 0.05
    copy = Int4Weight(weight)
    assert copy.int4_panels is not None and copy.one_row_kernel == "rows_int4_product (native)"
    assert copy.max_rows == NATIVE_INT4_MAX_ROWS
    assert copy.nbytes == 384 * 256 // 2 + 384 * 2 * 2 * 2  # + an fp16 scale and low a group
    x = torch.randn(5, 256, generator=g)
    assert _outside_rounding(copy.matmul(x), x, _dequantized(weight)) <= 1.0
    torch.testing.assert_close(copy.matvec(x[0]), copy.matmul(x[:1])[0])
    plain = Int4Weight(weight, use_native=False)  # torch's kernel: bf16 activations
    assert plain.int4_panels is None and plain.one_row_kernel == "torch int4 weight-only"
    assert (plain.matmul(x) - copy.matmul(x)).abs().max() < 0.05 * x.abs().max()


@pytest.mark.skipif(
    _ROWS is not None and bool(_ROWS.int4_panel), reason="this CPU's kernel reads int4"
)
def test_without_integer_dot_products_int4_keeps_torchs_kernel():
    copy = Int4Weight(torch.randn(64, 256) * 0.05)
    assert copy.int4_panels is None and copy.one_row_kernel == "torch int4 weight-only"
    with pytest.raises(RuntimeError, match="no native int4 kernel"):
        Int4Weight(torch.randn(64, 256), use_native=True)


@pytest.mark.skipif(
    _ROWS is None or not _ROWS.int4_panel or shutil.which("cc") is None,
    reason="needs cc and a CPU whose kernel reads int4",
)
def test_a_build_counting_int4_activations_in_23_bits_is_that_exact(tmp_path):
    # -DINT4_DIGITS=3 (the A/B of the digits' count): three digits a row, as int8's products.
    import ctypes
    import subprocess

    from chatcli.kernels import build as kernel_build
    from chatcli.kernels.rows_step import DECODE_OPS_SOURCE, RowsStep

    lib = tmp_path / "decode_ops.so"
    tools = kernel_build.toolchain()
    command = [tools.path, *tools.flags, "-DINT4_DIGITS=3", str(DECODE_OPS_SOURCE), "-o", str(lib)]
    subprocess.run(command, check=True)
    kernel = RowsStep(ctypes.CDLL(str(lib)))
    g = torch.Generator().manual_seed(4)
    panels = Int4Panels.of(torch.randn(3 * kernel.int4_panel, 384, generator=g), kernel.int4_panel)
    x = torch.randn(5, 384, generator=g)
    x[-1, 7] = 1e4  # 2^-23 of it is still below the others' size
    exact = x.double() @ panels.matrix().double()
    got = kernel.int4_product(panels, x, 2).double()
    unit = x.double().abs().amax(dim=1, keepdim=True) / (127 * 65536)
    w = panels.matrix().double().abs()
    allowed = 0.5 * unit * w.sum(dim=0) + 1e-6 * (x.double().abs() @ w)
    assert ((got - exact).abs() / allowed).max().item() <= 1.0
    # The default's 15 bits could not hold the outlier row to that bound.
    default = _ROWS.int4_product(panels, x, 2).double()
    assert ((default - exact).abs() / allowed).max().item() > 1.0
