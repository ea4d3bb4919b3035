"""Building, caching and loading our C kernels: each kernel's wrapper module asks for its library here.

Owns: which compiler builds them and how (`toolchain`: CC from the environment, else cc;
what it targets; the CPU flag it takes, -march=native on x86, -mcpu=native or Apple's
-mcpu=apple-m1 on arm64; whether it has OpenMP, found by compiling a test program), compiling
a shipped C source (beside this file, with its headers lanes.h and team.h) for this CPU into
a per-user cache named by what it was built from and for, loading it with ctypes, checking a
kernel against torch once per process, and the reason a kernel is unavailable
(`unavailable_reason`, with the command that fixes it where one does). Why at run time: the
fastest loop depends on the CPU's vector width, which a wheel built elsewhere cannot know,
and a C file without torch's headers compiles in under a second. Any failure (no compiler,
another CPU, a wrong answer at the check) leaves chatcli on torch's ops;
CHATCLI_NATIVE_KERNELS=0 turns every kernel off. Knows nothing about what a kernel computes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import torch

KERNELS_DIR = Path(__file__).parent
HEADERS = ("lanes.h", "team.h")  # what every kernel source includes: part of its cache key
COMPILE_TIMEOUT_S = 60
# A probe that answers: the source every candidate flag is tried on, and OpenMP's.
_PROBE = "int probe(int x) { return x + 1; }\n"
_OPENMP_PROBE = "#include <omp.h>\nint probe(void) { return omp_get_max_threads(); }\n"

_reasons: dict[str, str] = {}


@dataclass(frozen=True)
class Toolchain:
    """The compiler the kernels are built with and what it was found to take."""

    compiler: str  # as named (CC, or cc)
    path: str  # where it is, links resolved
    kind: str  # "gcc", "clang", "apple-clang" or "other"
    version: str  # its --version's first line
    target: str  # its -dumpmachine: x86_64-linux-gnu, aarch64-linux-gnu, arm64-apple-darwin23
    cpu_flags: tuple[str, ...]  # the first of the CPU's candidates it accepts (may be none)
    openmp: bool  # -fopenmp links GCC's libgomp: else team.h's own threads
    extra: tuple[str, ...]  # CFLAGS from the environment, last (they win)

    @property
    def flags(self) -> tuple[str, ...]:
        """Everything but the source and output of a library's compile command."""
        # OpenMP in the process's one libgomp: torch's, whose soname the libraries name.
        openmp = ("-fopenmp",) if self.openmp else ()
        base = ("-O3", *self.cpu_flags, "-shared", "-fPIC", *openmp, "-I", str(KERNELS_DIR))
        return (*base, *self.extra)

    @property
    def threads(self) -> str:
        """What shares a kernel's loops: 'OpenMP' or 'pthreads' (team.h's pool)."""
        return "OpenMP" if self.openmp else "pthreads"


def cpu_flag_candidates(target: str, kind: str) -> list[tuple[str, ...]]:
    """The flags that tune a build for this CPU, best first, for a compiler of `kind` that
    targets `target`: x86's -march=native; arm64's -mcpu=native (GCC, clang), which Apple's
    clang took only in later releases, so -mcpu=apple-m1 after it there; none at last."""
    arch = target.split("-", 1)[0]
    if arch in ("x86_64", "i686", "i386", "amd64"):
        return [("-march=native",), ()]
    if arch in ("aarch64", "arm64"):
        if kind == "apple-clang" or "apple" in target:
            return [("-mcpu=native",), ("-mcpu=apple-m1",), ()]
        return [("-mcpu=native",), ()]
    return [("-march=native",), ("-mcpu=native",), ()]


def _compiles(compiler: str, flags: tuple[str, ...], source: str) -> bool:
    """Whether `compiler` builds `source` into a shared library with `flags`."""
    with tempfile.TemporaryDirectory() as folder:
        c_file = Path(folder) / "probe.c"
        c_file.write_text(source)
        try:
            done = subprocess.run(
                [compiler, *flags, "-shared", "-fPIC", str(c_file), "-o", f"{folder}/probe.so"],
                capture_output=True,
                timeout=COMPILE_TIMEOUT_S,
            )
        except (OSError, subprocess.SubprocessError):
            return False
        return done.returncode == 0


def _ask(compiler: str, *args: str) -> str:
    done = subprocess.run(
        [compiler, *args], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S
    )
    return (done.stdout.strip().splitlines() or [""])[0]


def _kind(compiler: str) -> str:
    """gcc, clang, apple-clang or other, by the macros the compiler predefines (a `cc`
    names itself by its file's name, not its maker)."""
    done = subprocess.run(
        [compiler, "-dM", "-E", "-x", "c", "-"],
        input="",
        capture_output=True,
        text=True,
        timeout=COMPILE_TIMEOUT_S,
    )
    macros = {line.split()[1] for line in done.stdout.splitlines() if line.count(" ") >= 1}
    if "__clang__" in macros:
        return "apple-clang" if "__apple_build_version__" in macros else "clang"
    return "gcc" if "__GNUC__" in macros else "other"


