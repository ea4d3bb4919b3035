"""A cache of independent sequences side by side: a server's conversations decoding together.

Owns: SlotCache (one (layers, slots, T, Hkv, D) key/value store whose slots are each a
whole KVCache of their own: a position, a previous token, prefilled and rewound alone) and
SlotRows (the slots one decode step advances, one token each, every slot at its own
position). Knows nothing about which conversation a slot holds or when it is free (the
engine's batch.py decides), nor about attention (the decode steps read a slot's own keys
only, up to its own position).

Why one store rather than a cache a slot: a decode step of many rows reads every row's
keys and values through one pair of tensors (our kernel's pointers, a CUDA graph's fixed
buffers), and a slot's own cache is a view of its row, so a prefill or a rewind of one
conversation is the plain batch-1 path.
"""

from __future__ import annotations

import torch

from chatcli.model.kv_cache import KVCache


class SlotCache:
    def __init__(
        self,
        slots: int,
        num_heads: int,
        seq_len: int,
        head_dim: int,
        num_layers: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        zeroed: bool = True,
    ) -> None:
        """zeroed as KVCache's: False leaves the memory as allocated (untouched pages cost
        nothing on the CPU, so slots that hold short conversations stay small)."""
        if slots < 1:
            raise ValueError("a SlotCache needs at least one slot")
        shape = (num_layers, slots, seq_len, num_heads, head_dim)
        alloc = torch.zeros if zeroed else torch.empty
        self.k_cache = alloc(shape, device=device, dtype=dtype)
        self.v_cache = alloc(shape, device=device, dtype=dtype)
        self.max_seq_len = seq_len
        # Each slot's positions [0, finite[i]) hold finite numbers: written, or zeroed by
        # make_finite (memory left as allocated may hold NaN, which a mask does not hide).
        self.finite = [seq_len if zeroed else 0] * slots
        # Slot i: a batch-1 cache over row i of the shared tensors.
        self.slots = [
            KVCache.over(self.k_cache[:, i : i + 1], self.v_cache[:, i : i + 1])
            for i in range(slots)
        ]

    @classmethod
    def over(cls, cache: KVCache) -> SlotCache:
        """A one-slot SlotCache whose slot is `cache` itself (a batch-1 cache has a slot
        cache's layout): a step of several rows of one sequence (a verify forward's drafts)
        writes straight into it."""
        if cache.batch_size != 1:
            raise ValueError(f"a slot holds one sequence, not {cache.batch_size}")
        slots = cls.__new__(cls)
        slots.k_cache, slots.v_cache = cache.k_cache, cache.v_cache
        slots.max_seq_len = cache.max_seq_len
        slots.finite = [cache.get_pos()]  # past it, memory left as allocated may hold NaN
        slots.slots = [cache]
        return slots

    def __len__(self) -> int:
        return len(self.slots)

    def make_finite(self, slots: list[int], end: int) -> None:
        """Zero what the `slots` never wrote below position `end`, where a step reads every
        row's keys up to the longest row's position under a mask: -inf added to a NaN left
        in memory is still NaN, and so is its weight of 0 times a NaN value. Each position
        of a slot is zeroed at most once."""
        for s in slots:
            start = max(self.finite[s], self.slots[s].get_pos())
            if start < end:
                self.k_cache[:, s, start:end] = 0
                self.v_cache[:, s, start:end] = 0
            self.finite[s] = max(start, end)


class SlotRows:
    """The rows of one step: row i is a token for slot `slots[i]`, at the slot's length
    plus the rows of that slot before it. A slot's rows are its next tokens in order: one
    a step for a reply, several for a chunk of a prompt (each attends the ones before)."""

    def __init__(self, cache: SlotCache, slots: list[int]) -> None:
        self.cache, self.slots = cache, slots
        self.views = [cache.slots[s] for s in slots]
        self.counts: dict[int, int] = {}  # rows a slot
        self._before: list[int] = []  # each row's earlier rows of its slot
        for s in slots:
            self._before.append(self.counts.get(s, 0))
            self.counts[s] = self._before[-1] + 1

    @property
    def batch_size(self) -> int:
        return len(self.slots)

    @property
    def chained(self) -> bool:
        """Whether some slot has several rows (they read one another's keys)."""
        return len(self.counts) != len(self.slots)

    def positions(self) -> list[int]:
        """Where each row's token goes."""
        return [v.get_pos() + k for v, k in zip(self.views, self._before, strict=True)]

    def previous(self, ids: torch.Tensor) -> torch.Tensor:
        """(rows,) the token before each row's (era E's smear), given the rows' ids (rows,):
        the slot's last one, the slot's previous row's, or -1 at a sequence's start."""
        prev, last = [], {}
        for i, (view, s) in enumerate(zip(self.views, self.slots, strict=True)):
            if s in last:
                prev.append(ids[last[s] : last[s] + 1])
            elif view.get_pos() == 0 or view.prev_token is None:
                prev.append(torch.full((1,), -1, dtype=torch.long, device=ids.device))
            else:
                prev.append(view.prev_token.view(1))
            last[s] = i
        return torch.cat(prev)

    def room(self, max_positions: int) -> list[int]:
        """The positions the step writes; a ValueError where a slot or the model would
        overflow (said before anything is written, as KVCache.advance would say it after)."""
        positions = self.positions()
        for pos in positions:
            if pos + 1 > max_positions:
                raise ValueError(f"position {pos + 1} exceeds the model's {max_positions}")
            if pos + 1 > self.cache.max_seq_len:
                raise ValueError(f"KV cache overflow: {pos + 1} > {self.cache.max_seq_len}")
        return positions

    def advance(self, ids: torch.Tensor) -> None:
        """After a step wrote ids (rows,): each slot longer by its rows, its last token the
        last of them."""
        last = {s: i for i, s in enumerate(self.slots)}
        for s, i in last.items():
            view = self.cache.slots[s]
            view.prev_token = ids[i : i + 1]
            view.advance(self.counts[s])
