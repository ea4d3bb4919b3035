from __future__ import annotations

import shutil

import pytest
import torch

from chatcli import native_kernels
from chatcli.native_kernels import (
    F16Matvec,
    _reference_attention,
    attend_one_row,
    build,
    f16_matvec,
    library_path,
)
from chatcli.quantize import Fp16Weight

_KERNEL = f16_matvec()
needs_kernel = pytest.mark.skipif(
    _KERNEL is None, reason=f"no native kernel: {native_kernels.unavailable_reason()}"
)
needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """f16_matvec() decided again, with its library cache in a temporary folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    f16_matvec.cache_clear()
    attend_one_row.cache_clear()
    yield tmp_path
    f16_matvec.cache_clear()
    attend_one_row.cache_clear()


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("n", "k"), [(3840, 1280), (1280, 5120), (4, 32)])
def test_the_kernel_sums_the_fp16_weights_times_the_input_in_fp32(n, k, threads):
    g = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, k, generator=g) * 0.02).half()
    x = torch.randn(k, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)  # the rows are shared among torch's OpenMP threads
        got = _KERNEL(weight, x)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == torch.float32 and got.shape == (n,)
    torch.testing.assert_close(got, weight.float() @ x, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_the_kernel_refuses_what_it_was_not_written_for():
    assert not _KERNEL.fits(torch.zeros(6, 64, dtype=torch.float16))  # rows in fours
    assert not _KERNEL.fits(torch.zeros(8, 48, dtype=torch.float16))  # inputs in 32s
    with pytest.raises(ValueError, match="contiguous fp16"):
        _KERNEL(torch.zeros(8, 64), torch.zeros(64))
    with pytest.raises(ValueError, match="contiguous fp16"):
        _KERNEL(torch.zeros(64, 8, dtype=torch.float16).t(), torch.zeros(64))
    with pytest.raises(ValueError, match="input of shape"):
        _KERNEL(torch.zeros(8, 64, dtype=torch.float16), torch.zeros(32))


@needs_kernel
def test_an_fp16_copy_reads_one_row_through_the_kernel_and_several_through_fbgemm(monkeypatch):
    w = torch.randn(512, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    copy = Fp16Weight(w)
    assert copy._native is not None
    calls = []
    real_call = F16Matvec.__call__
    monkeypatch.setattr(
        F16Matvec, "__call__", lambda self, *a: calls.append(a) or real_call(self, *a)
    )
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    rounded = w.half().float()
    torch.testing.assert_close(copy.matvec(x[0]), rounded @ x[0], atol=1e-5, rtol=1e-5)
    assert len(calls) == 1
    if copy.use_fbgemm:
        torch.testing.assert_close(copy.matmul(x), x @ rounded.t(), atol=1e-5, rtol=1e-5)
        assert len(calls) == 1
    # A shape the kernel does not take keeps the other path.
    odd = Fp16Weight(torch.randn(510, 256) * 0.05)
    assert odd._native is None


def test_it_can_be_turned_off(fresh, monkeypatch):
    monkeypatch.setenv("CHATCLI_NATIVE_KERNELS", "0")
    assert f16_matvec() is None
    assert "CHATCLI_NATIVE_KERNELS=0" in native_kernels.unavailable_reason()
    with pytest.raises(RuntimeError, match="no native fp16 kernel"):
        Fp16Weight(torch.randn(8, 64), use_native=True)


def test_a_cpu_without_avx512_keeps_torchs_kernels(fresh, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(native_kernels.platform, "machine", lambda: "x86_64")
    assert f16_matvec() is None
    assert "AVX-512" in native_kernels.unavailable_reason()
    assert not list(fresh.rglob("*.so"))  # nothing was compiled


def test_a_missing_compiler_is_a_reason_not_a_crash(fresh, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(native_kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(native_kernels.shutil, "which", lambda name: None)
    assert f16_matvec() is None
    assert "no C compiler" in native_kernels.unavailable_reason()


@needs_compiler
def test_a_source_that_does_not_compile_says_why(fresh, tmp_path):
    bad = tmp_path / "bad.c"
    bad.write_text('#error "not on this CPU"\n')
    with pytest.raises(RuntimeError, match="not on this CPU"):
        build(bad)
    assert not list((fresh / "chatcli").rglob("*.so"))  # no half-built library is left


@needs_compiler
def test_the_library_is_built_once_and_rebuilt_when_its_source_changes(
    fresh, tmp_path, monkeypatch
):
    src = tmp_path / "k.c"
    src.write_text("int answer(void) { return 42; }\n")
    built = build(src)
    assert built == library_path(src) and built.exists()
    runs = []
    real_run = native_kernels.subprocess.run
    monkeypatch.setattr(
        native_kernels.subprocess, "run", lambda *a, **k: runs.append(a) or real_run(*a, **k)
    )
    assert build(src) == built and runs == []  # found in the cache
    src.write_text("int answer(void) { return 43; }\n")
    assert build(src) != built and len(runs) == 1


@needs_kernel
def test_a_library_that_answers_wrongly_is_not_used(fresh, monkeypatch):
    def wrong(self, weight, x):
        return torch.zeros(weight.size(0))

    monkeypatch.setattr(F16Matvec, "__call__", wrong)
    assert f16_matvec() is None
    assert "disagrees" in native_kernels.unavailable_reason()


_ATTEND = attend_one_row()
needs_attend = pytest.mark.skipif(
    _ATTEND is None,
    reason=f"no native kernel: {native_kernels.unavailable_reason('attend_one_row')}",
)


@needs_attend
@pytest.mark.parametrize(
    ("n_q", "n_kv", "d", "pos", "start"),
    [(3, 3, 64, 0, 0), (4, 2, 24, 9, 9), (6, 2, 20, 30, 3), (2, 1, 128, 200, 0)],
)
def test_attend_one_row_equals_torchs_rotary_norm_cache_write_and_attention(
    n_q, n_kv, d, pos, start
):
    # pos == start: one key; n_q == n_kv and grouped heads; D not a multiple of the 8 lanes
    g = torch.Generator().manual_seed(pos + d)
    qk, v = torch.randn(n_q + n_kv, d, generator=g), torch.randn(n_kv, d, generator=g)
    cos, sin = torch.rand(d, generator=g), torch.rand(d, generator=g)
    caches = [torch.randn(pos + 4, n_kv, d, generator=g) for _ in range(2)]
    mine = [c.clone() for c in caches]
    args = (pos, start, 1.44 / d, 1e-7)
    want = _reference_attention(qk, v, cos, sin, *caches, *args)
    got = _ATTEND(qk, v, cos, sin, *mine, *args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine[0], caches[0], atol=1e-6, rtol=1e-6)  # k at pos, normed
    assert torch.equal(mine[1], caches[1])  # v at pos as given, the rest untouched


@needs_attend
def test_attend_one_row_refuses_shapes_it_does_not_take():
    qk, v = torch.zeros(4, 15), torch.zeros(2, 15)  # an odd head size has no rotary halves
    cache = torch.zeros(8, 2, 15)
    with pytest.raises(ValueError, match="does not take"):
        _ATTEND(qk, v, torch.zeros(15), torch.zeros(15), cache, cache.clone(), 3, 0, 1.0, 0.0)
    assert torch.equal(cache, torch.zeros(8, 2, 15))  # nothing written


def test_a_decode_step_keeps_torchs_attention_when_the_kernels_are_off(fresh, monkeypatch):
    from chatcli.decode_step import DecodeStep
    from tests.test_model import _random_model

    monkeypatch.setenv("CHATCLI_NATIVE_KERNELS", "0")
    assert DecodeStep(_random_model("E"))._native_attention is None
    assert "CHATCLI_NATIVE_KERNELS=0" in native_kernels.unavailable_reason("attend_one_row")
