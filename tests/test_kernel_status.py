"""What a person is told about our C kernels and the device: the chat banner's and the bench's
line where the kernels do not run, and `--device auto`'s choice on Apple Silicon."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from chatcli.bench.report import render_bench
from chatcli.cli.app import app
from chatcli.kernels import build as kernel_build
from chatcli.kernels.rows_step import rows_step
from chatcli.kernels.sample_rows import sample_rows
from chatcli.kernels.status import kernels_line, toolchain_line
from chatcli.model import device_choice, model_build
from chatcli.model.device_choice import (
    MPS_MIN_MATRIX_PARAMS,
    DeviceChoice,
    choose_apple_device,
)
from chatcli.terminal.render_panels import render_banner

runner = CliRunner()


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    """A home of its own, and the kernels' loaders decided again with an empty cache."""
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in ("CHATCLI_TEMPERATURE", "CHATCLI_MODEL", "CHATCLI_CONFIG", "CHATCLI_URL"):
        monkeypatch.delenv(name, raising=False)
    for kernel in (rows_step, sample_rows):
        kernel.cache_clear()
    yield
    for kernel in (rows_step, sample_rows):
        kernel.cache_clear()


def test_the_chat_banner_says_why_the_kernels_are_off_and_the_fix(monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc")
    result = runner.invoke(app, ["chat", "-t", "0", "--max-tokens", "4"], input="hi\n")
    assert result.exit_code == 0, result.output
    line = next(ln for ln in result.stderr.splitlines() if ln.startswith("C kernels off"))
    assert line.startswith(
        "C kernels off (rows_step, sample_rows): could not build decode_ops.c: "
        "no C compiler (no-such-cc) on PATH (fix: "
    )
    assert f"(fix: {kernel_build.install_hint()})" in line
    assert "torch's ops" in line
    assert result.stdout.strip()  # the chat went on, on torch's ops


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_the_chat_banner_says_nothing_of_kernels_that_run():
    result = runner.invoke(app, ["chat", "-t", "0", "--max-tokens", "4"], input="hi\n")
    assert result.exit_code == 0, result.output
    assert "C kernels" not in result.stderr
    assert kernels_line() is None


def test_kernels_turned_off_by_hand_say_so(monkeypatch):
    monkeypatch.setenv("CHATCLI_NATIVE_KERNELS", "0")
    assert kernels_line() == (
        "C kernels off (rows_step, sample_rows): turned off by CHATCLI_NATIVE_KERNELS=0; "
        "decoding with torch's ops: correct, several times slower for a small model"
    )


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_the_toolchain_line_names_compiler_flag_threads_and_target():
    tools = kernel_build.toolchain()
    line = toolchain_line()
    assert line.startswith(f"{tools.kind} (cc) ")
    assert line.endswith(f", {tools.threads}, {tools.target}")


def test_the_banner_shows_why_auto_chose_the_device_and_the_kernels_notice():
    out = io.StringIO()
    render_banner(
        Console(file=out, width=120, color_system=None),
        {
            "device": "cpu",
            "device_note": "our C kernels: faster than MPS for 477M weights",
            "dtype": "float32",
            "kernels": None,
        },
    )
    assert out.getvalue() == (
        "chatcli\n"
        "cpu (our C kernels: faster than MPS for 477M weights) · float32\n"
        "Type /help for commands, Ctrl-D to exit.\n"
    )
    out = io.StringIO()
    render_banner(
        Console(file=out, width=200, color_system=None),
        {"device": "cpu", "kernels": "C kernels off (rows_step): no C compiler"},
    )
    assert out.getvalue().splitlines()[2] == "C kernels off (rows_step): no C compiler"


def test_the_bench_report_leads_with_the_kernels_line_where_they_do_not_run():
    result = json.loads((Path(__file__).parent / "data" / "bench_h200_embedded.json").read_text())
    off = "C kernels off (rows_step, sample_rows): turned off by CHATCLI_NATIVE_KERNELS=0"
    for kernels, shown in ((None, False), (off, True)):
        out = io.StringIO()
        render_bench(
            Console(file=out, width=300, color_system=None), {**result, "kernels": kernels}
        )
        assert (off in out.getvalue().splitlines()) is shown


@pytest.mark.parametrize(
    ("params", "kernels", "mps", "bf16", "device", "why"),
    [
        # the embedded model: dispatch-bound everywhere, and our kernels run it as one call
        (3_600_000, True, True, True, "cpu", "our C kernels: a small model's step"),
        (3_600_000, False, True, True, "cpu", "torch's CPU ops: a small model's step"),
        # d20: our fp16 copies' kernel, never MPS's launches
        (477_000_000, True, True, True, "cpu", "our C kernels: faster than MPS for 477M"),
        # a model past a billion weights streams them faster from the GPU
        (MPS_MIN_MATRIX_PARAMS, True, True, True, "mps", "MPS: 1,000M weights stream"),
        (3_000_000_000, False, True, True, "mps", "MPS: 3,000M weights stream"),
        # without our kernels, a mid-size model goes to MPS ...
        (477_000_000, False, True, True, "mps", "MPS: our C kernels are not built here"),
        # ... but never where MPS has no bf16 (its fp32 reads twice the CPU's fp16 bytes)
        (3_000_000_000, True, True, False, "cpu", "MPS here has no bf16"),
        (477_000_000, False, True, False, "cpu", "MPS here has no bf16"),
        (3_000_000_000, True, False, False, "cpu", "no Apple GPU"),
    ],
)
def test_auto_on_apple_silicon_picks_the_faster_side_by_model_size(
    params, kernels, mps, bf16, device, why
):
    choice = choose_apple_device(params, kernels, mps, bf16)
    assert isinstance(choice, DeviceChoice)
    assert choice.device == device and choice.why.startswith(why), choice


def test_pick_device_asks_the_size_only_on_apple_silicon_with_mps(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device wins auto before any of this")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda *_: True)
    monkeypatch.setattr(model_build, "on_apple_silicon", lambda: False)
    assert model_build.pick_device("auto", 477_000_000).type == "mps"  # elsewhere: as before
    monkeypatch.setattr(model_build, "on_apple_silicon", lambda: True)
    monkeypatch.setattr(device_choice, "on_apple_silicon", lambda: True)
    kernels = rows_step() is not None
    assert model_build.pick_device("auto", 477_000_000).type == ("cpu" if kernels else "mps")
    assert model_build.pick_device("auto", 3_000_000_000).type == "mps"
    assert model_build.pick_device("auto", 3_600_000).type == "cpu"
    assert model_build.pick_device("cpu", 3_000_000_000).type == "cpu"  # asked for by hand
    note = model_build.device_note("auto", 3_600_000)
    assert note is not None and note.endswith("a small model's step costs less than MPS's launches")
    assert model_build.device_note("cpu", 3_600_000) is None


def test_a_server_on_apple_silicon_lets_each_worker_weigh_its_model(monkeypatch):
    from chatcli.serve.runner import worker_devices

    if torch.cuda.is_available():
        pytest.skip("a CUDA device wins auto before any of this")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(device_choice, "on_apple_silicon", lambda: True)
    assert worker_devices("auto", 2) == ["auto", "auto"]  # load_model decides by size
    assert worker_devices("mps") == ["mps"]  # asked for by hand
    monkeypatch.setattr(device_choice, "on_apple_silicon", lambda: False)
    assert worker_devices("auto") == ["mps"]  # an Intel Mac's MPS: as before
