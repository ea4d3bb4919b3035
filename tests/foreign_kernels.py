"""The kernels built for another CPU and checked here: their calls replayed by
kernel_harness.c under an emulator, behind the kernels' own Python wrappers.

Owns: building the harness with the kernels for a target (a cross compiler, -static, so
qemu-user needs no target libraries), the record format it reads and writes, and Foreign*
wrappers (subclasses of the real ones) whose calls go through it, so the very load checks
chatcli runs at startup (check_rows_step, check_f16_rows, ...) hold the foreign build to
the same torch references.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import torch

from chatcli.kernels.build import KERNELS_DIR
from chatcli.kernels.f16_matvec import F16Matvec
from chatcli.kernels.f16_rows import F16Rows
from chatcli.kernels.panels import HalfPanels, Int4Panels, Int8Panels, Matrix, pack_panels
from chatcli.kernels.rows_step import RowsModel, RowsStep
from chatcli.kernels.sample_rows import SampleRows

HARNESS_SOURCE = Path(__file__).with_name("kernel_harness.c")
CALL_TIMEOUT_S = 120

Arg = str | int | float | torch.Tensor | None


def build_harness(compiler: str, flags: tuple[str, ...], target: Path, half: bool = True) -> Path:
    """The harness and every kernel compiled by `compiler` with `flags` into `target`,
    statically linked (without f16_rows.c and f16_matvec.c where `half` is False: a CPU that
    widens no fp16). RuntimeError with the compiler's message where it fails."""
    command = [compiler, "-O3", *flags, "-static", "-I", str(KERNELS_DIR), str(HARNESS_SOURCE)]
    if half:
        command += [str(KERNELS_DIR / "f16_rows.c"), str(KERNELS_DIR / "f16_matvec.c")]
    done = subprocess.run([*command, "-o", str(target), "-lm"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
    return target


def _record(arg: Arg) -> bytes:
    if arg is None:
        data = b""
    elif isinstance(arg, str):
        data = arg.encode()
    elif isinstance(arg, int):
        data = struct.pack("<q", arg)
    elif isinstance(arg, float):
        data = struct.pack("<d", arg)
    else:
        data = arg.detach().contiguous().view(torch.uint8).numpy().tobytes()
    return struct.pack("<Q", len(data)) + data


def _records(data: bytes) -> list[bytes]:
    out, at = [], 0
    while at < len(data):
        (n,) = struct.unpack_from("<Q", data, at)
        out.append(data[at + 8 : at + 8 + n])
        at += 8 + n
    return out


def _tensor(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape).clone()


def _integer(data: bytes) -> int:
    return struct.unpack("<q", data)[0]


class Harness:
    """One built harness, run as `program` (e.g. ["qemu-aarch64", path]) once a call."""

    def __init__(self, program: list[str]) -> None:
        self.program = program
        layout = [_integer(r) for r in self.call("layout")]
        self.block, self.half_panel, self.int8_panel = layout[:3]
        self.rows_panel, self.rows_max, self.matvec_rows, self.matvec_step = layout[3:7]
        self.int8_interleave, self.int4_panel = layout[7:9]

    def call(self, name: str, *args: Arg) -> list[bytes]:
        """The harness's answer records to the call `name` with `args`."""
        data = b"".join(_record(a) for a in (name, *args))
        done = subprocess.run(self.program, input=data, capture_output=True, timeout=CALL_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"the harness failed {name}: {done.stderr.decode().strip()}")
        return _records(done.stdout)


class ForeignF16Matvec(F16Matvec):
    def __init__(self, harness: Harness) -> None:
        self.harness, self.rows, self.step = harness, harness.matvec_rows, harness.matvec_step

    def __call__(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        n, k = weight.shape
        (y,) = self.harness.call("f16_matvec", x.float(), weight.half(), n, k, 2)
        return _tensor(y, torch.float32, (n,))


class ForeignF16Rows(F16Rows):
    def __init__(self, harness: Harness) -> None:
        self.harness, self.panel, self.max_rows = harness, harness.rows_panel, harness.rows_max

    def __call__(self, panels: torch.Tensor, x: torch.Tensor, out: int) -> torch.Tensor:
        rows, k = x.shape
        (y,) = self.harness.call("f16_rows", x.float(), rows, panels, out, k, 2)
        return _tensor(y, torch.float32, (rows, out))


class ForeignSampleRows(SampleRows):
    def __init__(self, harness: Harness) -> None:
        self.harness = harness

    def __call__(
        self,
        logits: torch.Tensor,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        u: torch.Tensor,
    ) -> torch.Tensor | None:
        rows, V = logits.shape
        status, out = self.harness.call(
            "sample_rows", logits.float(), rows, V, float(temperature), top_k or 0,
            float(top_p) if top_p is not None else 1.0, u.float(),
        )  # fmt: skip
        return None if _integer(status) else _tensor(out, torch.long, (rows, 1))


class ForeignRowsStep(RowsStep):
    """RowsStep whose model structs are the real ones' (model()), every call replayed."""

    def __init__(self, harness: Harness) -> None:
        self.harness = harness
        self.block, self.half_panel, self.int8_panel = (
            harness.block,
            harness.half_panel,
            harness.int8_panel,
        )
        self.int8_interleave, self.int4_panel = harness.int8_interleave, harness.int4_panel

    @property
    def has_slots(self) -> bool:
        return True

    def embeds(self, table: torch.Tensor) -> bool:
        return table.dim() == 2 and table.dtype in (torch.float32, torch.bfloat16)

    def _matrix(self, t: Matrix) -> torch.Tensor:
        if isinstance(t, HalfPanels):
            return t.panels
        if isinstance(t, Int8Panels | Int4Panels):
            return t.buffer
        return pack_panels(t, self.block)

    def _model(self, model: RowsModel) -> list[Arg]:
        m = model.struct
        args: list[Arg] = [m.n_layers, m.C, m.F, m.H, m.Hkv, m.D, m.ve_channels, m.V]
        args += [m.ve_scale, m.eps, m.norm_scale, m.norm_eps, m.att_scale, m.softcap]
        args += [m.backout_layer, m.backout_lambda, m.half, m.bf16_table]
        args.append(self._matrix(model.lm_head))
        for la in model.layers:
            args += [self._matrix(t) for t in la.matrices]
            args += [la.ve_gate, la.ve_table, la.window, la.resid_lambda, la.x0_lambda]
        return args

    def embed(
        self,
        table: torch.Tensor,
        ids: torch.Tensor,
        eps: float,
        prev: torch.Tensor | None = None,
        gate: torch.Tensor | None = None,
        smear_lambda: float = 0.0,
    ) -> torch.Tensor:
        rows, (V, C) = ids.size(0), table.shape
        prev = None if prev is None else prev.expand(rows)
        status, x = self.harness.call(
            "embed", table, int(table.dtype == torch.bfloat16), V, C, ids, prev, rows, gate,
            0 if gate is None else gate.numel(), float(smear_lambda), float(eps),
        )  # fmt: skip
        if _integer(status):
            raise IndexError(f"a token id outside the embedding table's {V} rows")
        return _tensor(x, torch.float32, (rows, C))

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
        rows, sk = x.size(0), suffix[0]
        k, v = prefix if prefix is not None and prefix_len > 0 else (None, None)
        status, logits, x_out, k_out, v_out = self.harness.call(
            "rows_step", *self._model(model), x, rows, ids, cos, sin, k, v, prefix_len,
            0 if k is None else k.stride(0), sk, suffix[1], sk.stride(0), sk.stride(1), pos,
            threads,
        )  # fmt: skip
        if _integer(status):
            raise ValueError(f"rows_step does not take {rows} rows at position {pos}")
        x.copy_(_tensor(x_out, torch.float32, tuple(x.shape)))
        suffix[0].copy_(_tensor(k_out, torch.float32, tuple(sk.shape)))
        suffix[1].copy_(_tensor(v_out, torch.float32, tuple(sk.shape)))
        return _tensor(logits, torch.float32, (rows, model.struct.V))

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
        rows, k = x.size(0), cache[0]
        n_out = rows if out is None else len(out)
        chained = int(len(set(slots.tolist())) != rows)
        out_rows = None if out is None else torch.tensor(out, dtype=torch.long)
        status, logits, k_out, v_out = self.harness.call(
            "rows_step_slots", *self._model(model), x, rows, ids, cos, sin, slots, positions,
            chained, k, cache[1], k.stride(0), k.stride(1), out_rows, n_out, threads,
        )  # fmt: skip
        if _integer(status):
            raise ValueError(f"rows_step_slots does not take {rows} rows")
        cache[0].copy_(_tensor(k_out, torch.float32, tuple(k.shape)))
        cache[1].copy_(_tensor(v_out, torch.float32, tuple(k.shape)))
        return _tensor(logits, torch.float32, (n_out, model.struct.V))
