"""Continuous batching: each row of a batch gives what its request gives alone, in every era,
on every decode path; rows join, leave and prefill in chunks between steps; a server with
--batch N answers N streams at once as one at a time would."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from builders import random_gpt
from fakes import DONE, SPECIAL_IDS, ByteTokenizer, SlotScriptedModel, tool_call, uniform_bytes
from serving import REFERENCE_E, byte_tokenizer, wait_until
from step_paths import NoStopsTokenizer, engine_on_path

from chatcli.engine.engine import Engine, GenerationStats
from chatcli.engine.scheduler import PREFILL_CHUNK, RowRequest, Scheduler, default_rows
from chatcli.engine.static_slots import SlotGraphs, buckets_for
from chatcli.errors import ContextOverflowError
from chatcli.kernels.build import unavailable_reason
from chatcli.kernels.rows_step import rows_step
from chatcli.kernels.rows_step_reference import slots_errors
from chatcli.model.checkpoint import load_model
from chatcli.model.gpt import ERAS
from chatcli.model.slot_cache import SlotRows
from chatcli.model.special_tokens import OUTPUT_END, OUTPUT_START
from chatcli.serve.app import Limits, Worker, create_app
from chatcli.serve.replies import GenerationParams
from chatcli.serve.runner import BackgroundServer

BYTES = ByteTokenizer()


def _alone(engine: Engine, request: RowRequest) -> tuple[list[int], list[int], str]:
    """The request through Engine.generate on its own: (tokens, masks, finish reason)."""
    stats = GenerationStats()
    tokens, masks = [], []
    for column, column_masks in engine.generate(
        request.tokens,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=request.top_p,
        seed=request.seed,
        use_tools=request.use_tools,
        stats=stats,
    ):
        tokens.append(column[0])
        masks.append(column_masks[0])
    return tokens, masks, stats.finish_reasons[0]


def _run(batch: Scheduler, requests: list[RowRequest], join_at: list[int] | None = None):
    """Join each request at its step (join_at, 0 for all at once) and step to the end:
    each row's (tokens, masks) and the rows, in request order."""
    join_at = join_at or [0] * len(requests)
    produced: dict[int, tuple[list[int], list[int]]] = {}
    rows = [None] * len(requests)
    step = 0
    while step <= max(join_at) or batch.running:
        for i, at in enumerate(join_at):
            if at == step:
                rows[i] = batch.join(requests[i])
        for row, token, mask in batch.step().tokens:
            tokens, masks = produced.setdefault(id(row), ([], []))
            tokens.append(token)
            masks.append(mask)
        step += 1
    return [produced.get(id(r), ([], [])) for r in rows], rows


def _requests(prompts: list[list[int]], max_tokens: int = 30) -> list[RowRequest]:
    """Greedy and sampled rows, top-k and top-p among them, each its own seed."""
    settings = [
        {"temperature": 0.0},
        {"temperature": 0.9, "seed": 7},
        {"temperature": 0.7, "top_k": 20, "seed": 8},
        {"temperature": 1.0, "top_p": 0.8, "seed": 9},
    ]
    return [
        RowRequest(p, max_tokens=max_tokens, **settings[i % len(settings)])
        for i, p in enumerate(prompts)
    ]


def _prompts(lengths: list[int], seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 190, (n,), generator=g).tolist() for n in lengths]


# ---- every row is its request alone -----------------------------------------------------------


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("era", list(ERAS))
def test_each_row_of_a_batch_is_what_its_request_gives_alone(era, path):
    # Prompts of 5 to 150 tokens: the long one crosses the 128-token short windows while it
    # decodes; rows join at different steps, so no two are at one position.
    model = random_gpt(era)
    requests = _requests(_prompts([5, 40, 150, 17, 90]), max_tokens=40)
    want = [_alone(Engine(model, NoStopsTokenizer()), r)[:2] for r in requests]
    batch = Scheduler(engine_on_path(model, path), rows=5, prefill_chunk=32)
    got, rows = _run(batch, requests, join_at=[0, 0, 3, 7, 8])
    assert got == [tuple(w) for w in want]
    assert [r.finish_reason for r in rows] == ["length"] * 5


