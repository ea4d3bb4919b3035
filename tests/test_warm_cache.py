"""WarmCache: a prompt prefills only what lies past the prefix the cache already holds, and
gives the logits a fresh full prefill gives."""

from __future__ import annotations

import threading

import pytest
import torch
from builders import random_chat_gpt
from fakes import ByteTokenizer

from chatcli.engine.engine import Engine
from chatcli.engine.warm_cache import WarmCache, choose
from chatcli.model.kv_cache import SharedPrefixCache
from chatcli.serve.replies import GenerationParams
from chatcli.serve.worker_pool import Worker


def prompt_of(*pieces: list[int]) -> list[int]:
    return [t for piece in pieces for t in piece]


def fresh_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt]))[:, -1]


@pytest.mark.parametrize("era", ["A", "E"])  # E remembers each position's previous token
def test_a_prompt_runs_past_the_longest_prefix_the_cache_holds(era):
    model = random_chat_gpt(era)
    warm = WarmCache(Engine(model, ByteTokenizer()))
    g = torch.Generator().manual_seed(2)
    first, more, other = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 7, 9))
    cases = [
        (first, len(first)),  # an empty cache: everything runs
        (prompt_of(first, more), len(more)),  # the conversation went on
        (prompt_of(first[:5], other), len(other)),  # a new branch from position 5
        (prompt_of(first[:5], other), 1),  # the same prompt: its last token runs again
        (first[:3], 1),  # a prompt the cache holds whole: its last position runs
    ]
    for prompt, runs in cases:
        logits, n = warm.prefill(prompt)
        assert n == runs
        assert warm.tokens == prompt and warm.cache.get_pos() == len(prompt)
        torch.testing.assert_close(logits, fresh_logits(model, prompt), atol=2e-5, rtol=0)


def test_a_failed_prefill_keeps_only_what_the_cache_still_holds(monkeypatch):
    model = random_chat_gpt("E")
    engine = Engine(model, ByteTokenizer())
    warm = WarmCache(engine)
    prompt = list(range(30, 50))
    warm.prefill(prompt)

    def broken(ids, cache):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine, "forward_last", broken)
    with pytest.raises(RuntimeError):
        warm.prefill([*prompt[:10], 7, 8, 9])
    assert warm.tokens == prompt[:10] and warm.cache.get_pos() == 10
    monkeypatch.undo()
    logits, n = warm.prefill(prompt)
    assert n == 10
    torch.testing.assert_close(logits, fresh_logits(model, prompt), atol=2e-5, rtol=0)


def test_a_generation_leaves_the_tokens_it_wrote_in_the_cache():
    engine = Engine(random_chat_gpt("E"), ByteTokenizer())
    warm = WarmCache(engine)
    prompt = list(range(40, 60))
    steps = engine.generate(prompt, max_tokens=5, temperature=0.0, use_tools=False, warm=warm)
    reply = [column[0] for column, _ in steps]
    assert len(reply) == 5
    # The last token was yielded, never run: the cache holds the rest.
    assert warm.tokens == prompt + reply[:-1] and warm.cache.get_pos() == len(warm.tokens)


def test_a_generation_closed_early_leaves_what_it_wrote():
    engine = Engine(random_chat_gpt("E"), ByteTokenizer())
    warm = WarmCache(engine)
    prompt = list(range(40, 60))
    steps = engine.generate(prompt, max_tokens=20, temperature=0.0, warm=warm)
    reply = [next(steps)[0][0] for _ in range(3)]
    steps.close()
    assert warm.tokens == prompt + reply[:2] and warm.cache.get_pos() == len(warm.tokens)


def _sample_rows(engine: Engine, warm: WarmCache, prompt: list[int], n: int, max_tokens: int):
    """Every row's tokens of an n-row generation forked from the warm cache."""
    steps = engine.generate(prompt, n, max_tokens, temperature=1.0, seed=4, warm=warm)
    columns = [column for column, _ in steps]
    return [[column[i] for column in columns] for i in range(n)]


@pytest.mark.parametrize("shared", [True, False])  # rows over the cache, or copies of it
def test_a_sample_rows_tokens_are_adopted_as_if_decoded_here(shared):
    model = random_chat_gpt("E")  # E: the adopted row's last token is the one remembered
    engine = Engine(model, ByteTokenizer())
    engine.shared_prefix = shared
    warm = WarmCache(engine)
    prompt = list(range(70, 90))
    reply = _sample_rows(engine, warm, prompt, 3, 6)[2]
    assert isinstance(warm.rows, SharedPrefixCache) == shared
    assert warm.tokens == prompt  # forking changed nothing
    assert warm.adopt(2, reply) == len(reply) - 1  # the last was never run
    assert warm.tokens == prompt + reply[:-1] and warm.cache.get_pos() == len(warm.tokens)
    following = [*prompt, *reply, 5]
    logits, n = warm.prefill(following)
    assert n == 2
    torch.testing.assert_close(logits, fresh_logits(model, following), atol=2e-5, rtol=0)


