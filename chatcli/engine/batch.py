"""Continuous batching: independent generations sharing one decode step, joining and leaving
between steps (a server's requests).

Owns: Batch (a SlotCache of conversation slots, each a WarmCache kept between requests, and
the rows generating in them: `join` takes a request into a free slot, `step` runs a share of
the waiting prompts' prefill, in chunks, and one decode step of every decoding row, `leave`
frees a row's slot at once) and BatchRow (one request: its prompt, sampling settings and
own seeded generator, budget, calculator state, finish reason and timings).

A row's tokens are what Engine.generate gives the same request alone: the same per-row logic
(Engine.take_token), the same budget and finish reasons, its own generator drawing exactly
when the single path's draws; only the float rounding of a batched product differs, which
moves greedy and seeded choices only at near-ties. Knows nothing about text, threads or
HTTP: the server's worker drives it (serve/batch_worker.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from chatcli.engine.engine import Engine, GenerationStats
from chatcli.engine.tool_use import RowState
from chatcli.engine.warm_cache import WarmCache, choose
from chatcli.model.sampling import GREEDY_BELOW, draws, sample_with_draws
from chatcli.model.slot_cache import SlotRows

# The prompt tokens a step prefills (across waiting rows, oldest first) after its decode
# step: the decoding rows wait that long for their next token. See docs/batching.md.
PREFILL_CHUNK = 64
# A GPU prefills a chunk of this many in about the time of a decode step's launch.
GPU_PREFILL_CHUNK = 512


# A server worker's rows where --batch is not given (docs/batching.md has the measurements).
CPU_ROWS = 8
GPU_ROWS = 16


def default_prefill_chunk(device: torch.device | str) -> int:
    return GPU_PREFILL_CHUNK if torch.device(device).type == "cuda" else PREFILL_CHUNK


def default_rows(device: torch.device | str) -> int:
    """The rows a server's worker on `device` batches by default."""
    return GPU_ROWS if torch.device(device).type == "cuda" else CPU_ROWS


@dataclass(frozen=True)
class RowRequest:
    """One generation, as Engine.generate's one-row arguments."""

    tokens: list[int]
    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 42
    use_tools: bool = True
    resume: RowState | None = None  # the tool-use state `tokens` end in (Engine.generate)


@dataclass(eq=False)
class BatchRow:
    """One request in a Batch: where it is, and what it generated so far."""

    request: RowRequest
    slot: int
    warm: WarmCache
    budget: int
    cut: str  # the finish reason of a row the budget ends: length or context
    state: RowState
    rng: torch.Generator | None
    stats: GenerationStats
    t_join: float
    prefilled: int = 0  # the prompt's tokens the slot holds
    pending: int | None = None  # the last token produced, not yet run (decoding rows)
    done: bool = False
    finish_reason: str = ""
    tokens: list[int] = field(default_factory=list)  # every token produced
    t_first: float = 0.0

    @property
    def decoding(self) -> bool:
        return self.pending is not None and not self.done


@dataclass
class Stepped:
    """What one Batch.step produced: (row, token, mask) in order, and the rows it ended."""

    tokens: list[tuple[BatchRow, int, int]] = field(default_factory=list)
    finished: list[BatchRow] = field(default_factory=list)


