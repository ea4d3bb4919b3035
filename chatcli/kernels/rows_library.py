"""The rows_step library: a model's whole decode step, one row or several, in one call.

Owns: the wrapper of decode_ops.c's rows_step (every layer and the vocabulary's products of
any number of rows, sample rows over a shared prompt included, or rows of independent
sequences each in its own slot of the cache at its own position; a small model's fp32
matrices, or a big one's fp16 or int8 copies read from their panels), the model and caches
as its structs hold them (RowsModel, RowsLayer), its helpers (the rows' embedding, a shared
prompt's packing, an int8 product, the softcap). rows_step.py gives the compiled library,
checked against rows_step_reference.py's torch arithmetic. Any CPU with a
C compiler; fp16 and int8 where it widens them (lanes.h: x86 with F16C, AVX2 for int8;
every ARM64).

Past 500 lines on purpose: one kernel's wrapper, whose structs mirror decode_ops.c's field by
field; split apart, the halves would have to be read side by side with the C anyway.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from chatcli.kernels.build import KERNELS_DIR
from chatcli.kernels.panels import HalfPanels, Int4Panels, Int8Panels, Matrix, pack_panels

DECODE_OPS_SOURCE = KERNELS_DIR / "decode_ops.c"


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
        self.half = bool(struct.half)  # narrow matrices: fp16, int8 or int4
        self.weights = WEIGHT_KINDS[struct.half]


def _compact_product_call(library: ctypes.CDLL, name: str) -> Any:
    """rows_int8_product or rows_int4_product, typed: (x, rows, in, w, out, y, threads) ->
    0 or -1; None where an earlier revision's library has none."""
    call = getattr(library, name, None)
    if call is not None:
        call.restype = ctypes.c_int
        call.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
        call.argtypes += [ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
    return call


# What rows_model.half says the matrices are (decode_ops.c's enum narrow).
WEIGHT_KINDS = ("float32", "float16", "int8", "int4")


class RowsStep:
    """The loaded rows_step (kernels/decode_ops.c): every layer of a decode step of any
    number of rows, and the vocabulary's products, in one call on `threads` cores."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.rows_step
        fn.restype = ctypes.c_int  # 0, or -1 where it wrote nothing
        fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] + [ctypes.c_void_p] * 5
        fn.argtypes += [ctypes.c_int]
        self._fn = fn
        # Rows of independent sequences (rows_step_slots); an earlier revision has none.
        self._slots = getattr(library, "rows_step_slots", None)
        if self._slots is not None:
            self._slots.restype = ctypes.c_int
            self._slots.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long]
            self._slots.argtypes += [ctypes.c_void_p] * 5 + [ctypes.c_long]
            self._slots.argtypes += [ctypes.c_void_p] * 2 + [ctypes.c_long, ctypes.c_void_p]
            self._slots.argtypes += [ctypes.c_int]
        self.block = int(library.rows_block())  # the columns of a panel (pack_panels)
        # fp16 matrices' panel width (HalfPanels), two a block; 0 where the CPU cannot
        # widen fp16 (no F16C) and the kernel reads fp32 only. int8's (Int8Panels) the
        # same where it reads int8 (AVX2); an earlier revision's library reads none.
        self.half_panel = int(library.rows_half_panel())
        int8_panel = getattr(library, "rows_int8_panel", None)
        self.int8_panel = int(int8_panel()) if int8_panel is not None else 0
        # The inputs an int8 panel interleaves (Int8Panels.interleave): 4 where the kernel
        # multiplies in integer dot products (AVX-512 VNNI, AVX-VNNI, aarch64's sdot).
        interleave = getattr(library, "rows_int8_interleave", None)
        self.int8_interleave = int(interleave()) if interleave is not None else 1
        # int4's (Int4Panels) where the CPU has integer dot products; 0 elsewhere.
        int4_panel = getattr(library, "rows_int4_panel", None)
        self.int4_panel = int(int4_panel()) if int4_panel is not None else 0
        self._int4_product = _compact_product_call(library, "rows_int4_product")
        self._int8_product = _compact_product_call(library, "rows_int8_product")
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
        * rms_norm(table[prev]) (era E's smear; -1: a sequence's first token, none). ids,
        prev: (rows,) int64; gate fp32.
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
        if w.interleave != self.int8_interleave:
            raise ValueError(
                f"rows_step reads int8 panels interleaving {self.int8_interleave} inputs here,"
                f" not {w.interleave}"
            )
        return self._compact_product("int8", self._int8_product, w, x, threads)

    def int4_product(self, w: Int4Panels, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
        """x (rows, in) fp32 @ an int4 matrix (in, out) on `threads` cores: an int4 copy's
        own products outside a whole step."""
        if not self.int4_panel or self._int4_product is None or w.panel != self.int4_panel:
            raise ValueError(f"rows_step reads no int4 panels of {w.panel} columns here")
        return self._compact_product("int4", self._int4_product, w, x, threads)

    @staticmethod
    def _compact_product(
        kind: str, call: Any, w: Int8Panels | Int4Panels, x: torch.Tensor, threads: int
    ) -> torch.Tensor:
        """x @ w through the library's rows_{kind}_product (its layout already checked)."""
        if x.dim() != 2 or x.size(1) != w.n_in:
            raise ValueError(f"an {kind} product takes (rows, {w.n_in}), not {tuple(x.shape)}")
        x = x.float().contiguous()
        y = torch.empty(x.size(0), w.n_out, dtype=torch.float32)
        failed = call(
            x.data_ptr(), x.size(0), w.n_in, w.buffer.data_ptr(), w.n_out, y.data_ptr(), threads
        )
        if failed:
            raise ValueError(f"rows_{kind}_product does not take {tuple(x.shape)} @ {w.shape}")
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
        or all Int8Panels of `int8_panel`, or all Int4Panels of `int4_panel` (their widths
        whole panels), read where they are."""
        matrices = [lm_head] + [t for la in layers for t in la.matrices]
        narrows = (None, HalfPanels, Int8Panels, Int4Panels)
        kind = next((i for i, n in enumerate(narrows) if n and isinstance(lm_head, n)), 0)
        name, narrow = ("fp32", "fp16", "int8", "int4")[kind], narrows[kind]
        panel = (0, self.half_panel, self.int8_panel, self.int4_panel)[kind]
        tables = [la.ve_table for la in layers if la.ve_table is not None]
        gates = [la.ve_gate for la in layers if la.ve_gate is not None]
        if narrow is not None:
            if not panel:
                raise ValueError(
                    f"rows_step reads no {name} here (an x86 without F16C or AVX2; int4: a CPU"
                    " without integer dot products)"
                )
            if not all(isinstance(t, narrow) for t in matrices):
                raise ValueError(f"rows_step reads every matrix {name} or every one fp32")
            if any(t.panel != panel or t.n_out % t.panel for t in matrices):
                raise ValueError(f"rows_step reads {name} in whole panels of {panel} columns")
            if narrow is Int8Panels and any(t.interleave != self.int8_interleave for t in matrices):
                raise ValueError(
                    f"rows_step reads int8 panels interleaving {self.int8_interleave} inputs"
                )
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
        elif narrow in (Int8Panels, Int4Panels):
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

    @property
    def has_slots(self) -> bool:
        """Whether the library steps rows of independent sequences (`run_slots`)."""
        return self._slots is not None

    @staticmethod
    def takes_slots(model: RowsModel, cache: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether `run_slots` reads these (layers, slots, T, Hkv, D) keys and values:
        contiguous fp32 of the model's shape."""
        return all(
            c.dtype == torch.float32
            and c.is_contiguous()
            and c.dim() == 5
            and (c.size(0), c.size(3), c.size(4))
            == (model.struct.n_layers, model.struct.Hkv, model.struct.D)
            for c in cache
        )

    def run_slots(
        self,
        model: RowsModel,
        x: torch.Tensor,
        ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        threads: int = 1,
        out: list[int] | None = None,
    ) -> torch.Tensor:
        """One step of rows that are independent sequences: row n in slot slots[n] of the
        (layers, slots, T, Hkv, D) keys and values `cache` (`takes_slots`), at position
        positions[n], where its key and value are written and up to which it attends.
        Rows may share a slot (a prompt's tokens, at consecutive positions: each attends
        those before it), never a slot and a position. x (rows, C) as for __call__ (a
        sequence's first token unsmeared: embed's -1), overwritten; cos/sin (rows, D) each
        row's tables; slots, positions (rows,) int64. Returns the logits (len(out), V) of
        the rows `out` names (None: every row; [] none, a prompt's chunk that does not end
        it), the softcap applied."""
        if self._slots is None:
            raise ValueError("this rows_step library steps no rows in slots")
        rows = x.size(0)
        if x.dtype != torch.float32 or not x.is_contiguous() or x.size(1) != model.struct.C:
            raise ValueError("rows_step takes contiguous fp32 rows of the model's width")
        for t in (ids, slots, positions):
            if t.dtype != torch.long or t.shape != (rows,):
                raise ValueError("rows_step_slots takes one int64 id, slot and position a row")
        for t in (cos, sin):
            if t.dtype != torch.float32 or t.shape != (rows, model.struct.D):
                raise ValueError("rows_step_slots takes fp32 rotary tables (rows, D)")
        k, v = cache
        if not self.takes_slots(model, cache) or k.shape != v.shape:
            raise ValueError("rows_step reads contiguous fp32 caches of the model's shape")
        # The kernel trusts these: a slot or position outside the cache would be written.
        slot_list, pos_list = slots.tolist(), positions.tolist()
        if not all(0 <= s < k.size(1) for s in slot_list):
            raise ValueError(f"rows_step_slots: slots {slot_list} of a cache of {k.size(1)}")
        if not all(0 <= p < k.size(2) for p in pos_list):
            raise ValueError(f"rows_step_slots: positions {pos_list} of a cache of {k.size(2)}")
        if len(set(zip(slot_list, pos_list, strict=True))) != rows:
            raise ValueError("rows_step_slots: two rows at one slot and position")
        if out is not None and not all(0 <= i < rows for i in out):
            raise ValueError(f"rows_step_slots: logits of rows {out} of {rows}")
        chained = len(set(slot_list)) != rows
        m = model.struct
        cache_struct = _Cache(
            None, None, 0, k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), 0
        )
        n_out = rows if out is None else len(out)
        out_rows = None if out is None else torch.tensor(out, dtype=torch.long)
        logits = torch.empty(n_out, m.V)
        ids, slots, positions = ids.contiguous(), slots.contiguous(), positions.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        failed = self._slots(
            ctypes.addressof(m), x.data_ptr(), rows, ids.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), slots.data_ptr(), positions.data_ptr(), int(chained),
            ctypes.addressof(cache_struct), None if out_rows is None else out_rows.data_ptr(),
            n_out, logits.data_ptr(), threads,
        )  # fmt: skip
        if failed:
            raise ValueError(f"rows_step_slots does not take {rows} rows at {pos_list}")
        return logits
