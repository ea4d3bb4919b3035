"""The structured-output options: `--json-schema FILE` and `--format json`.

Owns: the two options and the schema they ask for, read and checked before a model loads
(a schema the grammar cannot enforce is one red line, not a reply later). The grammar
itself is the engine's (chatcli.engine.grammar); a server at --url checks the schema itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from chatcli.errors import UsageError

JsonSchemaOpt = Annotated[
    Path | None,
    typer.Option(
        "--json-schema",
        metavar="FILE",
        help="Reply with JSON that follows the JSON Schema in FILE (the structured extra).",
    ),
]
FormatOpt = Annotated[
    str | None,
    typer.Option(
        "--format",
        metavar="json",
        help="json: reply with a JSON object (--json-schema for a given shape).",
    ),
]
FORMATS = ("json",)


def reply_schema(path: Path | None, reply_format: str | None, local: bool) -> dict[str, Any] | None:
    """The JSON Schema the reply follows ({"type": "object"} for --format json), or None for
    free text. With a `local` model its grammar is built now, so a schema it cannot enforce
    (or llguidance missing) fails before the model loads."""
    if reply_format is not None and reply_format not in FORMATS:
        raise UsageError(
            f"--format {reply_format!r}: the one format is json (--json-schema FILE for a "
            "given shape)."
        )
    if path is None and reply_format is None:
        return None
    from chatcli.engine.grammar import ANY_OBJECT, json_grammar, read_schema

    schema = read_schema(path) if path is not None else dict(ANY_OBJECT)
    if local:
        json_grammar(schema)
    return schema
