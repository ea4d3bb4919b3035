"""The one generation loop: every generation is rows, and one Scheduler steps them.

Owns: RowRequest (what a generation asks for), Generation (one request's rows: where they
run, their sampling and seeded generator, budget, stop ids, calculator states, finish
reasons and timings), and Scheduler, which takes generations in, steps them and lets them
go. A chat turn is one row on its warm cache; /samples N is N rows forked from one prompt's
cache, sharing its generator; a server request is one row in a slot of the scheduler's
SlotCache, joining and leaving between steps, its prompt prefilled in chunks beside the
other rows' decoding. The per-row policy (which token a row takes, its mask, the budget,
the calculator's forced tokens, when and why a row ends) and every timing are written here
once, so a chat turn, /samples, a server request and the benchmark get the same answer.

Knows nothing about text, threads or HTTP; runs the model through a RowRunner (the Engine).

One concept past 600 lines, on purpose: the per-row policy must exist once, so the step's
order (logprobs from the model's logits, then a grammar's mask, the draw, the calculator,
the end checks) reads in one place; what each of those does lives in its own module
(logprobs.py, grammar_rows.py, tool_use.py, speculation.py) and is called from here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from chatcli.engine.grammar import grammar_tokenizer
from chatcli.engine.grammar_rows import RowsGrammar, masked_rows
from chatcli.engine.logprobs import TokenLogprob, check_top, column_logprobs, distributions
from chatcli.engine.speculation import (
    Drafter,
    SlotVerifier,
    Speculation,
    SpeculationCounts,
    VerifyRunner,
)
from chatcli.engine.tool_use import RowState, ToolUse
from chatcli.engine.warm_cache import CacheRunner, WarmCache, choose
from chatcli.errors import ContextOverflowError
from chatcli.model.kv_cache import KVCache, SharedPrefixCache
from chatcli.model.sampling import GREEDY_BELOW, draws, sample_with_draws
from chatcli.model.slot_cache import SlotCache, SlotRows

# The prompt tokens a step prefills (across waiting rows, oldest first) after its decode
# step: the decoding rows wait that long for their next token. See docs/batching.md.
PREFILL_CHUNK = 64
# A GPU prefills a chunk of this many in about the time of a decode step's launch.
GPU_PREFILL_CHUNK = 512

# A server worker's rows where --batch is not given (docs/batching.md has the measurements).
CPU_ROWS = 8
GPU_ROWS = 16
# Slot rows draft and verify (speculation.py) while at most this many decode: their drafts
# ride the same pass over the weights, where more rows' would multiply the step's positions.
# The embedded model's batch (scripts/bench_speculation.py --rows 2,3,4): a copy workload
# 1.21x, 1.10x, 1.07x plain; open-ended text 0.976x, 0.942x, 0.945x.
SPECULATE_MAX_ROWS = 2


def default_prefill_chunk(device: torch.device | str) -> int:
    return GPU_PREFILL_CHUNK if torch.device(device).type == "cuda" else PREFILL_CHUNK


def default_rows(device: torch.device | str) -> int:
    """The rows a server's worker on `device` batches by default."""
    return GPU_ROWS if torch.device(device).type == "cuda" else CPU_ROWS


