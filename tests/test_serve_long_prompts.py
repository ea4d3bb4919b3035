"""`chatcli serve` as a user starts it (default flags: a batched worker on the CPU) answers
prompts longer than one prefill chunk, alone and with other clients at once, exactly as
`--batch 1` answers them. Its default path once answered 500 to every prompt over 64 tokens
not already cached, while every test sent short ones."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from chatcli.engine.scheduler import PREFILL_CHUNK
from chatcli.model.checkpoint import load_model

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a careful assistant for arithmetic. Answer each question with the number first, "
    "then one short sentence that says how you got it. Use the calculator for anything with "
    "more than two digits, and never guess a result you have not computed."
)


@contextmanager
def _server(*flags: str) -> Iterator[str]:
    """`chatcli serve --port 0 FLAGS` on the embedded model; yields its URL."""
    env = {**os.environ, "NO_COLOR": "1"}
    env.pop("CHATCLI_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "chatcli", "serve", "--port", "0", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            found = re.search(r"at (http://127\.0\.0\.1:\d+) ", line)
            if found:
                yield found.group(1)
                return
        raise AssertionError("the server never said where it listens:\n" + "".join(seen))
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _ask(url: str, body: dict) -> tuple[str, dict]:
    """One streamed chat completion: its text and usage; a non-200 or an error chunk fails."""
    text, usage = "", {}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200, response.read().decode()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                text += chunk["choices"][0]["delta"].get("content", "")
            usage = chunk.get("usage") or usage
    return text, usage


def _bodies() -> list[dict]:
    """Conversations of a system prompt and a question of exactly 17 (the shortest with a
    system prompt), 63, 64, 65, 200 and 1240 tokens (the embedded model's context is 1280),
    greedy and sampled."""
    _, tokenizer, _ = load_model(None, device="cpu")
    bodies = []
    for i, n in enumerate([17, 63, 64, 65, 200, 1240]):
        question = {"role": "user", "content": f"What is {i + 2}*{i + 3}?"}
        words = SYSTEM.split()
        system = "Be brief."

        def length(system: str, question: dict = question) -> int:
            messages = [{"role": "system", "content": system}, question]
            return len(tokenizer.render_for_completion(messages))

        while length(f"{system} {words[0]}") < n - 4:  # whole words, then one token a "!"
            system = f"{system} {words[0]}"
            words = [*words[1:], words[0]]
        while length(system) < n:
            system += "!"
        assert length(system) == n
        bodies.append(
            {
                "messages": [{"role": "system", "content": system}, question],
                "max_tokens": 16,
                "temperature": 0.0 if i % 2 == 0 else 0.8,
                "seed": i,
            }
        )
    return bodies


def test_the_default_server_answers_long_prompts_alone_and_at_once_as_batch_1_does():
    bodies = _bodies()
    answers: dict[str, list] = {}
    for name, flags in (("default", ()), ("batch 1", ("--batch", "1"))):
        with _server(*flags) as url:
            alone = [_ask(url, body) for body in bodies]
            with ThreadPoolExecutor(len(bodies)) as pool:
                together = list(pool.map(lambda b, url=url: _ask(url, b), bodies))
        answers[name] = alone
        # The server read the prompts as they were measured: one short of a prefill chunk,
        # one chunk, one over, and many chunks.
        assert [usage["prompt_tokens"] for _, usage in alone] == [17, 63, 64, 65, 200, 1240]
        assert PREFILL_CHUNK == 64
        assert [t for t, _ in together] == [t for t, _ in alone]
        assert all(text for text, _ in alone)
    assert [t for t, _ in answers["default"]] == [t for t, _ in answers["batch 1"]]
    assert [u["completion_tokens"] for _, u in answers["default"]] == [
        u["completion_tokens"] for _, u in answers["batch 1"]
    ]
