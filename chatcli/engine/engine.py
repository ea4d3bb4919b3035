"""The Engine: prefill once, then decode one or many samples with the calculator tool.

Owns: the generation loop over token ids (prefill, decode, sampling, stop conditions), the
per-row tool-use state machine, and generation timings. Knows nothing about text beyond the
few special tokens it needs and decoding a calculator expression.

It works with any model that follows the cache protocol (`config`, `get_device()`,
`forward(ids, kv_cache=...)` that writes K/V and advances the cache) and any tokenizer with
encode/decode/encode_special/get_bos_token_id.

Masks: 1 for tokens the model sampled, 0 for tokens the calculator forced into the stream.
"""

from __future__ import annotations

import inspect
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from chatcli.engine.calculator import MAX_ABS_VALUE, format_result, use_calculator
from chatcli.engine.cpu_plan import SMALL_MODEL_PARAMS, prefill_threads, torch_threads
from chatcli.engine.decode_step import (
    CudaGraphStep,
    DecodeStep,
    ModuleStep,
    StaticDecodeStep,
    WithFallback,
)
from chatcli.errors import ContextOverflowError
from chatcli.kernels.native import sample_rows
from chatcli.model.kv_cache import KVCache, SharedPrefixCache
from chatcli.model.sampling import sample_next_token
from chatcli.model.special_tokens import (
    ASSISTANT_END,
    OUTPUT_END,
    OUTPUT_START,
    PYTHON_END,
    PYTHON_START,
)

__all__ = ["Engine", "GenerationStats", "KVCache", "RowState"]

# A calculator result is one unit: once <|python_end|> queued it, its forced tokens are all
# written even past max_tokens. This is the most they can take (<|output_start|>, the longest
# result, <|output_end|>; a token is at least one character), so caches sized to a budget
# keep this much room beyond it.
RESULT_RESERVE = len(format_result(-MAX_ABS_VALUE)) + 2


