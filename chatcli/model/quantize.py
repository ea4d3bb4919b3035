"""Weight-only formats a large matrix can be read in on the CPU: in batch-1 decode, and in
the products of a few rows (up to each format's max_rows) where its kernel beats fp32's.

Owns: converting an fp32 matrix to a compact copy, and the products over that copy. Batch-1
decode of a big model is bandwidth-bound (docs/performance.md): the time per token is the
bytes of weights read, so a copy in fewer bytes is a faster token, at some cost in accuracy
that `chatcli bench --quantize ...` reports as greedy agreement with fp32.

- float16: half the bytes, rounded 8x closer than bf16 (11 bits of mantissa against 8). On
  x86 the product is fbgemm's fp16 GEMM: weights packed once, widened to fp32 in registers
  (F16C), fp32 activations and sums: one row faster than bf16's torch.mv, and a few to
  1024 rows (FBGEMM_FP16_MAX_ROWS) faster than fp32 (`python
  scripts/bench_decode_paths.py kernels` measures them). Where
  fbgemm is missing, torch.mv over fp16, one row, its input scaled into fp16's range. On
  AVX-512 one row goes through our own kernel instead (kernels/f16_matvec.py).
- bfloat16: half the bytes; exact products of rounded weights (torch.mv).
- int8: a quarter; one symmetric scale per output row. Where our kernels run (a C compiler,
  AVX2) it is weight-only in them: the codes widened to fp32 in registers, fp32 activations
  and sums, each row's scale applied to its sum; the whole decode step (rows_step) reads
  the copy's panels itself, and its products serve chat turns and prompts too
  (NATIVE_INT8_MAX_ROWS). Else, on x86, fbgemm's dynamic int8 linear: each call also
  rounds its activations to 7-bit integers (one scale and offset per call), and multiplies
  in integers, faster than torch's weight-only kernel or bf16's torch.mv. Where fbgemm is
  missing (ARM) it is weight-only:
  torch._weight_int8pack_mm, activations in bf16.
- int4: an eighth; asymmetric, a scale and low end per group of GROUP_SIZE inputs. Where
  our kernels have integer dot products (AVX-512 VNNI, AVX-VNNI, aarch64's sdot) in them,
  the whole decode step included, fp32 activations rounded to 15 bits a product; else
  torch._weight_int4pack_mm_for_cpu, activations in bf16.

Activations stay in the model's dtype outside the product. Knows nothing about the model.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import torch

from chatcli.kernels.build import unavailable_reason
from chatcli.kernels.f16_matvec import f16_matvec
from chatcli.kernels.f16_rows import f16_rows
from chatcli.kernels.panels import (
    INT4_GROUP,
    HalfPanels,
    Int4Panels,
    Int8Panels,
    int4_groups,
    int8_rows,
)
from chatcli.kernels.rows_step import rows_step

# From the most bits to the fewest.
QUANTIZE_KINDS = ("float16", "bfloat16", "int8", "int4")
INT4_GROUP_SIZE = 128
_INT4_INNER_K_TILES = 8
_INT4_OUTPUT_TILE = 16
_TINY = torch.finfo(torch.float32).tiny
# fbgemm's fp16 GEMM beat fp32 (linear.linear) at every row count measured, up to this.
FBGEMM_FP16_MAX_ROWS = 1024
# Our int8 product (weight-only, fp32 activations) beat the fp32 weight at every row count
# measured, up to this: a chat turn and a prompt read the same int8 weights as decode, as
# fp16 copies do through fbgemm.
NATIVE_INT8_MAX_ROWS = 1024
# Our int4 product (15-bit activations, integer dot products) for up to this many rows.
NATIVE_INT4_MAX_ROWS = 1024
# torch's int4 kernel wins clearly over fp32 only for a few rows, more with AVX-512 than
# with AVX2; past that the rows keep fp32's exact products.
INT4_MAX_ROWS = {"AVX512": 64}
INT4_MAX_ROWS_ELSEWHERE = 8


class DecodeWeight(Protocol):
    nbytes: int  # bytes one product reads
    # The most rows (tokens) a product over this copy beats the fp32 weight at: bf16
    # matrix-matrix kernels are compute-bound on this CPU, while int8's stays ahead up to
    # a few sample rows, and fbgemm's fp16 one up to long prompts (FBGEMM_FP16_MAX_ROWS).
    max_rows: int
    # Whether the product takes its rows as floats, so that a row scaled after the product
    # equals the row scaled before it, up to rounding: not so for fbgemm's int8 kernel, which
    # rounds all the rows of a call to integers on one scale.
    float_activations: bool

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """(K,) -> (N,) in x's dtype."""
        ...

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """(M, K) -> (M, N) in x's dtype, for M <= max_rows."""
        ...


