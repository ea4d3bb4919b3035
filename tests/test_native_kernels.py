from __future__ import annotations

import os
import platform
import shutil
import subprocess

import pytest
import torch

from chatcli.kernels import build as kernel_build
from chatcli.kernels import rows_step as rows_step_module
from chatcli.kernels import rows_step_reference
from chatcli.kernels.build import build, library_path
from chatcli.kernels.f16_matvec import F16Matvec, f16_matvec
from chatcli.kernels.f16_rows import F16Rows, f16_rows
from chatcli.kernels.panels import HalfPanels, Int8Panels, int8_rows, pack_panels
from chatcli.kernels.rows_step import DECODE_OPS_SOURCE, RowsLayer, RowsStep, rows_step
from chatcli.kernels.rows_step_reference import embed_errors, rows_step_errors
from chatcli.kernels.sample_rows import sample_rows
from chatcli.model import sampling
from chatcli.model.quantize import Fp16Weight

_KERNEL = f16_matvec()
needs_kernel = pytest.mark.skipif(
    _KERNEL is None, reason=f"no native kernel: {kernel_build.unavailable_reason()}"
)
_F16_ROWS = f16_rows()
needs_rows_kernel = pytest.mark.skipif(
    _F16_ROWS is None, reason=f"no f16_rows: {kernel_build.unavailable_reason('f16_rows')}"
)
needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Each kernel's loader decided again, with the library cache in a temporary folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for kernel in (f16_matvec, f16_rows, rows_step):
        kernel.cache_clear()
    yield tmp_path
    for kernel in (f16_matvec, f16_rows, rows_step):
        kernel.cache_clear()


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
    assert copy.one_row_kernel == "f16_matvec (native)"
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
    assert odd.one_row_kernel != "f16_matvec (native)"


