from __future__ import annotations

import pytest
import torch
from builders import random_gpt

from chatcli.engine import step_attention
from chatcli.engine.cpu_plan import ThreadChoice
from chatcli.engine.decode_step import DecodeStep
from chatcli.engine.engine import Engine
from chatcli.engine.static_step import CudaGraphStep, ModuleStep, StaticDecodeStep, StepWithFallback
from chatcli.engine.step_matrices import StepMatrix
from chatcli.kernels.build import unavailable_reason
from chatcli.kernels.rows_step import rows_step
from chatcli.model.checkpoint import load_model
from chatcli.model.gpt import ERAS
from chatcli.model.kv_cache import KVCache, SharedPrefixCache
from tests.fakes import ScriptedModel, reply


def _cache(model, seq_len: int = 256) -> KVCache:
    c = model.config
    return KVCache(1, c.n_kv_head, seq_len, c.head_dim, c.n_layer)


def _step(model, kernel: str) -> DecodeStep:
    """The model's step through our compiled whole-step kernel ("native") or torch's ops."""
    step = DecodeStep(model, kernel=kernel == "native")
    if kernel == "native":
        if rows_step() is None:
            pytest.skip(f"no native kernel: {unavailable_reason('rows_step')}")
        assert step.kernel is not None
    else:
        assert step.kernel is None
    return step


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("era", list(ERAS))
def test_steps_equal_the_module_forward_across_the_windows(era, kernel):
    model = random_gpt(era)
    step = _step(model, kernel)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 190, (1, 200), generator=g)
    ours, theirs = _cache(model), _cache(model)
    model(ids[:, :120], kv_cache=ours)
    model(ids[:, :120], kv_cache=theirs)
    for t in range(120, 200):  # past every short window (128 positions here)
        got = step(ids[:, t : t + 1], ours)
        want = model(ids[:, t : t + 1], kv_cache=theirs)[:, -1, :]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        assert ours.get_pos() == theirs.get_pos() == t + 1
    torch.testing.assert_close(ours.k_cache, theirs.k_cache, atol=2e-5, rtol=0)
    torch.testing.assert_close(ours.v_cache, theirs.v_cache, atol=2e-5, rtol=0)
    assert ours.prev_token.tolist() == theirs.prev_token.tolist() == [int(ids[0, 199])]


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize(
    ("era", "prompt_len", "steps"),
    [("A", 100, 30), ("B", 100, 60), ("D", 100, 30), ("E", 100, 60), ("E", 20, 150)],
)
def test_sample_rows_over_a_shared_prompt_equal_the_module_forward(era, prompt_len, steps, kernel):
    # 100 + 60: the short window (128) cuts into the prompt; 20 + 150: it leaves the prompt.
    model = random_gpt(era)
    step = _step(model, kernel)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 190, (1, prompt_len), generator=g)
    rows = torch.randint(0, 190, (4, steps), generator=g)  # a different token per row, each step
    caches = []
    for _ in range(2):
        prefix = _cache(model)
        model(prompt, kv_cache=prefix)
        caches.append(SharedPrefixCache(prefix, 4, steps))
    ours, theirs = caches
    for t in range(steps):
        got = step(rows[:, t : t + 1], ours)
        want = model(rows[:, t : t + 1], kv_cache=theirs)[:, -1, :]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    assert ours.get_pos() == theirs.get_pos() == prompt_len + steps


@pytest.mark.parametrize("table", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernel_embeds_fp32_and_bf16_tables_and_leaves_fp16_to_torch(table):
    model = random_gpt("E")  # the smear reads the previous token's embedding too
    wte = model.transformer.wte
    wte.weight.data = wte.weight.data.to(table)
    step = _step(model, "native")
    assert step.embeds_natively == (table != torch.float16)
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 190, (1, 30), generator=g)
    rows = torch.randint(0, 190, (3, 10), generator=g)
    caches = []
    for _ in range(2):
        prefix = _cache(model)
        model(prompt, kv_cache=prefix)
        caches.append(SharedPrefixCache(prefix, 3, 10))
    ours, theirs = caches
    for t in range(10):  # the first step smears the prompt's last token into every row
        got = step(rows[:, t : t + 1], ours)
        want = model(rows[:, t : t + 1], kv_cache=theirs)[:, -1, :]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("era", ["A", "E"])  # E smears the token before the rewind point
