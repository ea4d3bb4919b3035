"""The kernels beyond this machine's compiler and CPU: aarch64 (cross-built, run under
qemu-user), clang without OpenMP (team.h's own threads), and the build's choices per
compiler and CPU. CI installs gcc-aarch64-linux-gnu, qemu-user and clang (.ci/run) and sets
CI_REQUIRE_TOOLCHAINS=1, so there a missing tool fails these tests rather than skipping
them; elsewhere they skip saying what to install."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
import torch
from foreign_kernels import (
    ForeignF16Matvec,
    ForeignF16Rows,
    ForeignRowsStep,
    ForeignSampleRows,
    Harness,
    build_harness,
)

from chatcli.kernels import build as kernel_build
from chatcli.kernels.f16_matvec import check_f16_matvec, f16_matvec
from chatcli.kernels.f16_rows import check_f16_rows, f16_rows
from chatcli.kernels.rows_step import check_rows_step, rows_step
from chatcli.kernels.rows_step_reference import rows_step_errors, slots_errors
from chatcli.kernels.sample_rows import agrees, check_sample_rows, sample_rows

CROSS, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
REQUIRED = os.environ.get("CI_REQUIRE_TOOLCHAINS") == "1"


def require(*tools: str, install: str) -> None:
    """Skip unless every tool is on PATH; fail instead where CI requires them."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        message = f"needs apt install {install} (missing: {', '.join(missing)})"
        if REQUIRED:
            pytest.fail(f"{message}; CI_REQUIRE_TOOLCHAINS=1 says CI installed them")
        pytest.skip(message)


@pytest.fixture
def cross_tools() -> None:
    require(CROSS, QEMU, install="gcc-aarch64-linux-gnu qemu-user")


@pytest.fixture
def clang_tool() -> None:
    require("clang", install="clang")


needs_cross = pytest.mark.usefixtures("cross_tools")
needs_clang = pytest.mark.usefixtures("clang_tool")
KERNELS = (f16_matvec, f16_rows, rows_step, sample_rows)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Each kernel's loader decided again, with the library cache in a temporary folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for kernel in KERNELS:
        kernel.cache_clear()
    yield tmp_path
    for kernel in KERNELS:
        kernel.cache_clear()


@pytest.fixture(scope="module", params=["openmp", "pthreads"])
def aarch64(request, tmp_path_factory):
    """The harness and kernels built for a baseline ARMv8-A (NEON, no fp16 arithmetic:
    Graviton 1, a Raspberry Pi 3 or 4), with OpenMP or with team.h's threads."""
    require(CROSS, QEMU, install="gcc-aarch64-linux-gnu qemu-user")
    flags = ("-march=armv8-a", "-fopenmp") if request.param == "openmp" else ("-march=armv8-a",)
    program = build_harness(CROSS, flags, tmp_path_factory.mktemp("arm") / "harness")
    return Harness([QEMU, str(program)])


@needs_cross
def test_the_aarch64_build_reads_neon_panels_of_four_lanes(aarch64):
    # 4 fp32 lanes (one NEON register), fp16 and int8 widened in hardware: both compact
    # copies run in the whole-step kernel there, which an x86 without F16C cannot.
    assert (aarch64.block, aarch64.half_panel, aarch64.int8_panel) == (8, 4, 4)
    assert aarch64.int8_interleave == 1  # ARMv8.0 has no sdot: int8 is widened
    assert aarch64.int4_panel == 0  # and int4 keeps torch's kernel
    assert (aarch64.rows_panel, aarch64.rows_max) == (4, 8)
    assert (aarch64.matvec_rows, aarch64.matvec_step) == (4, 8)


@needs_cross
def test_every_kernel_passes_its_load_check_on_aarch64(aarch64):
    # The very checks chatcli runs before it uses a library (RuntimeError on a disagreement).
    check_rows_step(ForeignRowsStep(aarch64))
    check_f16_rows(ForeignF16Rows(aarch64))
    check_f16_matvec(ForeignF16Matvec(aarch64))
    check_sample_rows(ForeignSampleRows(aarch64))


@needs_cross
def test_the_aarch64_step_matches_torch_for_every_row_count_and_weight_kind(aarch64):
    kernel = ForeignRowsStep(aarch64)
    # 8 sample rows over a prompt (two passes of the products: 8 is MAX_ROWS there), one row
    # without a prompt, and one row of fp16 and of int8 matrices with a bf16 table.
    assert max(rows_step_errors(kernel, rows=8)) < 1e-5
    assert max(rows_step_errors(kernel, rows=1, prompt=None)) < 1e-5
    assert max(rows_step_errors(kernel, rows=3, half=True, bf16_table=True)) < 1e-5
    assert max(rows_step_errors(kernel, rows=2, int8=True)) < 1e-5
    assert max(slots_errors(kernel, threads=3)) < 1e-5


