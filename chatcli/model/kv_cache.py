"""The preallocated key/value cache the model writes into during prefill and decode.

Owns: the K/V tensors for every layer, the current position, and the last token written
(era E's smear needs the previous token's embedding when a chunk continues the cache).
Knows nothing about sampling, tools or text.

Layout (num_layers, B, T, H, D), as nanochat's flash-attention cache: one layer's slice is a
(B, T, H, D) view that the model writes in place. The position is kept on the host so reading
it never syncs with a GPU; `cache_seqlens` gives it as a tensor for kernels that want one,
made when asked: kept in step, its in-place add was a tensor op in every decode step,
which read nothing of it.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        batch_size: int,
        num_heads: int,
        seq_len: int,
        head_dim: int,
        num_layers: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        zeroed: bool = True,
    ) -> None:
        """zeroed=False leaves the memory as allocated: for readers that never look past
        the written positions (every dynamic-shape path). Zeroing a big model's whole-context
        cache on the CPU (d20: 420 MB) took most of a first turn's time to first token; a
        static step, which reads every position under a mask, needs finite values there."""
        self.batch_size, self.max_seq_len = batch_size, seq_len
        self.n_layers, self.n_heads, self.head_dim = num_layers, num_heads, head_dim
        shape = (num_layers, batch_size, seq_len, num_heads, head_dim)
        alloc = torch.zeros if zeroed else torch.empty
        self.k_cache = alloc(shape, device=device, dtype=dtype)
        self.v_cache = alloc(shape, device=device, dtype=dtype)
        self.pos = 0
        # (B,) ids of the last token written; None while the cache is empty.
        self.prev_token: torch.Tensor | None = None

    @classmethod
    def over(cls, k_cache: torch.Tensor, v_cache: torch.Tensor) -> KVCache:
        """An empty cache that writes into existing (layers, B, T, H, D) tensors (views of a
        larger cache's: slot_cache.SlotCache's slots) instead of its own."""
        cache = cls.__new__(cls)
        cache.n_layers, cache.batch_size, cache.max_seq_len, cache.n_heads, cache.head_dim = (
            k_cache.shape
        )
        cache.k_cache, cache.v_cache = k_cache, v_cache
        cache.pos, cache.prev_token = 0, None
        return cache

    @property
    def cache_seqlens(self) -> torch.Tensor:
        """(B,) int32: every row's length, the position (flash-attention's argument)."""
        return torch.full(
            (self.batch_size,), self.pos, dtype=torch.int32, device=self.k_cache.device
        )

    def reset(self) -> None:
        """Empty the cache without reallocating it."""
        self.pos = 0
        self.prev_token = None

    def get_pos(self) -> int:
        return self.pos

    def get_layer_cache(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) views of one layer, each (B, T, H, D)."""
        return self.k_cache[layer_idx], self.v_cache[layer_idx]

    def advance(self, num_tokens: int) -> None:
        if self.pos + num_tokens > self.max_seq_len:
            raise ValueError(f"KV cache overflow: {self.pos + num_tokens} > {self.max_seq_len}")
        self.pos += num_tokens

    def prefill(self, other: KVCache) -> None:
        """Copy another cache's contents in, expanding a batch-1 cache to every row."""
        if other.batch_size not in (1, self.batch_size):
            raise ValueError(f"cannot expand a batch of {other.batch_size} to {self.batch_size}")
        if (other.n_layers, other.n_heads, other.head_dim) != (
            self.n_layers,
            self.n_heads,
            self.head_dim,
        ):
            raise ValueError("KV caches of different model shapes")
        if other.pos > self.max_seq_len:
            raise ValueError(f"cache of {other.pos} positions does not fit in {self.max_seq_len}")
        n = other.pos
        self.k_cache[:, :, :n] = other.k_cache[:, :, :n]
        self.v_cache[:, :, :n] = other.v_cache[:, :, :n]
        self.pos = n
        self.prev_token = (
            None if other.prev_token is None else other.prev_token.expand(self.batch_size).clone()
        )

    def rewind(self, pos: int, prev_token: int | torch.Tensor | None) -> None:
        """Forget everything from position `pos` on; prev_token is the token at pos - 1 (an
        int, or as the (B,) ids tensor prev_token keeps: a caller that has it on the device
        saves making one).

        Entries past pos are simply overwritten by the next write, so nothing is copied.
        """
        if not 0 <= pos <= self.pos:
            raise ValueError(f"cannot rewind to {pos}: the cache holds {self.pos} positions")
        if pos > 0 and prev_token is None:
            # Era E mixes the previous token's embedding into the next one (smear): without
            # it the step after the rewind would quietly compute different logits.
            raise ValueError(f"rewinding to {pos} needs the token at {pos - 1} (prev_token)")
        self.pos = pos
        if pos == 0:
            self.prev_token = None
        elif isinstance(prev_token, torch.Tensor):
            self.prev_token = prev_token
        else:
            self.prev_token = torch.full(
                (self.batch_size,), prev_token, dtype=torch.long, device=self.k_cache.device
            )


class SharedPrefixCache:
    """Many sample rows over one prompt: the prompt's K/V are stored once, not per row.

    `prefix` is the batch-1 cache the prompt was prefilled into; each row owns only the
    suffix it generates. Attention combines the shared prefix and a row's own suffix exactly
    (one softmax over both; see model.attend_shared). With N rows and a P-token prompt this
    reads P positions of K/V per step instead of N * P, and copies nothing at fork time.
    """

    def __init__(self, prefix: KVCache, batch_size: int, suffix_len: int) -> None:
        self.prefix = prefix
        self.suffix = KVCache(
            batch_size,
            prefix.n_heads,
            suffix_len,
            prefix.head_dim,
            prefix.n_layers,
            device=prefix.k_cache.device,
            dtype=prefix.k_cache.dtype,
        )
        self.batch_size, self.n_layers = batch_size, prefix.n_layers
        self.prev_token: torch.Tensor | None = (
            None if prefix.prev_token is None else prefix.prev_token.expand(batch_size).clone()
        )

    @property
    def prefix_len(self) -> int:
        return self.prefix.get_pos()

    def get_pos(self) -> int:
        return self.prefix.get_pos() + self.suffix.get_pos()

    def advance(self, num_tokens: int) -> None:
        self.suffix.advance(num_tokens)