def test_a_step_after_a_rewind_equals_a_fresh_forward_of_the_kept_history(era, kernel):
    model = random_gpt(era)
    step = _step(model, kernel)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 190, (1, 60), generator=g)
    retry = torch.randint(0, 190, (1, 8), generator=g)
    ours = _cache(model)
    model(ids[:, :40], kv_cache=ours)
    for t in range(40, 60):
        step(ids[:, t : t + 1], ours)
    ours.rewind(30, int(ids[0, 29]))  # as /undo and /retry do: the token at 29 comes back
    theirs = _cache(model)
    model(ids[:, :30], kv_cache=theirs)
    for t in range(8):
        got = step(retry[:, t : t + 1], ours)
        want = model(retry[:, t : t + 1], kv_cache=theirs)[:, -1, :]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    assert ours.get_pos() == theirs.get_pos() == 38


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_rows_of_a_plain_cache_equal_the_module_forward(kernel):
    model = random_gpt("E")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 190, (3, 40), generator=g)
    ours, theirs = KVCache(3, 2, 64, 16, 4), KVCache(3, 2, 64, 16, 4)
    model(ids[:, :20], kv_cache=ours)
    model(ids[:, :20], kv_cache=theirs)
    step = _step(model, kernel)
    for t in range(20, 40):
        got = step(ids[:, t : t + 1], ours)
        want = model(ids[:, t : t + 1], kv_cache=theirs)[:, -1, :]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("era", ["A", "E"])
def test_the_first_position_of_an_empty_cache(era, kernel):
    model = random_gpt(era)
    ours, theirs = _cache(model), _cache(model)
    ids = torch.tensor([[7]])
    torch.testing.assert_close(
        _step(model, kernel)(ids, ours), model(ids, kv_cache=theirs)[:, -1, :], atol=2e-5, rtol=0
    )


def test_a_small_models_kernel_starts_on_every_core(monkeypatch):
    # Our kernel shares each product among the cores; torch's ops paid a fork/join each.
    monkeypatch.setattr("chatcli.engine.decode_step.available_cores", lambda: 2)
    model = random_gpt("E")
    for kernel, first in (("native", 2), ("torch", 1)):
        step = _step(model, kernel)
        cache = _cache(model)
        model(torch.tensor([[3, 9, 27]]), kv_cache=cache)
        step(torch.tensor([[5]]), cache)
        assert step.threads_by_rows() == {1: first}


def test_a_cache_the_kernel_does_not_read_takes_torchs_ops(monkeypatch):
    model = random_gpt("E")
    step = _step(model, "native")
    ran = []
    monkeypatch.setattr(type(rows_step()), "run", lambda *a, **k: ran.append(1))
    g = torch.Generator().manual_seed(13)
    ids = torch.randint(0, 190, (1, 40), generator=g)
    # a cache of two rows, of which each step's row is one: not (layers, rows, T, Hkv, D)
    ours, theirs = _cache(model), _cache(model)
    ours.k_cache = torch.zeros(4, 2, 256, 2, 16)[:, :1]
    ours.v_cache = torch.zeros(4, 2, 256, 2, 16)[:, :1]
    model(ids[:, :30], kv_cache=ours)
    model(ids[:, :30], kv_cache=theirs)
    for t in range(30, 40):
        got = step(ids[:, t : t + 1], ours)
        want = model(ids[:, t : t + 1], kv_cache=theirs)[:, -1, :]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    assert ran == [] and not step.kernel_takes(ours, 1)