@pytest.mark.parametrize("path", ["forward", "module", "static"])
@pytest.mark.parametrize("era", ["A", "E"])
def test_the_other_decode_paths_give_each_row_its_own_tokens(era, path):
    model = random_gpt(era)
    requests = _requests(_prompts([12, 140, 30]), max_tokens=24)
    want = [_alone(Engine(model, NoStopsTokenizer()), r)[:2] for r in requests]
    got, _ = _run(
        Scheduler(engine_on_path(model, path), rows=3, prefill_chunk=50), requests, [0, 2, 5]
    )
    assert got == [tuple(w) for w in want]


def test_the_kernels_slot_rows_equal_each_row_stepped_alone():
    kernel = rows_step()
    if kernel is None:
        pytest.skip(f"no native kernel: {unavailable_reason('rows_step')}")
    assert kernel.has_slots
    for threads in (1, 2):
        assert max(slots_errors(kernel, threads=threads)) < 1e-5
    # Eight rows in scrambled slots, a window of 3 cutting into some of them.
    errors = slots_errors(
        kernel, slots=(5, 0, 7, 2, 1, 6, 3, 4), positions=(9, 1, 4, 12, 3, 7, 2, 10)
    )
    assert max(errors) < 1e-5


def test_the_kernels_prompt_rows_read_the_keys_the_rows_before_them_wrote():
    kernel = rows_step()
    if kernel is None:
        pytest.skip(f"no native kernel: {unavailable_reason('rows_step')}")
    # A prompt's ten tokens in slot 0 from its start, one continuing in slot 2 and a reply's
    # token in slot 1; logits for the reply and each prompt's last token only.
    slots = (1, *[0] * 10, 2, 2, 2)
    positions = (6, *range(10), 4, 5, 6)
    for threads in (1, 2):
        errors = slots_errors(
            kernel, slots=slots, positions=positions, out=(0, 10, 13), threads=threads
        )
        assert max(errors) < 1e-5


def test_the_kernels_prompt_rows_that_end_no_prompt_ask_for_no_logits():
    # A first chunk of a long prompt alone in the step: its keys and values are written and
    # no row wants logits (the default server answered 500 here: "logits of rows [] of 64").
    kernel = rows_step()
    if kernel is None:
        pytest.skip(f"no native kernel: {unavailable_reason('rows_step')}")
    for threads in (1, 2):
        errors = slots_errors(
            kernel, slots=(0,) * 8, positions=tuple(range(8)), out=(), threads=threads
        )
        assert max(errors) < 1e-5


def test_the_kernels_embedding_leaves_a_sequences_first_token_unsmeared():
    kernel = rows_step()
    if kernel is None or not kernel.embeds(torch.empty(1, 1)):
        pytest.skip("no native embedding")
    g = torch.Generator().manual_seed(1)
    table, gate = torch.randn(50, 40, generator=g), torch.randn(24, generator=g) * 0.3
    ids, prev = torch.tensor([3, 7, 9]), torch.tensor([-1, 4, -1])
    got = kernel.embed(table, ids, 1e-6, prev, gate, 0.7)
    plain = kernel.embed(table, ids, 1e-6)
    smeared = kernel.embed(table, ids[1:2], 1e-6, prev[1:2], gate, 0.7)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[2], plain[2])
    assert torch.equal(got[1], smeared[0]) and not torch.equal(got[1], plain[1])
    with pytest.raises(IndexError):
        kernel.embed(table, ids, 1e-6, torch.tensor([-2, 4, 4]), gate, 0.7)


def test_slot_graphs_pad_to_a_bucket_and_give_the_models_logits():
    # The CUDA graphs' bookkeeping, run eagerly on the CPU: three rows take the bucket of
    # four, the fourth repeating the third, which writes nothing anywhere else.
    assert buckets_for(1) == [1]
    assert buckets_for(6) == [1, 2, 4, 6]
    assert buckets_for(16) == [1, 2, 4, 8, 16]
    model = random_gpt("E")
    engine = engine_on_path(model, "static")
    cache = engine.new_slot_cache(6)
    graphs = SlotGraphs(engine.decode_step, cache, capture=False)
    prompts = _prompts([7, 30, 19])
    slots = [4, 0, 2]
    for slot, prompt in zip(slots, prompts, strict=True):
        model(torch.tensor([prompt]), kv_cache=cache.slots[slot])
    untouched = [cache.k_cache[:, s].clone() for s in (1, 3, 5)]
    ids = torch.tensor([[11], [12], [13]])
    got = graphs(ids, SlotRows(cache, slots))
    assert sorted(graphs.buckets) == [4]
    for i, prompt in enumerate(prompts):
        want = model(torch.tensor([[*prompt, 11 + i]]))[0, -1]
        torch.testing.assert_close(got[i], want, atol=2e-5, rtol=0)
        assert cache.slots[slots[i]].get_pos() == len(prompt) + 1
    for s, before in zip((1, 3, 5), untouched, strict=True):
        assert torch.equal(cache.k_cache[:, s], before)
    graphs(ids[:1], SlotRows(cache, slots[:1]))  # one row: the bucket of one, made now
    assert sorted(graphs.buckets) == [1, 4]


