from __future__ import annotations

import pytest
import torch

from chatcli.kernels.build import unavailable_reason
from chatcli.kernels.f16_matvec import f16_matvec
from chatcli.kernels.f16_rows import f16_rows
from chatcli.kernels.rows_step import rows_step
from chatcli.model.quantize import (
    INT4_GROUP_SIZE,
    NATIVE_INT8_MAX_ROWS,
    QUANTIZE_KINDS,
    Bf16Weight,
    Fp16Weight,
    Int4Weight,
    Int8Weight,
    default_half_kind,
    fbgemm_available,
    fbgemm_fp16_available,
    int8_rows,
    make_decode_weight,
    supports,
)


def _matrix(n: int = 384, k: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def _relative_error(kind: str, w: torch.Tensor, x: torch.Tensor) -> float:
    want = torch.mv(w, x)
    got = make_decode_weight(w, kind).matvec(x)
    assert got.shape == want.shape and got.dtype == x.dtype
    return float((got - want).norm() / want.norm())


# Expected error of round-to-nearest: fp16 keeps 11 bits of mantissa, bf16 8, int8 per-row
# scales about 7 bits of range, int4 groups of 128 about 4 bits.
@pytest.mark.parametrize(
    ("kind", "bound"), [("float16", 0.0007), ("bfloat16", 0.005), ("int8", 0.02), ("int4", 0.15)]
)
def test_products_are_close_to_fp32(kind, bound):
    w = _matrix()
    x = torch.randn(256, generator=torch.Generator().manual_seed(1))
    err = _relative_error(kind, w, x)
    assert 0 < err < bound


def test_more_bits_less_error():
    w, x = _matrix(seed=2), torch.randn(256, generator=torch.Generator().manual_seed(3))
    errors = [_relative_error(kind, w, x) for kind in QUANTIZE_KINDS]
    assert errors == sorted(errors)


def test_bytes_read_per_product():
    w = _matrix(512, 256)
    assert Bf16Weight(w).nbytes == Fp16Weight(w).nbytes == 512 * 256 * 2
    # + one bf16 scale per row; fbgemm keeps an fp32 scale and an int32 offset
    assert Int8Weight(w, use_fbgemm=False).nbytes == 512 * 256 + 512 * 2
    assert Int8Weight(w, use_fbgemm=True).nbytes == 512 * 256 + 512 * 8
    groups = 256 // INT4_GROUP_SIZE
    assert Int4Weight(w).nbytes == 512 * 256 // 2 + groups * 512 * 2 * 2  # + bf16 scale, zero


def test_int8_rows_use_their_whole_range():
    w = _matrix()
    codes, scales = int8_rows(w)
    assert codes.dtype == torch.int8
    assert torch.equal(codes.abs().amax(dim=1), torch.full((384,), 127, dtype=torch.int8))
    torch.testing.assert_close(codes.float() * scales[:, None], w, atol=0.5 * scales.max(), rtol=0)


@pytest.mark.skipif(not fbgemm_available(), reason="fbgemm is an x86 build's")
@pytest.mark.parametrize("rows", [1, 8])
def test_both_int8_kernels_compute_the_same_product(rows):
    # fbgemm also rounds the activations (7 bits per call): close to the weight-only kernel,
    # not equal to it.
    w = _matrix(seed=5)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(6))
    want = x @ w.t()
    fbgemm = Int8Weight(w, use_fbgemm=True).matmul(x)
    weight_only = Int8Weight(w, use_fbgemm=False).matmul(x)
    assert fbgemm.shape == weight_only.shape == (rows, 384)
    for got in (fbgemm, weight_only):
        assert 0 < float((got - want).norm() / want.norm()) < 0.02
    assert not torch.equal(fbgemm, weight_only)


_INT8_PANEL = rows_step().int8_panel if rows_step() is not None else 0
needs_native_int8 = pytest.mark.skipif(
    not _INT8_PANEL, reason=f"no native int8 kernel: {unavailable_reason('rows_step')}"
)


