"""Raw completion: a text's continuation as the model writes it, with no chat template.

Owns: RawCompletion, what `chatcli once --raw` runs: the text encoded after <|bos|> as
ordinary text (a "<|user_start|>" typed into it stays text), the model's continuation
streamed as events until <|bos|> or <|assistant_end|>, the token budget or the context, and
the Reply it leaves (`last_reply`), as a ChatSession's turn leaves one. It is how a base
checkpoint (`--source base`), which never learned the chat's turns, is run. The server's
/v1/completions is the same over HTTP.

Knows nothing of the terminal or HTTP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

from chatcli.chat.stream import StreamEvent, TokenDecoder, decode_assistant_parts
from chatcli.chat.turns import Reply, SamplingOptions, TurnNotice, turn_stats
from chatcli.engine.engine import Engine, GenerationStats
from chatcli.engine.logprobs import LogprobRecord, TokenLogprob


class RawCompletion:
    """`send(text)` streams the continuation of `text`; `last_reply` is what it wrote. Each
    send starts afresh: there is no conversation."""

    can_show_raw: ClassVar[bool] = True

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        options: SamplingOptions,
        logprobs: int | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.options = options
        self.logprobs = logprobs  # each token's logprob and this many alternatives; None: none
        self.raw = False  # stream special tokens as they are
        self.last_reply: Reply | None = None

    def prompt_tokens(self, text: str) -> list[int]:
        """<|bos|> and the text as ordinary text."""
        return self.tokenizer.encode(text, prepend=self.tokenizer.get_bos_token_id())

    def take_notices(self) -> list[TurnNotice]:
        return []

    def send(self, text: str) -> Iterator[StreamEvent]:
        """The continuation of `text` as events (the ContextOverflowError of a text that
        fills the context comes at the call)."""
        prompt = self.prompt_tokens(text)
        self.engine.budget_for(prompt, self.options.max_tokens)
        return self._stream(prompt)

    def _stream(self, prompt: list[int]) -> Iterator[StreamEvent]:
        opts = self.options
        seed = opts.turn_seed()
        gen = GenerationStats()
        record = None if self.logprobs is None else LogprobRecord(self.logprobs)
        decoder = TokenDecoder(self.tokenizer, raw=self.raw, tools=opts.tools)
        tokens: list[int] = []
        masks: list[int] = []
        finish = "interrupted"
        steps = self.engine.generate(
            prompt,
            max_tokens=opts.max_tokens,
            temperature=opts.temperature,
            top_k=opts.top_k,
            top_p=opts.top_p,
            seed=seed,
            use_tools=opts.tools,
            stats=gen,
            logprobs=record,
        )
        try:
            with contextlib.closing(steps):
                for column, column_masks in steps:
                    tokens.append(column[0])
                    masks.append(column_masks[0])
                    yield from decoder.feed(column[0], column_masks[0])
            finish = gen.finish_reasons[0]
        finally:
            ends = (self.engine.assistant_end, self.engine.bos)
            body = tokens[:-1] if tokens and tokens[-1] in ends else tokens
            stats = turn_stats(gen, len(prompt), len(tokens), finish, seed, self.engine.context_len)
            logprobs: list[TokenLogprob | None] | None = None
            if record is not None:
                logprobs = [c[0] for c in record.columns[: len(body)]]
            parts = decode_assistant_parts(body, masks[: len(body)], self.tokenizer)
            self.last_reply = Reply(parts, body, masks[: len(body)], stats, logprobs)
        yield from decoder.flush()
