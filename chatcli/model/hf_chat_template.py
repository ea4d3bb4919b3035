"""The chat template an export ships: messages rendered to exactly the ids chatcli builds.

Owns: the Jinja template transformers' `apply_chat_template` (and the serving engines that
use it) renders, and the message shapes it accepts. It must agree token for token with
chatcli's own rendering (chatcli.model.tokenizer.render_conversation and the chat session);
tests hold it to that. Knows nothing about models or files.

Messages:
- `{"role": "system", "content": str}`, first only: nanochat has no system role, so its text
  goes before the first user message's, with a blank line between (none when empty).
- `{"role": "user", "content": str}`.
- `{"role": "assistant", "content": str}`, or content as chatcli's parts:
  `[{"type": "text", "text": ...}, {"type": "python", "text": "12*7"},
  {"type": "python_output", "text": "84"}, {"type": "text", "text": ...}]`: a calculator
  call is `<|python_start|>12*7<|python_end|>`, its result `<|output_start|>84<|output_end|>`.
- The same call in transformers' tool-calling shape: an assistant message with
  `"tool_calls": [{"type": "function", "function": {"name": "calculator",
  "arguments": {"expression": "12*7"}}}]` (one call; arguments may also be the expression as
  a string) leaves the assistant turn open; a `{"role": "tool", "content": "84"}` message
  gives the result inside it, and the next assistant message continues the same turn.

Content given as a list of `{"type": "text", "text": ...}` parts (the OpenAI shape) reads as
their text joined. Known limits, shared by every text chat template: the rendered text is
tokenized again, so text that spells a special token (`<|bos|>`) becomes that token, where
chatcli encodes a user's text as plain text; and two text parts side by side are read as one
text, where chatcli encodes each apart.
"""

from __future__ import annotations

from chatcli.model.special_tokens import (
    ASSISTANT_END,
    ASSISTANT_START,
    BOS,
    OUTPUT_END,
    OUTPUT_START,
    PYTHON_END,
    PYTHON_START,
    USER_END,
    USER_START,
)

_TEMPLATE = """\
{#- nanochat's chat format, as chatcli renders it: see chatcli's docs/huggingface.md -#}
{%- macro text_of(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}{%- if part.type == "text" -%}{{ part.text }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- macro fail(why) -%}{{ raise_exception("nanochat chat template: " ~ why) }}{%- endmacro -%}
{{- "@BOS@" -}}
{%- set ns = namespace(system="", turn="none") -%}
{%- for message in messages -%}
{%- if message.role == "system" -%}
{%- if not loop.first -%}{{ fail("only the first message may be a system message") }}{%- endif -%}
{%- set system = text_of(message.content) -%}
{%- if system -%}{%- set ns.system = system ~ "\\n\\n" -%}{%- endif -%}
{%- elif message.role == "user" -%}
{%- if ns.turn not in ("none", "assistant") -%}
{{- fail("a user message must follow an assistant reply (roles alternate)") -}}
{%- endif -%}
{{- "@USER_START@" ~ ns.system ~ text_of(message.content) ~ "@USER_END@" -}}
{%- set ns.system = "" -%}
{%- set ns.turn = "user" -%}
{%- elif message.role == "assistant" -%}
{%- if ns.turn == "user" -%}{{- "@ASSISTANT_START@" -}}
{%- elif ns.turn != "tool" -%}
{{- fail("an assistant message must follow a user message or a tool result") -}}
{%- endif -%}
{%- if message.content is string -%}{{- message.content -}}
{%- elif message.content is iterable and message.content is not mapping -%}
{%- for part in message.content -%}
{%- if part.type == "text" -%}{{- part.text -}}
{%- elif part.type == "python" -%}{{- "@PYTHON_START@" ~ part.text ~ "@PYTHON_END@" -}}
{%- elif part.type == "python_output" -%}{{- "@OUTPUT_START@" ~ part.text ~ "@OUTPUT_END@" -}}
{%- else -%}{{- fail("assistant parts are text, python or python_output") -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- if message.tool_calls -%}
{%- if message.tool_calls | length > 1 -%}
{{- fail("one tool call per assistant message: its result follows it") -}}
{%- endif -%}
{%- set call = message.tool_calls[0] -%}
{%- set call = call.function if call.function is defined else call -%}
{%- set args = call.arguments -%}
{%- set expression = args.expression if args is mapping else args -%}
{{- "@PYTHON_START@" ~ expression ~ "@PYTHON_END@" -}}
{%- set ns.turn = "open" -%}
{%- else -%}
{{- "@ASSISTANT_END@" -}}
{%- set ns.turn = "assistant" -%}
{%- endif -%}
{%- elif message.role == "tool" -%}
{%- if ns.turn != "open" -%}
{{- fail("a tool message must follow an assistant message with tool_calls") -}}
{%- endif -%}
{{- "@OUTPUT_START@" ~ text_of(message.content) ~ "@OUTPUT_END@" -}}
{%- set ns.turn = "tool" -%}
{%- else -%}
{{- fail("roles are system, user, assistant and tool") -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and ns.turn == "user" -%}{{- "@ASSISTANT_START@" -}}{%- endif -%}
"""

_NAMES = {
    "@BOS@": BOS,
    "@USER_START@": USER_START,
    "@USER_END@": USER_END,
    "@ASSISTANT_START@": ASSISTANT_START,
    "@ASSISTANT_END@": ASSISTANT_END,
    "@PYTHON_START@": PYTHON_START,
    "@PYTHON_END@": PYTHON_END,
    "@OUTPUT_START@": OUTPUT_START,
    "@OUTPUT_END@": OUTPUT_END,
}


def chat_template() -> str:
    """The Jinja chat template, with the special tokens spelled from special_tokens.py."""
    text = _TEMPLATE
    for placeholder, token in _NAMES.items():
        text = text.replace(placeholder, token)
    return text