class Fp16Weight:
    """fp16: on x86, fbgemm's fp16 GEMM over weights packed once, which widens them to fp32
    in registers and takes and accumulates fp32 activations, so any number of rows and no
    range to mind. Elsewhere torch.mv, one row, its input scaled into fp16's range. One row
    goes through our own kernel where it runs (kernels/f16_matvec.py: AVX-512), which also
    widens the weights in registers and sums in fp32, and streams them faster than fbgemm's
    packing. It reads a plain fp16 copy beside
    fbgemm's packing (which serves several rows), unpacked from the panels below at its
    first use where they are kept.
    2 to 8 rows (a big model's sample rows) go through our f16_rows where it runs (AVX2
    with F16C, or AVX-512), over the copy packed in its panels, faster than fbgemm's as its
    loop widens each weight once for all the rows. Another fp16
    copy, kept beside fbgemm's, which still serves 9 rows and more (chat chunks, prompts).
    A decode step through our whole-step kernel (kernels/rows_step.py) reads those
    panels itself (half_panels) and calls none of these products."""

    float_activations = True

    def __init__(
        self, weight: torch.Tensor, use_fbgemm: bool | None = None, use_native: bool | None = None
    ) -> None:
        self.use_fbgemm = fbgemm_fp16_available() if use_fbgemm is None else use_fbgemm
        self.nbytes = weight.numel() * 2
        native = f16_matvec() if use_native is None or use_native else None
        if use_native and native is None:
            raise RuntimeError(f"no native fp16 kernel here: {unavailable_reason()}")
        self._native = native if native is not None and native.fits(weight) else None
        rows = f16_rows() if use_native is None or use_native else None
        self._rows = rows if rows is not None and rows.fits(weight) else None
        self._panels = self._rows.pack(weight) if self._rows is not None else None
        self.out_features, self.in_features = weight.shape
        # The plain fp16 copy serves one row outside a whole-step kernel, which reads the
        # panels. Beside panels it is unpacked from them at the first such product, not
        # made at load, so a model that decodes through rows_step keeps two copies, not
        # three. Without panels it is made now: nothing else keeps the
        # halves (the weight may be a stack made for this copy and freed after).
        self._plain: torch.Tensor | None = None
        if self._panels is None and (self._native is not None or not self.use_fbgemm):
            self._plain = weight.detach().to(torch.float16).contiguous()
        if self.use_fbgemm:
            with warnings.catch_warnings():  # torch's quantized ops are marked deprecated
                warnings.simplefilter("ignore")
                self._packed = torch.ops.quantized.linear_prepack_fp16(
                    weight.detach().float().contiguous(), None
                )
            self.max_rows = FBGEMM_FP16_MAX_ROWS
        else:
            self.max_rows = self._rows.max_rows if self._rows is not None else 1

    @property
    def weight(self) -> torch.Tensor:
        """The plain fp16 copy (N, K), made on first use."""
        if self._plain is None:
            blocks = self._panels.view(-1, self.in_features, self._rows.panel)
            self._plain = blocks.permute(0, 2, 1).reshape(self.out_features, -1).contiguous()
        return self._plain

    @property
    def holds_plain_copy(self) -> bool:
        """Whether the (out, in) fp16 matrix is made yet (panels alone make it at first use)."""
        return self._plain is not None

    @property
    def one_row_kernel(self) -> str:
        """What a product of one row runs (reported by `chatcli bench`)."""
        if self._native is not None:
            return "f16_matvec (native)"
        return "fbgemm fp16" if self.use_fbgemm else "torch.mv fp16"

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        if self._native is not None:
            return self._native(self.weight, x).to(x.dtype)
        if self.use_fbgemm:
            return self.matmul(x.view(1, -1)).view(-1)
        # torch.mv takes and gives fp16, whose range (65504) the MLP's squared activations
        # can pass: divide by the input's largest magnitude (an all-zero input by the
        # smallest normal float, not by zero) and multiply the output back.
        top = torch.linalg.vector_norm(x, float("inf")).clamp_min_(_TINY)
        y = torch.mv(self.weight, torch.div(x, top).to(torch.float16))
        return y.to(x.dtype).mul_(top)

    @property
    def half_panels(self) -> HalfPanels | None:
        """The f16_rows panels as a whole decode step reads them (kernels/rows_step.py
        of a big model: its products with no copy of their own), or None without them."""
        if self._panels is None:
            return None
        n_in, n_out, panel = self.in_features, self.out_features, self._rows.panel
        return HalfPanels(self._panels, n_in, n_out, panel)

    @property
    def rows_kernel(self) -> str:
        """What a product of 2 to 8 rows runs (reported by `chatcli bench`)."""
        if self._rows is not None:
            return "f16_rows (native)"
        return "fbgemm fp16" if self.use_fbgemm else "torch.mv fp16"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._rows is not None and 1 < x.size(0) <= self._rows.max_rows:
            return self._rows(self._panels, x, self.out_features).to(x.dtype)
        if self.use_fbgemm:
            y = torch.ops.quantized.linear_dynamic_fp16(x.float().contiguous(), self._packed)
            return y.to(x.dtype)
        return self.matvec(x.view(-1)).view(1, -1)


