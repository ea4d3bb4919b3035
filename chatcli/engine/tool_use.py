"""The calculator tool inside the token stream: where each row is in a call, what it forces.

Owns: RowState (one row's progress: an open calculator call, the result tokens still to
force, whether the row is over), following a row's tokens through
<|python_start|> expr <|python_end|>, queueing the calculator's result as the forced tokens
<|output_start|> result <|output_end|>, and replaying that state from a reply's tokens. Knows
nothing about caches, sampling or timing (the Engine's loop decides when a queued token is
written); the arithmetic itself is calculator.py's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from chatcli.engine.calculator import MAX_ABS_VALUE, format_result, use_calculator
from chatcli.model.special_tokens import OUTPUT_END, OUTPUT_START, PYTHON_END, PYTHON_START

# A calculator result is one unit: once <|python_end|> queued it, its forced tokens are all
# written even past max_tokens. This is the most they can take (<|output_start|>, the longest
# result, <|output_end|>; a token is at least one character), so caches sized to a budget
# keep this much room beyond it.
RESULT_RESERVE = len(format_result(-MAX_ABS_VALUE)) + 2


class ToolTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def encode_special(self, name: str) -> int: ...

    def get_bos_token_id(self) -> int: ...


@dataclass
class RowState:
    """One sample's progress through the tool-use state machine."""

    forced_tokens: deque[int] = field(default_factory=deque)
    in_python_block: bool = False
    python_expr_tokens: list[int] = field(default_factory=list)
    completed: bool = False

    def copy(self) -> RowState:
        """An independent copy (rows resumed from one state must not share its queues)."""
        return RowState(
            deque(self.forced_tokens),
            self.in_python_block,
            list(self.python_expr_tokens),
            self.completed,
        )


class ToolUse:
    """The calculator's side of a generation, over one tokenizer's special ids."""

    def __init__(self, tokenizer: ToolTokenizer) -> None:
        self.tokenizer = tokenizer
        special = tokenizer.encode_special
        self.python_start, self.python_end = special(PYTHON_START), special(PYTHON_END)
        self.output_start, self.output_end = special(OUTPUT_START), special(OUTPUT_END)

    def track(self, row: RowState, token: int) -> None:
        """Follow one token a row wrote: a call opens, its expression grows, or it closes
        and the calculator's result (if it gives one) is queued on the row."""
        if token == self.python_start:
            row.in_python_block, row.python_expr_tokens = True, []
        elif token == self.python_end and row.in_python_block:
            row.in_python_block = False
            if row.python_expr_tokens:
                expr = self.tokenizer.decode(row.python_expr_tokens)
                result = use_calculator(expr)
                if result is not None:
                    row.forced_tokens.append(self.output_start)
                    row.forced_tokens.extend(self.tokenizer.encode(format_result(result)))
                    row.forced_tokens.append(self.output_end)
            row.python_expr_tokens = []
        elif row.in_python_block:
            row.python_expr_tokens.append(token)

    def replay(self, tokens: Sequence[int]) -> tuple[RowState, list[int]]:
        """The state at the end of `tokens` (the body of an unfinished reply, after
        <|assistant_start|>) and their masks: 0 for the tokens the calculator forced.

        The calculator is deterministic, so each result is computed again and the tokens
        that match it are the forced ones; a token that does not match means nothing was
        forced there (the reply was written with the tools off).
        """
        row, masks = RowState(), []
        for token in tokens:
            if row.forced_tokens and token == row.forced_tokens[0]:
                row.forced_tokens.popleft()
                masks.append(0)
            else:
                row.forced_tokens.clear()
                masks.append(1)
            self.track(row, token)
        return row, masks
