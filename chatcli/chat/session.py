"""A chat session: the conversation, its tokens, and the KV cache kept warm between turns.

Owns: the messages of one conversation and the exact token ids the model saw for each (the
assistant's as it generated them, so nothing is re-tokenized), the context guard, and running
the Engine for a turn. The cache is kept across turns: a new turn prefills only the tokens
past the longest prefix the cache already holds, and /undo, /retry and interrupts just rewind
it. Knows nothing about the terminal: it yields typed stream events and returns statistics.

One concept past ~500 lines: the messages, their tokens, the context guard and the turns all
read and rewrite the same entries, so they stay one class.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from chatcli.chat.stream import StreamEvent, TokenDecoder, decode_assistant_parts
from chatcli.chat.token_probs import TokenProb, token_probs
from chatcli.chat.turns import (
    CONTEXT_WARN_FRACTION,
    Message,
    Reply,
    SamplingOptions,
    TurnNotice,
    TurnStats,
    readable_text,
    split_system,
    turn_stats,
)
from chatcli.engine.engine import Engine, GenerationStats
from chatcli.engine.grammar import json_grammar
from chatcli.engine.logprobs import LogprobRecord, TokenLogprob
from chatcli.engine.tool_use import RowState
from chatcli.engine.warm_cache import WarmCache
from chatcli.errors import ChatcliError, ContextOverflowError
from chatcli.model.special_tokens import (
    ASSISTANT_END,
    ASSISTANT_START,
    PYTHON_END,
    USER_END,
    USER_START,
)
from chatcli.model.tokenizer import Tokenizer

# The alternatives a chat records beside each token of its replies, for /probs: the cost is a
# log_softmax and a top-k over the vocabulary a token, lost in the step's noise.
CHAT_TOP_LOGPROBS = 5
# A system prompt must leave at least this many tokens for a message and as many for a reply.
SYSTEM_MIN_ROOM = 16
CONTEXT_REFILL_FRACTION = 0.75  # after dropping old exchanges, the prompt + reply budget use this


def _dropped_notice(dropped: int, system: str | None) -> str:
    """What a chat says when old exchanges leave the model's view; the system prompt, never
    dropped, is named only where there is one."""
    kept = " (the system prompt is kept)" if system else ""
    return f"Context full: dropped the {dropped} oldest exchange{'s' if dropped > 1 else ''}{kept}."


@dataclass
class _Entry:
    message: Message
    tokens: list[int]  # the ids of this message, special tokens included
    finish: str | None = None  # a reply's finish_reason ("stop", "length", ...), if known
    rendered: bool = False  # tokens rendered from a saved message, not the ones generated
    masks: list[int] | None = None  # a reply's body's masks (0: the calculator's), if known


@dataclass
class ChatSession:
    can_sample_replies: ClassVar[bool] = True  # n rows forked from the warm cache
    can_show_raw: ClassVar[bool] = True  # `raw`: its decoder streams the special tokens
    can_show_probs: ClassVar[bool] = True  # its replies keep their logprobs (self.logprobs)

    model: Any
    tokenizer: Tokenizer
    options: SamplingOptions = field(default_factory=SamplingOptions)
    system: str | None = None
    raw: bool = False  # stream special tokens as they are (/raw on)
    compile: bool = False  # run the model through torch.compile (--compile)
    speculate: bool = False  # replies draft and verify (--speculate auto; speculation.py)
    # Each reply's tokens' logprobs and this many alternatives (Reply.logprobs); None: none.
    logprobs: int | None = CHAT_TOP_LOGPROBS

    def __post_init__(self) -> None:
        self.engine = Engine(
            self.model, self.tokenizer, compile=self.compile, speculate=self.speculate
        )
        self.entries: list[_Entry] = []  # the conversation as the model sees it
        # Exchanges dropped from the model's view to make room in the context: still the
        # conversation's, for /save and /export (transcript).
        self.earlier: list[_Entry] = []
        self._popped: _Entry | None = None  # the reply a /retry replaces, until a new one comes
        self.warm = WarmCache(self.engine)  # the conversation's K/V, kept across turns
        # The last sample_replies' replies and prompt, until one is accepted: its K/V (the
        # warm cache's rows) go into the warm cache rather than being prefilled again.
        self._forked: tuple[list[Reply], list[int]] | None = None
        self.last_reply: Reply | None = None
        self.notices: list[TurnNotice] = []
        self.history_stats: list[TurnStats] = []
        s = self.tokenizer.encode_special
        self._ids = {
            name: s(name)
            for name in (USER_START, USER_END, ASSISTANT_START, ASSISTANT_END, PYTHON_END)
        }
        self.set_system(self.system)  # --system or the config's: refused at the start if too long

    # ---- the conversation ---------------------------------------------------------------------

    @property
    def messages(self) -> list[Message]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [e.message for e in self.entries]

    @property
    def transcript(self) -> tuple[list[Message], list[str | None]]:
        """The whole conversation (exchanges dropped for the context included) and each
        message's finish_reason where known: what /save and /export write."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        every = self.earlier + self.entries
        return head + [e.message for e in every], [None] * len(head) + [e.finish for e in every]

    @property
    def context_len(self) -> int:
        return self.engine.context_len

    def load_messages(
        self, messages: list[Message], finishes: Sequence[str | None] | None = None
    ) -> None:
        """Replace the conversation (e.g. a resumed file); the cache refills on the next turn.
        finishes: each message's finish_reason where the file kept it (LoadResult's).

        The oldest exchanges leave the model's view as they did in the chat that wrote them:
        each question makes room for itself as it did when it was asked (at today's
        max_tokens), so the next turn sees what it would have seen had the chat gone on.
        One notice says how many are out."""
        self.system, _ = split_system(messages)
        self.earlier, self._popped, self.entries = [], None, []
        notices = len(self.notices)
        reserve = self._reply_reserve()
        for m, f in zip(messages, finishes or [None] * len(messages), strict=True):
            if m["role"] == "system":
                continue
            if m["role"] == "user" and self.entries:
                self._fit_context(m["content"], reserve)
            first = not self.entries
            entry = _Entry(m, [], f, rendered=True)
            user = m["role"] == "user"
            entry.tokens = (
                self._user_tokens(m["content"], first) if user else self._assistant_tokens(m)
            )
            self.entries.append(entry)
        self._retokenize()
        del self.notices[notices:]  # the drops of turns gone by: said once, below
        dropped = sum(1 for e in self.earlier if e.message["role"] == "user")
        if dropped:
            self.notices.append(TurnNotice(_dropped_notice(dropped, self.system)))

    def set_system(self, text: str | None) -> None:
        """Set (or with None remove) the system prompt. One that leaves no room in the
        context for a message and a reply is refused, the old one kept."""
        text = readable_text(text) if text else text
        if text:
            cost = self._system_cost(text)
            # <|bos|>, <|user_start|>, <|user_end|>, <|assistant_start|> around it
            if cost + 4 + 2 * SYSTEM_MIN_ROOM > self.context_len:
                raise ContextOverflowError(
                    f"This system prompt takes {cost} tokens of the model's {self.context_len}-"
                    "token context, leaving too little for a message and a reply. Shorten it."
                )
        self.system = text or None
        self._retokenize()

    def clear(self) -> None:
        self.entries, self.earlier, self._popped = [], [], None
        self.last_reply = None
        self._drop_samples()

    def undo(self) -> bool:
        """Drop the last exchange (the last user message and whatever followed it). Exchanges
        dropped earlier to make room come back into the model's view: the room was made for
        this one (the next turn drops again what does not fit)."""
        self._popped = None
        self._drop_samples()
        if not self.entries and self.earlier:
            self.entries, self.earlier = self.earlier, []
        for i in range(len(self.entries) - 1, -1, -1):
            if self.entries[i].message["role"] == "user":
                del self.entries[i:]
                if self.earlier:
                    self.entries, self.earlier = self.earlier + self.entries, []
                    self._retokenize()  # the first message takes the system prompt again
                return True
        return False

    def pop_last_reply(self) -> Message | None:
        """Remove the last assistant message (for /retry and /continue). A /retry that finds
        no room for a new reply puts it back (regenerate)."""
        if self.entries and self.entries[-1].message["role"] == "assistant":
            self._popped = self.entries.pop()
            return self._popped.message
        return None

    def prompt_tokens(self) -> list[int]:
        """The conversation as the model sees it, ending with <|assistant_start|>."""
        tokens = [self.tokenizer.get_bos_token_id()]
        for e in self.entries:
            tokens.extend(e.tokens)
        tokens.append(self._ids[ASSISTANT_START])
        return tokens

    def _system_cost(self, system: str | None) -> int:
        """The tokens a system prompt adds to the first user message it is merged into (its
        text and the blank line after it), as both context checks count it."""
        return len(self.tokenizer.encode(f"{system}\n\n")) if system else 0

    def _user_tokens(self, text: str, first: bool) -> list[int]:
        # nanochat has no system role: the system text is merged into the first user message.
        if first and self.system:
            text = f"{self.system}\n\n{text}"
        return [self._ids[USER_START], *self.tokenizer.encode(text), self._ids[USER_END]]

    def _assistant_tokens(self, message: Message) -> list[int]:
        ids, _ = self.tokenizer.render_conversation([{"role": "user", "content": ""}, message])
        start = ids.index(self._ids[ASSISTANT_START])
        return ids[start:]

    def _retokenize(self) -> None:
        for i, e in enumerate(self.entries):
            if e.message["role"] == "user":
                e.tokens = self._user_tokens(e.message["content"], first=i == 0)
            elif not e.tokens:
                e.tokens = self._assistant_tokens(e.message)

    def _fit_context(self, text: str, reserve: int) -> None:
        """Drop the oldest exchanges when the prompt, the message `text` and a reply budget
        would not fit.

        It drops down to CONTEXT_REFILL_FRACTION of the context rather than just enough: each
        drop changes the prompt's start and costs a full re-prefill, so freeing room for
        several turns at once keeps the next turns on the warm cache.
        """
        limit = self.context_len
        as_first, as_later = (len(self._user_tokens(text, first)) for first in (True, False))

        def needed() -> int:
            # <|bos|> and <|assistant_start|>; the message carries the system prompt when
            # it is the only one left
            message = as_later if self.entries else as_first
            return sum(len(e.tokens) for e in self.entries) + message + 2 + reserve

        if needed() <= limit:
            return
        dropped = 0
        while needed() > CONTEXT_REFILL_FRACTION * limit:
            if not self._drop_oldest():
                break
            first = self.entries[0] if self.entries else None
            if first is not None and first.message["role"] == "user":
                # the new first message takes the system prompt in
                first.tokens = self._user_tokens(first.message["content"], first=True)
            dropped += 1
        if dropped:
            self.notices.append(TurnNotice(_dropped_notice(dropped, self.system)))

    def _reply_reserve(self) -> int:
        """The room a reply gets when old exchanges are dropped for a new message: a quarter
        of the context, at most max_tokens."""
        return min(self.options.max_tokens, max(self.context_len // 4, 16))

    def _drop_oldest(self) -> bool:
        """Move the oldest exchange (a user message and the reply after it) out of the
        model's view into `earlier`; False when there is none."""
        if not self.entries:
            return False
        end = 1
        while end < len(self.entries) and self.entries[end].message["role"] != "user":
            end += 1
        self.earlier += self.entries[:end]
        del self.entries[:end]
        return True

    # ---- running a turn -----------------------------------------------------------------------

    def send(self, text: str) -> Iterator[StreamEvent]:
        """Add a user message and stream the assistant's reply as events."""
        self.send_prepare(text)
        return self._stream()

    def send_prepare(self, text: str, reply_so_far: int = 0) -> None:
        """Add a user message, dropping old exchanges if the context needs the room.

        A message that could not fit even as the conversation's only one (with the system
        prompt, which nanochat merges into the first message) is refused before anything is
        dropped: the conversation stays as it was. reply_so_far: the tokens of a reply to it
        that a /continue goes on from, which need the room too.
        """
        text = readable_text(text)
        self._check_fits_alone(text, reply_so_far)
        self._popped = None
        # What to put back if the message still does not fit after the drops.
        before, notices = [(e, e.tokens) for e in self.entries], len(self.notices)
        earlier = len(self.earlier)
        self._fit_context(text, self._reply_reserve() + reply_so_far)
        user = _Entry({"role": "user", "content": text}, self._user_tokens(text, not self.entries))
        self.entries.append(user)
        if len(self.prompt_tokens()) + reply_so_far >= self.context_len:  # see _check_fits_alone
            self.entries = [e for e, _ in before]
            for e, tokens in before:
                e.tokens = tokens
            del self.earlier[earlier:]
            del self.notices[notices:]
            raise ContextOverflowError(
                f"This message does not fit the model's {self.context_len}-token context. "
                "Send a shorter one, or /clear to start afresh."
            )
        self._drop_samples()  # sample rows not taken are dropped with their memory

    def _check_fits_alone(self, text: str, reply_so_far: int = 0) -> None:
        # <|bos|>, the message (with the system prompt) and <|assistant_start|>, with room
        # for at least one token of reply.
        alone = len(self._user_tokens(text, first=True)) + 2
        if alone + reply_so_far < self.context_len:
            return
        if alone < self.context_len:
            raise ContextOverflowError(
                f"This reply has filled the model's {self.context_len}-token context with "
                "its question: there is no room to continue it. /retry writes another one."
            )
        limit = self.context_len
        if self.system:
            system = self._system_cost(self.system)
            if system >= limit // 2:
                raise ContextOverflowError(
                    f"The system prompt ({system} tokens) and this message need {alone} "
                    f"tokens, more than the model's {limit}-token context. Shorten the "
                    "system prompt (/system TEXT, or /system clear) or the message."
                )
        raise ContextOverflowError(
            f"This message alone needs {alone} tokens, more than the model's {limit}-token "
            "context. Send a shorter one."
        )

    def regenerate(self) -> Iterator[StreamEvent]:
        """Stream a new reply to the last user message (after pop_last_reply), dropping old
        exchanges first where the conversation has outgrown the context (a longer system
        prompt since, or a conversation resumed on a model of a shorter context)."""
        popped, self._popped = self._popped, None
        if not self.entries or self.entries[-1].message["role"] != "user":
            raise ChatcliError("There is no user message to reply to.")
        try:
            self._ask_again(self.entries.pop())
        except BaseException:
            if popped is not None:  # no room for a new reply: the old one stays
                self.entries.append(popped)
            raise
        return self._stream()

    def _ask_again(self, question: _Entry, reply_so_far: int = 0) -> None:
        """Put the last user message back through send_prepare, which makes room for it;
        where none can be made it goes back as it was, and the error is raised."""
        try:
            self.send_prepare(question.message["content"], reply_so_far)
        except BaseException:
            self.entries.append(question)
            raise

    def continue_reply(self) -> Iterator[StreamEvent]:
        """Continue the last reply where it stopped (interrupted or cut at max_tokens)."""
        if not self.entries or self.entries[-1].message["role"] != "assistant":
            raise ChatcliError("There is no reply to continue.")
        if self.entries[-1].finish == "stop":
            raise ChatcliError(
                "The last reply is complete: there is nothing to continue. /retry writes "
                "another one."
            )
        last = self.entries.pop()
        body = last.tokens[1:-1]  # without <|assistant_start|> and <|assistant_end|>
        masks = last.masks[: len(body)] if last.masks is not None else None
        parts = last.message["content"]
        if (
            last.rendered
            and body[-1:] == [self._ids[PYTHON_END]]
            and isinstance(parts, list)
            and parts
            and parts[-1]["type"] == "python"
        ):
            # A saved reply that ends in a calculator call without its result was cut inside
            # the call (one that ended after it has finish "stop", refused above): rendering
            # it closed the call, and continuing from there would run the calculator on the
            # cut expression.
            body = body[:-1]
        try:
            self._ask_again(self.entries.pop(), len(body))
        except BaseException:
            self.entries.append(last)
            raise
        return self._stream(prefix=body, prefix_masks=masks)

    def sample_replies(self, text: str, n: int) -> list[Reply]:
        """Add a user message and generate n alternative replies, forked from the warm
        cache: only the new turn is prefilled, and the rows share the conversation's K/V.

        Nothing is added for the assistant: pass the chosen one to accept_reply, or call
        undo() to drop the question.
        """
        self.send_prepare(text)
        seed = self.options.turn_seed()
        prompt = self.prompt_tokens()
        gen = GenerationStats()
        record = self._record()
        # The warm cache stays the prompt.
        columns = list(self._generate(prompt, n, seed, gen, record=record))
        end, bos = self._ids[ASSISTANT_END], self.tokenizer.get_bos_token_id()
        replies = []
        for i in range(n):
            tokens, masks = [], []
            for column, column_masks in columns:
                if column[i] in (end, bos):
                    break
                tokens.append(column[i])
                masks.append(column_masks[i])
            stats = self._turn_stats(gen, len(prompt), len(tokens), gen.finish_reasons[i], seed)
            parts = decode_assistant_parts(tokens, masks, self.tokenizer)
            logprobs = None
            if record is not None:
                logprobs = [c[i] for c in record.columns[: len(tokens)]]
            replies.append(Reply(parts, tokens, masks, stats, logprobs))
        self._forked = replies, prompt
        return replies

    def accept_reply(self, reply: Reply) -> None:
        """Make one of sample_replies' alternatives the conversation's reply."""
        if not self.entries or self.entries[-1].message["role"] != "user":
            raise ChatcliError("There is no question waiting for a reply.")
        end = self._ids[ASSISTANT_END]
        tokens = [self._ids[ASSISTANT_START], *reply.tokens, end]
        self.entries.append(
            _Entry(reply.message, tokens, reply.stats.finish_reason, masks=reply.masks)
        )
        self.last_reply = reply
        self.history_stats.append(reply.stats)
        self._warn_if_nearly_full(reply.stats)
        replies, prompt = self._forked or ([], None)
        row = next((i for i, r in enumerate(replies) if r is reply), None)
        if row is not None and self.warm.tokens == prompt:  # the cache they forked from
            # adopt refuses before it changes anything; the reply is kept all the same,
            # and the next turn prefills it.
            with contextlib.suppress(ValueError):
                self.warm.adopt(row, reply.tokens)
        self._drop_samples()

    def _drop_samples(self) -> None:
        """Forget sample_replies' rows and replies (their memory with them)."""
        self._forked = None
        self.warm.drop_rows()

    def _generate(
        self,
        prompt: list[int],
        n: int,
        seed: int,
        gen: GenerationStats,
        resume: RowState | None = None,
        record: LogprobRecord | None = None,
        prefix: Sequence[int] = (),
    ) -> Iterator[tuple[list[int], list[int]]]:
        """The engine's generation of n rows after `prompt`, over the warm cache, with the
        session's sampling options (and each step's logprobs into `record`); `prefix` is the
        reply so far (a /continue), which the reply format's grammar follows first."""
        opts = self.options
        return self.engine.generate(
            prompt,
            n,
            max_tokens=opts.max_tokens,
            temperature=opts.temperature,
            top_k=opts.top_k,
            top_p=opts.top_p,
            seed=seed,
            use_tools=opts.tools,
            stats=gen,
            resume=resume,
            warm=self.warm,
            logprobs=record,
            grammar=self._grammar(),
            grammar_prefix=prefix,
        )

    def _record(self) -> LogprobRecord | None:
        return None if self.logprobs is None else LogprobRecord(self.logprobs)

    def _grammar(self) -> str | None:
        """The grammar of the options' JSON schema (built once per schema), or None."""
        schema = self.options.json_schema
        return None if schema is None else json_grammar(schema)

    def _stream(
        self, prefix: list[int] | None = None, prefix_masks: list[int] | None = None
    ) -> Iterator[StreamEvent]:
        """The reply to the conversation, going on from `prefix` (a /continue: the reply so
        far, its masks where they were kept, else read from its tokens)."""
        # What the finally below closes the turn with, set before anything can be
        # interrupted: a Ctrl-C from the first line on leaves a reply (if an empty one), never
        # a question without one.
        prefix = list(prefix or [])
        tokens: list[int] = list(prefix)
        kept = prefix_masks is not None and len(prefix_masks) == len(prefix)
        masks: list[int] = list(prefix_masks) if kept else [1] * len(prefix)  # type: ignore[arg-type]
        record = self._record()
        # A continued reply's earlier tokens: their logprobs went with the reply they were.
        logprobs: list[TokenLogprob | None] = [None] * len(prefix)
        gen = GenerationStats()
        seed = self.options.turn_seed()
        prompt: list[int] = []
        finish = "interrupted"
        try:
            prompt = self.prompt_tokens() + prefix
            # A continued reply keeps what it had, and picks up where it stopped: inside a
            # calculator call, or with the rest of the calculator's result still to write.
            resume, replayed = self.engine.replay_tool_use(prefix)
            if not kept:
                masks = replayed  # else as generated: the model may have written an output
            decoder = TokenDecoder(self.tokenizer, raw=self.raw, tools=self.options.tools)
            decoder.resume(prefix, masks)
            steps = self._generate(prompt, 1, seed, gen, resume, record, prefix)
            with contextlib.closing(steps):
                for column, column_masks in steps:
                    tokens.append(column[0])
                    masks.append(column_masks[0])
                    if record is not None:
                        logprobs.append(record.columns[-1][0])
                    yield from decoder.feed(column[0], column_masks[0])
            finish = gen.finish_reasons[0]
        except Exception:
            finish = "error"
            raise
        finally:
            # Runs on normal completion, on Ctrl-C (GeneratorExit) and on errors alike: the
            # partial reply is kept and the turn is closed with <|assistant_end|>.
            stats = self._turn_stats(gen, len(prompt), len(tokens) - len(prefix), finish, seed)
            self._close_turn(tokens, masks, stats, logprobs if record is not None else None)
        yield from decoder.flush()

    def _turn_stats(
        self, gen: GenerationStats, tokens_in: int, tokens_out: int, finish: str, seed: int
    ) -> TurnStats:
        """A reply's statistics from its generation's: a prompt of `tokens_in`, `tokens_out`
        of its own."""
        return turn_stats(gen, tokens_in, tokens_out, finish, seed, self.context_len)

    def _close_turn(
        self,
        tokens: list[int],
        masks: list[int],
        stats: TurnStats,
        logprobs: list[TokenLogprob | None] | None = None,
    ) -> None:
        """Record the reply (a continued one includes what it continued) and its statistics."""
        end = self._ids[ASSISTANT_END]
        # The engine ends a reply at <|assistant_end|> or <|bos|>: neither is the reply's.
        ended = tokens and tokens[-1] in (end, self.engine.bos)
        body = tokens[:-1] if ended else tokens
        parts = decode_assistant_parts(body, masks[: len(body)], self.tokenizer)
        self._warn_if_nearly_full(stats)
        # As long as the body (an interrupt between a token and its entry leaves one short).
        kept = None if logprobs is None else (logprobs + [None] * len(body))[: len(body)]
        reply = Reply(parts, list(body), masks[: len(body)], stats, kept)
        self.last_reply = reply
        self.history_stats.append(stats)
        entry_tokens = [self._ids[ASSISTANT_START], *body, end]
        self.entries.append(
            _Entry(reply.message, entry_tokens, stats.finish_reason, masks=reply.masks)
        )

    def _warn_if_nearly_full(self, stats: TurnStats) -> None:
        # Said after the reply, before the next message: that message's turn is the one
        # that drops (before it, a drop made room and left no prompt to warn about).
        if stats.context_used > CONTEXT_WARN_FRACTION * self.context_len:
            self.notices.append(
                TurnNotice(
                    f"Context {stats.context_used}/{self.context_len} tokens: the next turns "
                    "drop the oldest exchanges to make room (/clear starts afresh)."
                )
            )

    def take_notices(self) -> list[TurnNotice]:
        notices, self.notices = self.notices, []
        return notices

    def reply_probs(self) -> list[TokenProb]:
        """The last reply's tokens with their probabilities, for /probs."""
        reply = self.last_reply
        last = self.entries[-1] if self.entries else None
        if last is None or last.message["role"] != "assistant":
            raise ChatcliError("No reply yet: /probs shows the last reply's, once there is one.")
        # The reply recorded last may be one /undo took back, or from before a /load.
        if reply is None or last.rendered or last.tokens[1:-1] != reply.tokens:
            reply = None
        if reply is None or reply.logprobs is None:
            raise ChatcliError(
                "The last reply has no probabilities: only a reply written since the chat "
                "started keeps them, not one loaded from a file. /retry writes one that has."
            )
        return token_probs(self.tokenizer, reply.tokens, reply.logprobs)

    def put_reply(self, message: Message, finish: str | None = None) -> None:
        """Make `message`, a reply this session did not write (the arena's other model's),
        the answer to the last question, in place of its own. Its tokens are rendered from
        its parts; the warm cache keeps the prefix up to the question."""
        self.pop_last_reply()
        self._popped = None
        if not self.entries or self.entries[-1].message["role"] != "user":
            raise ChatcliError("There is no question waiting for a reply.")
        entry = _Entry(message, self._assistant_tokens(message), finish, rendered=True)
        self.entries.append(entry)
