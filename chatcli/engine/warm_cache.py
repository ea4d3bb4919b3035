"""A batch-1 KV cache kept warm between generations, with the tokens it holds.

A chat session's turns and a server worker's requests mostly extend what the cache already
holds: the same conversation with one more turn (an OpenAI-style client sends the whole
conversation every time). A new prompt rewinds the cache to the longest prefix it shares
with the held tokens and prefills only the rest; rewinding copies nothing (later positions
are overwritten) and restores era E's remembered previous token from the prompt. The cache
spans the model's whole context and lives as long as its owner, so a static decode step (a
CUDA graph) is captured once for it, not once a prompt.

Owns the cache, its tokens, and the sample rows last forked from it (until it moves on), so
that a chosen row's K/V can be taken over. Does not generate: Engine.generate prefills into
it and decodes, appending what it writes.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from chatcli.model.kv_cache import KVCache, SharedPrefixCache


class CacheRunner(Protocol):
    """What a warm cache needs from whoever runs the model (the Engine)."""

    model: Any  # get_device()

    @property
    def context_len(self) -> int: ...

    def new_cache(self, batch_size: int, seq_len: int) -> KVCache: ...

    def forward_prompt(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor: ...

    def fork(
        self, prefix: KVCache, num_samples: int, budget: int
    ) -> KVCache | SharedPrefixCache: ...


class WarmCache:
    def __init__(self, engine: CacheRunner, cache: KVCache | None = None) -> None:
        """cache: the batch-1 cache to keep (empty); None makes a whole-context one at the
        first prefill."""
        self.engine = engine
        self.cache = cache
        # What the cache holds, position by position; a generation appends each token it
        # yields and `settle` drops the last one, which decode yields but never writes.
        self.tokens: list[int] = []
        # Sample rows forked from the cache as it is (`fork`), until it moves on: `adopt`
        # takes a chosen row's K/V from them.
        self.rows: KVCache | SharedPrefixCache | None = None

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> tuple[torch.Tensor, int]:
        """Bring the cache to hold `prompt`: the logits (1, V) of its last position and how
        many of its tokens ran (at least one: the logits come from running it)."""
        common = self.begin(prompt)
        return self.extend(prompt[common:]), len(prompt) - common

    def begin(self, prompt: list[int]) -> int:
        """Rewind the cache to the longest prefix it shares with `prompt` (shared_with) and
        say how long that is: the rest of the prompt is for `extend`, in one piece or in
        chunks (a server's batch prefills a long prompt between other rows' steps)."""
        if self.cache is None:
            self.cache = self.engine.new_cache(1, self.engine.context_len)
        self.rows = None  # rows over a shared prefix read the positions rewritten after this
        common = self.shared_with(prompt)
        self.cache.rewind(common, prompt[common - 1] if common else None)
        self.tokens = self.tokens[:common]
        return common

    @torch.inference_mode()
    def extend(self, tokens: list[int]) -> torch.Tensor:
        """Run a prompt's `tokens` on from what the cache holds (Engine.forward_prompt):
        the logits (1, V) of the last one."""
        assert self.cache is not None, "begin() first"
        device = self.engine.model.get_device()
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        logits = self.engine.forward_prompt(ids, self.cache)
        self.tokens.extend(tokens)  # only once they ran: what stays true if the forward fails
        return logits

    def shared_with(self, prompt: list[int]) -> int:
        """How many of the prompt's tokens the cache holds: their longest common prefix,
        short of the prompt's last token (which runs again for its logits)."""
        common, limit = 0, min(len(self.tokens), len(prompt) - 1)
        while common < limit and self.tokens[common] == prompt[common]:
            common += 1
        return common

    def fork(self, num_samples: int, budget: int) -> KVCache | SharedPrefixCache:
        """`num_samples` rows going on from what the cache holds, for up to `budget` tokens
        (Engine.fork); the cache itself stays as it is, and remembers them."""
        if self.cache is None:
            raise ValueError("an empty warm cache has nothing to fork")
        self.rows = self.engine.fork(self.cache, num_samples, budget)
        return self.rows

    def settle(self) -> None:
        """Make `tokens` what the cache holds after a generation, however it ended."""
        self.tokens = self.tokens[: self.cache.get_pos()] if self.cache is not None else []

    def drop_rows(self) -> None:
        """Let the forked rows go (their memory with them): none of them will be adopted."""
        self.rows = None

    @torch.inference_mode()
    def adopt(self, row: int, reply: list[int]) -> int:
        """Take the K/V that sample row `row` of the rows last forked from this cache wrote
        for `reply`, the tokens it generated, as if this cache had decoded them. Returns how
        many it took: all that were run (a row's last token never is)."""
        rows = self.rows
        if self.cache is None or rows is None:
            raise ValueError("no sample rows were forked from this cache as it is")
        start = self.cache.get_pos()
        if len(self.tokens) != start:
            raise ValueError("the warm cache's tokens are not what it holds: settle() first")
        if not 0 <= row < rows.batch_size:
            raise ValueError(f"no row {row} among {rows.batch_size}")
        if isinstance(rows, SharedPrefixCache):
            k, v, at, written = rows.suffix.k_cache, rows.suffix.v_cache, 0, rows.suffix.get_pos()
        else:  # a copy of the prompt in every row, then the row's own tokens
            k, v, at, written = rows.k_cache, rows.v_cache, start, rows.get_pos() - start
        n = min(len(reply), written)
        self.rows = None  # the cache moves on past the prompt they share
        if n == 0:
            return 0
        self.cache.k_cache[:, 0, start : start + n] = k[:, row, at : at + n]
        self.cache.v_cache[:, 0, start : start + n] = v[:, row, at : at + n]
        self.cache.advance(n)
        self.cache.prev_token = torch.tensor([reply[n - 1]], device=self.cache.k_cache.device)
        self.tokens.extend(reply[:n])
        return n


def choose(slots: list[WarmCache], prompt: list[int]) -> WarmCache:
    """Of a server worker's warm caches, the one a prompt goes to, moved to the end of
    `slots` (they are kept least recently used first). The one sharing most with the prompt,
    where the prompt carries on at least half of what it holds (its conversation's next
    turn, a retry); else the least recently used (an empty one first), so that another
    conversation does not evict one that is still going on."""
    shared = [slot.shared_with(prompt) for slot in slots]
    best = max(range(len(slots)), key=shared.__getitem__)  # the oldest among equals
    pick = best if shared[best] and 2 * shared[best] >= len(slots[best].tokens) else 0
    slot = slots.pop(pick)
    slots.append(slot)
    return slot
