"""The plain way to generate, kept only as the yardstick `chatcli bench` measures against.

It does what nanochat's reference engine does: eager fp32, a batch-1 prefill copied into a
full cache for every sample row, torch.multinomial sampling, a host read of every row each
step, and in a chat every turn re-runs prefill over the whole conversation. Its greedy output
is the reference that every fp32 fast path must reproduce exactly.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from chatcli.model.kv_cache import KVCache


def _new_cache(model, batch_size: int, seq_len: int) -> KVCache:
    m = model.config
    return KVCache(
        batch_size,
        m.n_kv_head,
        seq_len,
        m.n_embd // m.n_head,
        m.n_layer,
        device=model.get_device(),
        dtype=model.compute_dtype,
    )


def _sample(logits: torch.Tensor, rng: torch.Generator, temperature: float, top_k: int | None):
    if temperature == 0.0:
        return torch.argmax(logits, dim=-1, keepdim=True)
    if top_k:
        vals, idx = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1)
        probs = F.softmax(vals / temperature, dim=-1)
        return idx.gather(1, torch.multinomial(probs, 1, generator=rng))
    probs = F.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=rng)


@torch.inference_mode()
def baseline_generate(
    model,
    tokens: list[int],
    num_samples: int = 1,
    max_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 42,
    stop_tokens: frozenset[int] = frozenset(),
) -> Iterator[list[int]]:
    """Yield one token per row per step, the reference engine's way (no tool use)."""
    device = model.get_device()
    rng = torch.Generator(device=device)
    rng.manual_seed(seed)
    prefill = _new_cache(model, 1, len(tokens))
    logits = model(torch.tensor([tokens], device=device), kv_cache=prefill)[:, -1, :]
    cache = _new_cache(model, num_samples, len(tokens) + max_tokens)
    cache.prefill(prefill)  # a full copy of the prompt's K/V for every row
    logits = logits.expand(num_samples, -1)
    done = [False] * num_samples
    for _ in range(max_tokens):
        column = [int(t.item()) for t in _sample(logits, rng, temperature, top_k)[:, 0]]
        yield column
        done = [d or t in stop_tokens for d, t in zip(done, column, strict=True)]
        if all(done):
            return
        logits = model(torch.tensor(column, device=device).unsqueeze(1), kv_cache=cache)[:, -1, :]
