"""A training conversation as ids and a loss mask: nanochat's SFT rendering, less what is marked
not to be learned.

Owns one rule on top of the tokenizer's `render_conversation` (which masks in what the
assistant writes and masks out the rest): an assistant message or one of its parts marked
`"learn": False` stays in the context but out of the loss. The synthetic data marks a flawed
reply that way (recovery_data.py): the model learns what follows a slip, never the slip.

It knows nothing about where conversations come from. The spans are found by rendering the
conversation cut just before and just after the marked message or part, so they are exactly
the tokens the tokenizer gives them, whatever its rules.
"""

from __future__ import annotations

from typing import Any, Protocol


class ConversationRenderer(Protocol):
    def render_conversation(
        self, conversation: list[dict[str, Any]], max_tokens: int | None = None
    ) -> tuple[list[int], list[int]]: ...


def render_for_training(
    tokenizer: ConversationRenderer,
    conversation: list[dict[str, Any]],
    max_tokens: int | None = None,
) -> tuple[list[int], list[int]]:
    """(ids, mask) as the tokenizer renders them, the mask 0 over every unlearned span."""
    ids, mask = tokenizer.render_conversation(conversation)
    for start, end in unlearned_spans(tokenizer, conversation):
        mask[start:end] = [0] * (end - start)
    if max_tokens is not None:
        ids, mask = ids[:max_tokens], mask[:max_tokens]
    return ids, mask


def unlearned_spans(
    tokenizer: ConversationRenderer, conversation: list[dict[str, Any]]
) -> list[tuple[int, int]]:
    """[start, end) token spans of the messages and parts marked "learn": False."""

    def length(messages: list[dict[str, Any]]) -> int:
        return len(tokenizer.render_conversation(messages)[0])

    spans = []
    for i, message in enumerate(conversation):
        if message.get("role") != "assistant":
            continue
        before = conversation[:i]
        if message.get("learn") is False:
            # From after <|assistant_start|> through <|assistant_end|>.
            spans.append((length(before) + 1, length(conversation[: i + 1])))
            continue
        content = message.get("content")
        if isinstance(content, str):
            continue
        for j, part in enumerate(content):
            if part.get("learn") is False:
                # A reply cut after a part renders with its <|assistant_end|> last: not ours.
                start = length([*before, {"role": "assistant", "content": content[:j]}]) - 1
                end = length([*before, {"role": "assistant", "content": content[: j + 1]}]) - 1
                spans.append((start, end))
    return spans
