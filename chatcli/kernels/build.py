"""Building, caching and loading our C kernels: each kernel's wrapper module asks for its library here.

Owns: compiling a shipped C source (beside this file) with the system's C compiler for this
CPU (-march=native) into a per-user cache named by what it was built from, loading it with
ctypes, checking a kernel against torch once per process, and the reason a kernel is
unavailable (`unavailable_reason`). Why at run time: the fastest loop depends on the CPU's
vector width, which a wheel built elsewhere cannot know, and a C file without torch's headers
compiles in under a second. Any failure (no compiler, another CPU, a wrong answer at the
check) leaves chatcli on torch's ops; CHATCLI_NATIVE_KERNELS=0 turns every kernel off. Knows
nothing about what a kernel computes.
"""

from __future__ import annotations

import ctypes
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

KERNELS_DIR = Path(__file__).parent
# OpenMP in the process's one libgomp: torch's, whose soname the libraries name.
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-fopenmp")
COMPILE_TIMEOUT_S = 60

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


def library_path(source: Path, compiler: str = "cc") -> Path:
    """Where the library built from `source` for this CPU is cached: named by a hash of the
    source, the flags, the compiler and the CPU's features, so a change to any rebuilds."""
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(FLAGS).encode(), compiler.encode()):
        key.update(part)
    key.update(_cpu_flags().encode())
    return cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"


def build(source: Path, compiler: str = "cc") -> Path:
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


def load(kernel: str, source: Path, needs_avx512: bool) -> ctypes.CDLL | None:
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


Kernel = TypeVar("Kernel")


def checked(
    name: str,
    source: Path,
    wrap: Callable[[ctypes.CDLL], Kernel],
    check: Callable[[Kernel], None],
    needs_avx512: bool,
) -> Kernel | None:
    """The library's kernel once `check` passed, or None with the reason kept for `name`."""
    library = load(name, source, needs_avx512)
    if library is None:
        return None
    kernel = wrap(library)
    try:
        check(kernel)
    except RuntimeError as e:
        _reasons[name] = str(e)
        return None
    return kernel