@needs_cross
def test_the_aarch64_step_gives_the_same_logits_on_one_thread_and_three(aarch64):
    kernel = ForeignRowsStep(aarch64)
    one = rows_step_errors(kernel, rows=5, threads=1)
    three = rows_step_errors(kernel, rows=5, threads=3)
    assert one == three


@needs_cross
def test_an_aarch64_with_dot_products_reads_interleaved_int8_and_int4(tmp_path):
    # ARMv8.2's sdot (Graviton 2 and later, Apple's cores): four inputs of a column a lane,
    # int8's and int4's products in integers.
    program = build_harness(CROSS, ("-march=armv8.2-a+dotprod",), tmp_path / "dot")
    dot = Harness([QEMU, str(program)])
    assert (dot.int8_panel, dot.int8_interleave, dot.int4_panel) == (4, 4, 4)
    kernel = ForeignRowsStep(dot)
    check_rows_step(kernel)  # int4 too
    assert max(rows_step_errors(kernel, rows=1, int8=True)) < 1e-5
    assert max(rows_step_errors(kernel, rows=5, int8=True, threads=2)) < 1e-5
    int4 = dict(widths=(128, 256, 100), heads=(8, 4), int4=True)
    assert max(rows_step_errors(kernel, rows=5, threads=2, **int4)) < 1e-3


@needs_cross
def test_the_plain_c_fallback_of_a_cpu_without_vectors_passes_the_checks(tmp_path):
    # aarch64 told it has no Advanced SIMD: lanes.h's vectors are plain C (GCC lowers them to
    # scalar code), no fp16 or int8 widening, so the step reads fp32 matrices only.
    program = build_harness(CROSS, ("-march=armv8-a+nosimd",), tmp_path / "plain", half=False)
    plain = Harness([QEMU, str(program)])
    assert (plain.block, plain.half_panel, plain.int8_panel) == (8, 0, 0)
    check_rows_step(ForeignRowsStep(plain))
    check_sample_rows(ForeignSampleRows(plain))
    assert max(rows_step_errors(ForeignRowsStep(plain), rows=8, threads=2)) < 1e-5


@pytest.mark.parametrize(
    ("compiler", "openmp_env"), [("clang", None), ("cc", "0")], ids=["clang", "gcc-pthreads"]
)
def test_a_build_without_openmp_loads_every_kernel_on_its_own_threads(
    fresh, monkeypatch, compiler, openmp_env
):
    require(compiler, install="clang" if compiler == "clang" else "gcc")
    monkeypatch.setenv("CC", compiler)
    if openmp_env is not None:
        monkeypatch.setenv("CHATCLI_KERNEL_OPENMP", openmp_env)
    tools = kernel_build.toolchain()
    assert not tools.openmp and "-fopenmp" not in tools.flags and tools.threads == "pthreads"
    kernels = {k.__name__: k() for k in KERNELS}
    reasons = {name: kernel_build.unavailable_reason(name) for name in kernels}
    x86 = kernel_build.platform.machine() in ("x86_64", "AMD64")
    if x86 and torch.backends.cpu.get_cpu_capability() != "AVX512":
        kernels.pop("f16_matvec")  # written for AVX-512 on x86
    assert all(k is not None for k in kernels.values()), reasons
    step = kernels["rows_step"]
    assert max(rows_step_errors(step, rows=8, threads=2)) < 1e-5
    assert max(slots_errors(step, threads=2)) < 1e-5


@pytest.mark.parametrize("compiler", ["clang", "cc"])
def test_several_callers_at_once_get_the_answer_each_gets_alone(fresh, monkeypatch, compiler):
    # team.h runs one caller's team at a time; a second caller meanwhile runs alone on its
    # own thread (a server's workers): same logits, nothing lost or mixed.
    require(compiler, install="clang" if compiler == "clang" else "gcc")
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("CHATCLI_KERNEL_OPENMP", "0")
    kernel = rows_step()
    assert kernel is not None, kernel_build.unavailable_reason("rows_step")
    alone = [rows_step_errors(kernel, rows=6, threads=2, seed=s) for s in range(4)]
    together: dict[int, list[float]] = {}

    def run(seed: int) -> None:
        for _ in range(5):
            together[seed] = rows_step_errors(kernel, rows=6, threads=2, seed=seed)

    callers = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert [together[s] for s in range(4)] == alone
    assert max(max(e) for e in alone) < 1e-5


@needs_clang
def test_the_toolchain_probe_tells_gcc_from_clang_and_finds_openmp_in_gcc_only():
    clang = kernel_build.probe("clang")
    assert clang.kind == "clang" and not clang.openmp
    assert clang.cpu_flags == ("-march=native",) or not clang.target.startswith("x86_64")
    if shutil.which("gcc") is not None:
        gcc = kernel_build.probe("gcc")
        assert gcc.kind == "gcc" and gcc.openmp and "-fopenmp" in gcc.flags


