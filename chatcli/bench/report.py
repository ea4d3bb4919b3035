"""`chatcli bench`'s table: what chatcli.bench.bench measured, as a person reads it (the JSON is
the bench's own dict)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from chatcli.terminal.render_panels import render_table

if TYPE_CHECKING:
    from chatcli.terminal.render import Console


def render_bench(console: Console, result: dict[str, Any]) -> None:
    """The model and its plan, the table of measures side by side, then the ratios."""
    on = f" on {result['device_name']}" if result.get("device_name") else ""
    console.print(
        f"{result['model']}{on}: {result['params'] / 1e6:.1f}M params, {result['weights']} "
        "weights; "
        f"plan: {result['plan']}, decode via {result['decode_path']}"
        + (" (compiled)" if result.get("compiled") else "")
        + (f" through our {result['step_kernel']} kernel" if result["step_kernel"] else "")
        + (f" ({', '.join(result['one_row_kernels'])})" if result["one_row_kernels"] else "")
        + (
            f" (2-8 rows: {', '.join(result['sample_rows_kernels'])})"
            if result["sample_rows_kernels"]
            else ""
        )
        + "; "
        f"memory bandwidth {result['bandwidth_gbs']} GB/s, "
        f"{result['weight_mb_per_token']} MB of weights per token -> roofline "
        f"{result['roofline_tps']} tok/s"
    )
    if result.get("kernels"):  # our C kernels did not load: the numbers below are torch's
        console.print(result["kernels"])
    rows = []
    p, t = result["prefill_tps"], result["threads"]
    by_rows = ", ".join(
        f"{n} at {k} row{'s' if int(k) > 1 else ''}" for k, n in result["decode_threads"].items()
    )
    ours_threads = f"{t['ours']} (decode: {by_rows})" if by_rows else str(t["ours"])
    rows.append(("threads", str(t["baseline"]), ours_threads, ""))
    prefill_ratio = f"{round(p['ours'] / p['baseline'], 2)}x" if p["baseline"] else ""
    rows.append(("prefill tok/s", str(p["baseline"]), str(p["ours"]), prefill_ratio))
    for key, title in (
        ("decode_tps", "decode tok/s, batch 1"),
        ("decode8_tps", "decode tok/s, 8 samples"),
    ):
        r = result[key]
        rows.append((title, str(r["baseline"]), str(r["ours"]), f"{r['ratio']}x"))
    ttft = result["ttft_s"]
    for turn in (1, 5, 10):
        # int keys as run_bench returns them, str keys as its JSON reads back
        base, ours = (
            ttft[side].get(turn, ttft[side].get(str(turn))) for side in ("baseline", "ours")
        )
        rows.append(
            (
                f"time to first token, turn {turn} (s)",
                str(base),
                str(ours),
                times_faster(base, ours),
            )
        )
    render_table(console, ("measure", "baseline", "ours", "ours / baseline"), rows)
    if ttft.get("chat_outgrew_context"):
        console.print(
            "The scripted chat outgrew the model's context: old turns were dropped and the "
            "cache rebuilt, which the later turns' time to first token includes."
        )
    console.print(
        f"8 samples / single: {result['samples8_vs_single']}x (one sample of the same prompt, "
        f"temperature 1: {result['single_sampled_tps']} tok/s); "
        f"TTFT turn 10 / turn 1: ours {ttft['ours_turn10_over_turn1']}, baseline "
        f"{ttft['baseline_turn10_over_turn1']}; roofline fraction {result['roofline_fraction']} "
        f"(of the bf16 roofline, {result['bf16_roofline_tps']} tok/s: "
        f"{result['bf16_roofline_fraction']}; against the bandwidth probed beside a decode "
        f"run: {result['roofline_fraction_paired']}, bf16 "
        f"{result['bf16_roofline_fraction_paired']}); "
        f"fp32 greedy identical: {result['greedy_identical_fp32']}; greedy agreement of the "
        f"fast path with fp32: {result['greedy_agreement']}; peak RSS {result['peak_rss_mb']} "
        "MB"
        + (
            f", peak device memory {result['peak_device_mb']} MB"
            if result.get("peak_device_mb") is not None
            else ""
        )
        + " (without the bench's bandwidth probe)"
    )


def times_faster(baseline_s: float, ours_s: float) -> str:
    """A time's ratio said the way round that reads: "2.5x faster", or "1.18x slower"."""
    if ours_s <= baseline_s:
        return f"{round(baseline_s / max(ours_s, 1e-9), 2)}x faster"
    return f"{round(ours_s / max(baseline_s, 1e-9), 2)}x slower"


def render_speculation(console: Console, rows: list[dict[str, Any]]) -> None:
    """The speculation rows (speculation_rows.py): each workload's greedy reply decoded
    plainly and with drafting, side by side."""
    table = [
        (
            r["workload"],
            str(r["plain_tps"]),
            str(r["speculate_tps"]),
            f"{r['ratio']}x",
            f"{r['acceptance']:.0%}",
            str(r["tokens_per_verification"]),
            "yes" if r["same_reply"] else "NO",
        )
        for r in rows
    ]
    header = ("speculation", "plain tok/s", "drafting tok/s", "ratio", "drafts taken")
    render_table(console, (*header, "tokens / verify", "same reply"), table)