# ---- joining, leaving, chunks ----------------------------------------------------------------


def test_a_finished_row_frees_its_slot_at_once_for_the_next_request():
    model = random_gpt("E")
    engine = engine_on_path(model, "kernel" if rows_step() else "torch")
    batch = Scheduler(engine, rows=2, prefill_chunk=64)
    short, long_, late = _requests(_prompts([10, 20, 15]), max_tokens=30)
    short = RowRequest(short.tokens, max_tokens=3)
    first = batch.join(short)
    second = batch.join(long_)
    assert batch.free_rows == 0
    with pytest.raises(RuntimeError, match="full"):
        batch.join(late)
    steps = 0
    while not first.done:
        batch.step()
        steps += 1
    assert steps == 3 and first.finish_reason == "length"
    assert batch.free_rows == 1 and not second.done  # freed within the step it ended
    third = batch.join(late)
    assert third.slot == first.slot  # the free one
    while batch.running:
        batch.step()
    for row, request in [(first, short), (second, long_), (third, late)]:
        assert row.tokens == _alone(Engine(model, NoStopsTokenizer()), request)[0]


def test_a_row_that_leaves_mid_decode_stops_there_and_the_others_go_on():
    # A client that disconnects: its row leaves between steps, its slot holds what it wrote.
    model = random_gpt("D")
    engine = engine_on_path(model, "kernel" if rows_step() else "torch")
    requests = _requests(_prompts([25, 8, 60]), max_tokens=20)
    batch = Scheduler(engine, rows=3)
    rows = [batch.join(r) for r in requests]
    for _ in range(6):
        batch.step()
    gone = rows[1]
    batch.leave(gone)
    assert gone.done and gone.finish_reason == "interrupted" and batch.free_rows == 1
    written = gone.warm.cache.get_pos()
    assert gone.warm.tokens == (requests[1].tokens + gone.tokens)[:written]
    assert written == len(requests[1].tokens) + len(gone.tokens) - 1  # the last never ran
    while batch.running:
        batch.step()
    for i in (0, 2):
        assert rows[i].tokens == _alone(Engine(model, NoStopsTokenizer()), requests[i])[0]
    alone = _alone(Engine(model, NoStopsTokenizer()), requests[1])[0]
    assert len(gone.tokens) == 6 and gone.tokens == alone[:6]  # its first came at step one