class Batch:
    """Up to `rows` generations at once over `slots` (at least `rows`) conversation caches.

    Not thread-safe: one thread joins, steps and leaves (the worker's loop)."""

    def __init__(
        self,
        engine: Engine,
        rows: int,
        slots: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
    ) -> None:
        if rows < 1:
            raise ValueError("a batch needs at least one row")
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")
        self.engine = engine
        self.rows = rows
        self.prefill_chunk = prefill_chunk
        self.cache = engine.new_slot_cache(max(rows, slots or rows))
        self.slots = [WarmCache(engine, view) for view in self.cache.slots]
        self._lru = list(range(len(self.slots)))  # slot indices, least recently used first
        self.running: list[BatchRow] = []  # in join order: the prefill's order

    @property
    def free_rows(self) -> int:
        return self.rows - len(self.running)

    def join(self, request: RowRequest) -> BatchRow:
        """Take `request` into a free slot: the one whose cache shares most with its prompt,
        else the least recently used (warm_cache.choose). Its prompt prefills over the next
        steps. The arguments are checked here (Engine.generate's errors); a full batch is a
        RuntimeError (free_rows says when there is room)."""
        if not self.free_rows:
            raise RuntimeError("the batch is full")
        engine = self.engine
        budget = engine.budget_for(request.tokens, request.max_tokens)
        if request.temperature < 0:
            raise ValueError("temperature must be non-negative")
        cut = (
            "length"
            if request.max_tokens is not None and budget == request.max_tokens
            else "context"
        )
        busy = {row.slot for row in self.running}
        free = [self.slots[i] for i in self._lru if i not in busy]
        warm = choose(free, request.tokens)
        slot = self.slots.index(warm)
        self._lru.remove(slot)
        self._lru.append(slot)
        resume = request.resume if request.use_tools else None
        greedy = request.temperature < GREEDY_BELOW
        rng = None
        if not greedy:
            rng = torch.Generator(device=engine.model.get_device())
            rng.manual_seed(request.seed)
        stats = GenerationStats(prompt_tokens=len(request.tokens), finish_reasons=[cut])
        row = BatchRow(
            request, slot, warm, budget, cut, RowState() if resume is None else resume.copy(),
            rng, stats, time.perf_counter(),
        )  # fmt: skip
        row.prefilled = warm.begin(request.tokens)
        stats.prefill_tokens = len(request.tokens) - row.prefilled
        self.running.append(row)
        return row

    def leave(self, row: BatchRow, reason: str = "interrupted") -> None:
        """End `row` now (its client left, a stop sequence matched): its slot is free for the
        next join and keeps what it holds (warm for the conversation's next turn)."""
        if row.done:
            return
        row.done = True
        row.finish_reason = reason
        row.stats.finish_reasons = [reason]
        row.warm.settle()
        self.running.remove(row)

    @torch.inference_mode()
    def step(self) -> Stepped:
        """One decode step of every decoding row and up to prefill_chunk tokens of the
        waiting prompts (oldest first; a prompt that completes gives its row's first token):
        in one forward where the engine's step takes a prompt's chunk as rows of its slot
        (our CPU step), else the chunks through the model's forward after the step. Rows
        that end (a stop token, the budget) leave at once."""
        out = Stepped()
        decoding = [row for row in self.running if row.decoding]
        chunks = self._chunks()
        if self.engine.takes_prompt_rows:
            self._step_together(decoding, chunks, out)
            return out
        if decoding:
            slots = SlotRows(self.cache, [row.slot for row in decoding])
            logits = self.engine.forward_rows(self._ids([[r.pending] for r in decoding]), slots)
            self._produce(decoding, logits, out)
        for row, tokens in chunks:
            self._prefilled(row, tokens, row.warm.extend(tokens), out)
        return out

    def _chunks(self) -> list[tuple[BatchRow, list[int]]]:
        """The prompt tokens this step runs: up to prefill_chunk, the oldest prompt first."""
        chunks, budget = [], self.prefill_chunk
        for row in self.running:
            if budget <= 0:
                break
            if row.pending is None:
                prompt = row.request.tokens
                take = min(budget, len(prompt) - row.prefilled)
                chunks.append((row, prompt[row.prefilled : row.prefilled + take]))
                budget -= take
        return chunks

    def _step_together(
        self, decoding: list[BatchRow], chunks: list[tuple[BatchRow, list[int]]], out: Stepped
    ) -> None:
        """The decoding rows and the prompts' chunks as the rows of one forward: logits for
        the decoding rows and for the last token of each prompt that completes."""
        slots = [row.slot for row in decoding]
        ids = [row.pending for row in decoding]
        wanted = list(range(len(decoding)))
        for row, tokens in chunks:
            slots += [row.slot] * len(tokens)
            ids += tokens
            if row.prefilled + len(tokens) == len(row.request.tokens):
                wanted.append(len(ids) - 1)
        if not ids:
            return
        tensor = self._ids([[token] for token in ids])
        logits = self.engine.forward_rows(tensor, SlotRows(self.cache, slots), wanted)
        if decoding:
            self._produce(decoding, logits[: len(decoding)], out)
        done = len(decoding)
        for row, tokens in chunks:
            row.warm.tokens.extend(tokens)
            last = None
            if row.prefilled + len(tokens) == len(row.request.tokens):
                last = logits[done : done + 1]
                done += 1
            self._prefilled(row, tokens, last, out)

    def _prefilled(
        self, row: BatchRow, tokens: list[int], logits: torch.Tensor | None, out: Stepped
    ) -> None:
        """`tokens` of the row's prompt ran; logits (1, V): its last token's, once it is all
        in (its first token is drawn from them)."""
        row.prefilled += len(tokens)
        if row.prefilled < len(row.request.tokens):
            return
        assert logits is not None
        row.stats.prefill_s = time.perf_counter() - row.t_join
        if row.budget <= 0:  # max_tokens 0: the prompt is in, nothing is generated
            self._finish(row, row.cut, out)
        else:
            self._produce([row], logits, out)

    def _ids(self, ids: list[list[int]]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.engine.model.get_device())

    def _produce(self, rows: list[BatchRow], logits: torch.Tensor, out: Stepped) -> None:
        """Each row's next token from its logits (N, V): drawn with its own settings and
        generator (none past its budget), or forced by the calculator; then whether it ends."""
        overtime = [row.stats.steps >= row.budget for row in rows]
        sampled = _sample(rows, logits, overtime)
        now = time.perf_counter()
        for row, drawn in zip(rows, sampled, strict=True):
            request = row.request
            token, mask, stopped = self.engine.take_token(row.state, drawn, request.use_tools)
            row.tokens.append(token)
            row.stats.steps += 1
            row.warm.tokens.append(token)
            out.tokens.append((row, token, mask))
            if row.stats.steps == 1:
                row.t_first = now
                row.stats.first_token_s = now - row.t_join
            row.stats.decode_s = now - row.t_first
            if stopped:
                self._finish(row, "stop", out)
            elif row.state.completed or (
                row.stats.steps >= row.budget and not self._result_pending(row)
            ):
                self._finish(row, row.cut, out)
            else:
                row.pending = token

    def _result_pending(self, row: BatchRow) -> bool:
        """As engine._result_pending for one row: calculator tokens queued, and room in its
        slot for the token just produced and one more."""
        cache = row.warm.cache
        assert cache is not None
        return bool(row.state.forced_tokens) and cache.max_seq_len - cache.get_pos() >= 2

    def _finish(self, row: BatchRow, reason: str, out: Stepped) -> None:
        self.leave(row, reason)
        out.finished.append(row)


def _sample(rows: list[BatchRow], logits: torch.Tensor, overtime: list[bool]) -> list[int | None]:
    """Each row's drawn token (None past its budget, where nothing is drawn): rows of the
    same settings sample in one call, each with its own generator's draw."""
    groups: dict[tuple[float, int | None, float | None], list[int]] = {}
    for i, (row, over) in enumerate(zip(rows, overtime, strict=True)):
        if not over:
            r = row.request
            temperature = 0.0 if r.temperature < GREEDY_BELOW else r.temperature
            groups.setdefault((temperature, r.top_k, r.top_p), []).append(i)
    chosen: list[int | None] = [None] * len(rows)
    for (temperature, top_k, top_p), members in groups.items():
        part = logits if len(members) == len(rows) else logits[members]
        if temperature == 0.0:
            picked = torch.argmax(part, dim=-1)
        else:
            u = torch.cat([draws(1, rows[i].rng, part.device) for i in members])
            picked = sample_with_draws(part, u, temperature, top_k, top_p)[:, 0]
        for i, token in zip(members, picked.tolist(), strict=True):
            chosen[i] = token
    return chosen
