"""Structured output's grammar: a JSON schema as the grammar a reply follows.

Owns: turning a JSON schema into a grammar the library can run (`json_grammar`, refusing
what it cannot enforce, naming the keyword; an unbounded integer kept to JSON's exact ones),
reading a schema file, and the grammar library's view of a tokenizer (built once per
tokenizer). Each row's matcher and mask are grammar_rows.py's. torch-free, so the chat's
settings and the server's validation can use it.

The grammar library is llguidance, an optional extra, imported at first use (docs/serving.md
says why it over xgrammar). Knows nothing of HTTP or of text beyond the tokenizer's bytes.
"""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path
from typing import Any

from chatcli.errors import SchemaError
from chatcli.model.data_files import UnreadableFileError, read_json_file, shown
from chatcli.model.special_tokens import ASSISTANT_END

STRUCTURED_EXTRA = "pip install 'chatcli[structured]'"
SCHEMA_MAX_BYTES = 1 << 20  # far past any schema a reply follows

# How the JSON is written: one space after ':' and ',' and no other whitespace. A model
# that never wrote JSON would otherwise be free to pad a reply with blanks until the budget
# ends it. A schema's own "x-guidance" options override these.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# An integer the schema leaves unbounded is kept to JSON's exactly representable ones (RFC
# 7493's I-JSON, what JavaScript reads without rounding): a model that never wrote JSON
# would otherwise go on adding digits until the budget cuts the reply.
SAFE_INTEGER = 2**53 - 1
# A schema's keywords whose values are JSON data, not schemas.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})

# Any JSON object: OpenAI's {"type": "json_object"}.
ANY_OBJECT: dict[str, Any] = {"type": "object"}

_tokenizers: dict[int, tuple[Any, Any]] = {}  # id(Encoding) -> (Encoding, LLTokenizer)
_lock = threading.Lock()


def import_llguidance() -> Any:
    """llguidance, or one line saying how to install it."""
    try:
        import llguidance
    except ImportError:
        raise SchemaError(
            f"Structured output needs the structured extra: {STRUCTURED_EXTRA}"
        ) from None
    return llguidance


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The grammar (llguidance's JSON text) of replies that are `schema`'s JSON (None: any
    JSON object). A SchemaError names what the grammar library cannot express."""
    schema = ANY_OBJECT if schema is None else schema
    if not isinstance(schema, dict):
        raise SchemaError(
            f"A JSON schema is a JSON object, not {type(schema).__name__}: "
            'write it as {"type": "object", "properties": {...}}.'
        )
    try:
        text = json.dumps(schema)  # in its order: the properties are written in it
        return _grammar_of(text)
    except RecursionError:  # Python's own limit, past llguidance's (a few hundred levels)
        raise SchemaError(
            "The JSON schema is nested too deeply: name a repeated part once in $defs and "
            "refer to it with $ref."
        ) from None
    except (TypeError, ValueError) as e:
        raise SchemaError(f"The JSON schema cannot be read: {e}.") from None


@functools.lru_cache(maxsize=64)
def _grammar_of(schema_text: str) -> str:
    """json_grammar of the schema written as `schema_text`: kept, since a server builds the
    grammar of each request's schema twice (to check it, then to run it) and clients send a
    few schemas again and again."""
    llguidance = import_llguidance()
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            bounded(json.loads(schema_text)), defaults=JSON_STYLE
        )
    except (ValueError, TypeError) as e:
        raise SchemaError(f"The JSON schema cannot be read: {e}.") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise SchemaError(
            f"The JSON schema uses what structured output cannot enforce ({first_line(messages)}):"
            " leave that keyword out or express it with properties, enum or a pattern."
        )
    return grammar


def bounded(schema: Any) -> Any:
    """`schema` with each integer it leaves unbounded kept within +-SAFE_INTEGER."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYWORDS else bounded(v) for k, v in schema.items()}
    kinds = out.get("type")
    if kinds == "integer" or (isinstance(kinds, list) and "integer" in kinds):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    return out


def read_schema(path: Path) -> dict[str, Any]:
    """The JSON Schema in the file at `path` (an UnreadableFileError, or a SchemaError where
    it is not a JSON object)."""
    try:
        schema = read_json_file(path, SCHEMA_MAX_BYTES)
    except UnreadableFileError as e:
        raise SchemaError(f"The JSON Schema file {e}: give the path of a schema file.") from None
    except ValueError as e:
        raise SchemaError(
            f"{path} is not readable JSON: {e}. Write the schema as a JSON object."
        ) from None
    if not isinstance(schema, dict):
        raise SchemaError(
            f"{path} holds {shown(schema, 40)}, not a JSON Schema object: write it as "
            '{"type": "object", "properties": {...}}.'
        )
    return schema


def first_line(messages: list[str]) -> str:
    text = " ".join(messages).strip() or "an invalid schema"
    return text.splitlines()[0][:200]


def grammar_tokenizer(tokenizer: Any) -> Any:
    """llguidance's tokenizer for a chatcli Tokenizer (its tiktoken Encoding), with
    <|assistant_end|> as the end of a reply. Built once per tokenizer: it takes about a
    second for a 65536-token vocabulary."""
    llguidance = import_llguidance()
    from llguidance.tiktoken import lltokenizer_from_encoding

    encoding = getattr(tokenizer, "enc", None)
    if encoding is None:
        raise SchemaError(
            "Structured output needs the model's tiktoken tokenizer (tokenizer.pkl); this "
            "model's tokenizer has none."
        )
    with _lock:
        kept = _tokenizers.get(id(encoding))
        if kept is None or kept[0] is not encoding:
            end = tokenizer.encode_special(ASSISTANT_END)
            built = lltokenizer_from_encoding(encoding, n_vocab=encoding.n_vocab, eos_token=end)
            kept = _tokenizers[id(encoding)] = (encoding, built)
    assert isinstance(kept[1], llguidance.LLTokenizer)
    return kept[1]
