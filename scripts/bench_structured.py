"""What structured output costs: the grammar libraries' mask time, and constrained decode
against free decode.

`masks`: the time to compute one token's mask, llguidance against xgrammar, following the
same valid JSON reply token by token, on the embedded model's vocabulary (1024 tokens) and on
one of nanochat's size (65536: a word-list vocabulary; nanochat's own is not on disk here).

`decode`: tokens a second of the embedded model or a random d20 (nanochat's shapes, the
65536-token vocabulary), free and under a JSON schema, in alternating rounds (free first,
then constrained first) so that a busy machine slows both alike. One row runs the chat's
path (Engine.generate); --rows N joins N requests in a server's batch (Scheduler).

    python scripts/bench_structured.py masks [--rounds 5]
    python scripts/bench_structured.py decode [--model embedded|d20] [--rows 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from chatcli.engine import scheduler
from chatcli.engine.engine import Engine, GenerationStats
from chatcli.engine.grammar import grammar_tokenizer, json_grammar
from chatcli.engine.grammar_rows import RowsGrammar
from chatcli.engine.scheduler import RowRequest, Scheduler
from chatcli.model.special_tokens import ASSISTANT_END, SPECIAL_TOKENS
from chatcli.model.tokenizer import COPY_SPLIT_PATTERN, Tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "friends": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "color", "friends"],
    "additionalProperties": False,
}
REPLY = {
    "name": "Ada Lovelace of London",
    "age": 36,
    "color": "green",
    "friends": ["Charles Babbage", "Mary Somerville", "Michael Faraday"],
}
NANOCHAT_VOCAB = 65536


def word_tokenizer(size: int = NANOCHAT_VOCAB) -> Tokenizer:
    """A tiktoken Tokenizer of `size` ids: the 256 bytes, then English words with and without
    a leading space and capitalised, then nanochat's 9 special tokens."""
    from english_words import get_english_words_set

    ranks = {bytes([i]): i for i in range(256)}
    for word in sorted(get_english_words_set(["web2"], lower=True)):
        for form in (f" {word}", word, f" {word.capitalize()}"):
            if len(ranks) == size - len(SPECIAL_TOKENS):
                return Tokenizer.from_ranks(ranks, pattern=COPY_SPLIT_PATTERN)
            ranks.setdefault(form.encode(), len(ranks))
    raise ValueError("not enough words")


def embedded_tokenizer() -> Tokenizer:
    from chatcli.model.checkpoint_paths import EMBEDDED_DIR

    return Tokenizer.from_file(EMBEDDED_DIR / "tokenizer" / "tokenizer.pkl")


# ---- masks ----------------------------------------------------------------------------------


def llguidance_mask_s(tokenizer: Tokenizer, reply: list[int]) -> tuple[float, float]:
    """(the schema's compile time, one token's mask time)."""
    import llguidance
    import llguidance.torch as lt

    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(grammar_tokenizer(tokenizer), json_grammar(PERSON))
    compiled = time.perf_counter() - t0
    bitmask = lt.allocate_token_bitmask(1, tokenizer.get_vocab_size())
    spent = 0.0
    for token in reply:
        t0 = time.perf_counter()
        lt.fill_next_token_bitmask(matcher, bitmask)
        spent += time.perf_counter() - t0
        assert matcher.consume_token(token), matcher.get_error()
    return compiled, spent / len(reply)


def xgrammar_mask_s(tokenizer: Tokenizer, reply: list[int], info: Any) -> tuple[float, float]:
    """(the schema's compile time, uncached, one token's mask time)."""
    import xgrammar as xgr

    t0 = time.perf_counter()
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    grammar = compiler.compile_json_schema(
        json.dumps(PERSON), any_whitespace=False, separators=(", ", ": ")
    )
    matcher = xgr.GrammarMatcher(grammar)
    compiled = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, tokenizer.get_vocab_size())
    spent = 0.0
    for token in reply:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        spent += time.perf_counter() - t0
        assert matcher.accept_token(token), token
    return compiled, spent / len(reply)


def xgrammar_info(tokenizer: Tokenizer) -> Any:
    import xgrammar as xgr

    n = tokenizer.get_vocab_size()
    vocab = [tokenizer.decode_bytes([i]) for i in range(n)]
    end = tokenizer.encode_special(ASSISTANT_END)
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=n, stop_token_ids=[end])


