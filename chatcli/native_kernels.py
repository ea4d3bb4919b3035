"""Kernels of our own in C, compiled on this machine at first use and loaded with ctypes.

Owns: building the shipped C source (chatcli/kernels/) with the system's C compiler for this
CPU (-march=native), caching the library, checking it against torch once per process, and
calling it. Today one kernel: f16_matvec, one fp32 row times an fp16 matrix, which batch-1
decode of a big model spends ~90% of its time in (quantize.Fp16Weight).

Why compile at run time: the fastest loop depends on the CPU's vector width, and a wheel
built elsewhere cannot know it; a C file with no torch headers compiles in under a second.
Why not always: it needs a C compiler, it only exists for AVX-512 (the CPU it was measured
faster on), and any failure (no compiler, another CPU, a wrong answer at the check) leaves
chatcli on torch's kernels, with the reason in `unavailable_reason()`.
CHATCLI_NATIVE_KERNELS=0 turns it off. Knows nothing about models.
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
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "kernels" / "f16_matvec.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
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


_reason: str | None = None


def unavailable_reason() -> str | None:
    """Why f16_matvec() gave None in this process (None when it loaded or was not asked)."""
    return _reason


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


@functools.cache
def f16_matvec() -> F16Matvec | None:
    """The compiled, checked kernel, or None where it cannot run here (unavailable_reason)."""
    global _reason
    if os.environ.get("CHATCLI_NATIVE_KERNELS", "1") == "0":
        _reason = "turned off by CHATCLI_NATIVE_KERNELS=0"
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        _reason = f"written for x86-64, this is {platform.machine()}"
        return None
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        _reason = "written for AVX-512, which this CPU lacks"
        return None
    try:
        kernel = F16Matvec(ctypes.CDLL(str(build())))
        _check(kernel)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _reason = f"could not build or load {SOURCE.name}: {e}"
        return None
    _reason = None
    return kernel
