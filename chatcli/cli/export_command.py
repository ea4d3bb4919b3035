"""The export command: a model as a transformers folder that other tools load."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from chatcli.cli.options import ModelOpt, SoftcapOpt, SourceOpt, StepOpt, fail
from chatcli.cli.session_setup import settings_from
from chatcli.errors import ChatcliError

EXPORT_HELP = (
    "Write a model as a transformers folder: config.json, safetensors weights, the fast "
    "tokenizer with its chat template, generation_config.json and a model card.\n\n"
    "AutoModelForCausalLM.from_pretrained(OUT) and AutoTokenizer.from_pretrained(OUT) load it, "
    "and so do evaluation harnesses and the Transformers backends of vLLM and SGLang. Era A is "
    "transformers' own NanoChatForCausalLM; later eras carry chatcli's modeling file "
    "(trust_remote_code=True). The model is the one chat would run (--model, CHATCLI_MODEL or "
    "the config's; the embedded model by default). Needs the hf extra."
)


def export(
    out: Annotated[
        Path, typer.Argument(metavar="OUT", help="A new folder to write (or an empty one).")
    ],
    model: ModelOpt = None,
    source: SourceOpt = None,
    step: StepOpt = None,
    softcap: SoftcapOpt = None,
    dtype: Annotated[
        str,
        typer.Option(
            help="keep (default: each tensor as saved, lossless), float32 (lossless) or "
            "bfloat16 (half the size, rounded)."
        ),
    ] = "keep",
    remote_code: Annotated[
        bool,
        typer.Option(
            "--remote-code",
            help="Era A too through chatcli's modeling file: its bf16 rotary rounding exact "
            "(transformers' own class differs by ~4e-3 in fp32 logits).",
        ),
    ] = False,
) -> None:
    """Write a model as a transformers folder (see chatcli export -h)."""
    try:
        from chatcli.chat.settings import DEFAULTS

        settings = settings_from(model=model, source=source, step=step)
        from chatcli.model.hf_export import (
            GenerationDefaults,
            check_dtype,
            check_out_folder,
            export_model,
            read_source,
            remove_stale_partials,
            require_hf_extra,
        )

        require_hf_extra()  # these before reading gigabytes
        check_dtype(dtype)
        check_out_folder(out)
        for path, pid in remove_stale_partials(out):
            typer.echo(
                f"Removed {path}: a half-written export left by process {pid}, which is no "
                "longer running.",
                err=True,
            )
        src = read_source(settings.model, settings.source, settings.step, softcap)
        typer.echo(f"Exporting era {src.arch.era} from {src.origin}…", err=True)
        defaults = GenerationDefaults(DEFAULTS.temperature, DEFAULTS.top_k or None)
        result = export_model(out, src, defaults, dtype=dtype, remote_code=remote_code)
    except ChatcliError as e:
        raise fail(str(e)) from None
    kind = (
        "transformers' NanoChatForCausalLM"
        if result.native
        else "chatcli's modeling file (trust_remote_code=True)"
    )
    typer.echo(
        f"Wrote {result.folder}: era {result.era}, {result.num_params / 1e6:.1f}M parameters, "
        f"{result.size_bytes / 1e6:.1f} MB in {result.seconds:.1f} s, through {kind}."
    )
    typer.echo(f"Files: {', '.join(result.files)}")
