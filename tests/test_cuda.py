"""The engine on a CUDA device: the same answers as the plain way, the CUDA graph in use, and
at most one host read a decode step. Skipped where torch sees no CUDA device (run them with
`pytest -m cuda` on a GPU machine)."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch
from builders import random_gpt
from reference import REFERENCE, needs_reference

from chatcli.bench import bench
from chatcli.bench.baseline import baseline_generate
from chatcli.chat.session import ChatSession, SamplingOptions
from chatcli.engine.engine import Engine
from chatcli.engine.static_step import CudaGraphStep, StaticDecodeStep, StepWithFallback
from chatcli.engine.warm_cache import WarmCache
from chatcli.model.checkpoint import load_model
from chatcli.model.kv_cache import KVCache, SharedPrefixCache

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = ("What is 1234*56?", "Tell me about the quick brown fox.", "How are you?")


def _embedded(dtype: str = "float32"):
    model, tokenizer, _ = load_model(None, device="cuda", dtype=dtype)
    return model, tokenizer


def _chat_prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.render_for_completion([{"role": "user", "content": text}])


def _greedy(engine: Engine, prompt: list[int], n: int = 40) -> list[int]:
    results, _ = engine.generate_batch(prompt, max_tokens=n, temperature=0.0, use_tools=False)
    return results[0][len(prompt) :]


def _baseline_greedy(model, tokenizer, prompt: list[int], n: int = 40) -> list[int]:
    stops = {tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()}
    out = []
    for column in baseline_generate(model, prompt, 1, n, 0.0):
        if column[0] in stops:
            break
        out.append(column[0])
    return out


def test_the_cuda_graph_decodes_what_the_plain_way_decodes_in_fp32():
    model, tokenizer = _embedded("float32")
    engine = Engine(model, tokenizer)
    assert isinstance(engine.decode_step, StepWithFallback)
    assert isinstance(engine.decode_step.fast, CudaGraphStep)
    for text in PROMPTS:
        prompt = _chat_prompt(tokenizer, text)
        assert _greedy(engine, prompt) == _baseline_greedy(model, tokenizer, prompt)
    assert engine.decode_step.fast is not None  # the graph held: nothing fell back


def test_bf16_on_the_gpu_runs_the_graph_and_stays_close_to_its_module_forward():
    model, tokenizer = _embedded("auto")
    if torch.cuda.get_device_capability() >= (8, 0):
        assert model.compute_dtype == torch.bfloat16
    step = CudaGraphStep(StaticDecodeStep(model))
    prompt = _chat_prompt(tokenizer, PROMPTS[0])
    c = model.config
    ours, theirs = (
        KVCache(
            1, c.n_kv_head, 256, c.head_dim, c.n_layer, device="cuda", dtype=model.compute_dtype
        )
        for _ in range(2)
    )
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        model(ids, kv_cache=ours)
        model(ids, kv_cache=theirs)
        token = ids[:, -1:]
        for _ in range(30):
            got = step(token, ours)
            want = model(token, kv_cache=theirs)[:, -1, :].float()
            torch.testing.assert_close(got, want, atol=0.2, rtol=0)
            token = want.argmax(dim=-1, keepdim=True)
    engine = Engine(model, tokenizer)
    reply = tokenizer.decode(_greedy(engine, prompt))
    assert reply.strip() and "\ufffd" not in reply
    assert engine.decode_step.fast is not None


def test_eight_greedy_samples_in_one_graph_each_equal_the_single_reply():
    model, tokenizer = _embedded("float32")
    engine = Engine(model, tokenizer)
    prompt = _chat_prompt(tokenizer, PROMPTS[1])
    prefix = engine.new_cache(1, len(prompt))
    with torch.inference_mode():
        engine.forward_last(torch.tensor([prompt], device="cuda"), prefix)
    rows = engine.fork(prefix, 8, 30)  # the prompt copied into plain rows: graph-capturable
    assert type(rows) is KVCache and rows.batch_size == 8
    single = _greedy(engine, prompt, 30)
    results, _ = engine.generate_batch(
        prompt, num_samples=8, max_tokens=30, temperature=0.0, use_tools=False
    )
    assert all(r[len(prompt) :] == single for r in results)
    assert engine.decode_step.fast is not None


def test_sampling_on_the_device_follows_the_seed():
    model, tokenizer = _embedded("float32")
    engine = Engine(model, tokenizer)
    prompt = _chat_prompt(tokenizer, PROMPTS[2])

    def draw(seed: int, **how) -> list[list[int]]:
        results, _ = engine.generate_batch(prompt, 4, max_tokens=24, seed=seed, **how)
        return results

    nucleus = {"temperature": 0.9, "top_k": 50, "top_p": 0.9}
    assert draw(7, **nucleus) == draw(7, **nucleus)
    first = draw(7, temperature=1.5)
    assert draw(7, temperature=1.5) == first
    assert draw(8, temperature=1.5) != first
    assert len({tuple(r) for r in first}) > 1  # the rows draw their own tokens


def test_a_decode_step_reads_the_host_at_most_once():
    model, tokenizer = _embedded("float32")
    engine = Engine(model, tokenizer)
    prompt = _chat_prompt(tokenizer, PROMPTS[1])
    for rows, temperature in ((1, 0.0), (1, 0.8), (4, 0.8)):
        steps = engine.generate(
            prompt, rows, max_tokens=40, temperature=temperature, top_k=40, use_tools=False
        )
        for _ in range(3):  # the graph's capture (which checks itself) is done by now
            next(steps)
        reads, seen = 0, 0
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(10):
                    next(steps)
                    seen += 1
            reads = sum("synchronizing" in str(w.message) for w in caught)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            steps.close()
        assert seen == 10 and 1 <= reads <= seen, (rows, temperature, reads)


def test_a_warm_cache_on_the_gpu_gives_a_fresh_prefill_s_logits():
    model, tokenizer = _embedded("float32")
    warm = WarmCache(Engine(model, tokenizer))
    first = _chat_prompt(tokenizer, PROMPTS[0])
    more = first + tokenizer.encode(" and then? ") + first[1:]
    for prompt in (first, more, first[:7] + more[-9:]):
        logits, _ = warm.prefill(prompt)
        with torch.inference_mode():
            fresh = model(torch.tensor([prompt], device="cuda"))[:, -1]
        torch.testing.assert_close(logits, fresh, atol=1e-4, rtol=0)


def test_a_chat_on_the_gpu_reuses_its_cache_and_answers_as_a_fresh_one():
    model, tokenizer = _embedded("float32")
    opts = SamplingOptions(temperature=0.0, top_k=None, max_tokens=16, seed=1, tools=True)
    kept = ChatSession(model, tokenizer, opts)
    replies = []
    for text in PROMPTS:
        for _ in kept.send(text):
            pass
        replies.append(kept.last_reply)
    assert kept.last_reply.stats.prefill_tokens < len(kept.prompt_tokens())
    fresh = ChatSession(model, tokenizer, opts)
    fresh.load_messages(kept.messages[:-1])
    for _ in fresh.regenerate():
        pass
    assert fresh.last_reply.text == replies[-1].text


@pytest.mark.parametrize("era", ["D", "E"])
def test_sample_rows_over_a_shared_prefix_match_copied_rows_on_the_gpu(era):
    model = random_gpt(era).cuda()
    c = model.config
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 190, (1, 60), generator=g).cuda()
    prefix = KVCache(1, c.n_kv_head, 60, c.head_dim, c.n_layer, device="cuda")
    copied = KVCache(3, c.n_kv_head, 80, c.head_dim, c.n_layer, device="cuda")
    with torch.inference_mode():
        model(ids, kv_cache=prefix)
        copied.prefill(prefix)
        shared = SharedPrefixCache(prefix, 3, 20)
        tokens = torch.randint(0, 190, (3, 10), generator=g).cuda()
        for t in range(10):
            got = model(tokens[:, t : t + 1], kv_cache=shared)[:, -1]
            want = model(tokens[:, t : t + 1], kv_cache=copied)[:, -1]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@needs_reference
@pytest.mark.parametrize("era", ["A", "E"])
def test_reference_checkpoints_on_the_gpu_match_nanochat(era):
    model, tokenizer, _ = load_model(REFERENCE / era, device="cuda", dtype="float32")
    expected = json.loads((REFERENCE / era / "expected.json").read_text())
    engine = Engine(model, tokenizer)
    for case in expected["cases"]:
        with torch.inference_mode():
            logits = model(torch.tensor([case["prompt"]], device="cuda"))[0]
        for pos, ref in zip(case["positions"], case["logits"], strict=True):
            torch.testing.assert_close(logits[pos].cpu(), torch.tensor(ref), atol=1e-4, rtol=0)
        want = case["greedy"]
        results, _ = engine.generate_batch(case["prompt"], max_tokens=len(want), temperature=0.0)
        assert results[0][len(case["prompt"]) :] == want


def test_the_bench_runs_on_the_gpu(monkeypatch):
    monkeypatch.setattr(bench, "REPEATS", 1)
    monkeypatch.setattr(bench, "MEASURE_SECONDS", 0.0)
    monkeypatch.setattr(bench, "CHAT_SECONDS", 0.0)
    monkeypatch.setattr(bench, "DECODE_TOKENS", 8)
    model, tokenizer = _embedded("float32")
    result = bench.run_bench(model, tokenizer, "embedded", precision="auto")
    assert result["device"].startswith("cuda") and result["device_name"]
    assert result["decode_path"] == "CUDA graph"
    assert result["greedy_identical_fp32"] is True
    assert result["peak_device_mb"] > 0 and result["bandwidth_gbs"] > 100
    assert result["decode_tps"]["ours"] > 0 and result["decode8_tps"]["ours"] > 0


def test_once_answers_on_the_gpu():
    done = subprocess.run(
        [sys.executable, "-m", "chatcli", "once", "--device", "cuda", "What is 1234*56?"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_a_gpu_worker_serves_what_the_engine_says():
    serving = pytest.importorskip("serving")  # the serve extra
    import httpx

    from chatcli.serve.app import Worker

    model, tokenizer = _embedded("float32")
    prompt = _chat_prompt(tokenizer, PROMPTS[2])
    want = tokenizer.decode(_greedy(Engine(model, tokenizer), prompt, 24))
    body = {
        "messages": [{"role": "user", "content": PROMPTS[2]}],
        "max_tokens": 24,
        "temperature": 0,
    }
    server = serving.serve_workers([Worker(model, tokenizer, name="0")])
    try:
        url = f"{server.url}/v1/chat/completions"
        whole = httpx.post(url, json=body, timeout=60).json()
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        stats = httpx.get(f"{server.url}/stats", timeout=10).json()
    finally:
        server.stop()
    assert whole["choices"][0]["message"]["content"] == want
    streamed = "".join(
        json.loads(e[6:])["choices"][0]["delta"].get("content") or ""
        for e in events
        if e != "data: [DONE]"
    )
    assert streamed == whole["choices"][0]["message"]["content"]
    assert events[-1] == "data: [DONE]"
    assert "cuda" in json.dumps(stats)
