"""`chatcli bench`: our engine against the plain baseline, side by side, in one run.

Owns: building the model to measure (a checkpoint, or a synthetic nanochat of depth d4, d12
or d20 with random weights), the measurements, and the result as a dict (the CLI prints a
table or JSON). Measured for both modes: prefill tok/s, batch-1 decode tok/s, aggregate decode
tok/s with 8 samples, time to first token at turns 1, 5 and 10 of a scripted chat; plus peak
memory, the machine's memory bandwidth and the decode roofline it implies for the weights.
Greedy outputs of the two modes are compared token for token.
"""

from __future__ import annotations

import math
import resource
import time
from typing import Any

import torch

from chatcli.baseline import baseline_generate
from chatcli.engine import Engine, GenerationStats
from chatcli.model import ERAS, GPT, GPTConfig
from chatcli.session import ChatSession, SamplingOptions
from chatcli.special_tokens import SPECIAL_TOKENS

SYNTHETIC_DEPTHS = {"d4": 4, "d12": 12, "d20": 20}
DECODE_TOKENS = 48
SAMPLES = 8
TURNS = (1, 5, 10)


class _SyntheticTokenizer:
    """Enough of a tokenizer for a random-weight model: bytes, specials at the top."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.special = {
            name: vocab_size - len(SPECIAL_TOKENS) + i for i, name in enumerate(SPECIAL_TOKENS)
        }

    def encode(self, text: str, prepend: int | str | None = None) -> list[int]:
        ids = list(text.encode())
        if prepend is not None:
            ids.insert(0, prepend if isinstance(prepend, int) else self.special[prepend])
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode(errors="replace")

    def decode_bytes(self, ids: list[int]) -> bytes:
        return bytes(i for i in ids if i < 256)

    def encode_special(self, name: str) -> int:
        return self.special[name]

    def get_bos_token_id(self) -> int:
        return self.special["<|bos|>"]

    def get_vocab_size(self) -> int:
        return self.vocab_size

    def render_conversation(self, messages: list[dict], max_tokens: int | None = None):
        raise NotImplementedError  # ChatSession only needs it for saved assistant messages


def synthetic_model(name: str) -> tuple[GPT, _SyntheticTokenizer]:
    """A random era-E model with nanochat's shapes for that depth (64 wide per layer)."""
    depth = SYNTHETIC_DEPTHS[name]
    n_embd = 64 * depth
    n_head = max(1, math.ceil(n_embd / 128))
    config = GPTConfig(2048, 65536, depth, n_head, n_head, n_embd, window_pattern="SSSL")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(config, ERAS["E"])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02 if p.ndim == 2 else 0.1)
    model.init_rotary()
    model.eval().requires_grad_(False)
    return model, _SyntheticTokenizer(config.vocab_size)


def measure_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Streaming read bandwidth in GB/s (a sum over a buffer much larger than the caches)."""
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def weight_bytes_per_token(model: GPT) -> int:
    """Bytes of weights a decode step reads: every matrix but the embedding tables."""
    skip = ("transformer.wte", "value_embeds")
    return sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if p.ndim == 2 and not name.startswith(skip)
    )


def _prompt(tokenizer, n: int) -> list[int]:
    text = ("The quick brown fox jumps over the lazy dog. " * (n // 10 + 1))[: max(n - 1, 1)]
    return tokenizer.encode(text, prepend=tokenizer.get_bos_token_id())[:n]


def _prefill_tps(model, tokens: list[int]) -> float:
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        model(ids)
        t = min(_timed(lambda: model(ids)) for _ in range(3))
    return len(tokens) / t


def _ours_decode(engine: Engine, prompt: list[int], n: int) -> tuple[float, list[int]]:
    stats = GenerationStats()
    first = []
    for column, _ in engine.generate(
        prompt,
        num_samples=n,
        max_tokens=DECODE_TOKENS,
        temperature=0.0 if n == 1 else 1.0,
        top_k=None,
        seed=1,
        use_tools=False,
        stats=stats,
    ):
        first.append(column[0])
    # Tokens per second over the decode steps only (the first column comes from the prefill).
    return n * (stats.steps - 1) / max(stats.decode_s, 1e-9), first


def _baseline_decode(model, prompt: list[int], n: int) -> tuple[float, list[int]]:
    out = []
    t0 = None
    for step, column in enumerate(
        baseline_generate(model, prompt, n, DECODE_TOKENS, 0.0 if n == 1 else 1.0, None, 1)
    ):
        if step == 0:
            t0 = time.perf_counter()
        out.append(column[0])
    return n * (len(out) - 1) / max(time.perf_counter() - t0, 1e-9), out


def _chat_ttft(model, tokenizer, plain: bool) -> dict[int, float]:
    """Time to first token at given turns of a scripted chat (the same for both modes)."""
    opts = SamplingOptions(temperature=0.0, top_k=None, max_tokens=24, seed=1, tools=False)
    session = ChatSession(model, tokenizer, opts)
    ttft = {}
    for turn in range(1, max(TURNS) + 1):
        text = f"Turn {turn}: tell me more about the quick brown fox and the lazy dog."
        if plain:
            session.cache, session.cache_tokens = None, []  # re-prefill everything
        for _ in session.send(text):
            pass
        if turn in TURNS:
            ttft[turn] = session.last_reply.stats.ttft_s
    return ttft


def run_bench(model: GPT, tokenizer: Any, label: str) -> dict[str, Any]:
    torch.manual_seed(0)
    engine = Engine(model, tokenizer)
    prompt = _prompt(tokenizer, min(512, model.config.sequence_len // 2))
    short = _prompt(tokenizer, 32)
    bandwidth = measure_bandwidth()
    wbytes = weight_bytes_per_token(model)
    prefill = _prefill_tps(model, prompt)

    base_1, base_greedy = _baseline_decode(model, short, 1)
    ours_1, ours_greedy = _ours_decode(engine, short, 1)
    base_8, _ = _baseline_decode(model, prompt, SAMPLES)
    ours_8, _ = _ours_decode(engine, prompt, SAMPLES)
    ttft_base = _chat_ttft(model, tokenizer, plain=True)
    ttft_ours = _chat_ttft(model, tokenizer, plain=False)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def ratio(a: float, b: float) -> float:
        return round(a / b, 2) if b else 0.0

    return {
        "model": label,
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": str(model.lm_head.weight.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "bandwidth_gbs": round(bandwidth, 1),
        "weight_mb_per_token": round(wbytes / 1e6, 1),
        "roofline_tps": round(bandwidth * 1e9 / wbytes, 1),
        "prefill_tps": round(prefill, 1),
        "decode_tps": {
            "baseline": round(base_1, 1),
            "ours": round(ours_1, 1),
            "ratio": ratio(ours_1, base_1),
        },
        "decode8_tps": {
            "baseline": round(base_8, 1),
            "ours": round(ours_8, 1),
            "ratio": ratio(ours_8, base_8),
        },
        "samples8_vs_single": ratio(ours_8, ours_1),
        "ttft_s": {
            "baseline": {t: round(v, 4) for t, v in ttft_base.items()},
            "ours": {t: round(v, 4) for t, v in ttft_ours.items()},
            "ours_turn10_over_turn1": ratio(ttft_ours[10], ttft_ours[1]),
            "baseline_turn10_over_turn1": ratio(ttft_base[10], ttft_base[1]),
        },
        "roofline_fraction": round(ours_1 / (bandwidth * 1e9 / wbytes), 3),
        "greedy_identical": ours_greedy == base_greedy,
        "peak_rss_mb": round(peak_mb, 1),
    }