def bench_masks(rounds: int) -> dict[str, Any]:
    out = {}
    for name, tokenizer in (
        ("embedded 1024", embedded_tokenizer()),
        ("words 65536", word_tokenizer()),
    ):
        text = json.dumps(REPLY)
        reply = [*tokenizer.encode(text), tokenizer.encode_special(ASSISTANT_END)]
        t0 = time.perf_counter()
        grammar_tokenizer(tokenizer)
        ll_setup = time.perf_counter() - t0
        t0 = time.perf_counter()
        info = xgrammar_info(tokenizer)
        xg_setup = time.perf_counter() - t0
        ll, xg = [], []
        for _ in range(rounds):  # alternating: a busy machine slows both alike
            ll.append(llguidance_mask_s(tokenizer, reply))
            xg.append(xgrammar_mask_s(tokenizer, reply, info))
        out[name] = {
            "tokens": len(reply),
            "llguidance_mask_us": round(statistics.median(m for _, m in ll) * 1e6, 1),
            "xgrammar_mask_us": round(statistics.median(m for _, m in xg) * 1e6, 1),
            "llguidance_schema_ms": round(statistics.median(c for c, _ in ll) * 1e3, 2),
            "xgrammar_schema_ms": round(statistics.median(c for c, _ in xg) * 1e3, 2),
            "llguidance_tokenizer_s": round(ll_setup, 3),
            "xgrammar_tokenizer_s": round(xg_setup, 3),
        }
        print(name, out[name], flush=True)
    return out


# ---- decode ---------------------------------------------------------------------------------


def load(name: str, device: str) -> tuple[Any, Tokenizer]:
    if name == "embedded":
        from chatcli.model.checkpoint import load_model

        model, tokenizer, _ = load_model(None, device=device)
        return model, tokenizer
    from chatcli.bench.models import synthetic_model

    model, _ = synthetic_model(name, device)
    return model, word_tokenizer(model.config.vocab_size)


def decode_tps(
    engine: Engine, prompt: list[int], grammar: str | None, tokens: int, rows: int
) -> float:
    """Tokens a second after the first, every row's (the same seeds each round)."""
    if rows == 1:
        stats = GenerationStats()
        for _ in engine.generate(prompt, max_tokens=tokens, seed=0, stats=stats, grammar=grammar):
            pass
        return stats.decode_tps
    batch = Scheduler(engine, rows=rows)
    gens = [
        batch.join(RowRequest(prompt, tokens, 1.0, seed=i, grammar=grammar)) for i in range(rows)
    ]
    t0, first = None, 0
    while batch.running:
        stepped = batch.step()
        if t0 is None and len(stepped.tokens) == rows:  # every row has its first token
            t0, first = time.perf_counter(), sum(g.stats.steps for g in gens)
    produced = sum(g.stats.steps for g in gens) - first
    return produced / (time.perf_counter() - t0)


class GrammarClock:
    """The time the sampler's thread spends in the grammar's calls (masking a step's logits,
    following the tokens taken): what constrained decode adds to a step, less noisy than the
    ratio of two speeds on a busy machine."""

    def __init__(self) -> None:
        self.spent = 0.0
        self.steps = 0
        masked_rows, advance = scheduler.masked_rows, RowsGrammar.advance

        def timed_masked_rows(parts: list) -> list:
            t0 = time.perf_counter()
            out = masked_rows(parts)
            if any(grammar is not None for grammar, _ in parts):
                self.spent += time.perf_counter() - t0
                self.steps += 1
            return out

        def timed_advance(grammar: RowsGrammar, column: list[int], live: list[bool]) -> None:
            t0 = time.perf_counter()
            advance(grammar, column, live)
            self.spent += time.perf_counter() - t0

        scheduler.masked_rows = timed_masked_rows
        RowsGrammar.advance = timed_advance  # type: ignore[method-assign]


def bench_decode(name: str, device: str, rows: int, tokens: int, rounds: int) -> dict[str, Any]:
    model, tokenizer = load(name, device)
    engine = Engine(model, tokenizer)
    prompt = tokenizer.render_for_completion([{"role": "user", "content": "Who are you?"}])
    grammar = json_grammar(PERSON)
    grammar_tokenizer(tokenizer)  # built once per tokenizer, as a server does at its first
    decode_tps(engine, prompt, grammar, 8, rows)  # warm-up: kernels, graphs, first masks
    decode_tps(engine, prompt, None, 8, rows)
    free, constrained = [], []
    clock = GrammarClock()
    for r in range(rounds):
        order = [(free, None), (constrained, grammar)]
        for into, g in order if r % 2 == 0 else order[::-1]:
            into.append(decode_tps(engine, prompt, g, tokens, rows))
    result = {
        "model": name,
        "device": device,
        "rows": rows,
        "free_tps": round(statistics.median(free), 1),
        "constrained_tps": round(statistics.median(constrained), 1),
        "ratio": round(statistics.median(constrained) / statistics.median(free), 3),
        "grammar_us_per_step": round(clock.spent / max(clock.steps, 1) * 1e6, 1),
        "free_ms_per_step": round(rows / statistics.median(free) * 1e3, 3),
        "free_rounds": [round(x, 1) for x in free],
        "constrained_rounds": [round(x, 1) for x in constrained],
    }
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("masks", "decode"))
    parser.add_argument("--model", default="embedded", choices=("embedded", "d4", "d12", "d20"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.what == "masks":
        bench_masks(args.rounds)
    else:
        bench_decode(args.model, args.device, args.rows, args.tokens, args.rounds)


if __name__ == "__main__":
    main()
