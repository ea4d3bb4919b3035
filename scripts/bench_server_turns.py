"""Time to first token of a server worker, turn by turn, when its client resends the whole
conversation every turn (as OpenAI-style clients do): with the worker's warm cache, and with
the cache emptied before each request (every request prefilled whole, as a worker without
one did). A benchmark, not a test.

    python scripts/bench_server_turns.py [--synthetic d12|d20] [--turns 10] [--rounds 3]

Runs Worker.generate directly (no HTTP: the server adds the same to both) on the embedded
model or a synthetic one (with the 16-bit decode copies `chatcli serve` would give a large
model), the CPU plan applied as `chatcli serve` applies it. Each turn appends a short user
message to the conversation and the reply the worker gave; each measured request is sent
`--rounds` times from the same state, the best kept (the host's noise moves single runs by
a third). Prints each turn's time to first token both ways and their turn-N / turn-1 ratio.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from chatcli.bench.models import synthetic_model
from chatcli.bench.roofline import weight_bytes_per_token
from chatcli.engine.cpu_plan import apply_cpu_plan
from chatcli.model.checkpoint import load_model
from chatcli.model.model_build import LARGE_MODEL_MATRIX_PARAMS
from chatcli.model.quantize import default_half_kind
from chatcli.model.special_tokens import ASSISTANT_END, ASSISTANT_START, USER_END, USER_START
from chatcli.serve.replies import GenerationParams
from chatcli.serve.worker_pool import Worker

REPLY_TOKENS = 16


def first_token_s(worker: Worker, prompt: list[int], held: list[int]) -> float:
    """Seconds from the request to its first token, the worker's cache holding
    `held` (a prefix of the prompt); the reply runs to its end."""
    worker.warm.tokens = list(held)  # the cache keeps its memory; only `held` is reused
    params = GenerationParams(REPLY_TOKENS, temperature=0.0, top_k=None, top_p=None, seed=1)
    first: list[float] = []
    decode = worker.engine.decode

    def timed(*args: Any, **kwargs: Any) -> Iterator[Any]:
        # The first token, not the first event: a synthetic model's tokens may decode to
        # no text at all.
        for item in decode(*args, **kwargs):
            if not first:
                first.append(time.perf_counter() - t0)
            yield item

    worker.engine.decode = timed
    try:
        t0 = time.perf_counter()
        worker.generate(prompt, params, lambda events: None, threading.Event())
    finally:
        del worker.engine.decode  # the class's again
    return first[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--synthetic", choices=["d4", "d12", "d20"])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.synthetic:
        model, tokenizer = synthetic_model(args.synthetic)
        if weight_bytes_per_token(model) / 4 > LARGE_MODEL_MATRIX_PARAMS:
            model.add_decode_weights(default_half_kind())
    else:
        model, tokenizer, _ = load_model(None, device="cpu")
    apply_cpu_plan(model)
    worker = Worker(model, tokenizer)
    special = tokenizer.encode_special
    user_start, user_end = special(USER_START), special(USER_END)
    assistant_start, assistant_end = special(ASSISTANT_START), special(ASSISTANT_END)
    conversation = [tokenizer.get_bos_token_id()]
    print(f"{args.synthetic or 'embedded'} model, {torch.get_num_threads()} threads")
    print("turn  prompt  warm ms  cold ms")
    firsts: dict[str, list[float]] = {"warm": [], "cold": []}
    with torch.inference_mode():
        for turn in range(1, args.turns + 1):
            text = tokenizer.encode(f"Turn {turn}: and the fox?")
            prompt = [*conversation, user_start, *text, user_end, assistant_start]
            # What the cache held after the last turn's reply, and nothing: every try
            # starts from one of the two (what a cold try writes over agrees with it).
            held = {"warm": list(worker.warm.tokens), "cold": []}
            for mode in ("cold", "warm"):  # warm last: its reply stays in the cache
                tries = [first_token_s(worker, prompt, held[mode]) for _ in range(args.rounds)]
                firsts[mode].append(min(tries))
            reply = worker.warm.tokens[len(prompt) :]  # the last token was never run
            conversation = [*prompt, *reply, assistant_end]
            print(
                f"{turn:4d}  {len(prompt):6d}  {firsts['warm'][-1] * 1e3:7.1f}  "
                f"{firsts['cold'][-1] * 1e3:7.1f}"
            )
    for mode, times in firsts.items():
        print(f"{mode}: turn {args.turns} / turn 1 = {times[-1] / times[0]:.2f}")


if __name__ == "__main__":
    main()
