"""Kernels of our own in C, compiled on this machine at first use and loaded with ctypes.

Owns: building the shipped C sources (chatcli/kernels/) with the system's C compiler for
this CPU (-march=native), caching the libraries, checking each against torch once per
process, and calling them. Four kernels:
- f16_matvec: one fp32 row times an fp16 matrix, which batch-1 decode of a big model spends
  ~90% of its time in (quantize.Fp16Weight). AVX-512 only, the CPU it was measured on.
- f16_rows: up to 8 rows times an fp16 matrix packed in panels (quantize.Fp16Weight: a few
  rows outside a decode step). x86 with AVX2, F16C and FMA, or AVX-512.
- rows_step: a model's whole decode step, one row or several (sample rows over a shared
  prompt), every layer and the vocabulary's products (decode_step): a small model's fp32
  matrices, where torch spent ~150 ops of ~2-5 us each, or a big one's fp16 copies read from
  their f16_rows panels (HalfPanels), where ~300 ops and their threads' hand-offs took ~15
  of d20's 52 ms a token. Any CPU with a C compiler and OpenMP; fp16 where it has F16C.
- sample_rows: the next token of each row from its logits, temperature, top-k and a
  uniform draw (sampling.sample_next_token), where ~10 torch ops took 84-114 us of the
  embedded model's ~550 us token at chat's defaults. Built with rows_step, from the same source.

Why compile at run time: the fastest loop depends on the CPU's vector width, and a wheel
built elsewhere cannot know it; a C file with no torch headers compiles in under a second.
Why not always: it needs a C compiler, and any failure (no compiler, another CPU, a wrong
answer at the check) leaves chatcli on torch's ops, with the reason in
`unavailable_reason(kernel)`. CHATCLI_NATIVE_KERNELS=0 turns them all off. Knows nothing about
models beyond the arithmetic each kernel is checked against.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F

KERNELS_DIR = Path(__file__).parent
SOURCE = KERNELS_DIR / "f16_matvec.c"
DECODE_OPS_SOURCE = KERNELS_DIR / "decode_ops.c"
F16_ROWS_SOURCE = KERNELS_DIR / "f16_rows.c"
# OpenMP in the process's one libgomp: torch's, whose soname the libraries name.
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-fopenmp")
COMPILE_TIMEOUT_S = 60


class F16Matvec:
    """The loaded f16_matvec: rows of `rows` and inputs of `step` at a time."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.f16_matvec
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2
        self.rows = int(library.f16_matvec_rows())
        self.step = int(library.f16_matvec_step())

    def fits(self, weight: torch.Tensor) -> bool:
        """Whether this kernel takes `weight` (N, K): whole blocks of rows and of inputs."""
        n, k = weight.shape
        return n % self.rows == 0 and k % self.step == 0

    def __call__(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """weight (N, K) fp16 contiguous, x (K,) -> fp32 (N,), on torch's current threads."""
        n, k = weight.shape
        if weight.dtype != torch.float16 or not weight.is_contiguous() or not self.fits(weight):
            raise ValueError(f"f16_matvec takes a contiguous fp16 (N, K) matrix, not {weight}")
        x = x.to(torch.float32).contiguous()
        if x.shape != (k,):
            raise ValueError(f"f16_matvec: input of shape {tuple(x.shape)}, matrix {n}x{k}")
        y = torch.empty(n, dtype=torch.float32)
        self._fn(x.data_ptr(), weight.data_ptr(), y.data_ptr(), n, k)
        return y


class F16Rows:
    """The loaded f16_rows: 1 to `max_rows` fp32 rows times an fp16 matrix packed once in
    panels of `panel` columns (pack)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.f16_rows
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 2
        self._fn.argtypes += [ctypes.c_long] * 2
        self.panel = int(library.f16_rows_panel())
        self.max_rows = int(library.f16_rows_max())

    def fits(self, weight: torch.Tensor) -> bool:
        """Whether this kernel takes `weight` (N, K): whole panels of columns."""
        return weight.dim() == 2 and weight.size(0) % self.panel == 0 and weight.size(1) > 0

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight (N, K) -> its fp16 panels as the kernel reads them (N * K halves)."""
        if not self.fits(weight):
            raise ValueError(f"f16_rows takes (N, K) with N a multiple of {self.panel}")
        return HalfPanels.of(weight.t(), self.panel).panels

    def __call__(self, panels: torch.Tensor, x: torch.Tensor, out: int) -> torch.Tensor:
        """panels from pack() of an (out, K) matrix, x (M, K) -> fp32 (M, out), M <=
        max_rows, on torch's current threads."""
        rows, k = x.shape
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"f16_rows takes 1 to {self.max_rows} rows, not {rows}")
        if panels.dtype != torch.float16 or panels.numel() != out * k or out % self.panel:
            raise ValueError(f"f16_rows: panels of {panels.numel()} halves for {out}x{k}")
        x = x.to(torch.float32).contiguous()
        y = torch.empty(rows, out, dtype=torch.float32)
        self._fn(x.data_ptr(), rows, panels.data_ptr(), y.data_ptr(), out, k)
        return y


