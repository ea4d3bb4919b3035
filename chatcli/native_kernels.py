"""Kernels of our own in C, compiled on this machine at first use and loaded with ctypes.

Owns: building the shipped C sources (chatcli/kernels/) with the system's C compiler for
this CPU (-march=native), caching the libraries, checking each against torch once per
process, and calling them. Two kernels:
- f16_matvec: one fp32 row times an fp16 matrix, which batch-1 decode of a big model spends
  ~90% of its time in (quantize.Fp16Weight). AVX-512 only, the CPU it was measured on.
- attend_one_row: rotary, qk-norm, the cache write and the attention of one layer of a
  small model's one-row decode step (decode_step), ~20 torch ops in one call. Plain C.

Why compile at run time: the fastest loop depends on the CPU's vector width, and a wheel
built elsewhere cannot know it; a C file with no torch headers compiles in under a second.
Why not always: it needs a C compiler, and any failure (no compiler, another CPU, a wrong
answer at the check) leaves chatcli on torch's ops, with the reason in
`unavailable_reason(kernel)`. CHATCLI_NATIVE_KERNELS=0 turns both off. Knows nothing about
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
from pathlib import Path
from typing import TypeVar

import torch

KERNELS_DIR = Path(__file__).parent / "kernels"
SOURCE = KERNELS_DIR / "f16_matvec.c"
DECODE_OPS_SOURCE = KERNELS_DIR / "decode_ops.c"
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
OPENMP = ("-fopenmp",)  # only for a source that runs OpenMP loops (f16_matvec)
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


class AttendOneRow:
    """The loaded attend_one_row (kernels/decode_ops.c); called with data pointers, as a
    decode step calls it ~6-30 times a token and a tensor argument costs a conversion."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.attend_one_row
        fn.restype = ctypes.c_int  # 0, or -1 where it wrote nothing
        fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_long] * 5 + [ctypes.c_float] * 3
        self.call = fn

    def __call__(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_layer: torch.Tensor,
        v_layer: torch.Tensor,
        pos: int,
        start: int,
        norm_scale: float,
        norm_eps: float,
    ) -> torch.Tensor:
        """Tensors in their shapes, for tests and the load check: qk (Hq+Hkv, D), v (Hkv,
        D), cos/sin (D,), k_layer/v_layer (T, Hkv, D), all contiguous fp32 -> y (Hq, D)."""
        n_kv, d = v.shape
        n_q = qk.size(0) - n_kv
        tensors = (qk, v, cos, sin, k_layer, v_layer)
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
            raise ValueError("attend_one_row takes contiguous fp32 tensors")
        y = torch.empty(n_q, d)
        ptrs = [t.data_ptr() for t in tensors]
        args = (n_q, n_kv, d, pos, start, norm_scale, norm_eps, d**-0.5)
        if self.call(*ptrs, y.data_ptr(), *args) != 0:
            raise ValueError(f"attend_one_row does not take these shapes: {args[:5]}")
        return y


_reasons: dict[str, str] = {}


def unavailable_reason(kernel: str = "f16_matvec") -> str | None:
    """Why that kernel's function (f16_matvec(), attend_one_row()) gave None in this
    process (None when it loaded or was not asked for)."""
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


def _flags(source: Path) -> tuple[str, ...]:
    return FLAGS + OPENMP if source.name == SOURCE.name else FLAGS


def library_path(source: Path = SOURCE, compiler: str = "cc") -> Path:
    """Where the library built from `source` for this CPU is cached: named by a hash of the
    source, the flags, the compiler and the CPU's features, so a change to any rebuilds."""
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(_flags(source)).encode(), compiler.encode()):
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
            [compiler, *_flags(source), str(source), "-o", tmp],
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


Kernel = TypeVar("Kernel", F16Matvec, AttendOneRow)


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


def _reference_attention(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    pos: int,
    start: int,
    norm_scale: float,
    norm_eps: float,
) -> torch.Tensor:
    """attend_one_row in torch ops (the load check's answer; it writes the caches too)."""
    half = qk.size(1) // 2
    x1, x2 = qk[:, :half], qk[:, half:]
    rotated = torch.cat([x1 * cos[:half] + x2 * sin[:half], x2 * cos[half:] - x1 * sin[half:]], 1)
    normed = rotated * torch.rsqrt(norm_eps + norm_scale * rotated.square().sum(1, keepdim=True))
    n_kv = v.size(0)
    n_q = qk.size(0) - n_kv
    k_layer[pos], v_layer[pos] = normed[n_q:], v
    keys, values = k_layer[start : pos + 1], v_layer[start : pos + 1]  # (n, Hkv, D)
    group = n_q // n_kv
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("hd,thd->ht", normed[:n_q], keys) * qk.size(1) ** -0.5
    return torch.einsum("ht,thd->hd", scores.softmax(-1), values)


def _check_attention(kernel: AttendOneRow) -> None:
    g = torch.Generator().manual_seed(0)
    n_q, n_kv, d, length = 4, 2, 32, 40
    qk, v = torch.randn(n_q + n_kv, d, generator=g), torch.randn(n_kv, d, generator=g)
    cos, sin = torch.rand(d, generator=g), torch.rand(d, generator=g)
    caches = [torch.randn(length, n_kv, d, generator=g) for _ in range(2)]
    mine = [c.clone() for c in caches]
    args = (30, 5, 1.0 / d, 1e-6)
    want = _reference_attention(qk, v, cos, sin, *caches, *args)
    got = kernel(qk, v, cos, sin, *mine, *args)
    close = all(
        torch.allclose(a, b, atol=1e-5, rtol=1e-5)
        for a, b in ((got, want), (mine[0], caches[0]), (mine[1], caches[1]))
    )
    if not close:
        raise RuntimeError("attend_one_row disagrees with torch on a test layer")


@functools.cache
def attend_one_row() -> AttendOneRow | None:
    """The compiled, checked kernel, or None where it cannot run here (unavailable_reason)."""
    return _checked(
        "attend_one_row", DECODE_OPS_SOURCE, AttendOneRow, _check_attention, needs_avx512=False
    )
