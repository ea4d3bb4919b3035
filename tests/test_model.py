"""The GPT against the reference fixtures, and its cached path against its full forward."""

from __future__ import annotations

import json

import pytest
import torch
from builders import random_gpt
from reference import REFERENCE, needs_reference

from chatcli.engine.engine import Engine
from chatcli.kernels.rows_step import rows_step
from chatcli.model.attention import _visible_cached, attend
from chatcli.model.checkpoint import load_model
from chatcli.model.gpt import ERAS, GPT, GPTConfig, infer_era, window_sizes
from chatcli.model.kv_cache import KVCache
from chatcli.model.special_tokens import ASSISTANT_END

FIXTURES = REFERENCE
needs_fixtures = needs_reference


def _expected(era: str) -> dict:
    return json.loads((FIXTURES / era / "expected.json").read_text())


@needs_fixtures
@pytest.mark.parametrize("era", ["A", "E"])
def test_reference_logits_match_within_1e4(era):
    model, _, _ = load_model(FIXTURES / era, device="cpu")
    assert model.arch.era == era
    for case in _expected(era)["cases"]:
        logits = model(torch.tensor([case["prompt"]]))[0]
        for pos, ref in zip(case["positions"], case["logits"], strict=True):
            torch.testing.assert_close(logits[pos], torch.tensor(ref), atol=1e-4, rtol=0)


def _greedy_until_end(tokens, tokenizer, n):
    stop = {tokenizer.encode_special(ASSISTANT_END), tokenizer.get_bos_token_id()}
    out = []
    for t in tokens:
        if t in stop or len(out) == n:
            break
        out.append(t)
    return out


@needs_fixtures
@pytest.mark.parametrize("era", ["A", "E"])
def test_reference_greedy_continuations_identical(era):
    model, tokenizer, _ = load_model(FIXTURES / era, device="cpu")
    engine = Engine(model, tokenizer)
    for case in _expected(era)["cases"]:
        want = case["greedy"]
        uncached = _greedy_until_end(
            model.generate(case["prompt"], max_tokens=len(want) + 1, temperature=0.0),
            tokenizer,
            len(want),
        )
        assert uncached == want
        results, _ = engine.generate_batch(case["prompt"], max_tokens=len(want), temperature=0.0)
        assert results[0][len(case["prompt"]) :] == want


@pytest.mark.parametrize("era", list(ERAS))
def test_era_is_inferred_from_weights_alone(era):
    model = random_gpt(era)
    assert infer_era(model.state_dict(), model.config) == era


@pytest.mark.parametrize("era", list(ERAS))
def test_cached_greedy_equals_uncached_reference_past_the_short_window(era):
    model = random_gpt(era)
    short = min(window_sizes(model.config, model.arch))
    if era != "A":
        assert short < model.config.sequence_len  # windows are really exercised
    g = torch.Generator().manual_seed(1)
    length = min(short + 20, model.config.sequence_len - 30)
    prompt = torch.randint(0, 190, (length,), generator=g).tolist()
    want = list(model.generate(prompt, max_tokens=24, temperature=0.0))
    engine = Engine(model, _NoStopTokenizer())
    got = [col[0] for col, _ in engine.generate(prompt, max_tokens=24, temperature=0.0)]
    assert got == want


@pytest.mark.parametrize("era", list(ERAS))
def test_chunks_appended_to_a_nonempty_cache_equal_the_full_forward(era):
    model = random_gpt(era)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 190, (1, 200), generator=g)
    full = model(ids)
    cache = KVCache(1, 2, 256, 16, 4)
    pieces = []
    for a, b in [(0, 37), (37, 38), (38, 150), (150, 151), (151, 200)]:
        pieces.append(model(ids[:, a:b], kv_cache=cache))
        assert cache.get_pos() == b
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=2e-5, rtol=0)


def test_batched_rows_decode_like_single_rows():
    model = random_gpt("E")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 190, (3, 40), generator=g)
    cache = KVCache(3, 2, 64, 16, 4)
    model(ids[:, :30], kv_cache=cache)
    step = model(ids[:, 30:31], kv_cache=cache)[:, -1]
    torch.testing.assert_close(step, model(ids[:, :31])[:, -1], atol=2e-5, rtol=0)