class Bf16Weight:
    max_rows = 1
    float_activations = True

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach().to(torch.bfloat16).contiguous()
        self.nbytes = self.weight.numel() * 2

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mv(self.weight, x.to(torch.bfloat16)).to(x.dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.matvec(x.view(-1)).view(1, -1)


def fbgemm_available() -> bool:
    """Whether fbgemm's dynamic int8 linear runs here (x86 builds; its engine is the default)."""
    return torch.backends.quantized.engine in ("x86", "fbgemm") and hasattr(
        torch.ops.quantized, "linear_dynamic"
    )


def fbgemm_fp16_available() -> bool:
    """Whether fbgemm's fp16-weight linear runs here (x86 builds, as its int8 one)."""
    return fbgemm_available() and hasattr(torch.ops.quantized, "linear_dynamic_fp16")


class Int8Weight:
    """int8, one scale per output row (int8_rows). Where our step kernel reads int8 (a C
    compiler, AVX2) and the rows are whole panels: weight-only in our own kernels, the
    codes in panels beside their scales (Int8Panels), which the whole decode step
    (kernels/rows_step.py) and this copy's own products (rows_int8_product: sample
    rows, a chat turn, a prompt: up to NATIVE_INT8_MAX_ROWS) read, fp32 activations and
    sums, a byte a weight. Else fbgemm's dynamic int8 linear, which also rounds the
    activations to 7-bit integers, or, where fbgemm is missing, torch's weight-only kernel
    with bf16 activations.
    use_native: None, ours where it runs unless use_fbgemm says which of the others; False,
    never; True, ours or a RuntimeError."""

    # Rows through fbgemm's copy: its rows share one activation scale, so a long prompt's
    # outliers would coarsen every row's rounding; more rows use the fp32 weight.
    max_rows = 16

    def __init__(
        self, weight: torch.Tensor, use_fbgemm: bool | None = None, use_native: bool | None = None
    ) -> None:
        codes, scales = int8_rows(weight)
        N, K = codes.shape
        native = use_native if use_native is not None else use_fbgemm is None
        kernel = rows_step() if native else None
        panel = kernel.int8_panel if kernel is not None else 0
        if use_native and not (panel and N % panel == 0):
            why = unavailable_reason("rows_step") or "no AVX2, or rows not whole panels"
            raise RuntimeError(f"no native int8 kernel for {N} rows here: {why}")
        self._kernel, self.int8_panels = None, None
        if panel and N % panel == 0:
            self._kernel = kernel
            self.int8_panels = Int8Panels.of(codes, scales, panel, kernel.int8_interleave)
            self.use_fbgemm, self.float_activations = False, True
            self.max_rows = NATIVE_INT8_MAX_ROWS
            self.nbytes = N * K + N * 4  # + an fp32 scale a row
            return
        self.use_fbgemm = fbgemm_available() if use_fbgemm is None else use_fbgemm
        self.float_activations = not self.use_fbgemm  # the weight-only kernel takes bf16
        if self.use_fbgemm:
            with warnings.catch_warnings():  # torch's quantized tensors are marked deprecated
                warnings.simplefilter("ignore")
                q = torch._make_per_channel_quantized_tensor(
                    codes, scales.double(), torch.zeros(N, dtype=torch.long), 0
                )
                self._packed = torch.ops.quantized.linear_prepack(q, None)
            self.nbytes = N * K + N * 8  # + an fp32 scale and an int32 column offset per row
        else:
            self.codes = codes
            self.scales = scales.to(torch.bfloat16)  # the kernel takes the activations' dtype
            self.nbytes = N * K + N * 2

    @property
    def one_row_kernel(self) -> str:
        """What a product of one row runs (reported by `chatcli bench`)."""
        if self._kernel is not None:
            return "rows_int8_product (native)"
        return "fbgemm int8" if self.use_fbgemm else "torch int8 weight-only"

    rows_kernel = one_row_kernel  # what 2 to max_rows rows run: the same kernel

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x.view(1, -1)).view(-1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            y = self._kernel.int8_product(self.int8_panels, x, torch.get_num_threads())
            return y.to(x.dtype)
        if self.use_fbgemm:
            # reduce_range: 7-bit activations, so AVX2's u8 x s8 pair sums cannot saturate.
            y = torch.ops.quantized.linear_dynamic(x.float().contiguous(), self._packed, True)
            return y.to(x.dtype)
        # bf16 activations: the kernel's fp32-activation path measured far slower.
        y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.codes, self.scales)
        return y.to(x.dtype)