def test_engine_greedy_output_is_the_module_forwards():
    model, tokenizer, _ = load_model()
    engine = Engine(model, tokenizer)
    assert engine.decode_step is not None  # the embedded model takes the fast step
    plain = Engine(model, tokenizer)
    plain.decode_step = None
    for text in ["What is 1234*56?", "How many r's in strawberry?", "Who are you?"]:
        prompt = tokenizer.render_for_completion([{"role": "user", "content": text}])
        got, _ = engine.generate_batch(prompt, max_tokens=40, temperature=0.0)
        want, _ = plain.generate_batch(prompt, max_tokens=40, temperature=0.0)
        assert got == want
        # Sampled rows over the shared prompt: the same seeds draw the same tokens.
        got, _ = engine.generate_batch(prompt, 4, max_tokens=30, temperature=1.0, seed=3)
        want, _ = plain.generate_batch(prompt, 4, max_tokens=30, temperature=1.0, seed=3)
        assert got == want


def test_only_our_fp32_cpu_gpt_is_supported():
    model = random_gpt("E")
    assert DecodeStep.supports(model)
    model.add_decode_weights("bfloat16")  # a big model's compact copies: read by the step
    assert DecodeStep.supports(model) and not StaticDecodeStep.supports(model)
    assert not DecodeStep.supports(random_gpt("E").to(torch.bfloat16))
    assert not DecodeStep.supports(ScriptedModel(reply([1, 2])))


@pytest.mark.parametrize("kind", ["float16", "bfloat16", "int8", "int4"])
def test_steps_read_the_compact_copies_as_the_module_forward_does(kind):
    # A big CPU model's step reads the copies its modules keep (c_q, c_k, c_v stacked).
    # Same products as the module forward, up to where the rms-norm scale is applied: the
    # step scales after the product, which a rounding of the activations can see.
    model = random_gpt("E")
    model.add_decode_weights(kind)
    step = DecodeStep(model, kernel=False)  # torch's ops over the copies (our kernel: below)
    matrices = [m for layer in step.layers for m in (layer.qkv, layer.fc, layer.fc_proj)]
    assert any(m.weight is None and m.copies[0] is not None for m in matrices)
    # int4 needs whole groups of 128 inputs, so only the 16-bit copies and int8 stack q, k, v.
    stacks = [layer.qkv.copy for layer in step.layers]
    assert stacks == [block.attn.qkv_decode_weight for block in model.transformer.h]
    assert all(c is not None for c in stacks) == (kind != "int4")
    read: list[str] = []  # which kernel of a stacked copy each step call goes through
    for c in stacks if kind != "int4" else []:
        for name in ("matvec", "matmul"):
            kernel = getattr(c, name)
            setattr(c, name, lambda x, kernel=kernel, name=name: read.append(name) or kernel(x))

    def stepped(ids: torch.Tensor, cache: object) -> torch.Tensor:
        read.clear()
        logits = step(ids, cache)
        if kind == "int4":
            assert read == []
        elif len(ids) == 1:
            assert "matvec" in read  # (int8's matvec is its matmul of one row)
        else:  # several rows: up to the copy's max_rows (bf16: 1), fp32 beyond
            assert set(read) == ({"matmul"} if len(ids) <= stacks[0].max_rows else set())
        return logits

    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 190, (1, 60), generator=g)
    ours, theirs = _cache(model), _cache(model)
    model(ids[:, :40], kv_cache=ours)
    model(ids[:, :40], kv_cache=theirs)
    for t in range(40, 60):
        got = stepped(ids[:, t : t + 1], ours)
        want = model(ids[:, t : t + 1], kv_cache=theirs)[:, -1, :]
        torch.testing.assert_close(got, want, atol=0.02, rtol=0)
    rows = SharedPrefixCache(ours, 3, 8), SharedPrefixCache(theirs, 3, 8)
    for _ in range(8):
        column = torch.randint(0, 190, (3, 1), generator=g)
        got = stepped(column, rows[0])
        want = model(column, kv_cache=rows[1])[:, -1, :]
        torch.testing.assert_close(got, want, atol=0.02, rtol=0)


