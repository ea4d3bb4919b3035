"""The Engine: prefill a prompt, then decode one or many sample rows with the calculator tool.

Owns: the one generation loop every caller runs (`Engine.generate`: a chat turn, /samples, a
server worker's request, the bench, nanochat-style callers), with its prefill, decode, token
budget, timings and finish reasons; the caches a generation decodes in (the caller's
WarmCache, or one made for it); running ids through the model. Knows nothing about text
beyond the few special tokens it needs (tool_use.py follows calculator calls).

It works with any model that follows the cache protocol (`config`, `get_device()`,
`forward(ids, kv_cache=...)` that writes K/V and advances the cache) and any tokenizer with
encode/decode/encode_special/get_bos_token_id.

Masks: 1 for tokens the model sampled, 0 for tokens the calculator forced into the stream.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from chatcli.engine.cpu_plan import prefill_threads, torch_threads
from chatcli.engine.slot_step import forward_slots
from chatcli.engine.step_choice import Step, compiled_forward, pick_decode_step
from chatcli.engine.tool_use import RESULT_RESERVE, RowState, ToolTokenizer, ToolUse
from chatcli.engine.warm_cache import WarmCache
from chatcli.errors import ContextOverflowError
from chatcli.kernels.sample_rows import sample_rows
from chatcli.model.kv_cache import KVCache, SharedPrefixCache
from chatcli.model.sampling import sample_next_token
from chatcli.model.slot_cache import SlotCache, SlotRows
from chatcli.model.special_tokens import ASSISTANT_END

__all__ = ["Engine", "GenerationStats", "KVCache", "RowState"]


class CachedModel(Protocol):
    config: Any  # needs n_layer, n_head, n_kv_head, n_embd, sequence_len

    def get_device(self) -> torch.device: ...

    def forward(self, idx: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor: ...


@dataclass
class GenerationStats:
    """Filled in by `Engine.generate` as it runs; pass one in to read it afterwards."""

    prompt_tokens: int = 0
    prefill_tokens: int = 0  # of the prompt's, those the prefill ran (a warm cache held the rest)
    prefill_s: float = 0.0  # the prompt's forward, waited for on a GPU
    first_token_s: float = 0.0  # from the call to the first yielded column
    decode_s: float = 0.0  # the decode steps, without the caller's time between them
    steps: int = 0  # columns yielded
    finish_reasons: list[str] = field(default_factory=list)  # per row: stop|length|context

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


def wait_for_device(device: torch.device | str) -> None:
    """Wait for a CUDA device's queued work, so that a prefill's time is the prefill's and
    not the first decode step's (whose host read would wait for it). Free: that read comes
    next anyway. Nothing to wait for on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class _Sampling(NamedTuple):
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int