class Int4Weight:
    """int4, asymmetric, a scale and low end per group of INT4_GROUP_SIZE inputs
    (int4_groups). Where our step kernel reads int4 (integer dot products: AVX-512 VNNI,
    AVX-VNNI, aarch64's sdot) and the shape is whole panels and groups: in our own kernels
    (Int4Panels, fp16 scales and lows beside the codes), which the whole decode step and
    this copy's own products (up to NATIVE_INT4_MAX_ROWS rows) read, fp32 activations
    rounded to 15 bits a product. Else torch's weight-only kernel, bf16 activations.
    use_native: None, ours where it runs; False, never; True, ours or a RuntimeError."""

    def __init__(
        self,
        weight: torch.Tensor,
        group_size: int = INT4_GROUP_SIZE,
        use_native: bool | None = None,
    ) -> None:
        w = weight.detach().float()
        N, K = w.shape
        if K % group_size or N % _INT4_OUTPUT_TILE:
            raise ValueError(
                f"int4 needs in_features divisible by {group_size} and out_features by "
                f"{_INT4_OUTPUT_TILE}, not {K} and {N}"
            )
        self.group_size = group_size
        kernel = rows_step() if use_native is not False else None
        panel = kernel.int4_panel if kernel is not None else 0
        self._kernel, self.int4_panels = None, None
        if panel and N % panel == 0 and group_size == INT4_GROUP:
            try:
                self.int4_panels = Int4Panels.of(w, panel)
                self._kernel = kernel
            except ValueError:  # scales past fp16's range: torch's kernel keeps them in bf16
                pass
        if self._kernel is not None:
            self.float_activations = True
            self.max_rows = NATIVE_INT4_MAX_ROWS
            self.one_row_kernel = self.rows_kernel = "rows_int4_product (native)"
            self.nbytes = self.int4_panels.buffer.numel()
            return
        if use_native:
            why = unavailable_reason("rows_step") or "no integer dot products, or odd widths"
            raise RuntimeError(f"no native int4 kernel for {N} x {K} here: {why}")
        capability = torch.backends.cpu.get_cpu_capability()
        self.max_rows = INT4_MAX_ROWS.get(capability, INT4_MAX_ROWS_ELSEWHERE)
        self.float_activations = True  # bf16
        self.one_row_kernel = self.rows_kernel = "torch int4 weight-only"
        q, scales, lo = int4_groups(w, group_size)
        # The kernel computes (q - 8) * scale + zero, so the zero is the value of q = 8.
        zeros = lo + 8.0 * scales
        self.packed = torch._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32), _INT4_INNER_K_TILES
        )
        # (K / group, N, 2): per group and output row, (scale, zero), in the activations' dtype.
        self.scales_and_zeros = (
            torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        )
        self.nbytes = N * K // 2 + self.scales_and_zeros.numel() * 2

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x.view(1, -1)).view(-1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            y = self._kernel.int4_product(self.int4_panels, x, torch.get_num_threads())
            return y.to(x.dtype)
        y = torch._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, self.group_size, self.scales_and_zeros
        )
        return y.to(x.dtype)