class RowRunner(CacheRunner, Protocol):
    """What the loop needs from whoever runs the model (the Engine)."""

    model: Any  # get_device()
    tools: ToolUse
    tokenizer: Any  # the grammar's vocabulary (a request with one)
    assistant_end: int
    bos: int
    speculate: bool  # one-row generations of their own draft and verify (speculation.py)
    drafter: Callable[[list[int]], Drafter]  # a row's drafter, given its prompt

    def forward_last(self, ids: torch.Tensor, cache: Any) -> torch.Tensor: ...

    def forward_verify(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor: ...

    def forward_rows(
        self, ids: torch.Tensor, rows: SlotRows, out: list[int] | None = None
    ) -> torch.Tensor: ...

    @property
    def takes_prompt_rows(self) -> bool: ...

    def new_slot_cache(self, slots: int) -> SlotCache: ...


@dataclass
class GenerationStats:
    """One generation's numbers, filled in as it runs (pass one to Engine.generate to read it
    afterwards). Every caller reports these same definitions: the chat's status line, `once
    --json`, the server's usage and /stats, the benchmark."""

    prompt_tokens: int = 0
    prefill_tokens: int = 0  # of the prompt's, those that ran (a warm cache held the rest)
    prefill_s: float = 0.0  # from the start to the prompt all in (waited for on a GPU)
    first_token_s: float = 0.0  # from the start to the first token: time to first token
    # The steps that produced the tokens after the first: the loop's own time, not the
    # caller's between steps (a chat drawing text, a server writing chunks).
    decode_s: float = 0.0
    steps: int = 0  # tokens each row produced (columns)
    finish_reasons: list[str] = field(default_factory=list)  # per row: stop|length|context|...
    # Drafting's verify forwards, drafts and drafts taken (speculation.py); zeros where the
    # generation did not draft.
    speculation: SpeculationCounts = field(default_factory=SpeculationCounts)

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens a second, over the ones that ran."""
        return self.prefill_tokens / max(self.prefill_s, 1e-9)

    @property
    def decode_tps(self) -> float:
        """Tokens a second over the decode steps, every row's: the first column came from
        the prefill's logits, so a generation of one column has no decode speed (0)."""
        if self.steps < 2 or self.decode_s <= 0:
            return 0.0
        return len(self.finish_reasons) * (self.steps - 1) / self.decode_s


@dataclass(frozen=True)
class RowRequest:
    """One generation's arguments, as Engine.generate takes them."""

    tokens: list[int]
    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 42
    use_tools: bool = True
    resume: RowState | None = None  # the tool-use state `tokens` end in (an unfinished reply)
    # The log-probability of each produced token and this many alternatives (0 to 20);
    # None: not asked, and nothing is computed (logprobs.py).
    logprobs: int | None = None
    # The grammar its rows' tokens must follow (grammar.json_grammar's); None: free text.
    # A row under a grammar does not call the calculator.
    grammar: str | None = None
    grammar_prefix: tuple[int, ...] = ()  # the reply's tokens the grammar followed already


def plan(context_len: int, request: RowRequest) -> tuple[int, str]:
    """A request's budget (the most tokens its rows may generate: max_tokens within what the
    context leaves) and the finish reason of a row the budget ends ("length": the caller's
    limit, "context": the context's room). Every check of the arguments is here, made before
    anything runs: a ValueError, or ContextOverflowError where the prompt fills the context."""
    tokens, max_tokens = request.tokens, request.max_tokens
    if not tokens or not all(isinstance(t, int) for t in tokens):
        raise ValueError("tokens must be a non-empty list of ints")
    if max_tokens is not None and max_tokens < 0:
        raise ValueError("max_tokens must be non-negative (or None for the whole context)")
    if request.temperature < 0:
        raise ValueError("temperature must be non-negative")
    check_top(request.logprobs)
    left = context_len - len(tokens)
    if left <= 0:
        raise ContextOverflowError(
            f"The prompt is {len(tokens)} tokens; the model's context is "
            f"{context_len}. Shorten the conversation (e.g. /clear) or the message."
        )
    budget = left if max_tokens is None else min(max_tokens, left)
    cut = "length" if max_tokens is not None and budget == max_tokens else "context"
    return budget, cut


@dataclass(eq=False)
class Generation:
    """One request's rows in the scheduler: one, or several forked from its prompt."""

    request: RowRequest
    warm: WarmCache  # the cache its prompt prefills into
    slot: int | None  # its slot of the scheduler's SlotCache; None: rows in a cache of its own
    samples: int  # rows
    budget: int
    states: list[RowState]
    rng: torch.Generator | None  # the rows' draws, in row order; None: greedy
    stats: GenerationStats
    t_start: float
    sampling: tuple[float, int | None, float | None]  # temperature (0: greedy), top_k, top_p
    cache: KVCache | SharedPrefixCache | None = None  # where its rows decode, once prefilled
    prefilled: int = 0  # the prompt's tokens its cache holds
    done: bool = False
    tokens: list[int] = field(default_factory=list)  # row 0's tokens so far
    # The last step's column (a token a row) and masks; None where it produced none.
    column: list[int] | None = None
    masks: list[int] = field(default_factory=list)
    ids: torch.Tensor | None = None  # the column on the device, to run next
    first_at: int = -1  # the scheduler's step that produced its first column
    # The last column's log-probabilities, an entry a row, where the request asked for them.
    logprobs: list[TokenLogprob] | None = None
    grammar: RowsGrammar | None = None  # its rows' matchers, under request.grammar
    # Its one row's drafting, where it drafts (speculation.py); None: plain decode steps.
    speculation: Speculation | None = None

    @property
    def decoding(self) -> bool:
        return self.cache is not None and not self.done

    @property
    def finish_reason(self) -> str:
        """Row 0's finish reason (a server request has one row)."""
        return self.stats.finish_reasons[0]


@dataclass
class Stepped:
    """What one Scheduler.step produced: (generation, token, mask) of each one-row
    generation in order, and the generations it ended."""

    tokens: list[tuple[Generation, int, int]] = field(default_factory=list)
    finished: list[Generation] = field(default_factory=list)


class Scheduler:
    """Generations stepped together: up to `rows` of them in slots of one SlotCache (joining
    and leaving between steps: a server's requests), and any started in caches of their own
    (Engine.generate's). Not thread-safe: one thread joins, steps and leaves."""

    def __init__(
        self,
        runner: RowRunner,
        rows: int = 1,
        slots: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
    ) -> None:
        if rows < 1:
            raise ValueError("a batch needs at least one row")
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")
        self.runner = runner
        self.rows = rows
        self.prefill_chunk = prefill_chunk
        self._slot_count = max(rows, slots or rows)
        self._cache: SlotCache | None = None  # made at the first join: generate needs none
        self._slots: list[WarmCache] = []
        self._lru: list[int] = []  # slot indices, least recently used first
        self.running: list[Generation] = []  # in join order: the prefill's order
        self._step = 0
        self._device = runner.model.get_device()

    @property
    def cache(self) -> SlotCache:
        if self._cache is None:
            self._cache = self.runner.new_slot_cache(self._slot_count)
            self._slots = [WarmCache(self.runner, view) for view in self._cache.slots]
            self._lru = list(range(len(self._slots)))
        return self._cache

    @property
    def slots(self) -> list[WarmCache]:
        """The slots' warm caches (each keeps its conversation between requests)."""
        _ = self.cache
        return self._slots

    @property
    def free_rows(self) -> int:
        return self.rows - sum(1 for g in self.running if g.slot is not None)

    # ---- taking generations in, letting them go ---------------------------------------------

    def join(self, request: RowRequest) -> Generation:
        """Take `request` into a free slot as one row: the slot whose cache shares most with
        its prompt, else the least recently used (warm_cache.choose). Its prompt prefills over
        the next steps, in chunks. The arguments are checked here (plan); a full batch is a
        RuntimeError (free_rows says when there is room)."""
        if not self.free_rows:
            raise RuntimeError("the batch is full")
        budget, cut = plan(self.runner.context_len, request)
        slots = self.slots
        busy = {g.slot for g in self.running}
        free = [slots[i] for i in self._lru if i not in busy]
        warm = choose(free, request.tokens)
        slot = slots.index(warm)
        self._lru.remove(slot)
        self._lru.append(slot)
        gen = self._new(request, warm, slot, 1, budget, cut, GenerationStats())
        gen.prefilled = warm.begin(request.tokens)
        gen.stats.prefill_tokens = len(request.tokens) - gen.prefilled
        self.running.append(gen)
        return gen

    def start(
        self, request: RowRequest, warm: WarmCache, samples: int, stats: GenerationStats
    ) -> Generation:
        """Take `request` in as `samples` rows in a cache of their own: its prompt prefills
        into `warm` past what it holds, in one forward at the next step; one row decodes in
        warm's cache, several in rows forked from it."""
        if samples < 1:
            raise ValueError("num_samples must be at least 1")
        budget, cut = plan(self.runner.context_len, request)
        gen = self._new(request, warm, None, samples, budget, cut, stats)
        self.running.append(gen)
        return gen

    def _new(
        self,
        request: RowRequest,
        warm: WarmCache,
        slot: int | None,
        samples: int,
        budget: int,
        cut: str,
        stats: GenerationStats,
    ) -> Generation:
        resume = request.resume if request.use_tools and request.grammar is None else None
        greedy = request.temperature < GREEDY_BELOW
        rng = None
        if not greedy:
            rng = torch.Generator(device=self._device)
            rng.manual_seed(request.seed)
        stats.prompt_tokens, stats.prefill_tokens, stats.steps = len(request.tokens), 0, 0
        stats.prefill_s = stats.first_token_s = stats.decode_s = 0.0
        stats.finish_reasons = [cut] * samples
        stats.speculation = SpeculationCounts()
        states = [RowState() if resume is None else resume.copy() for _ in range(samples)]
        temperature = 0.0 if greedy else request.temperature
        gen = Generation(
            request, warm, slot, samples, budget, states, rng, stats, time.perf_counter(),
            (temperature, request.top_k, request.top_p),
        )  # fmt: skip
        if request.grammar is not None:  # its first masks compute while the prompt prefills
            tokenizer = grammar_tokenizer(self.runner.tokenizer)
            end = self.runner.assistant_end
            gen.grammar = RowsGrammar(
                tokenizer, request.grammar, samples, end, request.grammar_prefix
            )
        if self._drafts(gen):
            drafter = self.runner.drafter(request.tokens)
            timed = self._device.type == "cpu"
            gen.speculation = Speculation(drafter, stats.speculation, timed)
        return gen

    def _drafts(self, gen: Generation) -> bool:
        """Whether `gen` drafts and verifies (speculation.py): a generation of one row (a chat
        turn, `once`, a server's request), not under a grammar, where the runner's speculate
        is on. A slot's row drafts while at most SPECULATE_MAX_ROWS rows decode, where the
        step takes several positions of a slot (_step_slots)."""
        return self.runner.speculate and gen.samples == 1 and gen.grammar is None

    def leave(self, gen: Generation, reason: str = "interrupted") -> None:
        """End `gen` now (its client left, a stop sequence matched): its rows' finish reason
        is `reason`, its slot free for the next join, keeping what it holds (warm for the
        conversation's next turn)."""
        if gen.done:
            return
        gen.stats.finish_reasons = [reason] * gen.samples
        self._end(gen)

    def _end(self, gen: Generation) -> None:
        if gen.speculation is not None and gen.cache is not None:
            gen.speculation.settle(gen.cache)  # type: ignore[arg-type]
        gen.done = True
        self.running.remove(gen)
        if gen.slot is not None:  # a generation of its own settles where its caller says
            gen.warm.settle()

    # ---- the step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> Stepped:
        """One step of every running generation: a decode step of each decoding row, and up
        to prefill_chunk tokens of the slots' waiting prompts (oldest first) where a prompt
        that completes gives its row's first token; a generation of its own prefills its
        prompt whole. Rows that end (a stop token, the budget) leave at once."""
        t0 = time.perf_counter()
        out = Stepped()
        ran: list[tuple[Generation, torch.Tensor]] = []  # each generation's rows' logits
        running = list(self.running)
        for gen in running:
            gen.column = None
        slotted = [g for g in running if g.slot is not None]
        if slotted:
            self._step_slots(slotted, ran, out)
        for gen in running:
            if gen.slot is None:
                logits = self._step_own(gen)
                if gen.budget > 0:
                    ran.append((gen, logits))
                else:  # max_tokens 0: the prompt is in, nothing is generated
                    self._end(gen)
                    out.finished.append(gen)
        self._produce(ran, out)
        # Each step's time is the decode time of the generations that had their first token
        # before it; the first token's step is the time to it.
        spent = time.perf_counter() - t0
        for gen in running:
            if 0 <= gen.first_at < self._step:
                gen.stats.decode_s += spent
        self._step += 1
        return out

    def _step_own(self, gen: Generation) -> torch.Tensor:
        """A generation in a cache of its own: its prompt at its first step (then its rows'
        cache: warm's own, or rows forked from it), else its rows' last tokens."""
        if gen.cache is not None:
            assert gen.ids is not None
            if gen.speculation is not None:
                return self._drafted(gen, self.runner, gen.ids)
            return self.runner.forward_last(gen.ids, gen.cache)
        logits, gen.stats.prefill_tokens = gen.warm.prefill(gen.request.tokens)
        wait_for_device(self._device)  # a GPU's work runs on after the call
        gen.stats.prefill_s = time.perf_counter() - gen.t_start
        gen.prefilled = len(gen.request.tokens)
        if gen.samples == 1:
            gen.cache = gen.warm.cache
        else:
            gen.cache = gen.warm.fork(gen.samples, gen.budget)
            logits = logits.expand(gen.samples, -1)
        return logits

    def _drafted(self, gen: Generation, runner: VerifyRunner, ids: torch.Tensor) -> torch.Tensor:
        """A drafting row's logits (1, V) for its next token (Speculation.logits): drafts up to
        its budget, the calculator's queued tokens first."""
        assert gen.speculation is not None and isinstance(gen.cache, KVCache)
        room, queued = self._draft_room(gen)
        return gen.speculation.logits(runner, ids, gen.cache, room, queued)

    def _plan(self, gen: Generation) -> list[int]:
        """A slot row's drafts to verify in this step's forward (Speculation.plan)."""
        assert gen.speculation is not None and isinstance(gen.cache, KVCache)
        room, queued = self._draft_room(gen)
        return gen.speculation.plan(gen.cache, room, queued)

    def _draft_room(self, gen: Generation) -> tuple[int, list[int]]:
        """(the tokens a row may draft: its budget past the next one, the calculator's
        queued tokens, which it drafts first)."""
        room = gen.budget - gen.stats.steps - 1  # tokens past the next one's
        forced = gen.states[0].forced_tokens
        return room, list(forced) if forced and gen.request.use_tools else []

    def _step_slots(
        self, slotted: list[Generation], ran: list[tuple[Generation, torch.Tensor]], out: Stepped
    ) -> None:
        """The slots' decoding rows and their prompts' chunks: in one forward where the
        runner takes a prompt's chunk as rows of its slot (our CPU step), else the decoding
        rows' forward and then each chunk through the model's forward. A row whose next
        logits a verification gave runs nothing; a drafting row that decodes alone, with no
        prompt to prefill, drafts and verifies in its slot."""
        decoding = [g for g in slotted if g.cache is not None]
        chunks = self._chunks(slotted)
        verified = [g for g in decoding if g.speculation and g.speculation.pending]
        for gen in verified:
            assert gen.speculation is not None
            ran.append((gen, gen.speculation.verified()))  # type: ignore[arg-type]
        decoding = [g for g in decoding if g not in verified]
        if len(decoding) == 1 and not chunks and not verified and decoding[0].speculation:
            gen = decoding[0]
            verifier = SlotVerifier(self.runner, self.cache, gen.slot)  # type: ignore[arg-type]
            ran.append((gen, self._drafted(gen, verifier, self._ids([[gen.tokens[-1]]]))))
            return
        if not self.runner.takes_prompt_rows:
            if decoding:
                slots = SlotRows(self.cache, [g.slot for g in decoding])  # type: ignore[misc]
                ids = self._ids([[g.tokens[-1]] for g in decoding])
                logits = self.runner.forward_rows(ids, slots)
                ran.extend((g, logits[i : i + 1]) for i, g in enumerate(decoding))
            for gen, tokens in chunks:
                self._prefilled(gen, tokens, gen.warm.extend(tokens), ran, out)
            return
        # A few rows (or one beside a prompt's chunk) draft too: each drafting row's
        # positions join the one forward, every one of them answered (the weights read once
        # for all, as a prompt's chunk reads them).
        drafting = len(decoding) <= SPECULATE_MAX_ROWS
        slots: list[int] = []
        ids: list[int] = []
        lines: list[tuple[Generation, list[int], int]] = []  # (row, its drafts, cache position)
        for gen in decoding:
            drafts = self._plan(gen) if drafting and gen.speculation is not None else []
            assert gen.slot is not None
            slots += [gen.slot] * (1 + len(drafts))
            ids += [gen.tokens[-1], *drafts]
            lines.append((gen, drafts, gen.cache.get_pos()))  # type: ignore[union-attr]
        wanted = list(range(len(ids)))
        for gen, tokens in chunks:
            slots += [gen.slot] * len(tokens)
            ids += tokens
            if gen.prefilled + len(tokens) == len(gen.request.tokens):
                wanted.append(len(ids) - 1)
        if not ids:
            return
        tensor = self._ids([[token] for token in ids])
        logits = self.runner.forward_rows(tensor, SlotRows(self.cache, slots), wanted)  # type: ignore[arg-type]
        done = 0
        for gen, drafts, base in lines:
            if drafts:
                assert gen.speculation is not None
                line = gen.speculation.line(drafts, self._device)
                gen.speculation.record(logits[done : done + 1 + len(drafts)], line, drafts, base)
            ran.append((gen, logits[done : done + 1]))
            done += 1 + len(drafts)
        for gen, tokens in chunks:
            gen.warm.tokens.extend(tokens)
            last = None
            if gen.prefilled + len(tokens) == len(gen.request.tokens):
                last = logits[done : done + 1]
                done += 1
            self._prefilled(gen, tokens, last, ran, out)

    def _chunks(self, slotted: list[Generation]) -> list[tuple[Generation, list[int]]]:
        """The prompt tokens this step runs: up to prefill_chunk, the oldest prompt first."""
        chunks, budget = [], self.prefill_chunk
        for gen in slotted:
            if budget <= 0:
                break
            if gen.cache is None:
                prompt = gen.request.tokens
                take = min(budget, len(prompt) - gen.prefilled)
                chunks.append((gen, prompt[gen.prefilled : gen.prefilled + take]))
                budget -= take
        return chunks

    def _prefilled(
        self,
        gen: Generation,
        tokens: list[int],
        logits: torch.Tensor | None,
        ran: list[tuple[Generation, torch.Tensor]],
        out: Stepped,
    ) -> None:
        """`tokens` of a slot's prompt ran; logits (1, V): its last token's, once it is all in
        (its first token is drawn from them)."""
        gen.prefilled += len(tokens)
        if gen.prefilled < len(gen.request.tokens):
            return
        assert logits is not None
        gen.stats.prefill_s = time.perf_counter() - gen.t_start
        gen.cache = gen.warm.cache
        if gen.budget <= 0:  # max_tokens 0: the prompt is in, nothing is generated
            self._end(gen)
            out.finished.append(gen)
        else:
            ran.append((gen, logits))

    def _ids(self, ids: list[list[int]]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self._device)

    # ---- the per-row policy -------------------------------------------------------------------

    def _produce(self, ran: list[tuple[Generation, torch.Tensor]], out: Stepped) -> None:
        """Each row's next token from its logits: drawn with its generation's settings and
        generator (nothing past the budget, nothing for a row that is over), or forced by
        the calculator; then whether each generation ends."""
        # Before the draw, from the logits as the model gave them (temperature 1, no
        # grammar's mask): the model's own distribution.
        dists = [None if g.request.logprobs is None else distributions(x) for g, x in ran]
        ran = constrained(ran)
        sampled = _sample(ran)
        now = time.perf_counter()
        for (gen, _), drawn, dist in zip(ran, sampled, dists, strict=True):
            column, masks = self._take(gen, drawn)
            if dist is not None:
                picked = drawn[1] if drawn is not None else None
                top = gen.request.logprobs or 0
                gen.logprobs = column_logprobs(dist, picked, column, masks, top)
            stats = gen.stats
            stats.steps += 1
            gen.column, gen.masks = column, masks
            gen.tokens.append(column[0])
            if gen.cache is gen.warm.cache:
                gen.warm.tokens.append(column[0])
            if gen.speculation is not None:  # before _result_pending reads the cache's room
                last = stats.steps >= gen.budget or gen.states[0].completed
                gen.speculation.took(column[0], gen.cache, last)  # type: ignore[arg-type]
            if stats.steps == 1:
                stats.first_token_s = now - gen.t_start
                gen.first_at = self._step
            if gen.samples == 1:
                out.tokens.append((gen, column[0], masks[0]))
            if all(s.completed for s in gen.states) or (
                stats.steps >= gen.budget and not self._result_pending(gen)
            ):
                self._end(gen)
                out.finished.append(gen)
            elif gen.slot is not None:
                pass  # its token runs among the slots' rows (_step_slots)
            elif drawn is not None and drawn[0] == column:
                gen.ids = drawn[1]  # on the device already: no copy from the host
            else:  # a calculator's forced tokens, an ended row's filler
                gen.ids = self._ids([[t] for t in column])

    def _take(
        self, gen: Generation, drawn: tuple[list[int], torch.Tensor] | None
    ) -> tuple[list[int], list[int]]:
        """Each row's token of this step and its mask: the calculator's next forced token
        (mask 0), else the one drawn for it (mask 1); a row that is over, or past the budget
        with nothing queued, gets <|assistant_end|> as filler (mask 0). A row that takes
        <|assistant_end|> or <|bos|> stops ("stop"); the calculator follows its tokens."""
        runner = self.runner
        end, bos = runner.assistant_end, runner.bos
        use_tools = gen.request.use_tools and gen.grammar is None
        picks = drawn[0] if drawn is not None else None
        column, masks = [], []
        for i, state in enumerate(gen.states):
            if state.completed:
                column.append(end)
                masks.append(0)
                continue
            pick = picks[i] if picks is not None else None
            if state.forced_tokens:
                token, mask = state.forced_tokens.popleft(), 0
            elif pick is None:  # past the budget, nothing queued: the row is over
                state.completed = True
                column.append(end)
                masks.append(0)
                continue
            else:
                token, mask = pick, 1
            column.append(token)
            masks.append(mask)
            if token in (end, bos):
                state.completed = True
                gen.stats.finish_reasons[i] = "stop"
            elif use_tools:
                runner.tools.track(state, token)
        if gen.grammar is not None:
            gen.grammar.advance(column, [not s.completed for s in gen.states])
        return column, masks

    @staticmethod
    def _result_pending(gen: Generation) -> bool:
        """Whether a row still has calculator tokens queued and its cache the room for one
        more: a position for the token just produced and one for the next. A calculator
        result is one unit, written whole past the budget (as far as the context allows)."""
        queued = any(s.forced_tokens and not s.completed for s in gen.states)
        cache = gen.cache
        rest = cache.suffix if isinstance(cache, SharedPrefixCache) else cache
        return queued and rest is not None and rest.max_seq_len - rest.get_pos() >= 2


def _sample(
    ran: list[tuple[Generation, torch.Tensor]],
) -> list[tuple[list[int], torch.Tensor] | None]:
    """Each generation's drawn tokens, one a row (None past its budget: nothing is drawn),
    and the same as a (rows, 1) tensor on the device. Generations of the same settings
    sample in one call, each row with its generator's next draw: the rows of one generation
    share its generator, in row order, and every row draws every step (one taking a forced
    token, or over, too), so a seed gives the same tokens however the rows end."""
    groups: dict[tuple[float, int | None, float | None], list[int]] = {}
    for i, (gen, _) in enumerate(ran):
        if gen.stats.steps < gen.budget:
            groups.setdefault(gen.sampling, []).append(i)
    chosen: list[tuple[list[int], torch.Tensor] | None] = [None] * len(ran)
    for (temperature, top_k, top_p), members in groups.items():
        parts = [ran[i][1] for i in members]
        both = parts[0] if len(parts) == 1 else torch.cat(parts)
        if temperature == 0.0:
            picked = torch.argmax(both, dim=-1, keepdim=True)
        else:
            u = [draws(ran[i][0].samples, ran[i][0].rng, both.device) for i in members]
            picked = sample_with_draws(
                both, u[0] if len(u) == 1 else torch.cat(u), temperature, top_k, top_p
            )
        tokens = picked[:, 0].tolist()  # the step's one host read
        at = 0
        for i in members:
            n = ran[i][0].samples
            chosen[i] = (tokens[at : at + n], picked[at : at + n])
            at += n
    return chosen


def constrained(
    ran: list[tuple[Generation, torch.Tensor]],
) -> list[tuple[Generation, torch.Tensor]]:
    """Each generation's rows' logits, with what its grammar forbids at -inf (as they are
    without one): the sampler then draws only tokens the grammar allows."""
    masked = masked_rows([(gen.grammar, logits) for gen, logits in ran])
    return [(gen, logits) for (gen, _), logits in zip(ran, masked, strict=True)]


def wait_for_device(device: torch.device | str) -> None:
    """Wait for a CUDA device's queued work, so that a prefill's time is the prefill's and
    not the first decode step's (whose host read would wait for it). Free: that read comes
    next anyway. Nothing to wait for on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
