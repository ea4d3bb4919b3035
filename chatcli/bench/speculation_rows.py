"""The speculation rows of `chatcli bench`: plain decode and drafting side by side, paired.

Owns: run_speculation_bench (each workload's greedy reply decoded plainly and with drafting,
in alternating rounds, best of each: tok/s, the drafts' acceptance and the tokens a verify
forward gave) and ReplayDrafter, which drafts a known reply (its own tokens, or tokens that
are surely wrong) so that random weights, whose replies copy nothing, still measure what
verification costs and gives at full and at no acceptance. Knows nothing of the terminal
(report.py renders the rows).
"""

from __future__ import annotations

import math
import time
from functools import partial
from typing import Any

from chatcli.engine.engine import Engine, GenerationStats
from chatcli.engine.speculation import Drafter, SpeculationCounts

# Tokens each reply decodes, and the alternating rounds each side runs.
REPLY_TOKENS = 96
ROUNDS = 5
# A run (a side's turn in a round) repeats the reply until it takes about this long: a small
# model's reply of 96 tokens is over in milliseconds, less than a shared machine's hiccups.
MIN_RUN_S = 0.5

# A reply that quotes and edits the question (the embedded model repeats its numbers and
# words), and one that does not.
COPY_PROMPT = (
    "Copy this list, then add the first two numbers: 4821, 7730, 1299, 3356, 8812, 6045, "
    "2217, 9904. The list again: 4821, 7730, 1299, 3356, 8812, 6045, 2217, 9904."
)
OPEN_PROMPT = "Tell me something about the sea, the wind and the sailors of old."


class ReplayDrafter(Drafter):
    """Drafts the tokens of `reply` that come next (hit), or each plus one (miss: never the
    model's greedy token), whatever the row's history holds."""

    def __init__(self, prompt: list[int], reply: list[int], hit: bool, vocab: int) -> None:
        super().__init__(prompt)
        self.start, self.reply, self.hit, self.vocab = len(prompt), reply, hit, vocab

    def draft(self, k: int) -> list[int]:
        at = len(self.history) - self.start
        drafts = self.reply[at : at + k]
        return drafts if self.hit else [(t + 1) % self.vocab for t in drafts]


def _decode(
    engine: Engine, prompt: list[int], speculate: bool, repeats: int = 1
) -> tuple[float, Any, list[int], float]:
    """The greedy reply `repeats` times: its decode tok/s over them all, the last one's
    drafting counts, the reply, and the seconds it all took."""
    engine.speculate = speculate
    tokens, seconds, t0 = 0, 0.0, time.perf_counter()
    for _ in range(repeats):
        stats = GenerationStats()
        columns = engine.generate(
            prompt, max_tokens=REPLY_TOKENS, temperature=0.0, use_tools=False, stats=stats
        )
        reply = [c[0] for c, _ in columns]
        tokens, seconds = tokens + stats.steps - 1, seconds + stats.decode_s
    return tokens / max(seconds, 1e-9), stats.speculation, reply, time.perf_counter() - t0


def _paired(engine: Engine, prompt: list[int]) -> dict[str, Any]:
    """Plain and drafting in alternating rounds (which goes first alternates too), after one
    untimed run of each (thread choices settle, pages fault in): the best tok/s of each, the
    median of the rounds' ratios (a slow spell of a shared machine falls on one pair), the
    drafting's counts, and whether the replies were the same."""
    best = {False: 0.0, True: 0.0}
    counts, replies, ratios = SpeculationCounts(), {}, []
    _decode(engine, prompt, True)
    took = _decode(engine, prompt, False)[3]
    repeats = max(1, math.ceil(MIN_RUN_S / max(took, 1e-9)))  # a small model's runs repeat
    for r in range(ROUNDS):
        tps = {}
        for speculate in (r % 2 == 1, r % 2 == 0):
            tps[speculate], c, reply, _ = _decode(engine, prompt, speculate, repeats)
            best[speculate] = max(best[speculate], tps[speculate])
            replies[speculate] = reply
            if speculate:
                counts = c
        ratios.append(tps[True] / max(tps[False], 1e-9))
    return {
        "plain_tps": round(best[False], 1),
        "speculate_tps": round(best[True], 1),
        "ratio": round(sorted(ratios)[len(ratios) // 2], 2),
        "acceptance": round(counts.acceptance, 3),
        "tokens_per_verification": round(counts.tokens_per_verification, 2),
        "verifications": counts.verifications,
        "same_reply": replies[False] == replies[True],
        "tokens": len(replies[True]),
    }


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    """The text as a user's message to complete; a synthetic model's tokenizer (no chat
    template) takes it as <|bos|> and its bytes."""
    render = getattr(tokenizer, "render_for_completion", None)
    if render is None:
        return [tokenizer.get_bos_token_id(), *tokenizer.encode(text)]
    return render({"messages": [{"role": "user", "content": text}]})


def speculation_rows(model: Any, tokenizer: Any, random_weights: bool) -> list[dict]:
    """run_speculation_bench on an engine of its own over `model`, as the bench left it (its
    decode copies and CPU plan)."""
    return run_speculation_bench(Engine(model, tokenizer), tokenizer, random_weights)


def run_speculation_bench(engine: Engine, tokenizer: Any, random_weights: bool) -> list[dict]:
    """The speculation rows: the copy and open-ended workloads as a chat runs them; with
    random weights also the copy prompt's reply replayed as drafts, all taken and none."""
    drafter, speculate = engine.drafter, engine.speculate
    rows = []
    try:
        for name, text in (("copy", COPY_PROMPT), ("open-ended", OPEN_PROMPT)):
            prompt = chat_prompt(tokenizer, text)
            engine.drafter = Drafter
            rows.append({"workload": name, **_paired(engine, prompt)})
            if not random_weights or name != "copy":
                continue
            reply = _decode(engine, prompt, False)[2]
            vocab = int(engine.model.config.vocab_size)
            for hit, label in ((True, "replayed, all taken"), (False, "replayed, none taken")):
                engine.drafter = partial(ReplayDrafter, reply=reply, hit=hit, vocab=vocab)
                rows.append({"workload": f"copy {label}", **_paired(engine, prompt)})
    finally:
        engine.drafter, engine.speculate = drafter, speculate
    return rows