class SampleRows:
    """The loaded sample_rows (kernels/decode_ops.c): every row's next token in one call."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.sample_rows
        fn.restype = ctypes.c_int  # 0, or -1 where it decided nothing
        fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_float]
        fn.argtypes += [ctypes.c_long, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
        self._fn = fn

    @staticmethod
    def takes(
        logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None
    ) -> bool:
        """Whether the kernel decides these: fp32 rows on the CPU, a temperature above 0,
        and top-p only inside a top-k (the kernel sorts no more than top-k's candidates)."""
        nucleus = top_p is not None and 0.0 < top_p < 1.0
        restricted = top_k is not None and 0 < top_k < logits.size(-1)
        return (
            logits.device.type == "cpu"
            and logits.dtype == torch.float32
            and logits.dim() == 2
            and temperature > 0.0
            and (restricted or not nucleus)
        )

    def __call__(
        self,
        logits: torch.Tensor,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        u: torch.Tensor,
    ) -> torch.Tensor | None:
        """logits (B, V) fp32 and the rows' draws u (B, 1) in [0, 1) -> token ids (B, 1), or
        None where a row's logits hold NaN or no finite value (torch's ops decide those)."""
        if not self.takes(logits, temperature, top_k, top_p):
            raise ValueError("sample_rows takes fp32 CPU rows, temperature > 0, top-p in top-k")
        logits = logits.contiguous()
        u = u.to(torch.float32).contiguous()
        out = torch.empty(logits.size(0), 1, dtype=torch.long)
        status = self._fn(
            logits.data_ptr(), logits.size(0), logits.size(1), temperature, top_k or 0,
            top_p if top_p is not None else 1.0, u.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        return out if status == 0 else None


def reference_sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    u: torch.Tensor,
) -> torch.Tensor:
    """sample_rows' choice in float64 torch ops: the candidates in the same order (top-k's
    strongest first, else the vocabulary's), the first whose running sum exceeds u times
    their total (the load check's answer)."""
    x = logits.double()
    idx = None
    if top_k is not None and 0 < top_k < x.size(-1):
        x, idx = torch.topk(x, top_k, dim=-1)
    probs = torch.softmax(x / temperature, dim=-1)
    if top_p is not None and 0.0 < top_p < 1.0:
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p, 0.0)
    cdf = probs.cumsum(-1)
    choice = torch.searchsorted(cdf, u.double() * cdf[:, -1:], right=True)
    choice = choice.clamp_(max=probs.size(-1) - 1)
    return idx.gather(1, choice) if idx is not None else choice


class _Layer(ctypes.Structure):  # decode_ops.c's struct rows_layer
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("qkv", "proj", "fc", "fc_proj")),
        *((name, ctypes.c_void_p) for name in ("ve_gate", "ve_table")),
        ("window", ctypes.c_long),
        ("resid_lambda", ctypes.c_float),
        ("x0_lambda", ctypes.c_float),
    ]


class _Model(ctypes.Structure):  # struct rows_model
    _fields_ = [
        ("layers", ctypes.c_void_p),
        ("n_layers", ctypes.c_long),
        ("lm_head", ctypes.c_void_p),
        *((name, ctypes.c_long) for name in ("C", "F", "H", "Hkv", "D", "ve_channels", "V")),
        *(
            (name, ctypes.c_float)
            for name in ("ve_scale", "eps", "norm_scale", "norm_eps", "att_scale", "softcap")
        ),
        ("backout_layer", ctypes.c_long),
        ("backout_lambda", ctypes.c_float),
        ("half", ctypes.c_long),
        ("bf16_table", ctypes.c_long),
    ]


class _Cache(ctypes.Structure):  # struct rows_cache
    _fields_ = [
        ("pk", ctypes.c_void_p),
        ("pv", ctypes.c_void_p),
        ("prefix", ctypes.c_long),
        ("sk", ctypes.c_void_p),
        ("sv", ctypes.c_void_p),
        *((name, ctypes.c_long) for name in ("s_layer", "s_row", "pos")),
    ]