@pytest.mark.parametrize("kind", ["float16", "int8", "int4"])
@pytest.mark.parametrize("era", ["A", "D", "E"])
def test_narrow_copies_run_through_the_kernel_from_their_own_panels(era, kind):
    # rows_step reads each fp16 copy's f16_rows panels, or each int8 or int4 copy's codes
    # and scales, where they are (no memory added), and sums as the copies' own products
    # do, in another order: torch's ops over the same copies within rounding, one row and
    # sample rows over a shared prompt.
    kernel = rows_step()
    attribute = {"float16": "half_panel", "int8": "int8_panel", "int4": "int4_panel"}[kind]
    panel = 0 if kernel is None else getattr(kernel, attribute)
    if not panel:
        why = unavailable_reason("rows_step") or "no F16C/AVX2, or for int4 no VNNI/sdot"
        pytest.skip(f"no {kind} kernel here: {why}")
    # Widths of whole panels, and a vocabulary of an odd count of them, which ends in a block
    # of one panel: 200 with AVX2's 8 columns, 208 with AVX-512's 16. int4: widths of whole
    # groups of 128 inputs.
    n_embd = 128 if kind == "int4" else 64
    model = random_gpt(era, n_embd=n_embd, vocab_size=(-(-190 // panel) | 1) * panel)
    model.add_decode_weights(kind)
    step = DecodeStep(model)
    assert step.kernel == f"rows_step {'fp16' if kind == 'float16' else kind}"
    if kind == "float16":
        copies = {c.half_panels.panels.data_ptr() for c in model.decode_weights()}
    elif kind == "int8":
        copies = {c.int8_panels.buffer.data_ptr() for c in model.decode_weights()}
    else:
        copies = {c.int4_panels.buffer.data_ptr() for c in model.decode_weights()}
    assert {p.data_ptr() for p in step.kernel_model.packed} == copies
    reference = DecodeStep(model, kernel=False)
    # int4's products round each row's activations to 15 bits of its largest: the step and
    # torch's ops round ones that differ in their last bits to neighbouring integers.
    tol = 5e-4 if kind == "int4" else 1e-4
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 190, (1, 170), generator=g)
    ours, theirs = _cache(model), _cache(model)
    model(ids[:, :20], kv_cache=ours)
    model(ids[:, :20], kv_cache=theirs)
    for t in range(20, 170):  # past the short windows
        got = step(ids[:, t : t + 1], ours)
        torch.testing.assert_close(got, reference(ids[:, t : t + 1], theirs), atol=tol, rtol=0)
    torch.testing.assert_close(ours.k_cache, theirs.k_cache, atol=tol, rtol=0)
    rows = SharedPrefixCache(ours, 8, 10), SharedPrefixCache(theirs, 8, 10)
    for _ in range(10):
        column = torch.randint(0, 190, (8, 1), generator=g)
        torch.testing.assert_close(step(column, rows[0]), reference(column, rows[1]),
                                   atol=tol, rtol=0)  # fmt: skip


def test_int8_copies_of_a_vocabulary_not_in_whole_panels_keep_torchs_ops():
    # An int8 copy our kernels cannot read (the lm_head of 190 rows) goes through fbgemm or
    # torch's weight-only kernel, and the step with it through torch's ops.
    model = random_gpt("E", vocab_size=190)
    model.add_decode_weights("int8")
    assert DecodeStep(model).kernel is None
    assert model.lm_head.decode_weight.int8_panels is None


@pytest.mark.parametrize("kind", ["bfloat16", "int4"])
def test_other_copies_keep_torchs_ops(kind):
    model = random_gpt("E")
    model.add_decode_weights(kind)
    assert DecodeStep(model).kernel is None


@pytest.mark.parametrize(
    ("kind", "folds"),
    [(None, True), ("float16", True), ("bfloat16", True), ("int4", True), ("int8", None)],
)
def test_sample_rows_fold_their_norms_unless_a_kernel_quantizes_the_rows(kind, folds):
    # Folding scales each row after its product; fbgemm's int8 kernel rounds all the rows of
    # a call to integers on one scale, so it must see them normalised.
    from chatcli.model.quantize import fbgemm_available

    model = random_gpt("E")
    if kind is not None:
        model.add_decode_weights(kind)
    if folds is None:
        folds = not fbgemm_available()
    assert DecodeStep(model).fold_norms == folds


def test_a_big_models_products_and_attention_run_on_the_callers_threads_the_rest_on_one(
    monkeypatch,
):
    monkeypatch.setattr("chatcli.engine.decode_step.SMALL_MODEL_PARAMS", 0)  # pretend it is big
    model = random_gpt("E")
    model.add_decode_weights("int8")
    step = DecodeStep(model)
    seen: dict[str, set[int]] = {"product": set(), "attention": set(), "norm": set()}
    copy = step.layers[0].fc.copies[0]
    matvec = copy.matvec
    attention = torch.nn.functional.scaled_dot_product_attention
    with_lse = step_attention.attention_with_lse
    row_scales = step.row_scales

    def spy(kind, fn):
        def run(*args, **kwargs):
            seen[kind].add(torch.get_num_threads())
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(copy, "matvec", spy("product", matvec))
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention", spy("attention", attention)
    )
    monkeypatch.setattr(step_attention, "attention_with_lse", spy("attention", with_lse))
    monkeypatch.setattr(step, "row_scales", spy("norm", row_scales))
    before = torch.get_num_threads()
    ours, theirs = _cache(model), _cache(model)
    ids = torch.tensor([[3, 9, 27, 81]])
    model(ids, kv_cache=ours)
    model(ids, kv_cache=theirs)
    seen["attention"].clear()  # the module forward's own calls
    try:
        torch.set_num_threads(2)
        got = step(torch.tensor([[5]]), ours)
        assert torch.get_num_threads() == 2  # restored
        rows = SharedPrefixCache(ours, 3, 4)
        step(torch.tensor([[1], [2], [3]]), rows)  # sample rows: both attention calls
    finally:
        torch.set_num_threads(before)
    # The products and the attention stream weights and cache: on every thread.
    assert seen == {"product": {2}, "attention": {2}, "norm": {1}}
    seen["product"].clear()
    seen["attention"].clear()
    try:
        torch.set_num_threads(1)  # the caller's count now: the products follow it
        step(torch.tensor([[6]]), ours)
    finally:
        torch.set_num_threads(before)
    assert seen["product"] == seen["attention"] == {1}
    want = model(torch.tensor([[5]]), kv_cache=theirs)[:, -1, :]
    torch.testing.assert_close(got, want, atol=0.02, rtol=0)


def test_refuses_positions_past_the_rotary_tables():
    model = random_gpt("E")
    cache = KVCache(1, 2, model.max_positions + 1, 16, 4)
    cache.advance(model.max_positions)
    with pytest.raises(ValueError, match="exceeds"):
        DecodeStep(model)(torch.tensor([[1]]), cache)


@pytest.mark.parametrize("era", list(ERAS))
def test_static_step_equals_the_module_forward(era):
    # Fixed shapes: keys over the whole cache under a mask, the position a tensor.
    model = random_gpt(era)
    step = StaticDecodeStep(model)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 190, (1, 200), generator=g)
    ours, theirs = _cache(model), _cache(model)
    want = model(ids[:, :1], kv_cache=theirs)[:, -1, :]
    got = step(ids[:, :1], ours)  # position 0: no previous token to smear
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    model(ids[:, 1:120], kv_cache=ours)
    model(ids[:, 1:120], kv_cache=theirs)
    for t in range(120, 200):
        got = step(ids[:, t : t + 1], ours)
        want = model(ids[:, t : t + 1], kv_cache=theirs)[:, -1, :]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    for a, b in [(ours.k_cache, theirs.k_cache), (ours.v_cache, theirs.v_cache)]:
        torch.testing.assert_close(a[:, :, :200], b[:, :, :200], atol=2e-5, rtol=0)


