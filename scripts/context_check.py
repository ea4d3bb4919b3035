"""How a chat model handles a new question in the middle of a conversation (greedy).

    python scripts/context_check.py                 # the embedded default model
    python scripts/context_check.py --model runs/X

The held-out evaluation asks each question at the start of a conversation (or right after
the exchange a follow-up refers to). In a chat, questions of every kind follow each other.
Here each conversation is a held-out arithmetic or counting question, the model's reply, a
follow-up ("and times 3?" or "what about banana?") and the model's reply, and then:

- a held-out question of the other tool kind: is its first calculator call exactly right?
- a held-out out-of-scope question: does the model decline it ("too small", no tool call)?
"""

from __future__ import annotations

import argparse
from typing import Any

from chatcli.engine.engine import Engine
from chatcli.model.checkpoint import load_model
from chatcli.training.eval_sets import BASE_EVAL_KINDS, EvalItem, generate_eval_set
from chatcli.training.evaluate import greedy_reply

FOLLOW_UPS = {"arithmetic": "and times 3?", "counting": "what about banana?"}


def reply(engine: Engine, tokenizer: Any, messages: list[dict]) -> list[dict[str, str]]:
    return greedy_reply(engine, tokenizer, messages)[0]


def after_a_follow_up(engine: Engine, tokenizer: Any, first: EvalItem, then: EvalItem) -> list:
    """The model's reply to `then`, asked after `first`, its answer, a follow-up and its answer."""
    messages = list(first.messages)
    messages.append({"role": "assistant", "content": reply(engine, tokenizer, messages)})
    messages.append({"role": "user", "content": FOLLOW_UPS[first.kind]})
    messages.append({"role": "assistant", "content": reply(engine, tokenizer, messages)})
    messages.append(then.messages[-1])
    return reply(engine, tokenizer, messages)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint path (default: embedded model)")
    parser.add_argument("--n", type=int, default=10, help="conversations per opening kind")
    args = parser.parse_args()
    model, tokenizer, _ = load_model(args.model, device="cpu")
    engine = Engine(model, tokenizer)
    items = generate_eval_set(3 * args.n, seed=77, kinds=BASE_EVAL_KINDS)
    by_kind = {k: [i for i in items if i.kind == k][: args.n] for k in ("arithmetic", "counting")}
    declines = [i for i in items if i.kind == "out_of_scope"][: args.n]
    exact = declined = 0
    pairs = list(zip(by_kind["arithmetic"], by_kind["counting"], declines, strict=True))
    for arithmetic, counting, out_of_scope in pairs:
        for first, then in ((arithmetic, counting), (counting, arithmetic)):
            parts = after_a_follow_up(engine, tokenizer, first, then)
            calls = [p["text"] for p in parts if p["type"] == "python"]
            exact += bool(calls) and calls[0] == then.expected_expression
            parts = after_a_follow_up(engine, tokenizer, first, out_of_scope)
            text = "".join(p["text"] for p in parts if p["type"] == "text").lower()
            declined += "too small" in text and not any(p["type"] == "python" for p in parts)
    total = 2 * len(pairs)
    print(f"a tool question of the other kind after a follow-up: exact call {exact}/{total}")
    print(f"an out-of-scope question after a follow-up: declined {declined}/{total}")


if __name__ == "__main__":
    main()
