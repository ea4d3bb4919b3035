"""The Engine: prefill a prompt, then decode one or many sample rows with the calculator tool.

Owns: `Engine.generate`, the nanochat-compatible way to generate (a chat turn, /samples,
a server worker's `--batch 1` request, the bench, nanochat-style callers), a thin client of
the one generation loop (scheduler.py: prefill, decode, token budget, timings and finish
reasons live there); the caches a generation decodes in (the caller's WarmCache, or one made
for it); running ids through the model, which the scheduler does through it. Knows nothing about text
beyond the few special tokens it needs (tool_use.py follows calculator calls).

It works with any model that follows the cache protocol (`config`, `get_device()`,
`forward(ids, kv_cache=...)` that writes K/V and advances the cache) and any tokenizer with
encode/decode/encode_special/get_bos_token_id.

Masks: 1 for tokens the model sampled, 0 for tokens the calculator forced into the stream.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from chatcli.engine.cpu_plan import prefill_threads, torch_threads
from chatcli.engine.logprobs import LogprobRecord
from chatcli.engine.scheduler import GenerationStats, RowRequest, Scheduler, plan
from chatcli.engine.slot_step import forward_slots
from chatcli.engine.speculation import Drafter
from chatcli.engine.step_choice import Step, compiled_forward, pick_decode_step
from chatcli.engine.tool_use import RESULT_RESERVE, RowState, ToolTokenizer, ToolUse
from chatcli.engine.warm_cache import WarmCache
from chatcli.kernels.sample_rows import sample_rows
from chatcli.model.kv_cache import KVCache, SharedPrefixCache
from chatcli.model.slot_cache import SlotCache, SlotRows
from chatcli.model.special_tokens import ASSISTANT_END

__all__ = ["Engine", "GenerationStats", "KVCache", "RowState"]


class CachedModel(Protocol):
    config: Any  # needs n_layer, n_head, n_kv_head, n_embd, sequence_len

    def get_device(self) -> torch.device: ...

    def forward(self, idx: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor: ...


class Engine:
    """Generation over one model: prefill, decode, sample rows and the calculator.

    Not thread-safe: a CUDA graph step's input buffers are the engine's own, so one thread
    uses an engine at a time (the server gives each worker its own). Generations begun on
    that thread may interleave."""

    def __init__(
        self,
        model: CachedModel,
        tokenizer: ToolTokenizer,
        *,
        compile: bool = False,
        speculate: bool = False,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self._forward = model.forward
        self.decode_step: Step | None = pick_decode_step(model, compile)
        self.compiled = False  # whether --compile took: only where no faster step was kept
        # Whether a one-row generation in a cache of its own drafts from its history and
        # verifies the drafts in one forward (speculation.py): --speculate auto|off.
        self.speculate = speculate
        # The drafter a drafting row gets, given its prompt: the bench swaps in one that
        # replays a known reply, to measure verification at a chosen acceptance.
        self.drafter: Callable[[list[int]], Drafter] = Drafter
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
        logprobs: LogprobRecord | None = None,
        grammar: str | None = None,
        grammar_prefix: Sequence[int] = (),
    ) -> Iterator[tuple[list[int], list[int]]]:
        """Yield (token_column, token_masks), one entry per sample row, each step.

        The prompt `tokens` prefills into `warm` past the prefix it already holds (a chat's
        or a server worker's cache, kept between generations), or into a cache made for this
        generation. One row decodes in that cache, appending its tokens to warm.tokens;
        `num_samples` rows fork from it (warm.fork) and decode together, each sampling its
        own first token. A row is done at <|assistant_end|> or <|bos|> (that token is
        yielded); while other rows go on, a done row's entry is <|assistant_end|>, mask 0.
        Stops when every row is done, after max_tokens steps (None: no limit; a
        calculator result still queued is written whole past it), or when the context is
        full; or when the caller closes the iterator. The last yielded column is never
        written to the cache (the caller decides whether the turn goes on).

        `resume` is the tool-use state `tokens` end in, when they end inside an unfinished
        reply (`replay_tool_use` of its body): every row starts from a copy of it. With
        use_tools off nothing is forced, so it is not used.

        `logprobs`: each step's column's log-probabilities are appended to its `columns`
        before the column is yielded (logprobs.py says which distribution).
        `grammar` (grammar.json_grammar's) restricts every row to what it allows, ending
        each with <|assistant_end|> once it is complete; those rows do not use the calculator.
        `grammar_prefix`: the reply's tokens `tokens` end in, which the grammar follows first
        (a reply going on).

        The arguments are checked at the call, before anything runs: a ValueError, or a
        ContextOverflowError where the prompt fills the context. The rows run in the
        scheduler's loop (scheduler.py), as a server's requests do.
        """
        if num_samples < 1:
            raise ValueError("num_samples must be at least 1")
        top = logprobs.top if logprobs is not None else None
        request = RowRequest(
            tokens, max_tokens, temperature, top_k, top_p, seed, use_tools, resume, top,
            grammar, tuple(grammar_prefix),
        )  # fmt: skip
        budget, _ = plan(self.context_len, request)
        return self._generate(
            request,
            num_samples,
            budget,
            stats if stats is not None else GenerationStats(),
            warm,
            logprobs,
        )

    @torch.inference_mode()
    def _generate(
        self,
        request: RowRequest,
        num_samples: int,
        budget: int,
        stats: GenerationStats,
        warm: WarmCache | None,
        record: LogprobRecord | None = None,
    ) -> Iterator[tuple[list[int], list[int]]]:
        """The request's rows through the scheduler, a column a step: the one loop a server's
        requests run in too (scheduler.py)."""
        prompt_len = len(request.tokens)
        with self._prompt_cache(warm, prompt_len, num_samples, budget) as warm:
            gen = None
            try:
                scheduler = Scheduler(self)
                gen = scheduler.start(request, warm, num_samples, stats)
                while not gen.done:
                    scheduler.step()
                    if gen.column is not None:
                        if record is not None and gen.logprobs is not None:
                            record.columns.append(gen.logprobs)
                        yield gen.column, gen.masks
            finally:
                if gen is not None and gen.speculation is not None and gen.cache is not None:
                    gen.speculation.settle(gen.cache)  # closed early: no drafts left in it
                warm.settle()

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
        return plan(self.context_len, RowRequest(tokens, max_tokens))[0]

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

    def forward_verify(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """ids (1, T): a row's last token and its drafts, run on from what the batch-1 `cache`
        holds -> the logits (T, V) of every position (speculation.py), the cache advanced by
        T. Where our step takes a prompt's rows, they are T rows of the cache as one slot (the
        decode step's own products, one pass over the weights); else the model's forward."""
        if self.takes_prompt_rows:
            assert self.decode_step is not None
            rows = SlotRows(SlotCache.over(cache), [0] * ids.size(1))
            return self.decode_step.step_rows(ids.view(-1, 1), rows)
        return self._forward(ids, kv_cache=cache)[0]

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