class Engine:
    """Generation over one model: prefill, decode, sample rows and the calculator.

    Not thread-safe: a CUDA graph step's input buffers are the engine's own, so one thread
    uses an engine at a time (the server gives each worker its own). Generations begun on
    that thread may interleave."""

    def __init__(
        self, model: CachedModel, tokenizer: ToolTokenizer, *, compile: bool = False
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self._forward = model.forward
        self.decode_step: Step | None = pick_decode_step(model, compile)
        self.compiled = False  # whether --compile took: only where no faster step was kept
        if compile and self.decode_step is None:
            # No faster step for this model: compile the whole forward (dynamic shapes).
            # The K/V writes happen before the cache advances, so a failed compiled call
            # that falls back to eager simply rewrites the same positions.
            self._forward = compiled_forward(model)
            self.compiled = True
        self.tools = ToolUse(tokenizer)
        self.assistant_end = tokenizer.encode_special(ASSISTANT_END)
        self.bos = tokenizer.get_bos_token_id()
        # Our GPT can skip the vocabulary projection of all but the last prefill position,
        # and decode many samples over one shared copy of the prompt's K/V (fork: not with
        # a static step, whose rows take a copy each).
        self._last_only = "last_only" in inspect.signature(model.forward).parameters
        self.shared_prefix = getattr(model, "supports_shared_prefix", False)
        # A static step's one-row generations reuse one full-context cache: its CUDA graph is
        # captured once, not per request, and the prompt prefills straight into it. The lock
        # marks it lent: a generation begun while another is still open gets its own cache.
        self._kept: WarmCache | None = None
        self._kept_lent = threading.Lock()
        if str(model.get_device()).startswith("cpu"):
            # Built (the first time on a machine) and checked now, with the model's loading,
            # not inside the first reply's decode.
            sample_rows()

    @property
    def context_len(self) -> int:
        """The most positions a sequence may take: the model's training context."""
        return int(self.model.config.sequence_len)

    # ---- the generation loop ----------------------------------------------------------------

    def generate(
        self,
        tokens: list[int],
        num_samples: int = 1,
        max_tokens: int | None = None,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int = 42,
        top_p: float | None = None,
        *,
        use_tools: bool = True,
        stats: GenerationStats | None = None,
        resume: RowState | None = None,
        warm: WarmCache | None = None,
    ) -> Iterator[tuple[list[int], list[int]]]:
        """Yield (token_column, token_masks), one entry per sample row, each step.

        The prompt `tokens` prefills into `warm` past the prefix it already holds (a chat's
        or a server worker's cache, kept between generations), or into a cache made for this
        generation. One row decodes in that cache, appending its tokens to warm.tokens;
        `num_samples` rows fork from it (warm.fork) and decode together, each sampling its
        own first token. A row is done at <|assistant_end|> or <|bos|> (that token is
        yielded). Stops when every row is done, after max_tokens steps (None: no limit; a
        calculator result still queued is written whole past it), or when the context is
        full; or when the caller closes the iterator. The last yielded column is never
        written to the cache (the caller decides whether the turn goes on).

        `resume` is the tool-use state `tokens` end in, when they end inside an unfinished
        reply (`replay_tool_use` of its body): every row starts from a copy of it. With
        use_tools off nothing is forced, so it is not used.

        The arguments are checked at the call, before anything runs: a ValueError, or a
        ContextOverflowError where the prompt fills the context.
        """
        if num_samples < 1:
            raise ValueError("num_samples must be at least 1")
        budget = self.budget_for(tokens, max_tokens)
        # A row cut at the budget says why: the caller's limit, or the context's room.
        cut = "length" if max_tokens is not None and budget == max_tokens else "context"
        return self._generate(
            tokens,
            num_samples,
            budget,
            cut,
            _Sampling(temperature, top_k, top_p, seed),
            use_tools=use_tools,
            stats=stats if stats is not None else GenerationStats(),
            resume=resume if use_tools else None,
            warm=warm,
        )

    @torch.inference_mode()
    def _generate(
        self,
        tokens: list[int],
        num_samples: int,
        budget: int,
        cut: str,
        sampling: _Sampling,
        *,
        use_tools: bool,
        stats: GenerationStats,
        resume: RowState | None,
        warm: WarmCache | None,
    ) -> Iterator[tuple[list[int], list[int]]]:
        stats.prompt_tokens, stats.prefill_tokens, stats.steps = len(tokens), 0, 0
        stats.prefill_s = stats.first_token_s = stats.decode_s = 0.0
        t_start = time.perf_counter()
        with self._prompt_cache(warm, len(tokens), num_samples, budget) as warm:
            try:
                # Prefill: the prompt past what the cache holds, in one batch-1 forward.
                logits, stats.prefill_tokens = warm.prefill(tokens)
                wait_for_device(self.model.get_device())  # a GPU's runs on after the call
                stats.prefill_s = time.perf_counter() - t_start
                # Decode: one row in the cache itself, or sample rows forked from it.
                cache = warm.cache if num_samples == 1 else warm.fork(num_samples, budget)
                rows = [RowState() if resume is None else resume.copy() for _ in range(num_samples)]
                stats.finish_reasons = [cut] * num_samples
                steps = self._decode(
                    cache, logits.expand(num_samples, -1), rows, budget, sampling, use_tools, stats
                )
                for column, masks in steps:
                    if cache is warm.cache:
                        warm.tokens.append(column[0])
                    if stats.steps == 1:
                        stats.first_token_s = time.perf_counter() - t_start
                    yield column, masks
            finally:
                warm.settle()

    def _decode(
        self,
        cache: KVCache | SharedPrefixCache,
        logits: torch.Tensor,
        rows: list[RowState],
        budget: int,
        sampling: _Sampling,
        use_tools: bool,
        stats: GenerationStats,
    ) -> Iterator[tuple[list[int], list[int]]]:
        """Decode from a filled cache and the logits (N, V) of its last position, one step a
        column: each row's token (_next_token) and its tool use (ToolUse.track), then one
        forward of every row's token. A row's state is its own (`rows[i]`, its finish reason
        in stats), so rows of different prompts could share these steps.

        A calculator result is one unit: forced tokens still queued when the budget runs out
        are yielded after it (as far as the cache has room), so a reply is never cut inside
        one.
        """
        temperature, top_k, top_p, seed = sampling
        device = self.model.get_device()
        rng = torch.Generator(device=device)
        rng.manual_seed(seed)
        if budget <= 0:
            return
        t_decode = time.perf_counter()
        waited = 0.0  # the caller's time between our yields: not decode time
        while True:
            overtime = stats.steps >= budget  # nothing is sampled any more, only queued tokens
            drawn = None if overtime else sample_next_token(logits, rng, temperature, top_k, top_p)
            sampled = [] if drawn is None else drawn[:, 0].tolist()  # the step's one host read
            column, masks = [], []
            for i, row in enumerate(rows):
                token, mask, stopped = self.take_token(
                    row, None if overtime else sampled[i], use_tools
                )
                column.append(token)
                masks.append(mask)
                if stopped:
                    stats.finish_reasons[i] = "stop"
            stats.steps += 1
            t_yield = time.perf_counter()
            stats.decode_s = t_yield - t_decode - waited
            yield column, masks
            waited += time.perf_counter() - t_yield
            if all(row.completed for row in rows):
                return
            if stats.steps >= budget and not _result_pending(rows, cache):
                return
            if column == sampled:  # (N, 1) on the device already: no copy back from the host
                ids = drawn
            else:  # a calculator's forced tokens, a finished row's filler
                ids = torch.tensor(column, dtype=torch.long, device=device).unsqueeze(1)
            logits = self.forward_last(ids, cache)

    def take_token(
        self, row: RowState, sampled: int | None, use_tools: bool
    ) -> tuple[int, int, bool]:
        """A row's token of a step (_next_token: forced, sampled, or the filler past the
        budget), its mask, and whether it stops the row (<|assistant_end|> or <|bos|>); the
        calculator follows it where use_tools. Every generation loop's one way to take a
        token: Engine.generate's rows and a server batch's (batch.py)."""
        token, mask = self._next_token(row, sampled)
        if row.completed:
            return token, mask, False
        if token in (self.assistant_end, self.bos):
            row.completed = True
            return token, mask, True
        if use_tools:
            self.tools.track(row, token)
        return token, mask, False

    def _next_token(self, row: RowState, sampled: int | None) -> tuple[int, int]:
        """One row's token of a step and its mask: the calculator's next forced token, else
        the one sampled for it; past the budget (nothing sampled) a row with nothing queued
        is over, and gets <|assistant_end|> (mask 0) as filler, its reason the budget's."""
        if row.forced_tokens:
            return row.forced_tokens.popleft(), 0
        if sampled is None:
            row.completed = True
            return self.assistant_end, 0
        return sampled, 1

    @contextmanager
    def _prompt_cache(
        self, warm: WarmCache | None, prompt_len: int, num_samples: int, budget: int
    ) -> Iterator[WarmCache]:
        """The warm cache a generation prefills into: the caller's; else, for one row of a
        static step (a CUDA graph's), the kept whole-context one, emptied, unless it is lent
        out already; else one made for it (the prompt alone where rows fork from it, room
        for the budget as well where its one row decodes in it)."""
        if warm is not None:
            yield warm
            return
        static = self._static_step()
        if not static:
            self._kept = None  # a graph that failed hands over to a step without it
        if num_samples == 1 and static and self._kept_lent.acquire(blocking=False):
            try:
                if self._kept is None:
                    self._kept = WarmCache(self)  # its cache made at the first prefill
                # Emptied, so the prompt runs whole: positions past it keep an old
                # generation's K/V, which the static step reads only under its mask.
                self._kept.tokens = []
                yield self._kept
            finally:
                self._kept_lent.release()
            return
        if num_samples > 1:
            length = prompt_len
        elif static:  # its one row sees the same cache shape every call
            length = self.context_len
        else:
            length = prompt_len + self._room_after(prompt_len, budget)
        yield WarmCache(self, self.new_cache(1, length))

    def generate_batch(
        self, tokens: list[int], num_samples: int = 1, **kwargs: Any
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Run `generate` to the end: (results, masks) per row, prompt included (mask 0),
        terminal tokens (<|assistant_end|>, <|bos|>) excluded."""
        results = [list(tokens) for _ in range(num_samples)]
        masks = [[0] * len(tokens) for _ in range(num_samples)]
        completed = [False] * num_samples
        for column, column_masks in self.generate(tokens, num_samples, **kwargs):
            for i, (token, mask) in enumerate(zip(column, column_masks, strict=True)):
                if completed[i]:
                    continue
                if token in (self.assistant_end, self.bos):
                    completed[i] = True
                else:
                    results[i].append(token)
                    masks[i].append(mask)
            if all(completed):
                break
        return results, masks

    def budget_for(self, tokens: list[int], max_tokens: int | None) -> int:
        """The most tokens a reply to `tokens` may generate: max_tokens (None: no limit)
        within what the context leaves. Raises where the prompt fills the context."""
        if not tokens or not all(isinstance(t, int) for t in tokens):
            raise ValueError("tokens must be a non-empty list of ints")
        if max_tokens is not None and max_tokens < 0:
            raise ValueError("max_tokens must be non-negative (or None for the whole context)")
        left = self.context_len - len(tokens)
        if left <= 0:
            raise ContextOverflowError(
                f"The prompt is {len(tokens)} tokens; the model's context is "
                f"{self.context_len}. Shorten the conversation (e.g. /clear) or the message."
            )
        return left if max_tokens is None else min(max_tokens, left)

    def replay_tool_use(self, tokens: Sequence[int]) -> tuple[RowState, list[int]]:
        """The tool-use state at the end of `tokens` (the body of an unfinished reply, after
        <|assistant_start|>) and their masks: 0 for the tokens the calculator forced. This is
        what lets a continued reply resume inside a calculator call, or with the rest of its
        result still to come (ToolUse.replay)."""
        return self.tools.replay(tokens)

    # ---- running the model, and its caches ----------------------------------------------------

    def forward_last(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run ids (B, T) through the model into the cache; logits (B, V) of the last position.

        On the CPU a long chunk (a first prompt, a rebuilt context) runs on every core even
        where the plan keeps a small model's decode on one (cpu_plan.prefill_threads)."""
        if self.decode_step is not None and ids.size(1) == 1:
            return self.decode_step(ids, cache)
        if ids.device.type == "cpu":
            threads = max(torch.get_num_threads(), prefill_threads(ids.size(1)))
            with torch_threads(threads):
                return self._prefill(ids, cache)
        return self._prefill(ids, cache)

    def forward_prompt(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """forward_last for a prompt's tokens (ids (1, T)). A static step's CUDA graph is
        captured for one cache: a one-token prompt goes through it only in the kept cache it
        decodes in anyway, elsewhere (a server's slots) through the model's forward."""
        kept = self._kept.cache if self._kept is not None else None
        if ids.size(1) == 1 and self._static_step() and cache is not kept:
            return self._prefill(ids, cache)
        return self.forward_last(ids, cache)

    def forward_rows(
        self, ids: torch.Tensor, rows: SlotRows, out: list[int] | None = None
    ) -> torch.Tensor:
        """ids (N, 1), row i's token for slot rows.slots[i], each at its own position ->
        the logits (len(out), V) of the rows `out` names (None: all), every slot advanced
        by its rows: the decode step's step_rows, or the model's forward a row at a time
        where no step is kept (slot_step.forward_slots)."""
        if self.decode_step is not None:
            return self.decode_step.step_rows(ids, rows, out)
        return forward_slots(self.forward_last, ids, rows, out)

    @property
    def takes_prompt_rows(self) -> bool:
        """Whether forward_rows takes a prompt's chunk as rows of its slot, beside the
        other slots' decode rows: our CPU step, where a chunk of rows costs a few reads of
        the weights, and a small model's forward costs its hundreds of ops."""
        return self.decode_step is not None and self.decode_step.takes_prompt_rows

    def _prefill(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if self._last_only:
            return self._forward(ids, kv_cache=cache, last_only=True)[:, -1, :]
        return self._forward(ids, kv_cache=cache)[:, -1, :]

    def _static_step(self) -> bool:
        """Whether the decode step in use is static (a CUDA graph's): it wants every cache
        whole and reads past the written positions."""
        return self.decode_step is not None and self.decode_step.wants_full_cache

    def new_cache(self, batch_size: int, seq_len: int) -> KVCache:
        return KVCache(batch_size=batch_size, seq_len=seq_len, **self._cache_shape())

    def new_slot_cache(self, slots: int) -> SlotCache:
        """Whole-context caches for `slots` conversations side by side (a server's batch)."""
        return SlotCache(slots, seq_len=self.context_len, **self._cache_shape())

    def _cache_shape(self) -> dict[str, Any]:
        """What every cache of this model takes: its heads, layers, device and dtype, and
        whether it is zeroed."""
        m = self.model.config
        device = torch.device(self.model.get_device())
        # The K/V dtype is the activations' (our GPT may keep its embedding tables narrower).
        dtype = getattr(self.model, "compute_dtype", None)
        if dtype is None:
            params = self.model.parameters() if hasattr(self.model, "parameters") else iter(())
            weight = next(iter(params), None)
            dtype = (
                weight.dtype if weight is not None and weight.is_floating_point() else torch.float32
            )
        return {
            "num_heads": m.n_kv_head,
            "head_dim": m.n_embd // m.n_head,
            "num_layers": m.n_layer,
            "device": device,
            "dtype": dtype,
            # Only a static step reads past the written positions (under a mask, where
            # uninitialised memory could hold NaN); zeroing is cheap off the CPU anyway.
            "zeroed": device.type != "cpu"
            or (self.decode_step is not None and self.decode_step.reads_whole_cache),
        }

    def fork(self, prefix: KVCache, num_samples: int, budget: int) -> KVCache | SharedPrefixCache:
        """The cache `num_samples` rows decode in, going on from the batch-1 cache `prefix`
        for up to `budget` tokens. Where the model reads a shared prefix and the decode step
        is not static, the rows share prefix's K/V (nothing copied, each step reads them
        once; prefix must not change while they decode); else (a GPU's CUDA graph step, or
        a model without shared-prefix attention) prefix is copied into each row."""
        suffix_len = self._room_after(prefix.get_pos(), budget)
        # A static decode step (a CUDA graph's) gets plain rows, the prompt copied into each:
        # the rows then decode in one graph replay a step, where over a shared prefix they
        # would take the dynamic step's hundreds of kernel launches. A GPU's memory copies
        # the prompt in microseconds.
        static = self._static_step()
        if num_samples > 1 and self.shared_prefix and not static:
            return SharedPrefixCache(prefix, num_samples, suffix_len)
        cache = self.new_cache(num_samples, prefix.get_pos() + suffix_len)
        cache.prefill(prefix)
        return cache

    def _room_after(self, prompt_len: int, budget: int) -> int:
        """Positions a generation's rows need past the prompt: the budget and a calculator
        result that runs past it, within the context."""
        return min(budget + RESULT_RESERVE, self.context_len - prompt_len)


def _result_pending(rows: list[RowState], cache: KVCache | SharedPrefixCache) -> bool:
    """Whether a row still has calculator tokens queued and the context room for one more:
    a position for the column just yielded and one for the next."""
    queued = any(row.forced_tokens and not row.completed for row in rows)
    rest = cache.suffix if isinstance(cache, SharedPrefixCache) else cache
    return queued and rest.max_seq_len - rest.get_pos() >= 2