def probe(compiler: str, extra: tuple[str, ...] = ()) -> Toolchain:
    """What `compiler` (on PATH) is and takes: asked and test-compiled, a few tenths of a
    second. RuntimeError where it cannot be run."""
    path = shutil.which(compiler)
    if path is None:
        raise RuntimeError(f"no C compiler ({compiler}) on PATH")
    try:
        version = _ask(path, "--version")
        target = _ask(path, "-dumpmachine") or platform.machine()
        kind = _kind(path)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"the C compiler {compiler} does not run: {e}") from e
    cpu_flags = next(
        (f for f in cpu_flag_candidates(target, kind) if _compiles(path, (*f, *extra), _PROBE)),
        (),
    )
    # clang's -fopenmp links LLVM's libomp, a second OpenMP runtime beside torch's libgomp
    # (two pools of spinning threads): clang builds use team.h's threads instead.
    openmp = kind == "gcc" and _compiles(path, ("-fopenmp", *extra), _OPENMP_PROBE)
    return Toolchain(
        compiler, os.path.realpath(path), kind, version, target, cpu_flags, openmp, extra
    )


def toolchain() -> Toolchain:
    """The toolchain for this process's builds: CC from the environment (else cc) and its
    CFLAGS, probed once a compiler binary (the answer kept in the cache folder, keyed by the
    binary's path, size and time). CHATCLI_KERNEL_OPENMP=0 builds with team.h's own threads
    even where the compiler has OpenMP (to compare the two). RuntimeError without one."""
    compiler = os.environ.get("CC") or "cc"
    extra = tuple(os.environ.get("CFLAGS", "").split())
    found = _probed(compiler, extra, _binary_stamp(compiler))
    if os.environ.get("CHATCLI_KERNEL_OPENMP") == "0" and found.openmp:
        found = Toolchain(**{**asdict(found), "openmp": False})
    return found


def _binary_stamp(compiler: str) -> str:
    path = shutil.which(compiler)
    if path is None:
        raise RuntimeError(f"no C compiler ({compiler}) on PATH")
    real = os.path.realpath(path)
    stat = os.stat(real)
    return f"{real}:{stat.st_size}:{stat.st_mtime_ns}"


@functools.cache
def _probed(compiler: str, extra: tuple[str, ...], stamp: str) -> Toolchain:
    key = hashlib.sha256(f"{compiler}|{' '.join(extra)}|{stamp}".encode()).hexdigest()[:16]
    record = cache_dir() / f"toolchain-{key}.json"
    try:
        fields = json.loads(record.read_text())
        fields["cpu_flags"], fields["extra"] = tuple(fields["cpu_flags"]), tuple(fields["extra"])
        return Toolchain(**fields)
    except (OSError, ValueError, TypeError, KeyError):
        pass
    found = probe(compiler, extra)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(asdict(found)))
    except OSError:
        pass  # a read-only cache: probed again next time
    return found


def install_hint() -> str:
    """The command that gets a C compiler onto this machine (for the reason's line)."""
    if platform.system() == "Darwin":
        return "xcode-select --install"
    if shutil.which("apt-get"):
        return "sudo apt install gcc"
    if shutil.which("dnf"):
        return "sudo dnf install gcc"
    return "install gcc or clang"


def unavailable_reason(kernel: str = "f16_matvec") -> str | None:
    """Why that kernel's function (f16_matvec(), f16_rows(), rows_step(), sample_rows())
    gave None in this process (None when it loaded or was not asked for)."""
    return _reasons.get(kernel)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "chatcli" / "kernels"


def _cpu_features() -> str:
    """The CPU's feature list (x86's `flags`, arm64 Linux's `Features`), else its name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def library_path(source: Path, tools: Toolchain | None = None) -> Path:
    """Where the library built from `source` for this CPU is cached: named by a hash of the
    source and its headers, the compiler (path, version, target), the flags and the CPU's
    features, so a change to any rebuilds."""
    tools = tools or toolchain()
    key = hashlib.sha256(source.read_bytes())
    for header in HEADERS:
        key.update((KERNELS_DIR / header).read_bytes())
    for part in (tools.path, tools.version, tools.target, " ".join(tools.flags)):
        key.update(part.encode())
    key.update(_cpu_features().encode())
    return cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"


def build(source: Path) -> Path:
    """Compile `source` into the cache with this process's toolchain (once; later calls
    find it). Raises RuntimeError with the compiler's message when it cannot."""
    tools = toolchain()
    target = library_path(source, tools)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place, so a reader never sees half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [tools.path, *tools.flags, str(source), "-o", tmp],
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
    """The library built from `source`, or None with the reason kept for `kernel`.
    needs_avx512: on x86, only where the CPU has AVX-512 (elsewhere there torch's own
    kernel was measured faster); other CPUs build it where the compiler can."""
    _reasons.pop(kernel, None)
    reason = None
    if os.environ.get("CHATCLI_NATIVE_KERNELS", "1") == "0":
        reason = "turned off by CHATCLI_NATIVE_KERNELS=0"
    elif (
        needs_avx512
        and platform.machine() in ("x86_64", "AMD64")
        and torch.backends.cpu.get_cpu_capability() != "AVX512"
    ):
        reason = "written for AVX-512, which this CPU lacks"
    if reason is None:
        try:
            return ctypes.CDLL(str(build(source)))
        except RuntimeError as e:
            reason = f"could not build {source.name}: {e}"
            if "no C compiler" in str(e):
                reason += f" (fix: {install_hint()})"
        except (OSError, subprocess.SubprocessError) as e:
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