@needs_rows_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("n", "k"), [(1280, 1280), (64, 40), (_F16_ROWS.panel if _F16_ROWS else 8, 3)]
)
def test_f16_rows_sums_every_row_times_the_fp16_weights_in_fp32(n, k, threads):
    g = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, k, generator=g) * 0.02).half()
    panels = _F16_ROWS.pack(weight)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)  # the panels are shared among torch's OpenMP threads
        for rows in range(1, _F16_ROWS.max_rows + 1):  # each count has its own loop
            x = torch.randn(rows, k, generator=g)
            got = _F16_ROWS(panels, x, n)
            assert got.dtype == torch.float32 and got.shape == (rows, n)
            torch.testing.assert_close(got, x @ weight.float().t(), atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


@needs_rows_kernel
def test_f16_rows_reads_the_transposed_weights_in_panels_and_refuses_other_shapes():
    weight = torch.randn(2 * _F16_ROWS.panel, 5)
    want = pack_panels(weight.t().half(), _F16_ROWS.panel)
    assert torch.equal(_F16_ROWS.pack(weight), want) and want.dtype == torch.float16
    assert not _F16_ROWS.fits(torch.zeros(_F16_ROWS.panel + 1, 5))  # whole panels of columns
    with pytest.raises(ValueError, match="multiple of"):
        _F16_ROWS.pack(torch.zeros(_F16_ROWS.panel + 1, 5))
    panels = _F16_ROWS.pack(weight)
    with pytest.raises(ValueError, match="1 to 8 rows"):
        _F16_ROWS(panels, torch.zeros(_F16_ROWS.max_rows + 1, 5), 2 * _F16_ROWS.panel)
    with pytest.raises(ValueError, match="panels of"):
        _F16_ROWS(panels, torch.zeros(2, 6), 2 * _F16_ROWS.panel)


@needs_rows_kernel
def test_an_fp16_copy_reads_2_to_8_rows_through_f16_rows(monkeypatch):
    w = torch.randn(512, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    copy = Fp16Weight(w)
    assert copy.rows_kernel == "f16_rows (native)"
    calls = []
    real_call = F16Rows.__call__
    monkeypatch.setattr(
        F16Rows, "__call__", lambda self, *a: calls.append(a) or real_call(self, *a)
    )
    rounded = w.half().float()
    x = torch.randn(12, 256, generator=torch.Generator().manual_seed(2))
    for rows in (2, 8):
        torch.testing.assert_close(copy.matmul(x[:rows]), x[:rows] @ rounded.t())
    assert len(calls) == 2
    # One row keeps f16_matvec or fbgemm, more than 8 fbgemm (a chat chunk, a prompt).
    copy.matvec(x[0])
    if copy.use_fbgemm:
        torch.testing.assert_close(copy.matmul(x), x @ rounded.t(), atol=1e-5, rtol=1e-5)
    assert len(calls) == 2
    assert Fp16Weight(torch.randn(510, 256)).rows_kernel != "f16_rows (native)"  # not panels
    assert Fp16Weight(w, use_native=False).rows_kernel != "f16_rows (native)"


def test_it_can_be_turned_off(fresh, monkeypatch):
    monkeypatch.setenv("CHATCLI_NATIVE_KERNELS", "0")
    assert f16_matvec() is None
    assert f16_rows() is None
    assert "CHATCLI_NATIVE_KERNELS=0" in kernel_build.unavailable_reason()
    with pytest.raises(RuntimeError, match="no native fp16 kernel"):
        Fp16Weight(torch.randn(8, 64), use_native=True)


def test_a_cpu_without_avx512_keeps_torchs_kernels(fresh, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(kernel_build.platform, "machine", lambda: "x86_64")
    assert f16_matvec() is None
    assert "AVX-512" in kernel_build.unavailable_reason()
    assert not list(fresh.rglob("*.so"))  # nothing was compiled


def test_a_missing_compiler_is_a_reason_not_a_crash(fresh, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(kernel_build.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kernel_build.shutil, "which", lambda name: None)
    assert f16_matvec() is None
    assert "no C compiler" in kernel_build.unavailable_reason()


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
    real_run = kernel_build.subprocess.run
    monkeypatch.setattr(
        kernel_build.subprocess, "run", lambda *a, **k: runs.append(a) or real_run(*a, **k)
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
    assert "disagrees" in kernel_build.unavailable_reason()


_ROWS = rows_step()
needs_rows = pytest.mark.skipif(
    _ROWS is None, reason=f"no native kernel: {kernel_build.unavailable_reason('rows_step')}"
)


# Eight query heads of 128 on one K/V head (a big model's head width, grouped heads).
_WIDE_HEADS = {"heads": (8, 1), "head_dim": 128, "widths": (64, 256, 64)}


@needs_rows
@pytest.mark.parametrize(
    "case",
    [
        {},  # 3 rows over a prefix, a window leaving it; widths in whole blocks, vocab not
        {"rows": 1, "prompt": None},  # one row of a plain cache (batch-1 decode)
        {"rows": 8, "threads": 1},
        {"rows": 7},  # with 16 registers a pass of 6 rows and one of 1; with AVX-512 one of 7
        # 9 rows: two passes (8 + 1, or 6 + 3 with 16 registers); no grouped heads; a head of 20 (no whole vectors)
        # and widths of no whole blocks; three windows, one leaving the prompt
        {
            "rows": 9,
            "heads": (3, 3),
            "head_dim": 20,
            "widths": (48, 96, 33),
            "prompt": 30,
            "pos": 40,
            "windows": (8, 100, 3),
        },
        {"rows": 2, "prompt": 0, "pos": 0},  # the first position: one key, the row's own
        # a window that starts inside the prompt, between two of its panels' first columns
        {"rows": 8, "prompt": 40, "pos": 45, "windows": (100, 20), "head_dim": 24},
        {**_WIDE_HEADS, "rows": 4, "prompt": 300, "pos": 310},
        # a row's own keys eight, then four, then one at a time (22 and 23 of them); the
        # values eight vectors at a time (a head of 64 with 8 lanes), or four (32)
        {"rows": 1, "prompt": None, "pos": 21, "head_dim": 64},
        {"rows": 8, "prompt": 30, "pos": 52, "head_dim": 32, "windows": (100, 40)},
    ],
)
def test_rows_step_equals_torchs_layers_and_writes_the_rows_keys_and_values(case):
    logits, keys, values = rows_step_errors(_ROWS, **case)
    assert logits < 1e-5 and keys < 1e-5 and values < 1e-5


def _cc_is_gcc() -> bool:
    try:
        version = subprocess.run(["cc", "--version"], capture_output=True, text=True).stdout
    except OSError:
        return False
    return "Free Software Foundation" in version


@needs_compiler
@pytest.mark.skipif(os.environ.get("CHATCLI_NATIVE_KERNELS") == "0", reason="turned off")
def test_the_step_kernel_loads_wherever_a_compiler_does():
    # A library that fails to build or its load check leaves rows_step() None, which skips
    # every test of it above and below: that must fail here instead. A wrong answer fails
    # anywhere; a failed build only where cc is GCC (its OpenMP is the one the flags name).
    reason = kernel_build.unavailable_reason("rows_step")
    if _ROWS is None and reason and reason.startswith("could not build") and not _cc_is_gcc():
        pytest.skip(reason)
    assert _ROWS is not None, reason


@needs_rows
def test_the_sampler_loads_wherever_the_step_kernel_does():
    # Built from the same source: a sampler that fails its load check (a wrong choice) would
    # otherwise only skip tests/test_sampling.py's native half.
    assert sample_rows() is not None, kernel_build.unavailable_reason("sample_rows")


needs_sampler = pytest.mark.skipif(
    sample_rows() is None,
    reason=f"no native kernel: {kernel_build.unavailable_reason('sample_rows')}",
)


def _both_paths(monkeypatch, logits, seed, **kwargs):
    native = sampling.sample_next_token(logits, torch.Generator().manual_seed(seed), **kwargs)
    with monkeypatch.context() as m:
        m.setattr(sampling, "sample_rows", lambda: None)
        plain = sampling.sample_next_token(logits, torch.Generator().manual_seed(seed), **kwargs)
    return native, plain


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 1.0},
        {"temperature": 0.6, "top_k": 50},
        {"temperature": 0.8, "top_k": 40, "top_p": 0.9},
        {"temperature": 1.3, "top_k": 1000},  # none over 7 words; a long heap over more
    ],
)
@pytest.mark.parametrize("vocab", [7, 1024, 3000])  # no whole vector; whole chunks; neither
@needs_sampler
def test_the_sampler_draws_the_tokens_torchs_ops_draw_from_the_same_seed(
    monkeypatch, kwargs, vocab
):
    # The same draws invert the same distribution: the same tokens, but for a draw within
    # rounding of a boundary between two, which 64 random rows a case do not meet.
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    native, plain = _both_paths(monkeypatch, logits, seed=vocab, **kwargs)
    assert torch.equal(native, plain)


def _panel_case(where: str, block: int) -> dict:
    """A step over a prompt whose attention window starts where a panel of the packed
    prompt (RowsStep.pack_prefix, `block` columns) makes it a case of its own."""
    if where == "inside the last, partial panel":  # fewer than a panel of columns, 3 skipped
        prompt, start = 2 * block + block // 2, 2 * block + 3
    elif where == "on a panel's first column":  # nothing skipped, panels before it unread
        prompt, start = 2 * block + 5, block
    else:  # "in a prompt of whole panels"
        prompt, start = 2 * block, block + 1
    pos = prompt + 5
    return {"rows": 8, "prompt": prompt, "pos": pos, "windows": (100, pos - start)}


@needs_rows
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [16, 40])  # 40: values padded past a whole panel
@pytest.mark.parametrize(
    "where",
    ["inside the last, partial panel", "on a panel's first column", "in a prompt of whole panels"],
)
def test_rows_step_reads_the_packed_prompt_wherever_a_window_starts(where, head_dim, threads):
    case = _panel_case(where, _ROWS.block)
    errors = rows_step_errors(_ROWS, head_dim=head_dim, threads=threads, **case)
    assert max(errors) < 1e-5


@needs_rows
def test_rows_step_takes_the_softcap_of_many_rows_of_a_long_vocabulary_on_both_cores():
    # 5 x 1000 logits: chunks of the softcap end mid-row, and the last is a partial one
    assert max(rows_step_errors(_ROWS, rows=5, widths=(64, 128, 1000))) < 1e-5


@needs_rows
def test_a_prefix_longer_than_its_cache_is_refused():
    prefix = tuple(torch.randn(2, 1, 10, 2, 16) for _ in range(2))
    with pytest.raises(ValueError, match="11 positions"):
        _ROWS.pack_prefix(prefix, 11)
    with pytest.raises(ValueError, match="fp32"):
        _ROWS.pack_prefix((prefix[0], prefix[1].transpose(3, 4).contiguous()), 4)
    packed = _ROWS.pack_prefix(prefix, 6)
    x = torch.randn(1, 8)
    with pytest.raises(ValueError, match="packed for 6 positions, not 7"):
        _ROWS.run(None, x, None, None, None, packed, 7, (x, x), 7, 1)  # type: ignore[arg-type]


needs_half_rows = pytest.mark.skipif(
    _ROWS is None or not _ROWS.half_panel, reason="rows_step reads no fp16 here (no F16C)"
)


@needs_half_rows
@pytest.mark.parametrize(
    "case",
    [
        {"rows": 1, "prompt": None},  # batch-1 decode of a big model: 1 row, 4 inputs a pass
        {"rows": 1, "threads": 1},
        {},  # 3 rows over a prompt; a vocabulary ending in a panel without a pair (8 lanes)
        {"rows": 2, "bf16_table": True},  # a checkpoint's value embeddings, kept bf16
        {"rows": 8, "threads": 1},
        {"rows": 7},
        {**_WIDE_HEADS, "rows": 9, "prompt": 40, "pos": 50},
        {"rows": 8, "prompt": 40, "pos": 45, "windows": (100, 20)},  # starts mid-prompt
    ],
)
def test_rows_step_reads_fp16_matrices_from_half_panels_as_torch_sums_them_widened(case):
    logits, keys, values = rows_step_errors(_ROWS, half=True, **case)
    assert logits < 1e-5 and keys < 1e-5 and values < 1e-5


@needs_rows
def test_rows_step_reads_bf16_value_embeddings_of_fp32_models():
    assert max(rows_step_errors(_ROWS, bf16_table=True)) < 1e-5


@needs_rows
@pytest.mark.parametrize("bf16", [False, True])
def test_rows_embed_is_the_normalised_look_up_plus_the_smear(bf16):
    # without the smear, with each row's previous token, with one previous token for all
    assert embed_errors(_ROWS, bf16=bf16) < 1e-5


@needs_rows
def test_rows_embed_takes_fp32_and_bf16_tables_and_int64_ids():
    assert _ROWS.embeds(torch.zeros(4, 8)) and _ROWS.embeds(torch.zeros(4, 8, dtype=torch.bfloat16))
    assert not _ROWS.embeds(torch.zeros(4, 8, dtype=torch.float16))
    assert not _ROWS.embeds(torch.zeros(8, 4).t())  # not contiguous
    with pytest.raises(ValueError, match="int64"):
        _ROWS.embed(torch.zeros(4, 8), torch.zeros(2, dtype=torch.int32), 1e-6)
    with pytest.raises(ValueError, match="gate"):
        _ROWS.embed(
            torch.zeros(4, 8), torch.zeros(2, dtype=torch.long), 1e-6, torch.zeros(2).long()
        )
    with pytest.raises(ValueError, match="channels"):
        _ROWS.embed(torch.zeros(4, 8), torch.zeros(2).long(), 1e-6, torch.zeros(2).long(),
                    torch.zeros(9), 0.5)  # fmt: skip


@needs_rows
@pytest.mark.parametrize("bad", [-1, 4])
def test_rows_embed_refuses_ids_outside_the_table_as_torchs_look_up_does(bad):
    table, gate = torch.randn(4, 8), torch.zeros(3)
    ids = torch.tensor([1, bad])
    with pytest.raises(IndexError, match="4 rows"):
        _ROWS.embed(table, ids, 1e-6)
    # A previous token out of range too; -1 there means none (a sequence's first token).
    prev = torch.tensor([1, -2 if bad == -1 else bad])
    with pytest.raises(IndexError, match="4 rows"):
        _ROWS.embed(table, torch.tensor([1, 2]), 1e-6, prev, gate, 0.5)
    with pytest.raises(IndexError):  # the model's nn.Embedding
        torch.nn.functional.embedding(ids, table)


@needs_rows
def test_a_rows_step_whose_embed_answers_wrongly_is_not_used(fresh, monkeypatch):
    def wrong(self, table, ids, eps, prev=None, gate=None, smear_lambda=0.0):
        return torch.zeros(ids.size(0), table.size(1))

    monkeypatch.setattr(RowsStep, "embed", wrong)
    assert rows_step() is None
    assert "embed disagrees" in kernel_build.unavailable_reason("rows_step")


@needs_rows
@pytest.mark.parametrize("length", [200_003, 5])  # whole vectors and a tail; a tail alone
def test_the_steps_softcap_is_cap_times_tanh_within_a_few_float_roundings(length):
    cap = 15.0
    z = torch.cat(
        [
            torch.linspace(-40, 40, 100_001),  # the series' side of 0.25 and the other's
            torch.linspace(-0.3, 0.3, 100_001),
            torch.logspace(-30, 1, 1000) * torch.tensor([1.0, -1.0]).repeat(500),
            torch.tensor([float("inf"), float("-inf"), float("nan")]),
        ]
    )[-length:]
    got = _ROWS.softcap(z.clone(), cap).double()
    want = cap * torch.tanh(z.double())
    finite = torch.isfinite(z) & (z != 0)
    # torch's own fp32 tanh is within 1.1e-7 of the exact value here
    assert ((got - want).abs() / want.abs())[finite].max() < 3e-7
    assert torch.equal(got.isnan(), z.isnan())
    far = z.abs() >= 9  # tanh rounds to 1 there: exactly +-cap, infinities too
    assert torch.equal(got[far], cap * z[far].sign().double())


def _panels(prefix: tuple[torch.Tensor, torch.Tensor], length: int, block: int):
    """RowsStep.pack_prefix's layout in torch: keys (layers, Hkv, P / block, D, block),
    values (layers, Hkv, Dp / block, length, block), zero-padded to whole panels."""
    keys, values = (c[:, 0, :length] for c in prefix)  # (layers, T, Hkv, D)
    layers, _, kv_heads, head_dim = keys.shape
    padded, wide = -(-length // block) * block, -(-head_dim // block) * block
    keys = torch.nn.functional.pad(keys, (0, 0, 0, 0, 0, padded - length))
    keys = keys.view(layers, padded // block, block, kv_heads, head_dim).permute(0, 3, 1, 4, 2)
    values = torch.nn.functional.pad(values, (0, wide - head_dim))
    values = values.view(layers, length, kv_heads, wide // block, block).permute(0, 2, 3, 1, 4)
    return keys.contiguous(), values.contiguous()


@needs_rows
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("length", "head_dim"), [(40, 24), (32, 64), (1, 16), (300, 20)])
def test_the_prefix_is_packed_in_panels_of_a_block_padded_with_zeros(length, head_dim, threads):
    prefix = tuple(torch.randn(3, 1, length + 5, 2, head_dim) for _ in range(2))
    keys, values = _ROWS.pack_prefix(prefix, length, threads)
    want_keys, want_values = _panels(prefix, length, _ROWS.block)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


def test_half_panels_are_the_fp16_matrix_in_f16_rows_layout():
    matrix = torch.randn(5, 48)  # (in, out): whole panels of 8 and of 16 (AVX-512's)
    panels = HalfPanels.of(matrix, 8)
    assert panels.shape == (5, 48) and panels.panels.dtype == torch.float16
    assert torch.equal(panels.panels, pack_panels(matrix.half(), 8))
    assert torch.equal(panels.matrix(), matrix.half().float())
    if _F16_ROWS is not None:  # the layout of an fp16 copy's own panels
        packed = _F16_ROWS.pack(matrix.t())
        assert torch.equal(HalfPanels.of(matrix, _F16_ROWS.panel).panels, packed)


@needs_half_rows
def test_a_rows_step_that_answers_fp16_wrongly_is_not_used(fresh, monkeypatch):
    errors = rows_step_reference.rows_step_errors

    def fp16_wrong(kernel: RowsStep, **case: object) -> list[float]:
        return [1.0, 0.0, 0.0] if case.get("half") else errors(kernel, **case)

    monkeypatch.setattr(rows_step_module, "rows_step_errors", fp16_wrong)
    assert rows_step() is None
    assert "fp16" in kernel_build.unavailable_reason("rows_step")


@needs_half_rows
def test_rows_step_refuses_fp16_it_does_not_read():
    g = torch.Generator().manual_seed(4)
    p = _ROWS.half_panel
    shapes = [(32, 4 * p), (2 * p, 32), (32, 4 * p), (4 * p, 32)]

    def layer(half: bool = True, panel: int = p, table: torch.Tensor | None = None) -> RowsLayer:
        ws = [torch.randn(*s, generator=g) for s in shapes]
        ms = [HalfPanels.of(w, panel) if half else w for w in ws]
        gate = torch.randn(1, 8) if table is not None else None
        return RowsLayer(*ms, gate, table, window=10)

    kwargs = dict(n_head=2, n_kv_head=1, ve_scale=1.0, eps=1e-6, norm_scale=1.0, norm_eps=0.0,
                  softcap=15.0)  # fmt: skip
    head = HalfPanels.of(torch.randn(32, 2 * p), p)
    assert _ROWS.model([layer()], head, **kwargs).half
    with pytest.raises(ValueError, match="every matrix fp16 or every one fp32"):
        _ROWS.model([layer(half=False)], head, **kwargs)
    with pytest.raises(ValueError, match="whole panels"):
        _ROWS.model([layer(panel=2 * p)], HalfPanels.of(torch.randn(32, 4 * p), 2 * p), **kwargs)
    with pytest.raises(ValueError, match="all fp32 or all bf16"):
        _ROWS.model([layer(table=torch.randn(50, p).half())], head, **kwargs)


needs_int8_rows = pytest.mark.skipif(
    _ROWS is None or not _ROWS.int8_panel, reason="rows_step reads no int8 here (no AVX2)"
)


@needs_int8_rows
@pytest.mark.parametrize(
    "case",
    [
        {"rows": 1, "prompt": None},  # batch-1 decode: one row, 4 inputs a pass
        {"rows": 1, "threads": 1},
        {},  # 3 rows over a prompt; a vocabulary ending in a panel without a pair (8 lanes)
        {"rows": 2, "bf16_table": True},
        {"rows": 8, "threads": 1},
        {"rows": 7},
        {**_WIDE_HEADS, "rows": 9, "prompt": 40, "pos": 50},
    ],
)
def test_rows_step_reads_int8_matrices_as_their_codes_times_their_scales(case):
    logits, keys, values = rows_step_errors(_ROWS, int8=True, **case)
    assert logits < 1e-5 and keys < 1e-5 and values < 1e-5


def test_int8_panels_are_the_scales_then_the_codes_in_panels():
    weight = torch.randn(48, 5)  # (out, in): whole panels of 8 and of 16
    codes, scales = int8_rows(weight)
    panels = Int8Panels.of(codes, scales, 8)
    assert panels.shape == (5, 48) and panels.buffer.dtype == torch.int8
    assert torch.equal(panels.scales, scales)
    assert torch.equal(panels.buffer[4 * 48 :], pack_panels(codes.t(), 8))
    assert torch.equal(panels.matrix(), codes.t().float() * scales)
    with pytest.raises(ValueError, match="whole panels of 16"):
        Int8Panels.of(*int8_rows(torch.randn(40, 5)), 16)


@needs_int8_rows
@pytest.mark.parametrize("rows", [1, 2, 8, 9, 16])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_int8_product_is_each_row_times_the_codes_then_the_scales(rows, threads):
    # Any row count (a chat turn's few tokens): passes of 8, each weight widened once a pass.
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(6 * _ROWS.int8_panel, 40, generator=g)
    panels = Int8Panels.of(*int8_rows(weight), _ROWS.int8_panel, _ROWS.int8_interleave)
    x = torch.randn(rows, 40, generator=g)
    got = _ROWS.int8_product(panels, x, threads)
    torch.testing.assert_close(got, x @ panels.matrix(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"takes \(rows, 40\)"):
        _ROWS.int8_product(panels, torch.randn(2, 41), threads)


@needs_int8_rows
def test_a_rows_step_that_answers_int8_wrongly_is_not_used(fresh, monkeypatch):
    errors = rows_step_reference.rows_step_errors

    def int8_wrong(kernel: RowsStep, **case: object) -> list[float]:
        return [1.0, 0.0, 0.0] if case.get("int8") else errors(kernel, **case)

    monkeypatch.setattr(rows_step_module, "rows_step_errors", int8_wrong)
    assert rows_step() is None
    assert "int8" in kernel_build.unavailable_reason("rows_step")


@needs_int8_rows
def test_rows_step_refuses_int8_it_does_not_read():
    g = torch.Generator().manual_seed(4)
    p = _ROWS.int8_panel
    shapes = [(32, 4 * p), (2 * p, 32), (32, 4 * p), (4 * p, 32)]

    def int8(matrix: torch.Tensor, panel: int = p) -> Int8Panels:
        return Int8Panels.of(*int8_rows(matrix.t()), panel, _ROWS.int8_interleave)

    def layer(kind: str = "int8", panel: int = p) -> RowsLayer:
        ws = [torch.randn(*s, generator=g) for s in shapes]
        ms = [int8(w, panel) if kind == "int8" else HalfPanels.of(w, p) if kind else w for w in ws]
        return RowsLayer(*ms, None, None, window=10)

    kwargs = dict(n_head=2, n_kv_head=1, ve_scale=1.0, eps=1e-6, norm_scale=1.0, norm_eps=0.0,
                  softcap=15.0)  # fmt: skip
    head = int8(torch.randn(32, 2 * p))
    assert _ROWS.model([layer()], head, **kwargs).weights == "int8"
    for other in ("", "fp16"):
        with pytest.raises(ValueError, match="every matrix int8 or every one fp32"):
            _ROWS.model([layer(other)], head, **kwargs)
    with pytest.raises(ValueError, match="whole panels"):
        _ROWS.model([layer(panel=2 * p)], int8(torch.randn(32, 4 * p), 2 * p), **kwargs)


@pytest.mark.skipif(
    shutil.which("cc") is None or platform.machine() not in ("x86_64", "AMD64"),
    reason="needs cc on x86-64",
)
def test_rows_step_built_for_a_cpu_with_f16c_but_not_avx2_reads_no_int8(tmp_path):
    # An Ivy Bridge: AVX and F16C widen fp16, but sign-extending 8 bytes to 8 ints is AVX2's.
    import ctypes

    lib = tmp_path / "decode_ops.so"
    tools = kernel_build.toolchain()
    flags = [f if f != "-march=native" else "-march=ivybridge" for f in tools.flags]
    subprocess.run([tools.path, *flags, str(DECODE_OPS_SOURCE), "-o", str(lib)],
                   check=True)  # fmt: skip
    ivy = RowsStep(ctypes.CDLL(str(lib)))
    assert ivy.half_panel == 8 and ivy.int8_panel == 0
    weight = Int8Panels.of(*int8_rows(torch.randn(16, 32)), 8)
    with pytest.raises(ValueError, match="no int8 panels"):
        ivy.int8_product(weight, torch.randn(1, 32))


@pytest.mark.skipif(
    shutil.which("cc") is None or platform.machine() not in ("x86_64", "AMD64"),
    reason="needs cc on x86-64",
)
def test_rows_step_built_without_f16c_reads_fp32_only(tmp_path):
    # The oldest x86-64 (SSE2, 4 lanes): no instruction widens fp16, so the library says so
    # and a model of fp16 matrices is refused before a call, the fp32 step still exact.
    import ctypes
    import subprocess

    lib = tmp_path / "decode_ops.so"
    tools = kernel_build.toolchain()
    flags = [f if f != "-march=native" else "-march=x86-64" for f in tools.flags]
    subprocess.run([tools.path, *flags, str(DECODE_OPS_SOURCE), "-o", str(lib)],
                   check=True)  # fmt: skip
    oldest = RowsStep(ctypes.CDLL(str(lib)))
    assert oldest.half_panel == oldest.int8_panel == 0 and oldest.block == 8
    assert max(rows_step_errors(oldest, rows=7)) < 1e-5
    ws = [HalfPanels.of(torch.randn(*s), 8) for s in [(32, 64), (32, 32), (32, 64), (64, 32)]]
    with pytest.raises(ValueError, match="no fp16 here"):
        oldest.model([RowsLayer(*ws, None, None, window=10)], HalfPanels.of(torch.randn(32, 16), 8),
                     n_head=2, n_kv_head=1, ve_scale=1.0, eps=1e-6, norm_scale=1.0,
                     norm_eps=0.0, softcap=15.0)  # fmt: skip


def _tiny_model():
    g = torch.Generator().manual_seed(1)
    layer = RowsLayer(*(torch.randn(*s, generator=g) for s in [(32, 64), (32, 32), (32, 64), (64, 32)]),
                      None, None, window=10)  # fmt: skip
    return _ROWS.model([layer], torch.randn(32, 50, generator=g), n_head=2, n_kv_head=1,
                       ve_scale=0.0, eps=1e-6, norm_scale=1 / 16, norm_eps=1e-6, softcap=15.0)  # fmt: skip


@needs_rows
def test_rows_step_reads_only_caches_laid_out_as_it_assumes():
    model = _tiny_model()  # 1 layer, 2 heads of 16, one K/V head
    x, ids, cs = torch.randn(2, 32), torch.tensor([3, 4]), torch.rand(16)
    suffix = (torch.zeros(1, 2, 8, 1, 16), torch.zeros(1, 2, 8, 1, 16))
    prefix = (torch.randn(1, 1, 8, 1, 16), torch.randn(1, 1, 8, 1, 16))
    assert _ROWS.takes(model, 2, prefix, suffix)
    for wrong_prefix, wrong_suffix in [
        (prefix, (suffix[0].bfloat16(), suffix[1])),  # another dtype
        (prefix, (suffix[0].transpose(2, 3), suffix[1])),  # not contiguous
        ((prefix[0].expand(1, 2, 8, 1, 16).contiguous(), prefix[1]), suffix),  # 2 prompt rows
        (prefix, (torch.zeros(1, 3, 8, 1, 16), suffix[1])),  # 3 rows, not 2
        (prefix, (torch.zeros(1, 2, 8, 2, 8), suffix[1])),  # another head layout
    ]:
        assert not _ROWS.takes(model, 2, wrong_prefix, wrong_suffix)
        with pytest.raises(ValueError, match="caches"):
            _ROWS(model, x.clone(), ids, cs, cs, wrong_prefix, 4, wrong_suffix, 5)
    with pytest.raises(ValueError, match="does not take"):  # a position inside the prompt
        _ROWS(model, x.clone(), ids, cs, cs, prefix, 4, suffix, 2)
    assert torch.equal(suffix[0], torch.zeros(1, 2, 8, 1, 16))  # nothing written
    with pytest.raises(ValueError, match="int64"):
        _ROWS(model, x.clone(), ids.int(), cs, cs, prefix, 4, suffix, 5)


@needs_rows
def test_rows_step_refuses_matrices_it_does_not_read():
    g = torch.Generator().manual_seed(2)
    shapes = [(32, 64), (32, 32), (32, 64), (64, 32)]
    layer = RowsLayer(*(torch.randn(*s, generator=g) for s in shapes), None, None, window=10)
    kwargs = dict(n_kv_head=1, ve_scale=0.0, eps=1e-6, norm_scale=1.0, norm_eps=0.0, softcap=15.0)
    odd = RowsLayer(*(torch.randn(*s) for s in [(32, 90), (30, 32), (32, 64), (64, 32)]),
                    None, None, window=10)  # fmt: skip
    with pytest.raises(ValueError, match="head width"):  # 2 heads of 15: no rotary halves
        _ROWS.model([odd], torch.randn(32, 50), n_head=2, **{**kwargs, "n_kv_head": 2})
    with pytest.raises(ValueError, match="other shapes"):  # a layer of another width
        _ROWS.model([layer, odd], torch.randn(32, 50), n_head=2, **kwargs)
    layer.fc = layer.fc.t()  # (64, 32) seen through a transpose: not contiguous
    with pytest.raises(ValueError, match="contiguous fp32"):
        _ROWS.model([layer], torch.randn(32, 50), n_head=2, **kwargs)


def test_a_decode_step_keeps_torchs_ops_when_the_kernels_are_off(fresh, monkeypatch):
    from builders import random_gpt

    from chatcli.engine.decode_step import DecodeStep

    monkeypatch.setenv("CHATCLI_NATIVE_KERNELS", "0")
    assert DecodeStep(random_gpt("E")).kernel is None
    assert "CHATCLI_NATIVE_KERNELS=0" in kernel_build.unavailable_reason("rows_step")


def test_panels_hold_each_block_of_columns_contiguous_then_the_rest():
    matrix = torch.arange(5 * 7, dtype=torch.float32).view(5, 7)  # (in, out)
    flat = pack_panels(matrix, 3)  # panels of columns 0-2 and 3-5, then column 6
    assert flat.shape == (35,)
    assert torch.equal(flat[:15].view(5, 3), matrix[:, 0:3])
    assert torch.equal(flat[15:30].view(5, 3), matrix[:, 3:6])
    assert torch.equal(flat[30:].view(5, 1), matrix[:, 6:])
    assert torch.equal(pack_panels(matrix, 7), matrix.reshape(-1))  # one whole panel
