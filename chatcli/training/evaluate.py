"""Evaluate a chat model on held-out prompts, through the real Engine and calculator.

    python -m chatcli.training.evaluate                 # the embedded default model
    python -m chatcli.training.evaluate --model PATH --n 200 --json
    python -m chatcli.training.evaluate --quantize int8   # through int8 decode copies

The prompts come from `synthetic.generate_eval_set`: numbers and phrasings that the training
split never uses. Every reply is generated greedily by the Engine, so calculator calls run and
their results are forced in exactly as in a chat. Reported:

- tool_call_rate: replies to arithmetic, counting and follow-up prompts that call the tool;
- arithmetic / counting / followup accuracy: the expected result appears in the reply's final
  sentence (after the tool output), as a whole number not part of a longer one;
- arithmetic / counting / followup exact_call: the reply's first calculator call is exactly
  the expected expression. Stricter than accuracy, which a miscopied word can still pass by
  chance ("number".count("n") answers "need".count("n") right);
- ended_rate: replies that end with <|assistant_end|> (every kind);
- identity / out_of_scope: the reply says how to load a real model, or that it is too small.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from chatcli.chat.stream import decode_assistant_parts
from chatcli.engine.engine import Engine, GenerationStats
from chatcli.training.eval_sets import EvalItem, generate_eval_set

TOOL_KINDS = ("arithmetic", "counting", "followup")
MAX_REPLY_TOKENS = 160


@dataclass(frozen=True)
class Graded:
    item: EvalItem
    parts: list[dict[str, str]]
    ended: bool
    called_tool: bool
    correct: bool
    exact_call: bool


def final_sentence(parts: list[dict[str, str]]) -> str:
    """The text after the last tool output (the whole text when there is none)."""
    last = max((i for i, p in enumerate(parts) if p["type"] == "python_output"), default=-1)
    return "".join(p["text"] for p in parts[last + 1 :] if p["type"] == "text")


def contains_number(text: str, number: str) -> bool:
    return re.search(rf"(?<![\d.]){re.escape(number)}(?![\d])", text) is not None


def grade(item: EvalItem, parts: list[dict[str, str]], ended: bool) -> Graded:
    calls = [p["text"] for p in parts if p["type"] == "python"]
    called = bool(calls)
    exact_call = called and calls[0] == item.expected_expression
    text = final_sentence(parts)
    if item.kind in TOOL_KINDS:
        correct = item.expected is not None and called and contains_number(text, item.expected)
    elif item.kind == "identity":
        correct = "--model" in text
    else:  # out_of_scope
        correct = "too small" in text.lower() and not called
    return Graded(item, parts, ended, called, correct, exact_call)


def greedy_reply(
    engine: Engine, tokenizer: Any, messages: list[dict]
) -> tuple[list[dict[str, str]], bool]:
    """The assistant's next reply to a conversation, greedy, with the calculator: its parts
    and whether it ended with <|assistant_end|>."""
    prompt = tokenizer.render_for_completion(messages)
    stats = GenerationStats()
    tokens, masks = [], []
    for column, column_masks in engine.generate(
        prompt, max_tokens=MAX_REPLY_TOKENS, temperature=0.0, stats=stats
    ):
        tokens.append(column[0])
        masks.append(column_masks[0])
    ended = stats.finish_reasons[0] == "stop"
    body = tokens[:-1] if ended else tokens
    return decode_assistant_parts(body, masks[: len(body)], tokenizer), ended


def run_item(engine: Engine, tokenizer: Any, item: EvalItem) -> Graded:
    return grade(item, *greedy_reply(engine, tokenizer, item.messages))


def summarize(graded: list[Graded]) -> dict[str, Any]:
    by_kind: dict[str, list[Graded]] = defaultdict(list)
    for g in graded:
        by_kind[g.item.kind].append(g)
    tool_items = [g for g in graded if g.item.kind in TOOL_KINDS]
    summary: dict[str, Any] = {
        "items": len(graded),
        "tool_call_rate": _rate(g.called_tool for g in tool_items),
        "ended_rate": _rate(g.ended for g in graded),
    }
    for kind, items in by_kind.items():
        summary[f"{kind}_accuracy"] = _rate(g.correct for g in items)
    for kind in TOOL_KINDS:
        if by_kind.get(kind):
            summary[f"{kind}_exact_call"] = _rate(g.exact_call for g in by_kind[kind])
    return summary


def _rate(flags: Any) -> float:
    flags = list(flags)
    return round(sum(flags) / len(flags), 4) if flags else 0.0


def evaluate(model: Any, tokenizer: Any, n_per_kind: int = 100, seed: int = 1234) -> dict[str, Any]:
    engine = Engine(model, tokenizer)
    t0 = time.perf_counter()
    graded = [run_item(engine, tokenizer, item) for item in generate_eval_set(n_per_kind, seed)]
    summary = summarize(graded)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    summary["failures"] = [
        {
            "kind": g.item.kind,
            "prompt": g.item.messages[-1]["content"],
            "expected": g.item.expected,
            "reply": g.parts,
        }
        for g in graded
        if not (g.correct and g.ended)
    ][:20]
    return summary


def main(argv: list[str] | None = None) -> None:
    from chatcli.model.checkpoint import QUANTIZE_CHOICES, load_model

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint path (default: embedded model)")
    parser.add_argument("--n", type=int, default=100, help="prompts per kind")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument(
        "--quantize",
        choices=QUANTIZE_CHOICES,
        default="none",
        help="decode through int8/int4 copies of the matrices (the quality of --quantize)",
    )
    args = parser.parse_args(argv)
    model, tokenizer, _ = load_model(args.model, device="cpu", quantize=args.quantize)
    summary = evaluate(model, tokenizer, args.n, args.seed)
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    for key, value in summary.items():
        if key != "failures":
            print(f"{key:>22}: {value}")
    for f in summary["failures"][:10]:
        print(f"  FAIL {f['kind']}: {f['prompt']!r} expected {f['expected']!r} got {f['reply']}")


if __name__ == "__main__":
    main()
