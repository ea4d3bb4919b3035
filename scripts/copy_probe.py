"""Where a chat model miscopies its letter-counting calls, teacher-forced.

    python scripts/copy_probe.py                   # the embedded default model
    python scripts/copy_probe.py --model runs/X --n 300

For every held-out counting prompt and counting follow-up (eval_sets.generate_eval_set, its
own seed so these are not the README's scored prompts), the correct `"word".count("x")` call
is appended to the conversation and the model predicts each of its tokens given the correct
ones before it. The first token it would get wrong (greedy) is classed as the word's first
token, a token inside the word, or the letter. Much quicker and less noisy than generating
(one forward pass per prompt), and it says which part of the copy fails, where the
evaluation's accuracy only says that the count came out wrong.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from chatcli.model.checkpoint import load_model
from chatcli.model.special_tokens import PYTHON_END, PYTHON_START
from chatcli.training.eval_sets import BASE_EVAL_KINDS, EvalItem, generate_eval_set
from chatcli.training.vocabulary import EVAL_WORDS

PLACES = ("first", "inside", "letter", "other")


def first_miss(model: torch.nn.Module, tokenizer, item: EvalItem) -> str | None:
    """Where greedy decoding would first leave the correct call, or None if it would not."""
    call = {"type": "python", "text": item.expected_expression}
    ids, _ = tokenizer.render_conversation(
        [*item.messages, {"role": "assistant", "content": [call]}]
    )
    start = len(ids) - 1 - ids[::-1].index(tokenizer.encode_special(PYTHON_START))
    end = ids.index(tokenizer.encode_special(PYTHON_END), start)
    with torch.no_grad():
        predicted = model(torch.tensor([ids[: end + 1]]))[0, start:end].argmax(-1).tolist()
    targets = ids[start + 1 : end + 1]
    pieces = [tokenizer.decode([t]) for t in targets]
    misses = [k for k, (p, t) in enumerate(zip(predicted, targets, strict=True)) if p != t]
    if not misses:
        return None
    k = misses[0]
    letter = pieces.index('("') + 1 if '("' in pieces else -1
    # pieces: '"', the word's tokens, '".', 'count', '("', the letter, '")'
    if k == letter:
        return "letter"
    if k == 1:
        return "first"
    return "inside" if 1 < k < letter - 2 else "other"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint path (default: embedded model)")
    parser.add_argument("--n", type=int, default=300, help="eval prompts per kind to draw from")
    parser.add_argument("--seed", type=int, default=4321)
    args = parser.parse_args()
    model, tokenizer, _ = load_model(args.model, device="cpu")
    items = [
        i
        for i in generate_eval_set(args.n, args.seed, kinds=BASE_EVAL_KINDS)
        if i.expected_expression and ".count(" in i.expected_expression
    ]
    totals: Counter[str] = Counter()
    misses: Counter[tuple[str, str]] = Counter()
    for item in items:
        word = item.expected_expression.split('"')[1]
        kind = "follow-up" if item.kind == "followup" else "question"
        group = f"{kind}, {'English' if word in EVAL_WORDS else 'random'} word"
        totals[group] += 1
        place = first_miss(model, tokenizer, item)
        if place is not None:
            misses[(group, place)] += 1
    print(f"{'calls':>6} {'exact':>6}  " + " ".join(f"{p:>7}" for p in PLACES) + "  group")
    for group in sorted(totals):
        wrong = [misses[(group, p)] for p in PLACES]
        exact = 1 - sum(wrong) / totals[group]
        cells = " ".join(f"{w:>7}" for w in wrong)
        print(f"{totals[group]:>6} {exact:>6.1%}  {cells}  {group}")


if __name__ == "__main__":
    main()
