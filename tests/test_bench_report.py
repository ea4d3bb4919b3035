"""bench_report: the bench's table as a person reads it."""

from __future__ import annotations

from chatcli.bench.report import times_faster


def test_bench_says_a_time_ratio_the_way_round_that_reads():
    assert times_faster(0.0167, 0.0049) == "3.41x faster"
    assert times_faster(0.0035, 0.0041) == "1.17x slower"
    assert times_faster(0.004, 0.004) == "1.0x faster"


def test_a_gpu_bench_names_the_card_and_its_peak_memory():
    import io
    import json
    from pathlib import Path

    from rich.console import Console

    from chatcli.bench.report import render_bench

    # What `chatcli bench --device cuda --json` printed on an H200 (docs/performance.md, "Measured on a GPU").
    result = json.loads((Path(__file__).parent / "data" / "bench_h200_embedded.json").read_text())
    out = io.StringIO()
    render_bench(Console(file=out, width=200, color_system=None), result)
    text = " ".join(out.getvalue().split())
    assert text.startswith("embedded default model on NVIDIA H200: 3.6M params, bfloat16 weights")
    assert "decode via CUDA graph;" in text
    assert "decode tok/s, batch 1 386.9 2517.4 6.51x" in text
    assert "peak RSS 1533.4 MB, peak device memory 1132.4 MB (without" in text
    # --compile asked for, nothing compiled (a GPU keeps its graph): the report says nothing
    for compiled, said in ((False, "via CUDA graph;"), (True, "via CUDA graph (compiled);")):
        out = io.StringIO()
        render_bench(
            Console(file=out, width=200), {**result, "compile": True, "compiled": compiled}
        )
        assert said in out.getvalue()