@dataclass(frozen=True)
class HalfPanels:
    """An fp16 (in, out) matrix packed in panels of `panel` columns (pack_panels), the
    layout f16_rows reads (F16Rows.pack), so that rows_step reads a compact copy's own
    panels and no second copy is made."""

    panels: torch.Tensor  # flat fp16
    n_in: int
    n_out: int
    panel: int

    @classmethod
    def of(cls, matrix: torch.Tensor, panel: int) -> HalfPanels:
        """An (in, out) matrix's fp16 panels."""
        half = matrix.detach().to(torch.float16)
        return cls(pack_panels(half, panel), matrix.size(0), matrix.size(1), panel)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_in, self.n_out

    def matrix(self) -> torch.Tensor:
        """The (in, out) matrix unpacked to fp32 (for references; whole panels only)."""
        blocks = self.panels.view(self.n_out // self.panel, self.n_in, self.panel)
        return blocks.transpose(0, 1).reshape(self.n_in, self.n_out).float()


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes (N, K) and fp32 scales (N,): row i is codes[i] * scales[i]."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


@dataclass(frozen=True)
class Int8Panels:
    """An int8 (in, out) matrix as rows_step and rows_int8_product read it: one flat int8
    buffer of the `out` fp32 column scales (their bytes) then the codes packed in panels of
    `panel` columns (pack_panels); column j is codes[:, j] * scales[j] (int8_rows of the
    (out, in) weight). One buffer, so the step's structs keep one pointer a matrix."""

    buffer: torch.Tensor  # flat int8
    n_in: int
    n_out: int
    panel: int

    @classmethod
    def of(cls, codes: torch.Tensor, scales: torch.Tensor, panel: int) -> Int8Panels:
        """From int8_rows' codes (out, in) and scales (out,); out whole panels."""
        n_out, n_in = codes.shape
        if n_out % panel:
            raise ValueError(f"int8 panels need whole panels of {panel} columns, not {n_out}")
        scale_bytes = scales.float().contiguous().view(torch.int8)
        return cls(torch.cat([scale_bytes, pack_panels(codes.t(), panel)]), n_in, n_out, panel)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_in, self.n_out

    @property
    def scales(self) -> torch.Tensor:
        return self.buffer[: 4 * self.n_out].view(torch.float32)

    def matrix(self) -> torch.Tensor:
        """The (in, out) matrix the codes and scales stand for, fp32 (for references)."""
        codes = self.buffer[4 * self.n_out :].view(self.n_out // self.panel, self.n_in, self.panel)
        return codes.transpose(0, 1).reshape(self.n_in, self.n_out).float() * self.scales


Matrix = torch.Tensor | HalfPanels | Int8Panels  # what rows_step reads a layer's matrix as


@dataclass
class RowsLayer:
    """One layer as rows_step reads it: each matrix (in, out), contiguous fp32, or fp16 in
    half panels (every matrix of a model the same)."""

    qkv: Matrix  # (C, (H + 2 Hkv) D): c_q, c_k and c_v stacked
    proj: Matrix  # (H D, C)
    fc: Matrix  # (C, F)
    fc_proj: Matrix  # (F, C)
    ve_gate: torch.Tensor | None  # (Hkv, ve_channels)
    ve_table: torch.Tensor | None  # (vocabulary, Hkv D), fp32 or bf16
    window: int
    resid_lambda: float = 1.0
    x0_lambda: float = 0.0

    @property
    def matrices(self) -> tuple[Matrix, ...]:
        return self.qkv, self.proj, self.fc, self.fc_proj


def pack_panels(matrix: torch.Tensor, block: int) -> torch.Tensor:
    """An (in, out) matrix as rows_step's products read it: its columns in panels of
    `block`, each panel's (in, block) contiguous, then the remaining out % block columns
    as one (in, out % block) panel; flat."""
    n_in, out = matrix.shape
    whole = out // block * block
    panels = matrix[:, :whole].reshape(n_in, out // block, block).transpose(0, 1)
    return torch.cat([panels.reshape(-1), matrix[:, whole:].reshape(-1)])


class RowsModel:
    """A model's layers and constants as the kernel reads them, built once (RowsStep.model):
    the structs hold pointers into `layers` and `lm_head`, which this keeps alive."""

    def __init__(
        self,
        struct: _Model,
        layers: list[RowsLayer],
        lm_head: torch.Tensor,
        packed: list[torch.Tensor],
    ) -> None:
        self.struct, self.layers, self.lm_head = struct, layers, lm_head
        self.packed = packed  # the matrices as the kernel reads them (pack_panels)
        self.n_kv_head, self.head_dim = struct.Hkv, struct.D
        self.half = bool(struct.half)  # narrow matrices: fp16 or int8
        self.weights = WEIGHT_KINDS[struct.half]


# What rows_model.half says the matrices are (decode_ops.c's enum narrow).
WEIGHT_KINDS = ("float32", "float16", "int8")


class RowsStep:
    """The loaded rows_step (kernels/decode_ops.c): every layer of a decode step of any
    number of rows, and the vocabulary's products, in one call on `threads` cores."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.rows_step
        fn.restype = ctypes.c_int  # 0, or -1 where it wrote nothing
        fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] + [ctypes.c_void_p] * 5
        fn.argtypes += [ctypes.c_int]
        self._fn = fn
        self.block = int(library.rows_block())  # the columns of a panel (pack_panels)
        # fp16 matrices' panel width (HalfPanels), two a block; 0 where the CPU cannot
        # widen fp16 (no F16C) and the kernel reads fp32 only. int8's (Int8Panels) the
        # same where it reads int8 (AVX2); an earlier revision's library reads none.
        self.half_panel = int(library.rows_half_panel())
        int8_panel = getattr(library, "rows_int8_panel", None)
        self.int8_panel = int(int8_panel()) if int8_panel is not None else 0
        self._int8_product = getattr(library, "rows_int8_product", None)
        if self._int8_product is not None:
            self._int8_product.restype = ctypes.c_int
            self._int8_product.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
            self._int8_product.argtypes += [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
            self._int8_product.argtypes += [ctypes.c_int]
        # The prefix's packing and the softcap alone: an earlier revision's library
        # (scripts/ab_rows_step.py builds them to time `run` on calls packed by this one)
        # may have neither.
        self._pack = getattr(library, "rows_pack_prefix", None)
        if self._pack is not None:
            self._pack.restype = None
            self._pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 6
            self._pack.argtypes += [ctypes.c_void_p] * 2 + [ctypes.c_int]
        self._softcap = getattr(library, "rows_softcap", None)
        if self._softcap is not None:
            self._softcap.restype = None
            self._softcap.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_float]
        self._embed = getattr(library, "rows_embed", None)
        if self._embed is not None:
            self._embed.restype = ctypes.c_int
            self._embed.argtypes = [ctypes.c_void_p] + [ctypes.c_long] * 3 + [ctypes.c_void_p] * 2
            self._embed.argtypes += [ctypes.c_long, ctypes.c_void_p, ctypes.c_long]
            self._embed.argtypes += [ctypes.c_float] * 2 + [ctypes.c_void_p]

    def embeds(self, table: torch.Tensor) -> bool:
        """Whether `embed` reads this token embedding table: contiguous (V, C) fp32 or bf16
        on the CPU (an fp16 table's rows widen through torch's ops)."""
        return (
            self._embed is not None
            and table.device.type == "cpu"
            and table.dim() == 2
            and table.dtype in (torch.float32, torch.bfloat16)
            and table.is_contiguous()
        )

    def embed(
        self,
        table: torch.Tensor,
        ids: torch.Tensor,
        eps: float,
        prev: torch.Tensor | None = None,
        gate: torch.Tensor | None = None,
        smear_lambda: float = 0.0,
    ) -> torch.Tensor:
        """The rows a step starts from (rows, C) fp32: rms_norm(table[ids]), plus, where
        prev (the previous tokens) is given, smear_lambda * sigmoid(x[:, :len(gate)] @ gate)
        * rms_norm(table[prev]) (era E's smear). ids, prev: (rows,) int64; gate fp32.
        The table as `embeds` takes it (checked once by the caller, not here)."""
        rows = ids.size(0)
        if ids.dtype != torch.long or ids.dim() != 1:
            raise ValueError("embed takes one int64 id a row")
        ids = ids.contiguous()
        channels = 0
        if prev is not None:
            if gate is None or gate.dtype != torch.float32 or prev.dtype != torch.long:
                raise ValueError("the smear takes int64 previous tokens and an fp32 gate")
            prev = prev.expand(rows).contiguous()  # one previous token may stand for every row
            gate = gate.contiguous()
            channels = gate.numel()
            if channels > table.size(1):
                raise ValueError("the smear's gate reads more channels than the table has")
        V, C = table.shape
        x = torch.empty(rows, C, dtype=torch.float32)
        failed = self._embed(
            table.data_ptr(), int(table.dtype == torch.bfloat16), V, C, ids.data_ptr(),
            None if prev is None else prev.data_ptr(), rows,
            None if gate is None else gate.data_ptr(), channels, smear_lambda, eps, x.data_ptr(),
        )  # fmt: skip
        if failed:
            raise IndexError(f"a token id outside the embedding table's {V} rows")
        return x

    def pack_prefix(
        self, prefix: tuple[torch.Tensor, torch.Tensor], length: int, threads: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A shared prefix's first `length` keys and values ((layers, 1, T, Hkv, D) caches,
        contiguous fp32: `takes`) as the step reads them, in panels of `block` columns: the
        keys (layers, Hkv, P / block, D, block) for P the length rounded up to whole
        panels, the values (layers, Hkv, Dp / block, length, block) for Dp the head width
        rounded up, zeros in the padding. Made once for many steps: the prefix does not
        change while rows decode over it."""
        if self._pack is None:
            raise ValueError("this rows_step library packs no prefix")
        keys, values = prefix
        layers, _, positions, kv_heads, head_dim = keys.shape
        rows = (kv_heads * head_dim, head_dim, 1)  # each position's heads contiguous
        for c in prefix:
            if c.dtype != torch.float32 or c.dim() != 5 or c.stride()[2:] != rows:
                raise ValueError("the prefix's keys and values: (layers, 1, T, Hkv, D) fp32")
        if values.shape != keys.shape or not 0 < length <= positions:
            raise ValueError(f"a prefix of {length} positions from caches of {positions}")
        b = self.block
        padded, wide = -(-length // b) * b, -(-head_dim // b) * b
        pk = torch.empty(layers, kv_heads, padded // b, head_dim, b, dtype=torch.float32)
        pv = torch.empty(layers, kv_heads, wide // b, length, b, dtype=torch.float32)
        self._pack(
            keys.data_ptr(), values.data_ptr(), layers, keys.stride(0), values.stride(0),
            kv_heads, head_dim, length, pk.data_ptr(), pv.data_ptr(), threads,
        )  # fmt: skip
        return pk, pv

    def int8_product(self, w: Int8Panels, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
        """x (rows, in) fp32 @ an int8 matrix (in, out), its products summed in fp32 on
        `threads` cores: an int8 copy's own products outside a whole step."""
        if not self.int8_panel or self._int8_product is None or w.panel != self.int8_panel:
            raise ValueError(f"rows_step reads no int8 panels of {w.panel} columns here")
        if x.dim() != 2 or x.size(1) != w.n_in:
            raise ValueError(f"an int8 product takes (rows, {w.n_in}), not {tuple(x.shape)}")
        x = x.float().contiguous()
        y = torch.empty(x.size(0), w.n_out, dtype=torch.float32)
        failed = self._int8_product(
            x.data_ptr(), x.size(0), w.n_in, w.buffer.data_ptr(), w.n_out, y.data_ptr(), threads
        )
        if failed:
            raise ValueError(f"rows_int8_product does not take {tuple(x.shape)} @ {w.shape}")
        return y

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        """x = cap * tanh(x) in place, as rows_step finishes its logits (contiguous fp32)."""
        if self._softcap is None:
            raise ValueError("this rows_step library has no softcap of its own")
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError("the softcap takes contiguous fp32")
        self._softcap(x.data_ptr(), x.numel(), cap)
        return x

    def model(
        self,
        layers: list[RowsLayer],
        lm_head: Matrix,
        *,
        n_head: int,
        n_kv_head: int,
        ve_scale: float,
        eps: float,
        norm_scale: float,
        norm_eps: float,
        softcap: float,
        backout_layer: int = -1,
        backout_lambda: float = 0.0,
    ) -> RowsModel:
        """The model as the kernel reads it; a ValueError for matrices it does not take.
        lm_head: (C, V). norm_scale, norm_eps: the qk-norm multiplies each head by
        1 / sqrt(norm_eps + norm_scale * sum(head^2)), which folds in the era's qk scale.
        The matrices: fp32 tensors, packed here; or all HalfPanels of `half_panel` columns,
        or all Int8Panels of `int8_panel` (their widths whole panels), read where they are."""
        matrices = [lm_head] + [t for la in layers for t in la.matrices]
        kind = 2 if isinstance(lm_head, Int8Panels) else int(isinstance(lm_head, HalfPanels))
        name, narrow = ("fp32", "fp16", "int8")[kind], (None, HalfPanels, Int8Panels)[kind]
        panel = (0, self.half_panel, self.int8_panel)[kind]
        tables = [la.ve_table for la in layers if la.ve_table is not None]
        gates = [la.ve_gate for la in layers if la.ve_gate is not None]
        if narrow is not None:
            if not panel:
                raise ValueError(f"rows_step reads no {name} here (the CPU lacks F16C or AVX2)")
            if not all(isinstance(t, narrow) for t in matrices):
                raise ValueError(f"rows_step reads every matrix {name} or every one fp32")
            if any(t.panel != panel or t.n_out % t.panel for t in matrices):
                raise ValueError(f"rows_step reads {name} in whole panels of {panel} columns")
        elif any(
            not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or not t.is_contiguous()
            for t in matrices
        ):
            raise ValueError("rows_step reads contiguous fp32 matrices")
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in gates):
            raise ValueError("rows_step reads contiguous fp32 value-embedding gates")
        bf16_table = bool(tables) and tables[0].dtype == torch.bfloat16
        want = torch.bfloat16 if bf16_table else torch.float32
        if any(t.dtype != want or not t.is_contiguous() for t in tables):
            raise ValueError("rows_step reads contiguous value embeddings, all fp32 or all bf16")
        first = layers[0]
        C, F = first.fc.shape
        D = first.proj.shape[0] // n_head
        width = (n_head + 2 * n_kv_head) * D
        for la in layers:
            shapes = tuple(tuple(t.shape) for t in la.matrices)
            if shapes != ((C, width), (n_head * D, C), (C, F), (F, C)):
                raise ValueError(f"rows_step: a layer's matrices of other shapes {shapes}")
        if lm_head.shape[0] != C or D % 2:
            raise ValueError(f"rows_step: lm_head {tuple(lm_head.shape)}, head width {D}")
        if narrow is HalfPanels:  # the copies' own panels
            packed = {id(t): t.panels for t in matrices}
        elif narrow is Int8Panels:
            packed = {id(t): t.buffer for t in matrices}
        else:
            packed = {id(t): pack_panels(t, self.block) for t in matrices}

        def at(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        structs = (_Layer * len(layers))(
            *(
                _Layer(
                    *(packed[id(t)].data_ptr() for t in la.matrices),
                    at(la.ve_gate),
                    at(la.ve_table),
                    la.window,
                    la.resid_lambda,
                    la.x0_lambda,
                )
                for la in layers
            )
        )
        ve_channels = next((la.ve_gate.size(1) for la in layers if la.ve_gate is not None), 0)
        struct = _Model(
            ctypes.addressof(structs), len(layers), packed[id(lm_head)].data_ptr(),
            C, F, n_head, n_kv_head, D, ve_channels, lm_head.shape[1],
            ve_scale, eps, norm_scale, norm_eps, D**-0.5, softcap,
            backout_layer, backout_lambda, kind, int(bf16_table),
        )  # fmt: skip
        struct.keep = structs
        return RowsModel(struct, layers, lm_head, list(packed.values()))

    def __call__(
        self,
        model: RowsModel,
        x: torch.Tensor,
        ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        prefix: tuple[torch.Tensor, torch.Tensor] | None,
        prefix_len: int,
        suffix: tuple[torch.Tensor, torch.Tensor],
        pos: int,
        threads: int = 1,
    ) -> torch.Tensor:
        """One step: x (rows, C) the normalised embeddings (after the smear), overwritten;
        ids (rows,) int64; cos/sin (D,); prefix: the shared (layers, 1, T, Hkv, D) keys and
        values, their first prefix_len positions attended, or None; suffix: the rows' own
        (layers, rows, Ts, Hkv, D), written at pos - prefix_len. Returns the logits
        (rows, V), the softcap applied (softcap * tanh(logits / softcap)). A
        ValueError for caches not laid out so (`takes`) or tensors of other types."""
        if not self.takes(model, x.size(0), prefix, suffix):
            raise ValueError("rows_step reads contiguous fp32 caches of the model's shape")
        if x.dtype != torch.float32 or not x.is_contiguous() or x.size(1) != model.struct.C:
            raise ValueError("rows_step takes contiguous fp32 rows of the model's width")
        if ids.dtype != torch.long or ids.shape != (x.size(0),):
            raise ValueError("rows_step takes one int64 id a row")
        shared = None
        if prefix is not None and prefix_len > 0:
            shared = self.pack_prefix(prefix, prefix_len, threads)
        return self.run(model, x, ids, cos, sin, shared, prefix_len, suffix, pos, threads)

    @staticmethod
    def takes(
        model: RowsModel,
        rows: int,
        prefix: tuple[torch.Tensor, torch.Tensor] | None,
        suffix: tuple[torch.Tensor, torch.Tensor],
    ) -> bool:
        """Whether the caches are laid out as the kernel reads them through raw pointers:
        contiguous fp32 (layers, rows, positions, Hkv, D), the prefix's of one row."""
        m = model.struct
        for c in list(suffix) + (list(prefix) if prefix is not None else []):
            if c.dtype != torch.float32 or not c.is_contiguous() or c.dim() != 5:
                return False
            if (c.size(0), c.size(3), c.size(4)) != (m.n_layers, m.Hkv, m.D):
                return False
        return suffix[0].size(1) == rows and (prefix is None or prefix[0].size(1) == 1)

    def run(
        self,
        model: RowsModel,
        x: torch.Tensor,
        ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        prefix: tuple[torch.Tensor, torch.Tensor] | None,
        prefix_len: int,
        suffix: tuple[torch.Tensor, torch.Tensor],
        pos: int,
        threads: int,
    ) -> torch.Tensor:
        """__call__ without its checks, for a caller that made them (`takes`) once; prefix
        as its pack_prefix (of prefix_len positions) or None."""
        if prefix is not None and prefix[1].size(3) != prefix_len:  # the kernel trusts it
            raise ValueError(f"a prefix packed for {prefix[1].size(3)} positions, not {prefix_len}")
        m = model.struct
        sk, sv = suffix
        pk, pv = (None, None) if prefix is None else (prefix[0].data_ptr(), prefix[1].data_ptr())
        cache = _Cache(
            pk, pv, prefix_len if prefix is not None else 0,
            sk.data_ptr(), sv.data_ptr(), sk.stride(0), sk.stride(1), pos,
        )  # fmt: skip
        logits = torch.empty(x.size(0), m.V)
        ids = ids.contiguous()  # a column of a (rows, steps) tensor is strided
        args = (x.data_ptr(), x.size(0), ids.data_ptr(), cos.data_ptr(), sin.data_ptr())
        if self._fn(
            ctypes.addressof(m), *args, ctypes.addressof(cache), logits.data_ptr(), threads
        ):
            raise ValueError(f"rows_step does not take {x.size(0)} rows at position {pos}")
        return logits


_reasons: dict[str, str] = {}


def unavailable_reason(kernel: str = "f16_matvec") -> str | None:
    """Why that kernel's function (f16_matvec(), f16_rows(), rows_step(), sample_rows())
    gave None in this process (None when it loaded or was not asked for)."""
    return _reasons.get(kernel)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "chatcli" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path(source: Path = SOURCE, compiler: str = "cc") -> Path:
    """Where the library built from `source` for this CPU is cached: named by a hash of the
    source, the flags, the compiler and the CPU's features, so a change to any rebuilds."""
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(FLAGS).encode(), compiler.encode()):
        key.update(part)
    key.update(_cpu_flags().encode())
    return cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"


def build(source: Path = SOURCE, compiler: str = "cc") -> Path:
    """Compile `source` into the cache (once; later calls find it). Raises RuntimeError with
    the compiler's message when it cannot."""
    target = library_path(source, compiler)
    if target.exists():
        return target
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler ({compiler}) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place, so a reader never sees half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, str(source), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
            raise RuntimeError(next((ln for ln in lines if "error" in ln), lines[-1]))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _check(kernel: F16Matvec) -> None:
    """The kernel against torch on a small random matrix: a library that answers wrongly is
    not used (RuntimeError)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(kernel.rows * 24, kernel.step * 10, generator=g).half()
    x = torch.randn(weight.size(1), generator=g)
    want = weight.float() @ x
    got = kernel(weight, x)
    if not torch.allclose(got, want, atol=1e-4, rtol=1e-4):
        raise RuntimeError("f16_matvec disagrees with torch on a test matrix")


def _load(kernel: str, source: Path, needs_avx512: bool) -> ctypes.CDLL | None:
    """The library built from `source`, or None with the reason kept for `kernel`."""
    _reasons.pop(kernel, None)
    reason = None
    if os.environ.get("CHATCLI_NATIVE_KERNELS", "1") == "0":
        reason = "turned off by CHATCLI_NATIVE_KERNELS=0"
    elif needs_avx512 and platform.machine() not in ("x86_64", "AMD64"):
        reason = f"written for x86-64, this is {platform.machine()}"
    elif needs_avx512 and torch.backends.cpu.get_cpu_capability() != "AVX512":
        reason = "written for AVX-512, which this CPU lacks"
    if reason is None:
        try:
            return ctypes.CDLL(str(build(source)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            reason = f"could not build or load {source.name}: {e}"
    _reasons[kernel] = reason
    return None


def _check_f16_rows(kernel: F16Rows) -> None:
    """The kernel against torch for every row count it takes (RuntimeError if it differs)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(kernel.panel * 6, 40, generator=g).half()
    panels = kernel.pack(weight)
    for rows in range(1, kernel.max_rows + 1):
        x = torch.randn(rows, weight.size(1), generator=g)
        if not torch.allclose(kernel(panels, x, weight.size(0)), x @ weight.float().t(),
                              atol=1e-4, rtol=1e-4):  # fmt: skip
            raise RuntimeError(f"f16_rows disagrees with torch for {rows} rows")


Kernel = TypeVar("Kernel", F16Matvec, F16Rows, RowsStep, SampleRows)


def _checked(
    name: str,
    source: Path,
    wrap: Callable[[ctypes.CDLL], Kernel],
    check: Callable[[Kernel], None],
    needs_avx512: bool,
) -> Kernel | None:
    """The library's kernel once `check` passed, or None with the reason kept for `name`."""
    library = _load(name, source, needs_avx512)
    if library is None:
        return None
    kernel = wrap(library)
    try:
        check(kernel)
    except RuntimeError as e:
        _reasons[name] = str(e)
        return None
    return kernel


@functools.cache
def f16_matvec() -> F16Matvec | None:
    """The compiled, checked kernel, or None where it cannot run here (unavailable_reason)."""
    return _checked("f16_matvec", SOURCE, F16Matvec, _check, needs_avx512=True)


@functools.cache
def f16_rows() -> F16Rows | None:
    """The compiled, checked kernel, or None where it cannot run here (unavailable_reason):
    x86 with AVX2, F16C and FMA, or AVX-512."""
    return _checked("f16_rows", F16_ROWS_SOURCE, F16Rows, _check_f16_rows, needs_avx512=False)


def _rope_norm(
    heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm_scale: float, norm_eps: float
) -> torch.Tensor:
    """Rotary embedding then the qk-norm of (..., D) heads, as the kernels compute them."""
    half = heads.size(-1) // 2
    x1, x2 = heads[..., :half], heads[..., half:]
    rotated = torch.cat([x1 * cos[:half] + x2 * sin[:half], x2 * cos[half:] - x1 * sin[half:]], -1)
    return rotated * torch.rsqrt(norm_eps + norm_scale * rotated.square().sum(-1, keepdim=True))


def _reference_rows_step(
    model: RowsModel,
    x: torch.Tensor,
    ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    prefix: tuple[torch.Tensor, torch.Tensor],
    prefix_len: int,
    suffix: tuple[torch.Tensor, torch.Tensor],
    pos: int,
) -> torch.Tensor:
    """rows_step in torch ops, x and the suffix written in place (the load check's answer)."""
    m = model.struct
    N, H, Hkv, D = x.size(0), m.H, m.Hkv, m.D
    at = pos - prefix_len

    def scales(t: torch.Tensor) -> torch.Tensor:
        return torch.rsqrt(t.square().mean(-1, keepdim=True) + m.eps)

    def dense(t: Matrix) -> torch.Tensor:
        return t.matrix() if isinstance(t, HalfPanels | Int8Panels) else t

    x0, saved = x.clone(), None
    for i, la in enumerate(model.layers):
        x.mul_(la.resid_lambda).add_(x0, alpha=la.x0_lambda)
        s = scales(x)
        qkv = (x @ dense(la.qkv)) * s
        q_k = qkv[:, : (H + Hkv) * D].view(N, H + Hkv, D)
        heads = _rope_norm(q_k, cos, sin, m.norm_scale, m.norm_eps)
        v = qkv[:, (H + Hkv) * D :].view(N, Hkv, D)
        if la.ve_table is not None:
            gate = torch.sigmoid((x[:, : m.ve_channels] @ la.ve_gate.t()) * s)
            v = v + m.ve_scale * gate.unsqueeze(-1) * la.ve_table[ids].float().view(N, Hkv, D)
        suffix[0][i, :, at], suffix[1][i, :, at] = heads[:, H:], v
        start = max(0, pos - la.window)
        keys = torch.cat(
            [prefix[0][i, :, start:prefix_len].expand(N, -1, -1, -1),
             suffix[0][i, :, max(0, start - prefix_len) : at + 1]], 1,
        )  # fmt: skip
        values = torch.cat(
            [prefix[1][i, :, start:prefix_len].expand(N, -1, -1, -1),
             suffix[1][i, :, max(0, start - prefix_len) : at + 1]], 1,
        )  # fmt: skip
        keys, values = keys.repeat_interleave(H // Hkv, 2), values.repeat_interleave(H // Hkv, 2)
        scores = torch.einsum("nhd,nthd->nht", heads[:, :H], keys) * m.att_scale
        y = torch.einsum("nht,nthd->nhd", scores.softmax(-1), values).reshape(N, H * D)
        x += y @ dense(la.proj)
        u = (torch.relu(x @ dense(la.fc)) * scales(x)).square()
        x += u @ dense(la.fc_proj)
        if i == m.backout_layer:
            saved = x.clone()
    if saved is not None:
        x -= m.backout_lambda * saved
    return m.softcap * torch.tanh((x @ dense(model.lm_head)) * scales(x) / m.softcap)


def rows_step_errors(
    kernel: RowsStep,
    *,
    rows: int = 3,
    heads: tuple[int, int] = (4, 2),
    head_dim: int = 16,
    widths: tuple[int, int, int] = (64, 128, 100),
    prompt: int | None = 7,
    pos: int = 9,
    windows: tuple[int, ...] = (100, 2),
    threads: int = 2,
    seed: int = 0,
    half: bool = False,
    int8: bool = False,
    bf16_table: bool = False,
) -> list[float]:
    """The largest differences between the kernel and _reference_rows_step on a random
    model (the logits, then the keys and values written): the load check, and the tests'.

    heads: (H, Hkv); widths: (model, MLP, vocabulary); prompt: the shared prefix's length,
    or None for rows without one; windows: one layer each, the first with value embeddings,
    a short one leaving the prompt. The defaults take both of the products' loops (whole
    blocks of the widest vectors' 32 columns and a vocabulary of 100). half: the matrices
    fp16 in half panels, the vocabulary rounded up to whole panels (104 with 8 lanes: 6
    blocks and a panel without a pair); int8: the matrices int8 (Int8Panels), the
    vocabulary rounded up so too, the reference reading the matrices they stand for;
    bf16_table: the value embeddings bf16."""
    g = torch.Generator().manual_seed(seed)
    (H, Hkv), D, (C, F, V), N = heads, head_dim, widths, rows
    panel = kernel.int8_panel if int8 else kernel.half_panel
    if half or int8:
        V = -(-V // panel) * panel
    P, L = prompt or 0, len(windows)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * shape[0] ** -0.5

    def weights(*shape: int) -> Matrix:
        w = rand(*shape)
        if int8:
            return Int8Panels.of(*int8_rows(w.t()), panel)
        return HalfPanels.of(w, panel) if half else w

    table_dtype = torch.bfloat16 if bf16_table else torch.float32
    layers = [
        RowsLayer(
            weights(C, (H + 2 * Hkv) * D),
            weights(H * D, C),
            weights(C, F),
            weights(F, C),
            rand(Hkv, 8) if i == 0 else None,
            rand(V, Hkv * D).to(table_dtype) if i == 0 else None,
            window=window,
            resid_lambda=0.9,
            x0_lambda=0.2,
        )
        for i, window in enumerate(windows)
    ]
    model = kernel.model(
        layers, weights(C, V), n_head=H, n_kv_head=Hkv, ve_scale=3.0, eps=1e-6,
        norm_scale=1.44 / D, norm_eps=1e-6, softcap=15.0, backout_layer=0, backout_lambda=0.3,
    )  # fmt: skip
    x, ids = torch.randn(N, C, generator=g), torch.randint(0, V, (N,), generator=g)
    cos, sin = torch.rand(D, generator=g), torch.rand(D, generator=g)
    prefix = tuple(torch.randn(L, 1, P + 3, Hkv, D, generator=g) for _ in range(2))
    suffix = tuple(torch.randn(L, N, pos - P + 2, Hkv, D, generator=g) for _ in range(2))
    mine, my_suffix = x.clone(), tuple(t.clone() for t in suffix)
    want = _reference_rows_step(model, x, ids, cos, sin, prefix, P, suffix, pos)
    shared = prefix if prompt is not None else None
    got = kernel(model, mine, ids, cos, sin, shared, P, my_suffix, pos, threads=threads)
    pairs = ((got, want), (my_suffix[0], suffix[0]), (my_suffix[1], suffix[1]))
    return [(a - b).abs().max().item() for a, b in pairs]


def reference_embed(
    table: torch.Tensor,
    ids: torch.Tensor,
    eps: float,
    prev: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    smear_lambda: float = 0.0,
) -> torch.Tensor:
    """RowsStep.embed in torch's ops, as the model's forward embeds a continuing token."""
    x = F.rms_norm(table[ids].float(), (table.size(1),), eps=eps)
    if prev is None or gate is None:
        return x
    before = F.rms_norm(table[prev].float(), (table.size(1),), eps=eps)
    weight = smear_lambda * torch.sigmoid(x[:, : gate.numel()] @ gate)
    return x + weight.unsqueeze(1) * before


def embed_errors(kernel: RowsStep, *, bf16: bool = False, rows: int = 5, seed: int = 0) -> float:
    """The largest difference between RowsStep.embed and reference_embed on a random table,
    with and without the smear (a previous token for every row, and one for all)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(50, 40, generator=g).to(torch.bfloat16 if bf16 else torch.float32)
    ids = torch.randint(0, 50, (rows,), generator=g)
    prev = torch.randint(0, 50, (rows,), generator=g)
    gate = torch.randn(24, generator=g) * 0.3
    worst = 0.0
    for p in (None, prev, prev[:1]):
        got = kernel.embed(table, ids, 1e-6, p, gate if p is not None else None, 0.7)
        want = reference_embed(table, ids, 1e-6, p, gate if p is not None else None, 0.7)
        worst = max(worst, (got - want).abs().max().item())
    return worst


def _check_rows_step(kernel: RowsStep) -> None:
    """The kernel against torch on a random model, with fp16 and int8 matrices too where it
    reads them: a library that answers wrongly any way is not used (RuntimeError)."""
    if max(rows_step_errors(kernel)) > 1e-4:
        raise RuntimeError("rows_step disagrees with torch on a test model")
    has_embed = kernel.embeds(torch.empty(1, 1))  # an earlier revision's build may not
    if has_embed and max(embed_errors(kernel), embed_errors(kernel, bf16=True)) > 1e-5:
        raise RuntimeError("rows_step's embed disagrees with torch")
    if kernel.half_panel and max(rows_step_errors(kernel, rows=1, half=True)) > 1e-4:
        raise RuntimeError("rows_step disagrees with torch on a test model of fp16 matrices")
    if kernel.int8_panel and max(rows_step_errors(kernel, rows=1, int8=True)) > 1e-4:
        raise RuntimeError("rows_step disagrees with torch on a test model of int8 matrices")


@functools.cache
def rows_step() -> RowsStep | None:
    """The compiled, checked kernel, or None where it cannot run here (unavailable_reason)."""
    return _checked("rows_step", DECODE_OPS_SOURCE, RowsStep, _check_rows_step, needs_avx512=False)


def _check_sample_rows(kernel: SampleRows) -> None:
    """The kernel against reference_sample on random rows, for each kind of restriction: a
    library that chooses otherwise is not used (RuntimeError)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 1000, generator=g) * 3
    u = torch.rand(32, 1, generator=g)
    for temperature, top_k, top_p in [(1.0, None, None), (0.6, 50, None), (0.8, 40, 0.9)]:
        got = kernel(logits, temperature, top_k, top_p, u)
        if got is None or not torch.equal(
            got, reference_sample(logits, temperature, top_k, top_p, u)
        ):
            raise RuntimeError(
                f"sample_rows disagrees with torch at temperature {temperature}, top-k {top_k}, "
                f"top-p {top_p}"
            )


@functools.cache
def sample_rows() -> SampleRows | None:
    """The compiled, checked kernel, or None where it cannot run here (unavailable_reason)."""
    return _checked(
        "sample_rows", DECODE_OPS_SOURCE, SampleRows, _check_sample_rows, needs_avx512=False
    )