def test_each_compiler_and_cpu_is_tuned_by_the_flag_it_takes():
    candidates = kernel_build.cpu_flag_candidates
    assert candidates("x86_64-linux-gnu", "gcc")[0] == ("-march=native",)
    assert candidates("x86_64-pc-linux-gnu", "clang")[0] == ("-march=native",)
    assert candidates("aarch64-linux-gnu", "gcc") == [("-mcpu=native",), ()]
    assert candidates("aarch64-unknown-linux-gnu", "clang") == [("-mcpu=native",), ()]
    # Apple's clang: -mcpu=native where it takes it, else the first Apple core's flag.
    apple = candidates("arm64-apple-darwin23.4.0", "apple-clang")
    assert apple == [("-mcpu=native",), ("-mcpu=apple-m1",), ()]
    assert candidates("riscv64-linux-gnu", "gcc")[-1] == ()  # at worst, no flag at all


def test_the_library_cache_is_keyed_by_compiler_flags_and_target(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = tmp_path / "k.c"
    source.write_text("int answer(void) { return 42; }\n")
    base = kernel_build.Toolchain(
        "cc", "/usr/bin/gcc-12", "gcc", "gcc 12.2", "x86_64-linux-gnu", ("-march=native",),
        True, (),
    )  # fmt: skip
    others = [
        kernel_build.Toolchain(**{**base.__dict__, field: value})
        for field, value in [
            ("path", "/usr/bin/clang"),
            ("version", "gcc 13.1"),
            ("target", "aarch64-linux-gnu"),
            ("cpu_flags", ("-mcpu=native",)),
            ("openmp", False),
            ("extra", ("-O2",)),
        ]
    ]
    paths = {kernel_build.library_path(source, t) for t in [base, *others]}
    assert len(paths) == 1 + len(others)
    assert kernel_build.library_path(source, base) == kernel_build.library_path(source, base)


def test_cflags_from_the_environment_come_last_and_win(monkeypatch, tmp_path):
    require("cc", install="gcc")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CFLAGS", "-march=x86-64 -DCHATCLI_TEST=1")
    tools = kernel_build.toolchain()
    assert tools.flags[-2:] == ("-march=x86-64", "-DCHATCLI_TEST=1")


def test_a_missing_compiler_says_the_command_that_installs_one(fresh, monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc")
    assert rows_step() is None
    reason = kernel_build.unavailable_reason("rows_step")
    assert "no C compiler (no-such-cc) on PATH" in reason
    assert "(fix: " in reason and kernel_build.install_hint() in reason


def test_a_draw_may_differ_only_within_rounding_of_a_boundary():
    # Candidates with probabilities 0.5, 0.25, 0.25: boundaries at 0.5 and 0.75 of the total.
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    on_boundary = torch.tensor([[0.5 + 1e-7]])
    assert agrees(torch.tensor([[0]]), logits, 1.0, None, None, on_boundary)
    assert agrees(torch.tensor([[1]]), logits, 1.0, None, None, on_boundary)
    # Far from any boundary, or two tokens away, another token is a wrong answer.
    assert not agrees(torch.tensor([[1]]), logits, 1.0, None, None, torch.tensor([[0.2]]))
    assert not agrees(torch.tensor([[2]]), logits, 1.0, None, None, on_boundary)


@pytest.mark.parametrize("compiler", ["clang", "cc"])
def test_a_forked_process_starts_threads_of_its_own(fresh, monkeypatch, compiler):
    # A fork keeps none of the parent's pool threads: the child's first call makes its own
    # (team.h's fork handler) instead of waiting for threads that are not there.
    require(compiler, install="clang" if compiler == "clang" else "gcc")
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("CHATCLI_KERNEL_OPENMP", "0")
    kernel = rows_step()
    assert kernel is not None, kernel_build.unavailable_reason("rows_step")
    parent = rows_step_errors(kernel, rows=4, threads=2)
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only where its answer is the parent's
        torch.set_num_threads(1)  # the reference's torch ops: libgomp's pool does not fork
        os._exit(0 if rows_step_errors(kernel, rows=4, threads=2) == parent else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's call did not return in 60 s")


def test_a_call_on_more_threads_than_any_before_starts_its_new_ones_cleanly(fresh, monkeypatch):
    # Threads made for a later, wider call must wait for that call's cue, not run the last
    # call's work (whose arguments are gone): a crash here, before team_born.
    require("cc", install="gcc")
    monkeypatch.setenv("CHATCLI_KERNEL_OPENMP", "0")
    kernel = rows_step()
    assert kernel is not None, kernel_build.unavailable_reason("rows_step")
    answers = [rows_step_errors(kernel, rows=6, threads=t) for t in (1, 2, 3, 5, 2, 5)]
    assert all(a == answers[0] for a in answers)