def test_window_pattern_is_tiled_and_the_last_layer_is_long():
    config = GPTConfig(2048, 100, 6, 4, 4, 64, window_pattern="SSL")
    assert window_sizes(config, ERAS["E"]) == [512, 512, 2048, 512, 512, 2048]
    assert window_sizes(config, ERAS["D"]) == [768, 768, 2048, 768, 768, 2048]
    assert window_sizes(config, ERAS["B"]) == [1024, 1024, 2048, 1024, 1024, 2048]
    config = GPTConfig(2048, 100, 4, 4, 4, 64, window_pattern="S")
    assert window_sizes(config, ERAS["E"])[-1] == 2048
    assert window_sizes(config, ERAS["A"]) == [2048] * 4


@pytest.mark.parametrize("era", ["A", "E"])
def test_rotary_tables_are_the_references_bit_for_bit(era):
    # nanochat computes 1 / base**(c/hd). base**(-c/hd) differs in the last bit for some
    # channels, and after era A's bf16 rounding whole table entries move (head_dim 128, the
    # released d20/d32, from position 104): a small model's 16 channels never show it.
    config = GPTConfig(2048, 100, 1, 1, 1, 128)
    model = GPT(config, ERAS[era])
    model.init_rotary()
    base = ERAS[era].rope_base
    inv_freq = 1.0 / (base ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    angles = torch.outer(torch.arange(20480, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    if ERAS[era].rope_tables_bf16:
        cos, sin = cos.bfloat16().float(), sin.bfloat16().float()
    assert torch.equal(model.cos[0, :, 0], cos)
    assert torch.equal(model.sin[0, :, 0], sin)


def test_forward_refuses_positions_past_the_rotary_tables():
    model = random_gpt("E", sequence_len=16)
    cache = KVCache(1, 2, 200, 16, 4)
    model(torch.zeros(1, 150, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="exceeds"):
        model(torch.zeros(1, 20, dtype=torch.long), kv_cache=cache)


class _NoStopTokenizer:
    """Special ids outside the random models' 200-token vocab, so nothing stops early."""

    def encode(self, text, prepend=None):
        return list(text.encode())

    def decode(self, ids):
        return bytes(i % 256 for i in ids).decode(errors="replace")

    def encode_special(self, name):
        return 1000 + hash(name) % 100

    def get_bos_token_id(self):
        return 999


@pytest.mark.parametrize("era", ["A", "C", "E"])
def test_shared_prefix_decode_equals_per_row_copies(era):
    from chatcli.model.kv_cache import SharedPrefixCache

    model = random_gpt(era)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 190, (1, 150), generator=g)  # longer than the short window
    rows = torch.randint(0, 190, (3, 6), generator=g)
    prefix = KVCache(1, 2, 150, 16, 4)
    copies = KVCache(3, 2, 160, 16, 4)
    first = model(prompt, kv_cache=prefix)
    copies.prefill(prefix)
    shared = SharedPrefixCache(prefix, 3, 10)
    for t in range(rows.size(1)):
        a = model(rows[:, t : t + 1], kv_cache=shared)
        b = model(rows[:, t : t + 1], kv_cache=copies)
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
        assert shared.get_pos() == copies.get_pos() == 151 + t
    full = model(torch.cat([prompt.expand(3, -1), rows], dim=1))[:, -1]
    torch.testing.assert_close(a[:, -1], full, atol=2e-5, rtol=0)
    assert first.shape == (1, 150, 200)


def test_shared_prefix_decode_after_the_window_leaves_the_prompt():
    from chatcli.model.kv_cache import SharedPrefixCache

    model = random_gpt("E")  # short windows of 128 positions
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, 190, (1, 10), generator=g)
    rows = torch.randint(0, 190, (2, 150), generator=g)
    prefix, copies = KVCache(1, 2, 10, 16, 4), KVCache(2, 2, 160, 16, 4)
    model(prompt, kv_cache=prefix)
    copies.prefill(prefix)
    shared = SharedPrefixCache(prefix, 2, 150)
    for t in range(rows.size(1)):  # from step 129 on, short layers see no prompt at all
        a = model(rows[:, t : t + 1], kv_cache=shared)
        b = model(rows[:, t : t + 1], kv_cache=copies)
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


def test_engine_samples_match_with_and_without_a_shared_prefix():
    model = random_gpt("E")
    engine = Engine(model, _NoStopTokenizer())
    prompt = list(range(1, 140))
    shared = engine.generate_batch(prompt, num_samples=4, max_tokens=12, temperature=1.0, seed=3)
    engine.shared_prefix = False
    copied = engine.generate_batch(prompt, num_samples=4, max_tokens=12, temperature=1.0, seed=3)
    assert shared == copied


@needs_fixtures
@pytest.mark.slow
def test_compiled_engine_gives_the_eager_greedy_output(monkeypatch):
    import shutil

    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("torch.compile on CPU needs a C compiler")
    model, tokenizer, _ = load_model(FIXTURES / "E", device="cpu")
    case = _expected("E")["cases"][1]  # the long prompt: past the short window
    n = len(case["greedy"])
    eager, _ = Engine(model, tokenizer).generate_batch(
        case["prompt"], max_tokens=n, temperature=0.0
    )
    # A small fp32 model keeps the fused step even with compile=True (it is faster); a big
    # one (pretend this one is) keeps it where our kernel runs its step, and else compiles
    # its forward.
    assert Engine(model, tokenizer, compile=True).decode_step is not None
    assert Engine(model, tokenizer).decode_step is not None
    monkeypatch.setattr("chatcli.engine.step_choice.SMALL_MODEL_PARAMS", 0)
    kernel = Engine(model, tokenizer, compile=True).decode_step
    assert (kernel is not None) == (rows_step() is not None)
    monkeypatch.setattr("chatcli.engine.decode_step.rows_step", lambda: None)  # no kernel here
    compiled_engine = Engine(model, tokenizer, compile=True)
    assert compiled_engine.decode_step is None
    with _no_fallback_warning():  # the compiled path really ran
        fast, _ = compiled_engine.generate_batch(case["prompt"], max_tokens=n, temperature=0.0)
    assert fast == eager
    assert fast[0][len(case["prompt"]) :] == case["greedy"]


def _no_fallback_warning():
    import contextlib
    import warnings

    @contextlib.contextmanager
    def check():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        assert not [w for w in caught if "torch.compile failed" in str(w.message)]

    return check()


@pytest.mark.parametrize(
    ("kind", "atol"),
    [
        ("float16", 0.01),
        ("float16-torch-mv", 0.01),
        ("bfloat16", 0.05),
        ("int8", 0.1),
        ("int4", 0.5),
    ],
)
def test_decode_weights_serve_rows_up_to_their_max(kind, atol, monkeypatch):
    from chatcli.model import quantize

    if kind == "float16-torch-mv":  # where fbgemm is missing: one row, through torch.mv
        monkeypatch.setattr(quantize, "fbgemm_fp16_available", lambda: False)
        kind = "float16"
    model = random_gpt("E")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 190, (2, 40), generator=g)
    cache = KVCache(1, 2, 64, 16, 4)
    before_full = model(ids)
    before_step = model(ids[:1, :1], kv_cache=cache)
    model.add_decode_weights(kind)
    copies = model.decode_weights()
    assert copies  # int4 takes only matrices with whole groups of 128 inputs (mlp.c_proj here)
    assert model.lm_head.weight.dtype == torch.float32  # fp32 kept for more rows
    full = model(ids)  # 80 rows: through the copies only where they serve that many
    if all(c.max_rows < ids.numel() for c in copies):
        torch.testing.assert_close(full, before_full, atol=0, rtol=0)  # prefill untouched
    else:  # fbgemm's fp16 kernel, our int8 one, torch's int4 one: faster than fp32's here
        assert kind in ("float16", "int8", "int4") and not torch.equal(full, before_full)
        torch.testing.assert_close(full, before_full, atol=atol, rtol=0)
    cache.reset()
    step = model(ids[:1, :1], kv_cache=cache)  # one vector: the compact copy
    assert not torch.equal(step, before_step)
    torch.testing.assert_close(step, before_step, atol=atol, rtol=0)


@pytest.mark.parametrize(
    "kind", ["float16", "float16-torch-mv", "bfloat16", "int8", "int8-weight-only", "int4"]
)
def test_stacked_qkv_copy_equals_the_three_copies_apart(kind, monkeypatch):
    from chatcli.model import quantize

    if kind == "int8-weight-only":
        monkeypatch.setattr(quantize, "fbgemm_available", lambda: False)
        kind = "int8"
    if kind == "float16-torch-mv":
        monkeypatch.setattr(quantize, "fbgemm_fp16_available", lambda: False)
        kind = "float16"
    model = random_gpt("E", n_embd=128)  # int4 takes whole groups of 128 inputs
    ids = torch.randint(0, 190, (3, 1), generator=torch.Generator().manual_seed(2))
    model.add_decode_weights(kind)
    attn = model.transformer.h[0].attn
    assert attn.qkv_decode_weight is not None  # one copy of c_q, c_k and c_v stacked
    assert all(m.decode_weight is None for m in (attn.c_q, attn.c_k, attn.c_v))
    assert attn.c_proj.decode_weight is not None
    stacked = [model(ids[:1]), model(ids)]  # one row, and three sample rows
    for block in model.transformer.h:  # now each of the three through its own copy
        a = block.attn
        a.qkv_decode_weight = None
        for m in (a.c_q, a.c_k, a.c_v):
            m.decode_weight = quantize.make_decode_weight(m.weight.detach(), kind)
    apart = [model(ids[:1]), model(ids)]
    assert torch.equal(stacked[0], apart[0]) and torch.equal(stacked[1], apart[1])
    model.drop_decode_weights()
    assert model.decode_weights() == []


def test_a_chunk_attends_through_one_cached_mask_per_window():
    # A chunk of 5 queries at positions 20..24 over keys 10..24, window 12: query i sees
    # keys i-12..i. The mask is built once and shared by every layer asking for it.
    _visible_cached.cache_clear()
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 5, 4, 8, generator=g)
    k, v = torch.randn(1, 15, 2, 8, generator=g), torch.randn(1, 15, 2, 8, generator=g)
    i = torch.arange(20, 25).unsqueeze(1)
    j = torch.arange(10, 25).unsqueeze(0)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=(j <= i) & (j >= i - 12),
        enable_gqa=True,
    ).transpose(1, 2)
    with torch.inference_mode():
        for _ in range(3):  # three layers, one mask
            got = attend(q, k, v, q_pos=20, k_pos=10, window=12)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert _visible_cached.cache_info().misses == 1
    assert _visible_cached.cache_info().hits == 2
    # Out of inference mode (training), the same chunk gets a mask of its own, which
    # autograd may keep: one made under inference_mode may not take part in backward.
    qg = q.clone().requires_grad_(True)
    attend(qg, k, v, q_pos=20, k_pos=10, window=12).sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    assert _visible_cached.cache_info().misses == 2
    mask = _visible_cached(20, 5, 10, 15, 12, q.dtype, q.device, False)
    assert not mask.is_inference()