class CachedModel(Protocol):
    config: Any  # needs n_layer, n_head, n_kv_head, n_embd, sequence_len

    def get_device(self) -> torch.device: ...

    def forward(self, idx: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor: ...


class ToolTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def encode_special(self, name: str) -> int: ...

    def get_bos_token_id(self) -> int: ...


@dataclass
class GenerationStats:
    """Filled in by `Engine.generate` as it runs; pass one in to read it afterwards."""

    prompt_tokens: int = 0
    prefill_s: float = 0.0
    first_token_s: float = 0.0  # from the call to the first yielded column
    decode_s: float = 0.0
    steps: int = 0  # columns yielded
    finish_reasons: list[str] = field(default_factory=list)  # per row: stop|length|context


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


def _free_positions(cache: KVCache | SharedPrefixCache) -> int:
    """How many more positions the cache can take."""
    if isinstance(cache, SharedPrefixCache):
        return cache.suffix.max_seq_len - cache.suffix.get_pos()
    return cache.max_seq_len - cache.get_pos()


T = TypeVar("T")


def compiled_or_eager(fn: Callable[..., T], **options: object) -> Callable[..., T]:
    """fn through torch.compile (with `options`), falling back to fn itself for good if
    compiling or running the compiled code fails.

    Inductor caches its kernels on disk (its default cache dir), so only the first run on a
    machine pays the full compile time. A failure (no C compiler, an unsupported op) is
    reported once as a warning, and fn runs eagerly from then on.
    """
    compiled: Callable[..., T] | None = torch.compile(fn, **options)

    def run(*args: object, **kwargs: object) -> T:
        nonlocal compiled
        if compiled is not None:
            try:
                return compiled(*args, **kwargs)
            except Exception as e:  # inductor raises many types; eager always works
                warnings.warn(f"torch.compile failed, running eagerly: {e}", stacklevel=2)
                compiled = None
        return fn(*args, **kwargs)

    return run


def compiled_forward(model: CachedModel) -> Callable[..., torch.Tensor]:
    """model.forward through torch.compile (dynamic shapes), falling back to eager if
    compiling fails (compiled_or_eager)."""
    return compiled_or_eager(model.forward, dynamic=True)


def _pick_decode_step(
    model: CachedModel, compile: bool = False
) -> Callable[..., torch.Tensor] | None:
    """The fastest one-token-per-row step that reproduces this model, or None (the forward).

    - CUDA: the static step captured as a CUDA graph (one launch per token instead of
      hundreds), falling back to the module's forward if capture fails. --compile does not
      change it (compiled, the step replayed slower).
    - CPU, fp32 activations: the fused step (decode_step.py), reading a big model's compact
      decode copies. A small model keeps it with --compile too: in a chat session (a
      512-position cache) it decodes the embedded model in 1.75 ms per token, where its
      static twin through torch.compile took 5.5 ms (scripts/bench_decode_paths.py; the
      compiled module forward took 4.3 ms against an older step's 2.0). A big model with
      --compile compiles its forward instead, as asked, unless its step runs through our
      kernel (its fp16 copies read in one call per token, at the memory's speed: d20 at
      26-33 tok/s on a 2-core Zen 3), which a compiled fp32 forward cannot approach.
    """
    device = model.get_device().type if hasattr(model, "get_device") else "cpu"
    if device == "cuda" and StaticDecodeStep.supports(model):
        # --compile is not taken here: compiled, the captured step replayed slower (d20 in
        # bf16 on an H200: 2.56 against 1.82 ms, 380 against 519 tok/s in `chatcli bench`;
        # scripts/cuda_step_profile.py).
        return WithFallback(
            CudaGraphStep(StaticDecodeStep(model)), ModuleStep(model), "CUDA graph capture"
        )
    if device == "cpu" and DecodeStep.supports(model):
        step = DecodeStep(model)
        if compile and model.num_params() >= SMALL_MODEL_PARAMS and step.kernel is None:
            return None
        return step
    return None


def wait_for_device(device: torch.device | str) -> None:
    """Wait for a CUDA device's queued work, so that a prefill's time is the prefill's and
    not the first decode step's (whose host read would wait for it). Free: that read comes
    next anyway. Nothing to wait for on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


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
        self.decode_step = _pick_decode_step(model, compile)
        self.compiled = False  # whether --compile took: only where no faster step was kept
        if compile and self.decode_step is None:
            # No faster step for this model: compile the whole forward (dynamic shapes).
            # The K/V writes happen before the cache advances, so a failed compiled call
            # that falls back to eager simply rewrites the same positions.
            self._forward = compiled_forward(model)
            self.compiled = True
        special = tokenizer.encode_special
        self.python_start, self.python_end = special(PYTHON_START), special(PYTHON_END)
        self.output_start, self.output_end = special(OUTPUT_START), special(OUTPUT_END)
        self.assistant_end = special(ASSISTANT_END)
        self.bos = tokenizer.get_bos_token_id()
        # Our GPT can skip the vocabulary projection of all but the last prefill position,
        # and decode many samples over one shared copy of the prompt's K/V (fork: not with
        # a static step, whose rows take a copy each).
        self._last_only = "last_only" in inspect.signature(model.forward).parameters
        self.shared_prefix = getattr(model, "supports_shared_prefix", False)
        # A static step's one-row generations reuse one full-context cache: its CUDA graph is
        # captured once, not per request, and the prompt prefills straight into it. The lock
        # marks it lent: a generation begun while another is still open gets its own cache.
        self._row_cache: KVCache | None = None
        self._row_cache_lent = threading.Lock()
        if str(model.get_device()).startswith("cpu"):
            # Built (the first time on a machine) and checked now, with the model's loading,
            # not inside the first reply's decode, whose speed it cut from ~3800 to ~90 tok/s.
            sample_rows()

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

    def _prefill(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if self._last_only:
            return self._forward(ids, kv_cache=cache, last_only=True)[:, -1, :]
        return self._forward(ids, kv_cache=cache)[:, -1, :]

    @property
    def context_len(self) -> int:
        """The most positions a sequence may take: the model's training context."""
        return int(self.model.config.sequence_len)

    def new_cache(self, batch_size: int, seq_len: int) -> KVCache:
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
        return KVCache(
            batch_size=batch_size,
            num_heads=m.n_kv_head,
            seq_len=seq_len,
            head_dim=m.n_embd // m.n_head,
            num_layers=m.n_layer,
            device=device,
            dtype=dtype,
            # Only a static step reads past the written positions (under a mask, where
            # uninitialised memory could hold NaN); zeroing is cheap off the CPU anyway.
            zeroed=device.type != "cpu" or getattr(self.decode_step, "reads_whole_cache", False),
        )

    @torch.inference_mode()
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
    ) -> Iterator[tuple[list[int], list[int]]]:
        """Yield (token_column, token_masks), one entry per sample row, each step.

        One batch-1 prefill of `tokens`; its cache is expanded to `num_samples` rows that
        decode together, each sampling its own first token. A row is done at
        <|assistant_end|> or <|bos|> (that token is yielded). Stops when every row is done,
        after max_tokens steps (plus the rest of a calculator result, see `decode`), or
        when the context is full.

        `resume` is the tool-use state `tokens` end in, when they end inside an unfinished
        reply (`replay_tool_use` of its body): every row starts from a copy of it.
        """
        if num_samples < 1:
            raise ValueError("num_samples must be at least 1")
        budget = self.budget_for(tokens, max_tokens)
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens = len(tokens)
        t_start = time.perf_counter()
        device = self.model.get_device()
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        lent = self._lend_row_cache() if num_samples == 1 else None
        try:
            if lent is not None:
                cache = lent
                logits = self.forward_last(ids, cache)  # (1, V)
            else:
                prefill_cache = self.new_cache(1, len(tokens))
                logits = self.forward_last(ids, prefill_cache)
                cache = self.fork(prefill_cache, num_samples, budget)
                del prefill_cache
            wait_for_device(device)  # a GPU's prefill runs on after the call returns
            stats.prefill_s = time.perf_counter() - t_start
            yield from self.decode(
                cache,
                logits.expand(num_samples, -1),
                budget,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
                use_tools=use_tools,
                stats=stats,
                t_start=t_start,
                resume=resume,
            )
        finally:
            if lent is not None:
                self._row_cache_lent.release()
        if max_tokens is None or budget < max_tokens:
            # The context ran out before the caller's limit: say so rather than "length".
            stats.finish_reasons = ["context" if r == "length" else r for r in stats.finish_reasons]

    def _lend_row_cache(self) -> KVCache | None:
        """The kept full-context one-row cache, emptied, where the decode step is static (a
        CUDA graph's) and the cache is not lent out already; else None (the caller makes its
        own). The caller releases _row_cache_lent when its generation ends."""
        if not getattr(self.decode_step, "wants_full_cache", False):
            self._row_cache = None  # a graph that failed hands over to a step without it
            return None
        if not self._row_cache_lent.acquire(blocking=False):
            return None
        if self._row_cache is None:
            try:
                self._row_cache = self.new_cache(1, self.context_len)
            except BaseException:  # out of memory, say: the next request tries again
                self._row_cache_lent.release()
                raise
        # Positions past the new prompt keep an old generation's K/V: the static step reads
        # them only under its mask, and every other read stops at the position.
        self._row_cache.reset()
        return self._row_cache

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

    def fork(self, prefix: KVCache, num_samples: int, budget: int) -> KVCache | SharedPrefixCache:
        """The cache `num_samples` rows decode in, going on from the batch-1 cache `prefix`
        for up to `budget` tokens. Where the model reads a shared prefix and the decode step
        is not static, the rows share prefix's K/V (nothing copied, each step reads them
        once; prefix must not change while they decode); else (a GPU's CUDA graph step, or
        a model without shared-prefix attention) prefix is copied into each row."""
        # Room for the budget and for a calculator result that runs past it, within the context.
        suffix_len = min(budget + RESULT_RESERVE, self.context_len - prefix.get_pos())
        # A static decode step (a CUDA graph's) gets plain rows, the prompt copied into each:
        # the rows then decode in one graph replay a step, where over a shared prefix they
        # take the dynamic step's hundreds of kernel launches (on an H200, 8 rows of d20 ran
        # at 697 tok/s that way, slower than the baseline's copies). A GPU's memory copies
        # the prompt in microseconds.
        static = getattr(self.decode_step, "wants_full_cache", False)
        if num_samples > 1 and self.shared_prefix and not static:
            return SharedPrefixCache(prefix, num_samples, suffix_len)
        # Its one row gets the whole context, so that it sees the same cache shape every call.
        length = self.context_len if num_samples == 1 and static else prefix.get_pos() + suffix_len
        cache = self.new_cache(num_samples, length)
        cache.prefill(prefix)
        return cache

    @torch.inference_mode()
    def decode(
        self,
        cache: KVCache | SharedPrefixCache,
        logits: torch.Tensor,
        budget: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 42,
        use_tools: bool = True,
        stats: GenerationStats | None = None,
        t_start: float | None = None,
        resume: RowState | None = None,
    ) -> Iterator[tuple[list[int], list[int]]]:
        """Decode up to `budget` steps from a filled cache and the logits (N, V) of its last
        position: one row per cache row. The last yielded column is not written to the cache
        (the caller decides whether the turn goes on).

        A calculator result is one unit: forced tokens still queued when the budget runs out
        are yielded after it (as far as the cache has room), so a reply is never cut inside
        one. In those extra steps a row with nothing queued is over: it gets <|assistant_end|>
        (mask 0) and keeps the finish reason "length".

        `resume` is the tool-use state the cache's tokens end in (see `replay_tool_use`): a
        continued reply picks up inside its calculator call, or with its result still queued.
        """
        stats = stats if stats is not None else GenerationStats()
        t_start = time.perf_counter() if t_start is None else t_start
        device = self.model.get_device()
        rng = torch.Generator(device=device)
        rng.manual_seed(seed)
        num_samples = logits.size(0)
        rows = [RowState() if resume is None else resume.copy() for _ in range(num_samples)]
        stats.finish_reasons = ["length"] * num_samples
        if budget <= 0:
            return
        t_decode = time.perf_counter()
        waited = 0.0  # the caller's time between our yields: not decode time
        step = 0
        while True:
            overtime = step >= budget  # nothing is sampled any more, only queued tokens written
            drawn = None if overtime else sample_next_token(logits, rng, temperature, top_k, top_p)
            sampled = [] if drawn is None else drawn[:, 0].tolist()  # the step's one host read
            column, masks = [], []
            for i, row in enumerate(rows):
                if row.forced_tokens:
                    token, mask = row.forced_tokens.popleft(), 0
                elif overtime:
                    token, mask = self.assistant_end, 0
                    row.completed = True  # past its budget: over, its reason stays "length"
                else:
                    token, mask = sampled[i], 1
                column.append(token)
                masks.append(mask)
                if row.completed:
                    continue
                if token in (self.assistant_end, self.bos):
                    row.completed = True
                    stats.finish_reasons[i] = "stop"
                elif use_tools:
                    self._track_tool_use(row, token)
            if step == 0:
                stats.first_token_s = time.perf_counter() - t_start
            step += 1
            stats.steps = step
            t_yield = time.perf_counter()
            stats.decode_s = t_yield - t_decode - waited
            yield column, masks
            waited += time.perf_counter() - t_yield
            if all(row.completed for row in rows):
                return
            if step >= budget and not self._result_pending(rows, cache):
                return
            if column == sampled:  # (N, 1) on the device already: no copy back from the host
                ids = drawn
            else:  # a calculator's forced tokens, a finished row's filler
                ids = torch.tensor(column, dtype=torch.long, device=device).unsqueeze(1)
            logits = self.forward_last(ids, cache)

    @staticmethod
    def _result_pending(rows: list[RowState], cache: KVCache | SharedPrefixCache) -> bool:
        """Whether a row still has calculator tokens queued and the context room for one more:
        a position for the column just yielded and one for the next."""
        queued = any(row.forced_tokens and not row.completed for row in rows)
        return queued and _free_positions(cache) >= 2

    def replay_tool_use(self, tokens: Sequence[int]) -> tuple[RowState, list[int]]:
        """The tool-use state at the end of `tokens` (the body of an unfinished reply, after
        <|assistant_start|>) and their masks: 0 for the tokens the calculator forced.

        This is what lets a continued reply resume inside a calculator call, or with the rest
        of its result still to come. The calculator is deterministic, so each result is
        computed again and the tokens that match it are the forced ones; a token that does not
        match means nothing was forced there (the reply was written with the tools off).
        """
        row, masks = RowState(), []
        for token in tokens:
            if row.forced_tokens and token == row.forced_tokens[0]:
                row.forced_tokens.popleft()
                masks.append(0)
            else:
                row.forced_tokens.clear()
                masks.append(1)
            self._track_tool_use(row, token)
        return row, masks

    def _track_tool_use(self, row: RowState, token: int) -> None:
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