def make_decode_weight(weight: torch.Tensor, kind: str) -> DecodeWeight:
    """A compact copy of `weight` (N, K) in `kind` (one of QUANTIZE_KINDS)."""
    if kind == "float16":
        return Fp16Weight(weight)
    if kind == "bfloat16":
        return Bf16Weight(weight)
    if kind == "int8":
        return Int8Weight(weight)
    if kind == "int4":
        return Int4Weight(weight)
    raise ValueError(f"unknown weight format {kind!r}; use one of {', '.join(QUANTIZE_KINDS)}")


def default_half_kind() -> str:
    """The 16-bit copy a big model keeps by default on this CPU for its decode (and, through
    fbgemm's fp16 GEMM, for its products of up to FBGEMM_FP16_MAX_ROWS rows): fp16 on x86
    where fbgemm runs, else bf16: fp16 measured about twice as fast on the x86 CPUs tried
    (`python scripts/bench_decode_paths.py kernels`). Elsewhere (ARM64) fp16 where our
    whole-step kernel reads it (NEON widens fp16; it reads no bf16), so a big model's step is
    one C call; bf16 where it does not (no compiler), speed there unmeasured either way."""
    x86 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    if x86:
        return "float16" if fbgemm_fp16_available() else "bfloat16"
    kernel = rows_step()
    return "float16" if kernel is not None and kernel.half_panel else "bfloat16"


def supports(weight: torch.Tensor, kind: str) -> bool:
    """Whether `weight` can take this format: int4 needs whole groups of inputs, and the
    packing kernel whole tiles of 16 outputs."""
    if kind != "int4":
        return True
    return weight.shape[1] % INT4_GROUP_SIZE == 0 and weight.shape[0] % _INT4_OUTPUT_TILE == 0
