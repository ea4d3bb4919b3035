"""The bench command: our engine against the plain baseline, side by side."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from chatcli.cli.options import (
    CompileOpt,
    ModelOpt,
    SoftcapOpt,
    fail_with,
)
from chatcli.errors import ChatcliError, UsageError

BENCH_HELP = (
    "Measure our engine against the plain baseline, side by side, in one run.\n\n"
    "The baseline runs the model the plain way (eager fp32, the whole conversation prefilled "
    "again every turn, the prompt's cache copied into every sample row, torch.multinomial, "
    "a host read per row per step); ours as chatcli runs it. On a GPU (--device auto picks "
    "one) both run there, ours in bf16 with its decode step as a CUDA graph. Measured for both: prefill tok/s, decode tok/s at batch 1 and "
    "with 8 samples, time to first token at turns 1, 5 and 10 of a scripted chat, peak memory, "
    "and the memory's bandwidth with the roofline it sets for the weights; each the best of "
    "three alternating rounds.\n\n"
    "On a 2-core CPU the embedded model takes ~25 s, --synthetic d20 ~7 minutes and ~10 GB "
    "of memory; on an H200 ~25 s and ~45 s."
)


def bench(
    model: ModelOpt = None,
    synthetic: Annotated[
        str | None, typer.Option(help="A random-weight nanochat of depth d4, d12 or d20.")
    ] = None,
    quantize: Annotated[
        str,
        typer.Option(
            help="Weights for ours. On a CPU its decode copies: auto (16-bit copies for a big "
            "model, else the fp32 weights), float32 (or none), float16, bfloat16, int8 or "
            "int4. On a GPU: auto (bf16 where the card computes in it), float32 or bfloat16."
        ),
    ] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON only.")] = False,
    softcap: SoftcapOpt = None,
    device: Annotated[
        str, typer.Option(help="auto (a CUDA device where there is one), cpu, cuda or cuda:N.")
    ] = "auto",
    compile_model: CompileOpt = False,
    speculate: Annotated[
        str,
        typer.Option(
            metavar="auto|off",
            help="auto: also decode a copy and an open-ended reply plainly and with drafting, "
            "side by side (speculation rows); off: not.",
        ),
    ] = "auto",
) -> None:
    """Measure our engine against the plain baseline, side by side, in one run."""
    from chatcli.bench.bench import run_bench
    from chatcli.bench.models import SYNTHETIC_DEPTHS, bench_device, gpu_weights, synthetic_model
    from chatcli.bench.report import render_bench, render_speculation
    from chatcli.bench.speculation_rows import speculation_rows
    from chatcli.model.checkpoint import load_model
    from chatcli.model.quantize import QUANTIZE_KINDS
    from chatcli.terminal.render import make_console

    try:
        # The options first: a mistake should not wait for a model to load.
        quantize = "float32" if quantize == "none" else quantize  # as chat and once say it
        if quantize not in ("auto", "float32", *QUANTIZE_KINDS):
            raise UsageError(
                f"--quantize takes auto, float32 (or none), {', '.join(QUANTIZE_KINDS)}; "
                f"not {quantize!r}."
            )
        # A device word the bench does not take is the command line's mistake (exit 2); a
        # CUDA device this machine lacks, or weights its card cannot run, are the machine's (1).
        kind, _, index = device.partition(":")
        wrong_word = kind not in ("auto", "cpu", "cuda") or (index and not index.isdigit())
        try:
            where = bench_device(device)
            if where.type == "cuda":
                gpu_weights(quantize, where)
        except ValueError as e:
            raise (UsageError if wrong_word else ChatcliError)(str(e)) from None
        if speculate not in ("auto", "off"):
            raise UsageError(f"--speculate takes auto or off, not {speculate!r}.")
        if synthetic is not None and model is not None:
            raise UsageError("Pass --model or --synthetic, not both.")
        if synthetic is not None and softcap is not None:
            raise UsageError("--softcap is a checkpoint's: a --synthetic model caps at 15.")
        if synthetic is not None:
            if synthetic not in SYNTHETIC_DEPTHS:
                raise UsageError(f"--synthetic takes one of {', '.join(SYNTHETIC_DEPTHS)}.")
            net, tokenizer = synthetic_model(synthetic, where)
            label = f"synthetic {synthetic}"
        else:
            # fp32 on a GPU: the baseline's weights (the bench makes ours' bf16 copy itself).
            dtype = "float32" if where.type == "cuda" else "auto"
            net, tokenizer, _ = load_model(model, device=str(where), dtype=dtype, softcap=softcap)
            label = "embedded default model" if model is None else str(model)
        # A run takes from ~25 s to minutes, with nothing to show until it ends.
        typer.echo(f"Measuring {label} on {where}, baseline and ours in turn…", err=True)
        result = run_bench(net, tokenizer, label, precision=quantize, compile=compile_model)
        if speculate == "auto":
            result["speculation"] = speculation_rows(net, tokenizer, synthetic is not None)
    except ChatcliError as e:
        raise fail_with(e) from None
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    console = make_console()
    render_bench(console, result)
    if "speculation" in result:
        render_speculation(console, result["speculation"])