@needs_native_int8
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_an_int8_copy_reads_its_own_panels_in_fp32_where_our_kernel_runs(rows):
    # Weight-only: the same codes and scales as the other kernels, fp32 activations, so a
    # row's product is x @ (codes * scales) within fp32 rounding, and nothing rounds x.
    w = _matrix(seed=7)
    copy = Int8Weight(w)
    assert copy.int8_panels is not None and copy.float_activations
    assert copy.one_row_kernel == copy.rows_kernel == "rows_int8_product (native)"
    assert copy.nbytes == 384 * 256 + 384 * 4  # a byte a weight, an fp32 scale a row
    codes, scales = int8_rows(w)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(8))
    want = x @ (codes.float() * scales[:, None]).t()
    torch.testing.assert_close(copy.matmul(x), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(copy.matvec(x[0]), want[0], atol=1e-5, rtol=1e-5)


def test_an_int8_copy_our_kernel_cannot_read_takes_the_others():
    # 100 output rows are not whole panels: fbgemm (or torch's weight-only kernel) instead,
    # as with use_native=False or a kernel asked for by name.
    for copy in (Int8Weight(_matrix(100, 256)), Int8Weight(_matrix(), use_native=False)):
        assert copy.int8_panels is None
        assert copy.one_row_kernel in ("fbgemm int8", "torch int8 weight-only")
    if _INT8_PANEL:
        with pytest.raises(RuntimeError, match="no native int8 kernel for 100 rows"):
            Int8Weight(_matrix(100, 256), use_native=True)


def test_a_constant_group_is_exact_in_int4():
    w = torch.full((64, 256), 0.25)
    x = torch.ones(256)
    got = Int4Weight(w).matvec(x)
    torch.testing.assert_close(got, torch.full((64,), 64.0), atol=0.5, rtol=0)


def test_int4_needs_whole_groups():
    assert supports(_matrix(64, 256), "int4")
    assert not supports(_matrix(64, 192), "int4")
    assert supports(_matrix(64, 192), "int8")
    with pytest.raises(ValueError, match="divisible by 128 and out_features by 16"):
        Int4Weight(_matrix(64, 192))


def test_unknown_format_names_the_choices():
    with pytest.raises(ValueError, match="bfloat16, int8, int4"):
        make_decode_weight(_matrix(), "fp8")


_INT8_KERNELS = [
    pytest.param(
        {"use_native": True},
        marks=pytest.mark.skipif(
            rows_step() is None or not rows_step().int8_panel, reason="no native int8 kernel"
        ),
    ),
    pytest.param(
        {"use_native": False, "use_fbgemm": True},
        marks=pytest.mark.skipif(not fbgemm_available(), reason="x86's"),
    ),
]


@pytest.mark.parametrize("kernel", _INT8_KERNELS)
def test_int8_serves_its_kernels_rows_and_fp32_the_rest(kernel):
    # Ours serves prompts too (its rows are independent and it beats fp32 there); fbgemm's
    # rows share one activation scale, so it serves a few sample rows and fp32 the rest.
    from chatcli.model.linear import Linear

    layer = Linear(256, 384, bias=False).requires_grad_(False)
    with torch.no_grad():
        layer.weight.copy_(_matrix())
    layer.decode_weight = copy = Int8Weight(layer.weight, **kernel)
    assert copy.max_rows == (NATIVE_INT8_MAX_ROWS if kernel["use_native"] else 16)
    g = torch.Generator().manual_seed(4)
    for rows in (8, 40):  # sample rows; a prompt
        x = torch.randn(rows, 256, generator=g)
        want = torch.nn.functional.linear(x, layer.weight)
        got = layer(x)
        if rows <= copy.max_rows:  # the int8 copy
            assert not torch.equal(got, want)
            assert float((got - want).norm() / want.norm()) < 0.02
            torch.testing.assert_close(got, copy.matmul(x), atol=0, rtol=0)
        else:  # the fp32 weight, exactly
            assert torch.equal(got, want)


_NATIVE = f16_matvec() is not None
# (use_fbgemm, use_native): fbgemm's kernel, torch.mv, and our own one-row kernel
_FP16_KERNELS = [
    pytest.param(
        (True, False), marks=pytest.mark.skipif(not fbgemm_fp16_available(), reason="x86's")
    ),
    (False, False),
    pytest.param(
        (fbgemm_fp16_available(), True),
        marks=pytest.mark.skipif(not _NATIVE, reason=f"no native kernel: {unavailable_reason()}"),
    ),
]


@pytest.mark.parametrize("kernels", _FP16_KERNELS)
def test_fp16_products_hold_inputs_past_fp16s_range(kernels):
    # Squared activations of a few hundred pass fp16's largest value (65504), where a plain
    # fp16 product overflows: fbgemm's kernel and ours take fp32 activations, and the
    # torch.mv path divides its input by its largest magnitude first.
    w = _matrix(seed=7)
    x = torch.randn(256, generator=torch.Generator().manual_seed(8)).relu() * 400
    x = x * x  # up to ~1e6
    want = torch.mv(w, x)
    plain = torch.mv(w.half(), x.half()).float()
    assert not torch.isfinite(plain).all()
    use_fbgemm, use_native = kernels
    got = Fp16Weight(w, use_fbgemm=use_fbgemm, use_native=use_native).matvec(x)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert float((got - want).norm() / want.norm()) < 0.0007


@pytest.mark.parametrize("kernels", _FP16_KERNELS)
def test_fp16_products_of_a_zero_input_are_zero(kernels):
    use_fbgemm, use_native = kernels
    copy = Fp16Weight(_matrix(), use_fbgemm=use_fbgemm, use_native=use_native)
    got = copy.matmul(torch.zeros(1, 256))
    assert got.shape == (1, 384) and torch.equal(got, torch.zeros(1, 384))
    assert torch.equal(copy.matvec(torch.zeros(256)), torch.zeros(384))  # one row: ours


@pytest.mark.skipif(not fbgemm_fp16_available(), reason="fbgemm is an x86 build's")
def test_fbgemm_fp16_serves_many_rows_as_the_rounded_weights_would():
    # fp32 activations and sums over fp16-rounded weights: equal to fp32 arithmetic over
    # those weights up to the order of the sums, for a prompt's worth of rows.
    w = _matrix(seed=9)
    copy = Fp16Weight(w, use_fbgemm=True, use_native=False)
    assert copy.max_rows >= 512
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(10))
    got = copy.matmul(x)
    assert got.shape == (300, 384)
    torch.testing.assert_close(got, x @ w.half().float().t(), atol=1e-5, rtol=1e-5)
    assert not torch.equal(got, x @ w.t())  # the weights were rounded


