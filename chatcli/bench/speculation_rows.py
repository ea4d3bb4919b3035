"""The speculation rows of `chatcli bench`: plain decode and drafting side by side, paired.

Owns: run_speculation_bench (each workload's greedy reply decoded plainly and with drafting,
in alternating rounds, best of each: tok/s, the drafts' acceptance and the tokens a verify
forward gave) and ReplayDrafter, which drafts a known reply (its own tokens, or tokens that
are surely wrong) so that random weights, whose replies copy nothing, still measure what
verification costs and gives at full and at no acceptance. Knows nothing of the terminal
(report.py renders the rows).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from chatcli.engine.engine import Engine, GenerationStats
from chatcli.engine.speculation import Drafter, SpeculationCounts

# Tokens each reply decodes, and the alternating rounds each side runs.
REPLY_TOKENS = 96
ROUNDS = 3

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


def _decode(engine: Engine, prompt: list[int], speculate: bool) -> tuple[float, Any, list[int]]:
    engine.speculate = speculate
    stats = GenerationStats()
    columns = engine.generate(
        prompt, max_tokens=REPLY_TOKENS, temperature=0.0, use_tools=False, stats=stats
    )
    reply = [c[0] for c, _ in columns]
    return stats.decode_tps, stats.speculation, reply


def _paired(engine: Engine, prompt: list[int]) -> dict[str, Any]:
    """Plain and drafting in alternating rounds (which goes first alternates too): the best
    tok/s of each, the drafting's counts, and whether the replies were the same."""
    best = {False: 0.0, True: 0.0}
    counts, replies = SpeculationCounts(), {}
    for r in range(ROUNDS):
        for speculate in (r % 2 == 1, r % 2 == 0):
            tps, c, reply = _decode(engine, prompt, speculate)
            best[speculate] = max(best[speculate], tps)
            replies[speculate] = reply
            if speculate:
                counts = c
    return {
        "plain_tps": round(best[False], 1),
        "speculate_tps": round(best[True], 1),
        "ratio": round(best[True] / max(best[False], 1e-9), 2),
        "acceptance": round(counts.acceptance, 3),
        "tokens_per_verification": round(counts.tokens_per_verification, 2),
        "verifications": counts.verifications,
        "same_reply": replies[False] == replies[True],
        "tokens": len(replies[True]),
    }


def _chat_prompt(tokenizer: Any, text: str) -> list[int]:
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
            prompt = _chat_prompt(tokenizer, text)
            engine.drafter = Drafter
            rows.append({"workload": name, **_paired(engine, prompt)})
            if not random_weights or name != "copy":
                continue
            _, _, reply = _decode(engine, prompt, False)
            vocab = int(engine.model.config.vocab_size)
            for hit, label in ((True, "replayed, all taken"), (False, "replayed, none taken")):
                engine.drafter = partial(ReplayDrafter, reply=reply, hit=hit, vocab=vocab)
                rows.append({"workload": f"copy {label}", **_paired(engine, prompt)})
    finally:
        engine.drafter, engine.speculate = drafter, speculate
    return rows