def test_a_failing_fast_step_hands_over_to_the_plain_one():
    model = random_gpt("E")
    plain = DecodeStep(model)

    def broken(ids, cache):
        raise RuntimeError("no compiler")

    step = StepWithFallback(broken, plain, "torch.compile")
    cache = _cache(model)
    with pytest.warns(UserWarning, match="torch.compile failed, running eagerly: no compiler"):
        first = step(torch.tensor([[5]]), cache)
    assert step.fast is None and cache.get_pos() == 1
    torch.testing.assert_close(first, model(torch.tensor([[5]]), kv_cache=_cache(model))[:, -1])


def test_a_failed_graph_hands_over_to_the_modules_own_forward():
    # The CUDA path's fallback (step_choice.pick_decode_step) is the module's forward, not the
    # static step it captured, which reads the whole context under a mask every token.
    model = random_gpt("E")

    def broken(ids, cache):
        raise RuntimeError("operation not permitted when stream is capturing")

    step = StepWithFallback(broken, ModuleStep(model), "CUDA graph capture")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 190, (2, 40), generator=g)
    ours, theirs = KVCache(2, 2, 64, 16, 4), KVCache(2, 2, 64, 16, 4)
    model(ids[:, :30], kv_cache=ours)
    model(ids[:, :30], kv_cache=theirs)
    with pytest.warns(UserWarning, match="CUDA graph capture failed, running eagerly"):
        step(ids[:, 30:31], ours)
    model(ids[:, 30:31], kv_cache=theirs)
    for t in range(31, 40):
        got = step(ids[:, t : t + 1], ours)
        assert got.shape == (2, model.config.vocab_size) and ours.get_pos() == t + 1
        torch.testing.assert_close(got, model(ids[:, t : t + 1], kv_cache=theirs)[:, -1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_step_equals_the_module_forward():
    model = random_gpt("E").cuda()
    step = CudaGraphStep(StaticDecodeStep(model))
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 190, (1, 160), generator=g).cuda()
    c = model.config
    ours = KVCache(1, c.n_kv_head, 256, c.head_dim, c.n_layer, device="cuda")
    theirs = KVCache(1, c.n_kv_head, 256, c.head_dim, c.n_layer, device="cuda")
    model(ids[:, :100], kv_cache=ours)
    model(ids[:, :100], kv_cache=theirs)
    for t in range(100, 160):  # captured once, replayed 59 times
        got = step(ids[:, t : t + 1], ours)
        want = model(ids[:, t : t + 1], kv_cache=theirs)[:, -1, :]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_a_full_context_passes_through_the_fallback():
    model = random_gpt("E")
    step = StepWithFallback(DecodeStep(model), DecodeStep(model), "torch.compile")
    cache = KVCache(1, 2, 4, 16, 4)
    cache.advance(4)
    with pytest.raises(ValueError, match=r"exceeds|overflow"):
        step(torch.tensor([[1]]), cache)
    assert step.fast is not None  # the caller's error, not the fast path's


@pytest.mark.parametrize("era", ["D", "E"])
def test_bf16_steps_scale_qk_exactly_and_return_fp32(era):
    # On a GPU the weights are bf16: the qk scale (1.15, 1.2) must not be rounded with them.
    model = random_gpt(era).to(torch.bfloat16)
    step = StaticDecodeStep(model)
    qk = torch.randn(6, 16, dtype=torch.bfloat16)
    want = torch.nn.functional.rms_norm(qk, (16,)) * model.arch.qk_scale
    assert torch.equal(step.qk_norm(qk), want)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 190, (1, 40), generator=g)
    logits = []
    for fn in (step, model):
        prefix = KVCache(1, 2, 40, 16, 4, dtype=torch.bfloat16)
        model(ids[:, :30], kv_cache=prefix)
        rows = SharedPrefixCache(prefix, 2, 10)  # sample rows: the dynamic step
        out = (
            fn(ids[:, 30:31].expand(2, 1), rows)
            if fn is step
            else fn(ids[:, 30:31].expand(2, 1), kv_cache=rows)[:, -1]
        )
        logits.append(out)
    assert logits[0].dtype == torch.float32
    torch.testing.assert_close(logits[0], logits[1], atol=0.1, rtol=0)