@pytest.mark.parametrize(
    ("rows", "threads", "weight_major"),
    [
        (1, 2, False),  # one row: a matrix-vector product either way
        (2, 1, True),
        (4, 1, True),
        (8, 1, False),  # on one thread F.linear is as fast from 8 rows on
        (8, 2, True),
        (128, 2, True),
        (129, 2, False),  # a long prefill: the transposed result's copy costs more
    ],
)
def test_a_streamed_weight_takes_a_few_rows_weight_major_and_equals_f_linear(
    monkeypatch, rows, threads, weight_major
):
    from chatcli.model.linear import STREAMED_WEIGHT_NUMEL, Linear

    torch.manual_seed(0)
    layer = Linear(512, STREAMED_WEIGHT_NUMEL // 512, bias=False)
    x = torch.randn(rows, 1, 512)  # (B, T, C): the leading dims fold into rows
    expected = torch.nn.functional.linear(x, layer.weight)
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: calls.append("mm") or real_mm(*a, **k))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            y = layer(x)
    finally:
        torch.set_num_threads(before)
    assert (calls == ["mm"]) is weight_major
    assert y.shape == expected.shape and y.is_contiguous()
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_a_cache_sized_weight_keeps_f_linear(monkeypatch):
    from chatcli.model.linear import STREAMED_WEIGHT_NUMEL, Linear

    layer = Linear(256, STREAMED_WEIGHT_NUMEL // 256 - 1, bias=False)
    monkeypatch.setattr(torch, "mm", lambda *a, **k: pytest.fail("a small weight took mm"))
    with torch.no_grad():
        assert layer(torch.randn(8, 256)).shape == (8, STREAMED_WEIGHT_NUMEL // 256 - 1)