@pytest.mark.skipif(f16_rows() is None, reason=f"no native kernel: {unavailable_reason()}")
def test_fp16_keeps_its_plain_copy_only_once_a_row_reads_it():
    # A model decoding through rows_step reads the panels alone: the plain copy for one-row
    # products comes from them at the first such product, the same halves, not at load.
    w = _matrix(seed=11)
    copy = Fp16Weight(w)
    assert copy.half_panels is not None and not copy.holds_plain_copy
    x = torch.randn(256, generator=torch.Generator().manual_seed(12))
    got = copy.matvec(x)
    assert copy.holds_plain_copy and torch.equal(copy.weight, w.half())
    torch.testing.assert_close(got, w.half().float() @ x, atol=1e-5, rtol=1e-5)
    # Without panels nothing else holds the halves: the copy is made with the weight.
    assert Fp16Weight(w, use_fbgemm=False, use_native=False).holds_plain_copy


def test_fp16_through_torch_mv_serves_one_row():
    copy = Fp16Weight(_matrix(), use_fbgemm=False, use_native=False)
    assert copy.max_rows == 1


@pytest.mark.parametrize(
    ("capability", "kind"),
    [("AVX2", "float16"), ("AVX512", "float16"), ("DEFAULT", "kernel"), ("SVE256", "kernel")],
)
def test_the_default_half_copy_is_fp16_where_it_was_measured_faster_or_our_step_reads_it(
    capability, kind, monkeypatch
):
    # Off x86 (ARM64: DEFAULT, SVE256) fp16 where our whole-step kernel reads it, else bf16.
    from chatcli.kernels.rows_step import rows_step

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    if kind == "kernel":
        kernel = rows_step()
        kind = "float16" if kernel is not None and kernel.half_panel else "bfloat16"
    assert default_half_kind() == kind


def test_the_default_half_copy_off_x86_is_bf16_without_our_kernels(monkeypatch):
    from chatcli.kernels.rows_step import rows_step

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    monkeypatch.setenv("CHATCLI_NATIVE_KERNELS", "0")
    rows_step.cache_clear()
    try:
        assert default_half_kind() == "bfloat16"
    finally:
        rows_step.cache_clear()


def test_the_default_half_copy_is_bf16_on_x86_without_fbgemms_fp16_kernel(monkeypatch):
    from chatcli.model import quantize

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(quantize, "fbgemm_fp16_available", lambda: False)
    assert default_half_kind() == "bfloat16"


@pytest.mark.parametrize(("capability", "rows"), [("AVX512", 64), ("AVX2", 8), ("DEFAULT", 8)])
def test_int4_serves_the_rows_its_kernel_wins_at_on_this_cpu(monkeypatch, capability, rows):
    # torch's int4 products (where our kernels have no integer dot products) beat fp32 up
    # to 64 rows with AVX-512, but past ~8 with AVX2 they lose: more rows keep fp32's
    # exact products.
    from chatcli.model.linear import Linear

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    layer = Linear(256, 384, bias=False).requires_grad_(False)
    with torch.no_grad():
        layer.weight.copy_(_matrix())
    layer.decode_weight = Int4Weight(layer.weight, use_native=False)
    assert layer.decode_weight.max_rows == rows
    served = torch.randn(rows, 256)
    assert not torch.equal(layer(served), torch.nn.functional.linear(served, layer.weight))
    more = torch.randn(rows + 1, 256)
    assert torch.equal(layer(more), torch.nn.functional.linear(more, layer.weight))