@pytest.mark.parametrize("era", ["A", "E"])  # qk scale 1 (rms_norm alone) and 1.2
def test_the_lean_norms_equal_rms_norm(era):
    model = random_gpt(era)
    step = DecodeStep(model)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 64, generator=g) * torch.tensor([[0.01], [0.3], [1.0], [7.0], [90.0]])
    rms = torch.nn.functional.rms_norm
    torch.testing.assert_close(x * step.row_scales(x), rms(x, (64,)), atol=1e-6, rtol=1e-6)
    # divided by the softcap, the scale the logits take before tanh
    torch.testing.assert_close(
        x * step.row_scales(x, times=15.0), rms(x, (64,)) / 15.0, atol=1e-7, rtol=1e-6
    )
    qk = torch.randn(5, 6, 16, generator=g) * 3.0
    torch.testing.assert_close(
        step.qk_norm_lean(qk.clone()), step.qk_norm(qk), atol=1e-6, rtol=1e-6
    )
    # a zero row stays zero (eps keeps the scale finite), as rms_norm gives it
    zero = torch.zeros(1, 64)
    assert torch.equal(zero * step.row_scales(zero), rms(zero, (64,)))


def test_small_matrices_read_a_transposed_copy_with_the_same_products():
    model = random_gpt("E")  # c_q, c_k, c_v stack to (128, 64); c_fc (256, 64)
    step = DecodeStep(model)
    layer = step.layers[0]
    g = torch.Generator().manual_seed(12)
    for matrix, modules in (
        (
            layer.qkv,
            [
                model.transformer.h[0].attn.c_q,
                model.transformer.h[0].attn.c_k,
                model.transformer.h[0].attn.c_v,
            ],
        ),
        (layer.fc, [model.transformer.h[0].mlp.c_fc]),
        (layer.fc_proj, [model.transformer.h[0].mlp.c_proj]),
    ):
        w = torch.cat([m.weight.detach() for m in modules])  # (out, in)
        out, inn = w.shape
        assert matrix.weight_t.shape == (inn, out) and matrix.weight_t.is_contiguous()
        # one row reads the transposed copy only where the output is the wider side
        assert matrix.vector_from_t == (out > inn)
        if len(modules) > 1:  # a stacked (out, in) copy is kept only if one row reads it
            assert (matrix.weight is None) == matrix.vector_from_t
        v, rows = torch.randn(inn, generator=g), torch.randn(3, inn, generator=g)
        bias_v, bias_rows = torch.randn(out, generator=g), torch.randn(3, out, generator=g)
        torch.testing.assert_close(matrix.mv(v), w @ v, atol=1e-5, rtol=0)
        torch.testing.assert_close(matrix.mm(rows), rows @ w.T, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            matrix.addmv(bias_v, v, alpha=0.5), bias_v + 0.5 * (w @ v), atol=1e-5, rtol=0
        )
        torch.testing.assert_close(
            matrix.addmm(bias_rows, rows), bias_rows + rows @ w.T, atol=1e-5, rtol=0
        )