def test_a_long_prompt_prefills_in_chunks_while_the_running_rows_keep_decoding():
    model = random_gpt("E", sequence_len=512)
    engine = engine_on_path(model, "kernel" if rows_step() else "torch")
    running, long_ = _requests(_prompts([12, 300]), max_tokens=60)
    long_ = RowRequest(long_.tokens, max_tokens=10, temperature=0.0)
    batch = Scheduler(engine, rows=2, prefill_chunk=32)
    first = batch.join(running)
    batch.step()  # its prompt
    batch.step()
    joined = batch.join(long_)
    chunks = 0
    while not joined.tokens:
        stepped = batch.step()
        chunks += 1
        # Every step of the long prefill also gave the running row its next token.
        assert [row for row, _, _ in stepped.tokens if row is first] == [first]
    assert chunks == -(-300 // 32)  # ten chunks: 9 of 32 and one of 12
    assert joined.stats.prefill_tokens == 300
    while batch.running:
        batch.step()
    assert first.tokens == _alone(Engine(model, NoStopsTokenizer()), running)[0]
    assert joined.tokens == _alone(Engine(model, NoStopsTokenizer()), long_)[0]


def test_a_slot_keeps_its_conversation_warm_for_the_next_turn():
    model = random_gpt("E")
    engine = engine_on_path(model, "kernel" if rows_step() else "torch")
    batch = Scheduler(engine, rows=2, slots=3)
    one, other = _prompts([40, 30])
    first, _ = _run(batch, [RowRequest(one, max_tokens=8, temperature=0.0)])
    # Another conversation in between: it takes another slot, the first stays warm.
    _run(batch, [RowRequest(other, max_tokens=8, temperature=0.0)])
    turn_two = [*one, *first[0][0], 5, 6, 7]
    request = RowRequest(turn_two, max_tokens=8, temperature=0.0)
    got, rows = _run(batch, [request])
    # Every token the first turn ran is reused: its prompt and all but its reply's last.
    assert rows[0].stats.prefill_tokens == len(turn_two) - (len(one) + 7)
    assert got[0][0] == _alone(Engine(model, NoStopsTokenizer()), request)[0]


def test_a_calculator_call_forces_its_result_in_that_row_only():
    # Both rows make the same call; only the first runs its tools.
    def engine() -> Engine:
        return Engine(SlotScriptedModel(tool_call("12*7", DONE)), BYTES)

    requests = [
        RowRequest(BYTES.encode("calc please"), max_tokens=30, temperature=0.0),
        RowRequest(BYTES.encode("no tools"), max_tokens=30, temperature=0.0, use_tools=False),
    ]
    got, rows = _run(Scheduler(engine(), rows=2), requests, join_at=[0, 2])
    tokens, masks = got[0]
    start, end = tokens.index(SPECIAL_IDS[OUTPUT_START]), tokens.index(SPECIAL_IDS[OUTPUT_END])
    assert BYTES.decode(tokens[start + 1 : end]) == "84"
    assert masks[start : end + 1] == [0] * (end + 1 - start)
    assert SPECIAL_IDS[OUTPUT_START] not in got[1][0] and set(got[1][1]) == {1}
    for (tokens, masks), row, request in zip(got, rows, requests, strict=True):
        assert (tokens, masks, row.finish_reason) == _alone(engine(), request)
        assert row.finish_reason == "stop" and tokens[-1] == DONE[-1]


def test_a_result_queued_at_the_budget_is_written_whole_as_alone():
    model = SlotScriptedModel(tool_call("12*7", DONE))
    request = RowRequest(BYTES.encode("go"), max_tokens=7, temperature=0.0)  # the call's end
    got, rows = _run(Scheduler(Engine(model, BYTES), rows=1), [request])
    alone = _alone(Engine(SlotScriptedModel(tool_call("12*7", DONE)), BYTES), request)
    assert got[0] == (alone[0], alone[1])
    assert rows[0].finish_reason == alone[2] == "length"
    assert BYTES.decode(got[0][0]).endswith("84<|output_end|>")


def test_max_tokens_zero_prefills_and_yields_nothing_and_a_full_context_is_refused():
    model = random_gpt("E")
    batch = Scheduler(engine_on_path(model, "torch"), rows=2)
    got, rows = _run(batch, [RowRequest(_prompts([9])[0], max_tokens=0)])
    assert got == [([], [])] and rows[0].finish_reason == "length"
    assert rows[0].warm.tokens == rows[0].request.tokens  # the prompt is in its slot
    with pytest.raises(ContextOverflowError):
        batch.join(RowRequest(list(range(10)) * 26))  # 260 tokens in a context of 256
    assert batch.free_rows == 2


# ---- long first prompts: more than one prefill chunk, alone and under load -------------------

# Around the default chunk (64): one token, one short, exactly one chunk, one over, several
# chunks, and a prompt that leaves room for the reply only (random_gpt's context is 256).
FIRST_PROMPTS = [1, 63, 64, 65, 200, 256 - 12]
STEP_PATHS = ["kernel", "torch", "forward", "module", "static"]


@pytest.mark.parametrize("path", STEP_PATHS)
def test_a_long_first_prompt_alone_gives_what_it_gives_alone(path):
    # Each prompt the only row, in a fresh batch at the default chunk: no row decodes while
    # its first chunks run, so those chunks want no logits.
    model = random_gpt("E")
    engine = engine_on_path(model, path)
    for request in _requests(_prompts(FIRST_PROMPTS), max_tokens=10):
        batch = Scheduler(engine, rows=4)
        assert batch.prefill_chunk == PREFILL_CHUNK
        got, rows = _run(batch, [request])
        want = _alone(Engine(model, NoStopsTokenizer()), request)
        assert (*got[0], rows[0].finish_reason) == want
        assert rows[0].stats.prefill_tokens == len(request.tokens)


@pytest.mark.parametrize("path", STEP_PATHS)
def test_long_first_prompts_under_load_give_what_they_give_alone(path):
    # Every length joins while other rows decode, and two long ones at once (their chunks
    # share a step); each row's tokens are its request's alone.
    model = random_gpt("E")
    requests = _requests(_prompts([5, 9, *FIRST_PROMPTS]), max_tokens=10)
    want = [_alone(Engine(model, NoStopsTokenizer()), r)[:2] for r in requests]
    batch = Scheduler(engine_on_path(model, path), rows=len(requests))
    got, _ = _run(batch, requests, join_at=[0, 0, 2, 2, 3, 4, 4, 6])
    assert got == [tuple(w) for w in want]


def test_a_conversation_whose_slot_another_took_prefills_again_from_its_start():
    # One slot: the second client's long prompt evicts the first conversation, whose next
    # turn then prefills all of its 200 tokens again, in chunks, with no row decoding.
    model = random_gpt("E")
    engine = engine_on_path(model, "kernel" if rows_step() else "torch")
    batch = Scheduler(engine, rows=1, slots=1)
    first, other = _requests(_prompts([70, 130]), max_tokens=8)
    [(reply, _)], _ = _run(batch, [first])
    _run(batch, [other])
    follow_up = RowRequest(first.tokens + reply + _prompts([122], seed=9)[0], max_tokens=8)
    got, rows = _run(batch, [follow_up])
    assert rows[0].stats.prefill_tokens == len(follow_up.tokens) == 200
    assert got[0] == _alone(Engine(model, NoStopsTokenizer()), follow_up)[:2]


# ---- the embedded model ---------------------------------------------------------------------


def test_eight_conversations_of_the_embedded_model_each_decode_as_alone():
    model, tokenizer, _ = load_model(None, device="cpu")
    engine = Engine(model, tokenizer)
    texts = ["What is 12*34?", "Tell me a story.", "Hi!", "Why is the sky blue?"] * 2
    prompts = [tokenizer.render_for_completion([{"role": "user", "content": t}]) for t in texts]
    requests = [
        RowRequest(p, max_tokens=40, temperature=0.0 if i < 4 else 0.8, top_k=50, seed=i)
        for i, p in enumerate(prompts)
    ]
    got, rows = _run(Scheduler(engine, rows=8), requests, join_at=[0, 0, 1, 2, 2, 3, 5, 8])
    for (tokens, masks), row, request in zip(got, rows, requests, strict=True):
        want = _alone(Engine(model, tokenizer), request)
        assert (tokens, masks, row.finish_reason) == want


def test_a_server_worker_batches_by_default_on_the_cpu():
    assert default_rows("cpu") == 8
    assert default_rows("cuda:0") == 16


# ---- the server -------------------------------------------------------------------------------


def _stream(url: str, body: dict) -> tuple[str, dict]:
    """A streamed reply's text and its usage."""
    text, usage = "", {}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk
            text += chunk["choices"][0]["delta"].get("content", "") if chunk["choices"] else ""
            usage = chunk.get("usage") or usage
    return text, usage


def _serving(workers: list[Worker], limits: Limits | None = None) -> BackgroundServer:
    """A server over `workers`, for a with block (started as the block opens)."""
    return BackgroundServer(create_app(workers, limits or Limits(), "batched"))


def _reference_worker(batch: int) -> Worker:
    if not REFERENCE_E.is_dir():
        pytest.skip(f"reference fixture not found at {REFERENCE_E}")
    model, tokenizer, _ = load_model(REFERENCE_E, device="cpu")
    return Worker(model, tokenizer, name="0", batch=batch)


def _at_once(url: str, bodies: list[dict], worker: Worker) -> tuple[list, int]:
    """Every body streamed at once, each from its own thread: the (text, usage) of each, and
    the most rows the worker had in use meanwhile."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(_stream, url, body) for body in bodies]
        most = 0
        while not all(f.done() for f in futures):
            most = max(most, worker.rows_in_use)
            time.sleep(0.002)
        return [f.result() for f in futures], most


def test_a_batched_server_answers_n_streams_at_once_as_one_at_a_time_does():
    bodies = [
        {
            "messages": [{"role": "user", "content": f"Question {i}: what is {i}+{i}?"}],
            "max_tokens": 24,
            "temperature": 0.0 if i % 2 else 0.9,
            "seed": i,
        }
        for i in range(4)
    ]
    answers = {}
    for batch in (1, 4):
        worker = _reference_worker(batch)
        with _serving([worker]) as server:
            answers[batch], most = _at_once(server.url, bodies, worker)
            stats = httpx.get(f"{server.url}/stats").json()
        assert 1 <= most <= batch
        assert stats["rows"] == batch and stats["workers"][0]["rows"] == batch
        assert stats["rows_in_use"] == 0 and stats["requests_served"] == 4
    assert [text for text, _ in answers[4]] == [text for text, _ in answers[1]]
    assert [u["completion_tokens"] for _, u in answers[4]] == [
        u["completion_tokens"] for _, u in answers[1]
    ]


def test_a_batched_worker_decodes_its_streams_together():
    worker = Worker(SlotScriptedModel(uniform_bytes, delay=0.005), byte_tokenizer(), batch=4)
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 40}
    steps = []
    step = worker.scheduler.step

    def counted():
        steps.append(len(worker.scheduler.running))
        return step()

    worker.scheduler.step = counted
    with _serving([worker]) as server:
        results, most = _at_once(server.url, [body] * 4, worker)
    assert most == 4 and max(steps) == 4
    assert [usage["completion_tokens"] for _, usage in results] == [40] * 4
    # Four replies of 40 tokens in about 40 steps of four rows, not 160 of one.
    assert len(steps) < 80


def test_a_disconnect_mid_batch_frees_its_row_and_the_others_finish():
    model = SlotScriptedModel(uniform_bytes, delay=0.01)
    worker = Worker(model, byte_tokenizer(), batch=3)
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 40, "seed": 1}
    with _serving([worker]) as server, ThreadPoolExecutor(2) as pool:
        others = [pool.submit(_stream, server.url, body) for _ in range(2)]
        with httpx.stream(
            "POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=30
        ) as response:
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 4:
                    break  # leave mid-reply: the connection closes
        assert wait_until(lambda: worker.requests_interrupted == 1, timeout=10)
        assert [f.result(30)[1]["completion_tokens"] for f in others] == [40, 40]
        assert wait_until(lambda: worker.rows_in_use == 0)
        assert worker.requests_served == 2


def test_a_failed_step_fails_the_rows_in_it_and_the_worker_goes_on():
    calls = {"n": 0}

    def breaks_once(generated: list[int]) -> int:
        calls["n"] += 1
        if calls["n"] == 12:
            raise RuntimeError("the model broke")
        return ord("a")

    worker = Worker(SlotScriptedModel(breaks_once), byte_tokenizer(), batch=2)
    params = GenerationParams(max_tokens=10, temperature=0.0, top_k=None, top_p=None, seed=0)
    prompt = byte_tokenizer().encode("go")

    def generate():
        return worker.generate(prompt, params, lambda events: None, threading.Event())

    with ThreadPoolExecutor(2) as pool:
        first = [pool.submit(generate) for _ in range(2)]
        errors = [e for e in (f.exception(30) for f in first) if e is not None]
    # Every row in the broken step failed with its error (a row done before it did not).
    assert errors and all(str(e) == "the model broke" for e in errors)
    assert generate().completion_tokens == 10  # the next request runs as usual


def test_the_queue_and_its_429_count_rows():
    model = SlotScriptedModel(uniform_bytes, delay=0.02)
    worker = Worker(model, byte_tokenizer(), batch=2)
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 30}
    with _serving([worker], Limits(max_queue=1)) as server, ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(_stream, server.url, body) for _ in range(3)]
        assert wait_until(
            lambda: httpx.get(f"{server.url}/stats").json()["queue_length"] == 1, timeout=10
        )
        stats = httpx.get(f"{server.url}/stats").json()
        assert stats["rows_in_use"] == 2 and stats["busy"] == 1
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
        assert refused.status_code == 429
        assert [f.result(30)[1]["completion_tokens"] for f in streams] == [30, 30, 30]