def test_a_row_the_fork_does_not_have_is_refused():
    engine = Engine(random_chat_gpt("E"), ByteTokenizer())
    warm = WarmCache(engine)
    prompt = list(range(40, 60))
    reply = _sample_rows(engine, warm, prompt, 2, 4)[0]
    with pytest.raises(ValueError, match="no row 2"):
        warm.adopt(2, reply)
    assert warm.tokens == prompt and warm.cache.get_pos() == len(prompt)


def test_rows_are_refused_once_the_cache_moved_on():
    engine = Engine(random_chat_gpt("E"), ByteTokenizer())
    warm = WarmCache(engine)
    reply = _sample_rows(engine, warm, list(range(40, 60)), 2, 4)[0]
    warm.prefill(list(range(40, 70)))  # the cache moved on past the rows' prompt
    with pytest.raises(ValueError, match="no sample rows"):
        warm.adopt(0, reply)
    assert warm.tokens == list(range(40, 70)) and warm.cache.get_pos() == 30


def test_a_prompt_goes_to_the_slot_it_carries_on_else_the_least_recently_used():
    engine = Engine(random_chat_gpt("A"), ByteTokenizer())
    a, b, c = slots = [WarmCache(engine) for _ in range(3)]
    assert choose(slots, [1, 2, 3]) is a and slots == [b, c, a]  # all empty: the oldest
    a.tokens = [1, 2, 3, 4, 5, 6]  # conversation A and its reply
    assert choose(slots, [1, 9, 9]) is b  # another conversation: not A's slot
    b.tokens = [1, 9, 9, 8]
    assert slots == [c, a, b]
    assert choose(slots, [1, 2, 3, 4, 5, 6, 7, 8]) is a  # A's next turn
    assert choose(slots, [1, 2, 3, 4, 0]) is a  # a retry of A's last turn: most of it
    assert choose(slots, [1, 9, 9, 8, 7]) is b
    assert slots == [c, a, b]
    # A prompt sharing less than half of what the best slot holds takes the oldest slot.
    assert choose(slots, [1, 2, 0]) is c


# ---- a server worker's requests ------------------------------------------------------------


def greedy(max_tokens: int) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, temperature=0.0, top_k=None, top_p=None, seed=1)


def reply_of(worker: Worker, prompt: list[int], max_tokens: int = 8, stop_after: int = 0):
    """The Finished of one request and the tokens the worker's cache took from it."""
    stop = threading.Event()
    emitted: list[object] = []

    def emit(events):
        emitted.extend(events)
        if stop_after and len(emitted) >= stop_after:
            stop.set()

    finished = worker.generate(prompt, greedy(max_tokens), emit, stop)
    return finished, worker.warm.tokens[len(prompt) :]


def test_a_worker_prefills_only_a_request_past_the_last_and_answers_as_a_fresh_one(
    reference_tokenizer,
):
    model = random_chat_gpt("E")
    warm = Worker(model, reference_tokenizer)
    first = list(range(60, 80))
    one, said = reply_of(warm, first)
    assert one.cached_tokens == 0 and one.completion_tokens == 8
    assert len(said) == 7  # the last token generated was never run
    nxt = first + said + [5, 6, 7]
    two, _ = reply_of(warm, nxt, max_tokens=12)
    assert two.cached_tokens == len(first) + len(said)
    cold = Worker(model, reference_tokenizer)
    fresh, _ = reply_of(cold, nxt, max_tokens=12)
    assert fresh.cached_tokens == 0
    assert warm.warm.tokens == cold.warm.tokens  # the same reply, token by token


def test_a_worker_s_interrupted_request_leaves_its_cache_as_far_as_it_ran(reference_tokenizer):
    model = random_chat_gpt("E")
    warm = Worker(model, reference_tokenizer)
    first = list(range(60, 80))
    _, said = reply_of(warm, first)
    interrupted, _ = reply_of(warm, first + said + [5, 6], max_tokens=30, stop_after=3)
    assert interrupted.finish_reason == "interrupted"
    assert interrupted.cached_tokens == len(first) + len(said)
    assert warm.warm.cache.get_pos() == len(warm.warm.tokens)
    nxt = first + said + [5, 6, 7]
    two, _ = reply_of(warm, nxt, max_tokens=12)
    assert two.cached_tokens == len(first) + len(said) + 2  # up to the new 7
    cold = Worker(model, reference_tokenizer)
    reply_of(cold, nxt, max_tokens=12)
    assert warm.warm.tokens == cold.warm.tokens


@pytest.mark.parametrize("slots", [1, 2])
def test_two_conversations_on_one_worker_keep_their_caches_with_two_slots(
    reference_tokenizer, slots
):
    worker = Worker(random_chat_gpt("E"), reference_tokenizer, cache_slots=slots)
    chats = {name: list(range(start, start + 20)) for name, start in (("a", 60), ("b", 120))}
    cached: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(2):
        for name in chats:
            finished, said = reply_of(worker, chats[name], max_tokens=4)
            cached[name].append(finished.cached_tokens)
            chats[name] = [*chats[name], *said, 7, 8]  # its reply and one more turn
    if slots == 2:  # each conversation's second request found its first in its own slot
        assert cached == {"a": [0, 23], "b": [0, 23]}
    else:  # one slot: each request found the other conversation there
        assert cached == {"a": [0, 0], "b": [0, 0]}