def test_a_big_matrix_keeps_no_transposed_copy(monkeypatch):
    monkeypatch.setattr("chatcli.engine.step_matrices.STACK_AT_MOST", 1000)  # every matrix is "big"
    step = DecodeStep(random_gpt("E"))
    for m in step.matrices:
        assert m.weight_t is None and not m.vector_from_t
    assert step.layers[0].qkv.weight is None  # nor a stacked copy: one product per module


def test_a_big_models_products_follow_the_measured_thread_choice(monkeypatch):
    monkeypatch.setattr("chatcli.engine.decode_step.SMALL_MODEL_PARAMS", 0)  # pretend it is big
    model = random_gpt("E")
    model.add_decode_weights("int8")
    step = DecodeStep(model)
    assert step.kernel is None  # a big model streams its weights through torch's kernels
    copy = step.layers[0].fc.copies[0]
    matvec, seen = copy.matvec, []

    def spy_matvec(x):
        seen.append(torch.get_num_threads())
        return matvec(x)

    monkeypatch.setattr(copy, "matvec", spy_matvec)
    # As if one thread had been measured faster: one run on it, then a probe of two.
    choice = ThreadChoice(1, 2, first_probe=1)
    step.choose_threads(1, 2, choice)
    cache = _cache(model)
    model(torch.tensor([[3, 9, 27]]), kv_cache=cache)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        step(torch.tensor([[5]]), cache)
        assert choice.threads() == 2  # the step recorded its time: the probe is due
        step(torch.tensor([[6]]), cache)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2]


def test_a_small_models_attention_and_products_run_on_one_thread_until_two_measure_faster(
    monkeypatch,
):
    monkeypatch.setattr("chatcli.engine.decode_step.available_cores", lambda: 2)
    model = random_gpt("E")
    step = DecodeStep(model, kernel=False)  # torch's ops: attention on the products' threads
    assert not step.split_threads  # a small model: the rest of its step stays on one thread
    seen = []
    real_attention = torch.nn.functional.scaled_dot_product_attention

    def spy_attention(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_attention(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy_attention)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 190, (1, 40), generator=g)
    ours, theirs = _cache(model), _cache(model)
    model(ids[:, :30], kv_cache=ours)
    model(ids[:, :30], kv_cache=theirs)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the small-model plan's count
        for t in range(30, 40):
            seen.clear()
            got = step(ids[:, t : t + 1], ours)
            threads = list(seen)
            want = model(ids[:, t : t + 1], kv_cache=theirs)[:, -1, :]
            torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
            assert torch.get_num_threads() == 1
            if t == 30:
                first = threads
            if t == 30 + 4:  # the default choice's first probe: every core
                probe = threads
    finally:
        torch.set_num_threads(before)
    n_layer = model.config.n_layer
    assert first == [1] * n_layer and probe == [2] * n_layer
    assert set(step.threads_by_rows()) == {1}  # one choice, for one row (over two cores)


def test_a_big_fp32_matrix_takes_sample_rows_weight_major_on_the_products_threads(monkeypatch):
    from chatcli.model.linear import Linear

    torch.manual_seed(0)
    layer = Linear(1024, 1040, bias=False)  # 4 MB: no transposed copy, read where it is
    matrix = StepMatrix([layer])
    assert matrix.weight is not None and matrix.weight_t is None
    matrix.threads = 2
    seen = []
    real_mm = torch.mm
    monkeypatch.setattr(
        torch, "mm", lambda *a, **k: seen.append(torch.get_num_threads()) or real_mm(*a, **k)
    )
    x, residual = torch.randn(8, 1024), torch.randn(8, 1040)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the step's own count; the products take theirs
    try:
        with torch.no_grad():
            y, z = matrix.mm(x), matrix.addmm(residual, x)
    finally:
        torch.set_num_threads(before)
    assert seen == [2, 2]
    expected = torch.nn.functional.linear(x, layer.weight)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(z, residual + expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(
    rows_step() is None, reason=f"no native kernel: {unavailable_reason('rows_step')}"
)
@pytest.mark.parametrize("rows", [2, 4, 8])
def test_sample_rows_logits_do_not_depend_on_the_thread_count(rows):
    # ThreadChoice moves a step between one thread and every core by measured time: a
    # fixed seed must draw the same samples either way, so the logits must be the same bits.
    model, tokenizer, _ = load_model()
    engine = Engine(model, tokenizer)
    step = engine.decode_step
    prompt = tokenizer.render_for_completion([{"role": "user", "content": "Count to ten."}])
    prefix = engine.new_cache(1, len(prompt))
    engine.forward_last(torch.tensor([prompt]), prefix)
    ids = torch.arange(rows).view(rows, 1) + 70
    logits = []
    for threads in (1, 2):
        cache = engine.fork(prefix, rows, 8)
        logits.append(torch.cat([step.step_on(threads, ids, cache) for _ in range(3)]))
    assert torch.equal(logits[0], logits[1])
