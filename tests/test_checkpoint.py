"""Finding checkpoints in every layout, and refusing every malformed one with a clear message."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from reference import REFERENCE, needs_reference

from chatcli.engine.decode_step import DecodeStep
from chatcli.engine.engine import Engine
from chatcli.errors import CheckpointError
from chatcli.kernels.rows_step import rows_step
from chatcli.model.checkpoint import load_model, read_state_dict, resolve_checkpoint
from chatcli.model.checkpoint_listing import list_checkpoints
from chatcli.model.model_build import Precision, build_model, pick_device, pick_precision

FIXTURES = REFERENCE
PROMPT = torch.tensor([[503, 504, 87, 459, 349, 32, 49, 505, 506]])


def _files(era: str = "E") -> tuple[dict[str, torch.Tensor], dict, Path]:
    ckpt = FIXTURES / era / "chatsft_checkpoints" / "d4"
    sd = torch.load(ckpt / "model_000001.pt", weights_only=True)
    meta = json.loads((ckpt / "meta_000001.json").read_text())
    return sd, meta, FIXTURES / era / "tokenizer" / "tokenizer.pkl"


def _flat(tmp_path: Path, sd=None, meta=None, step: int = 650, era: str = "E") -> Path:
    """A folder like the published nanochat-d32 download: model, meta, tokenizer side by side."""
    sd0, meta0, tok = _files(era)
    folder = tmp_path / "download"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(sd0 if sd is None else sd, folder / f"model_{step:06d}.pt")
    (folder / f"meta_{step:06d}.json").write_text(json.dumps(meta0 if meta is None else meta))
    shutil.copy(tok, folder / "tokenizer.pkl")
    return folder


def _reference_logits(era: str = "E") -> torch.Tensor:
    model, _, _ = load_model(FIXTURES / era, device="cpu")
    return model(PROMPT)


# ---- layouts ---------------------------------------------------------------------------------


@needs_reference
def test_base_dir_picks_largest_depth_tag_and_last_step(tmp_path):
    _, _, tok = _files()
    for tag in ("d4", "d12", "d8"):
        for step in (5, 120, 40):
            d = tmp_path / "chatsft_checkpoints" / tag
            d.mkdir(parents=True, exist_ok=True)
            (d / f"model_{step:06d}.pt").touch()
            (d / f"meta_{step:06d}.json").touch()
    (tmp_path / "tokenizer").mkdir()
    shutil.copy(tok, tmp_path / "tokenizer" / "tokenizer.pkl")
    ref = resolve_checkpoint(tmp_path)
    assert (ref.tag, ref.step, ref.source) == ("d12", 120, "sft")
    assert ref.tokenizer_file == tmp_path / "tokenizer" / "tokenizer.pkl"
    assert resolve_checkpoint(tmp_path, tag="d4", step=40).model_file.name == "model_000040.pt"
    with pytest.raises(CheckpointError, match="No step 7"):
        resolve_checkpoint(tmp_path, step=7)
    with pytest.raises(CheckpointError, match="base_checkpoints"):
        resolve_checkpoint(tmp_path, source="base")


@needs_reference
def test_flat_download_folder_and_model_file_load(tmp_path):
    folder = _flat(tmp_path)
    want = _reference_logits()
    for path in (folder, folder / "model_000650.pt"):
        model, tokenizer, meta = load_model(path, device="cpu")
        assert meta["step"] == 1 and model.info.step == 650
        torch.testing.assert_close(model(PROMPT), want)
        assert tokenizer.get_vocab_size() == 512


@needs_reference
def test_tag_is_found_in_nanochat_base_dir_env(tmp_path, monkeypatch):
    base = tmp_path / "base"
    shutil.copytree(FIXTURES / "E", base)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    model, _, _ = load_model("d4", device="cpu")
    assert model.info.tag == "d4" and model.arch.era == "E"


@needs_reference
def test_compiled_prefix_padded_vocab_and_bf16_weights_load_as_the_reference(tmp_path):
    sd, _meta, _ = _files()
    changed = {}
    for k, v in sd.items():
        if k in ("transformer.wte.weight", "lm_head.weight") or k.startswith("value_embeds"):
            v = torch.cat([v, torch.randn(64, v.shape[1])])  # vocab padded to 576
        if k == "transformer.wte.weight":
            v = v.bfloat16()  # as nanochat saves it: a table this small widens at load
        changed["_orig_mod." + k] = v
    model, _, _ = load_model(_flat(tmp_path, sd=changed), device="cpu")
    assert model.transformer.wte.weight.shape[0] == 576
    assert model.transformer.wte.weight.dtype == torch.float32
    logits = model(PROMPT)
    assert logits.shape[-1] == 512  # sliced back to vocab_size
    sd["transformer.wte.weight"] = sd["transformer.wte.weight"].bfloat16().float()
    ref_model, _, _ = load_model(_flat(tmp_path / "ref", sd=sd), device="cpu")
    assert torch.equal(logits, ref_model(PROMPT))


@pytest.mark.parametrize(
    ("era", "dtype", "only_values"),
    [
        ("A", torch.bfloat16, False),
        ("E", torch.bfloat16, False),
        ("E", torch.float16, False),
        ("E", torch.bfloat16, True),  # wte fp32, the value embeddings narrow
    ],
)
@needs_reference
def test_bf16_embedding_tables_stay_as_saved_and_answer_as_widened_ones(
    tmp_path, era, dtype, only_values, monkeypatch
):
    """nanochat's CUDA runs save wte and the value embeddings in bf16. On the CPU big ones
    stay bf16 (or fp16), mapped from the file (half the memory of fp32, and none of it
    copied), and every path gives what the same tables widened to fp32 at load give, bit
    for bit."""
    from chatcli.model import model_build

    monkeypatch.setattr(model_build, "NARROW_TABLES_AT", 1)  # the fixture's tables count
    sd, _, _ = _files(era)
    tables = [k for k in sd if k == "transformer.wte.weight" or k.startswith("value_embeds.")]
    assert len(tables) == 1 if era == "A" else len(tables) > 1  # E: value embeddings too
    if only_values:
        tables = [k for k in tables if k.startswith("value_embeds.")]
    narrow = {k: v.to(dtype) if k in tables else v for k, v in sd.items()}
    widened = {k: v.float() for k, v in narrow.items()}
    folder = _flat(tmp_path / "narrow", sd=narrow, era=era)
    model, tokenizer, _ = load_model(folder, device="cpu")
    ref, _, _ = load_model(_flat(tmp_path / "wide", sd=widened, era=era), device="cpu")
    for k in tables:
        assert model.get_parameter(k).dtype == dtype
        assert ref.get_parameter(k).dtype == torch.float32
    assert model.compute_dtype == torch.float32
    said = f"float32, embeddings {str(dtype).removeprefix('torch.')}"
    assert (model.info.dtype, ref.info.dtype) == (said, "float32")
    # Not copied: the parameter is the tensor read from the file's mapping.
    mapped = read_state_dict(folder / "model_000650.pt")
    config = model.config
    built = build_model(mapped, config, folder, torch.device("cpu"), Precision(torch.float32))
    for k in tables:
        assert built.get_parameter(k).data_ptr() == mapped[k].data_ptr()
    # Small tables widen at load, so that a small model's step needs no op to widen them.
    monkeypatch.setattr(model_build, "NARROW_TABLES_AT", sum(mapped[k].numel() for k in tables) + 1)
    small, _, _ = load_model(folder, device="cpu")
    assert all(small.get_parameter(k).dtype == torch.float32 for k in tables)
    assert small.info.dtype == "float32" and torch.equal(small(PROMPT), ref(PROMPT))

    assert torch.equal(model(PROMPT), ref(PROMPT))
    ours, theirs = Engine(model, tokenizer), Engine(ref, tokenizer)
    assert type(ours.decode_step) is DecodeStep  # the fused step still applies
    if dtype == torch.bfloat16 and rows_step() is not None:  # our kernel reads bf16 tables
        assert ours.decode_step.kernel == "rows_step"
    prompt = PROMPT[0].tolist()

    def run(engine: Engine, n: int) -> list:  # one row, or sample rows over a shared prompt
        kwargs = dict(num_samples=n, max_tokens=12, temperature=0.0 if n == 1 else 1.0, seed=3)
        return [cols for cols, _ in engine.generate(prompt, use_tools=False, **kwargs)]

    assert run(ours, 1) == run(theirs, 1)
    assert run(ours, 4) == run(theirs, 4)


@needs_reference
def test_softcap_override_changes_the_cap():
    model, _, _ = load_model(FIXTURES / "A", device="cpu", softcap=20.0)
    assert model.arch.softcap == 20.0
    assert model(PROMPT).abs().max() < 20.0


def test_embedded_default_or_a_clear_error():
    try:
        model, tokenizer, _ = load_model(device="cpu")
    except CheckpointError as e:
        assert "--model" in str(e)
    else:
        assert model.info.embedded and tokenizer.get_vocab_size() == model.config.vocab_size


# ---- malformed inputs ------------------------------------------------------------------------


def test_missing_path_says_what_to_pass(tmp_path):
    with pytest.raises(CheckpointError, match=r"No model at .*nowhere"):
        load_model(tmp_path / "nowhere")


@needs_reference
def test_missing_meta_and_tokenizer_are_named(tmp_path):
    folder = _flat(tmp_path)
    (folder / "meta_000650.json").unlink()
    with pytest.raises(CheckpointError, match=r"has no meta_000650\.json beside it"):
        load_model(folder)
    folder = _flat(tmp_path / "b")
    (folder / "tokenizer.pkl").unlink()
    with pytest.raises(CheckpointError, match=r"No tokenizer\.pkl"):
        load_model(folder)


@needs_reference
def test_a_meta_with_another_layer_count_is_blamed_on_the_meta(tmp_path):
    _, meta, _ = _files()
    for layers in (6, 3):
        meta["model_config"]["n_layer"] = layers
        folder = _flat(tmp_path / str(layers), meta=meta)
        with pytest.raises(
            CheckpointError, match=rf"says n_layer={layers}, but the weights have 4 layers"
        ):
            load_model(folder)


@needs_reference
def test_weights_wrapped_in_another_dict_say_what_they_hold(tmp_path):
    sd, _, _ = _files()
    folder = _flat(tmp_path, sd={"model": sd, "step": torch.tensor(1)})
    with pytest.raises(CheckpointError, match=r"holds a dict with keys model, step, not a state"):
        load_model(folder)


@needs_reference
def test_truncated_weights_are_reported_not_raised_raw(tmp_path):
    folder = _flat(tmp_path)
    f = folder / "model_000650.pt"
    f.write_bytes(f.read_bytes()[:3000])
    with pytest.raises(
        CheckpointError, match=r"model_000650\.pt: it is not a whole torch checkpoint \(3,000 bytes"
    ):
        load_model(folder)


@needs_reference
def test_weights_behind_a_broken_link_are_named_and_listed_not_raised(tmp_path):
    folder = _flat(tmp_path)
    f = folder / "model_000650.pt"
    f.unlink()
    f.symlink_to(tmp_path / "moved.pt")  # the download it pointed at was moved
    with pytest.raises(CheckpointError, match=r"model_000650\.pt is not there \(a link to .*moved"):
        load_model(folder)


@needs_reference
def test_weights_in_torchs_legacy_format_load(tmp_path):
    folder = _flat(tmp_path)
    f = folder / "model_000650.pt"
    sd = torch.load(f, weights_only=True)
    torch.save(sd, f, _use_new_zipfile_serialization=False)  # not a zip: no mmap for it
    model, _, _ = load_model(folder)
    assert torch.equal(model.state_dict()["lm_head.weight"], sd["lm_head.weight"].float())


@needs_reference
def test_weights_file_that_runs_code_is_refused(tmp_path):
    folder = _flat(tmp_path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"x": Evil()}, folder / "model_000650.pt")
    with pytest.raises(CheckpointError, match=r"holds more than a plain state_dict of tensors"):
        load_model(folder)
    assert not marker.exists()


@needs_reference
def test_meta_without_model_config(tmp_path):
    folder = _flat(tmp_path, meta={"step": 1})
    with pytest.raises(CheckpointError, match="no model_config"):
        load_model(folder)


@needs_reference
def test_meta_with_broken_json_or_missing_keys(tmp_path):
    folder = _flat(tmp_path)
    (folder / "meta_000650.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not readable JSON"):
        load_model(folder)
    _, meta, _ = _files()
    del meta["model_config"]["n_kv_head"]
    with pytest.raises(CheckpointError, match="lacks n_kv_head"):
        load_model(_flat(tmp_path / "b", meta=meta))


@needs_reference
def test_shapes_contradicting_meta(tmp_path):
    _, meta, _ = _files()
    meta["model_config"]["n_embd"] = 128
    meta["model_config"]["n_head"] = 8
    meta["model_config"]["n_kv_head"] = 4
    with pytest.raises(
        CheckpointError, match=r"says n_embd=128, but the token embedding is 64 wide"
    ):
        load_model(_flat(tmp_path, meta=meta))
    sd, _, _ = _files()
    sd["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(128, 64)
    with pytest.raises(
        CheckpointError,
        match=r"transformer\.h\.1\.mlp\.c_fc\.weight has shape \(128, 64\) but the meta's "
        r"model_config \(n_layer=4, n_embd=64, .*\) implies \(256, 64\)",
    ):
        load_model(_flat(tmp_path / "b", sd=sd))


@needs_reference
def test_tokenizer_vocab_must_equal_model_vocab(tmp_path):
    _, meta, _ = _files()
    meta["model_config"]["vocab_size"] = 500
    with pytest.raises(
        CheckpointError, match=r"has 512 tokens but the model .* expects vocab_size 500"
    ):
        load_model(_flat(tmp_path, meta=meta))


@needs_reference
def test_unknown_and_missing_keys_are_listed(tmp_path):
    sd, _, _ = _files()
    extra = dict(sd, **{"transformer.h.0.attn.c_x.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match=r"unknown keys transformer\.h\.0\.attn\.c_x\.weight"):
        load_model(_flat(tmp_path, sd=extra))
    fewer = {k: v for k, v in sd.items() if k != "transformer.h.2.mlp.c_fc.weight"}
    with pytest.raises(CheckpointError, match=r"missing keys transformer\.h\.2\.mlp\.c_fc\.weight"):
        load_model(_flat(tmp_path / "b", sd=fewer))


@needs_reference
def test_a_key_with_a_newline_is_shown_escaped_on_one_line(tmp_path):
    # Found by the fuzzer: a key renamed to hold a newline split the message over two lines.
    sd, _, _ = _files()
    renamed = {
        ("s\nmear" if k == "transformer.h.2.mlp.c_fc.weight" else k): v for k, v in sd.items()
    }
    with pytest.raises(CheckpointError) as e:
        load_model(_flat(tmp_path, sd=renamed))
    assert "\n" not in str(e.value)
    assert "unknown keys 's\\nmear'" in str(e.value)


@needs_reference
def test_hostile_tokenizer_pickle_is_refused_and_runs_nothing(tmp_path):
    folder = _flat(tmp_path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (folder / "tokenizer.pkl").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"Refused to load tokenizer .*pathlib"):
        load_model(folder)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantize_gives_cpu_decode_copies_and_says_so(kind):
    model, _, _ = load_model(quantize=kind)
    assert model.decode_weights() and model.info.dtype == f"float32 (decode weights {kind})"
    assert all(p.dtype == torch.float32 for p in model.parameters())  # prefill stays fp32


def _off_x86(kind: str) -> str:
    """Off x86 (ARM64 reads as DEFAULT) the 16-bit copy is fp16 where our whole-step kernel
    reads it, else bf16 (tests/test_quantize.py checks both sides)."""
    if kind != "kernel":
        return kind
    kernel = rows_step()
    return "float16" if kernel is not None and kernel.half_panel else "bfloat16"


@pytest.mark.parametrize(
    ("capability", "kind"), [("AVX2", "float16"), ("AVX512", "float16"), ("DEFAULT", "kernel")]
)
def test_a_large_model_loads_with_the_default_half_copies_and_answers(
    capability, kind, monkeypatch
):
    # The embedded model counted as large: the loader's default plan for a big checkpoint.
    from chatcli.model import model_build

    monkeypatch.setattr(model_build, "LARGE_MODEL_MATRIX_PARAMS", 0)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    kind = _off_x86(kind)
    model, tokenizer, _ = load_model()
    assert model.info.dtype == f"float32 (decode weights {kind})"
    reference, _, _ = load_model(dtype="float32")
    assert reference.info.dtype == "float32" and not reference.decode_weights()
    prompt = tokenizer.render_for_completion([{"role": "user", "content": "What is 7*6?"}])

    def greedy(net) -> list[int]:
        cols = Engine(net, tokenizer).generate(prompt, max_tokens=16, temperature=0.0)
        return [c[0] for c, _ in cols]

    got, want = greedy(model), greedy(reference)
    # A trained model's greedy reply survives 16-bit weights for its first tokens at least.
    assert got[:4] == want[:4]

    def one_step(net) -> torch.Tensor:  # a decode step: it reads the copies where kept
        engine = Engine(net, tokenizer)
        cache = engine.new_cache(1, len(prompt) + 1)
        engine.forward_last(torch.tensor([prompt]), cache)
        return engine.forward_last(torch.tensor([[got[0]]]), cache)

    step, reference_step = one_step(model), one_step(reference)
    assert not torch.equal(step, reference_step)
    torch.testing.assert_close(step, reference_step, atol=0.1, rtol=0)


@pytest.mark.parametrize(
    ("capability", "dtype"), [((7, 5), torch.float32), ((8, 0), torch.bfloat16)]
)
def test_a_gpu_runs_bf16_only_where_it_computes_it_itself(capability, dtype, monkeypatch):
    # A Turing card emulates bf16 (torch.cuda.is_bf16_supported() says yes there): fp32
    # instead, unless asked; the capability is the given device's, not the current one's.
    asked = []

    def capability_of(device: torch.device) -> tuple[int, int]:
        asked.append(device)
        return capability

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability_of)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert pick_precision(torch.device("cuda:1")).compute == dtype
    assert asked == [torch.device("cuda:1")]
    assert pick_precision(torch.device("cuda:1"), "bfloat16").compute == torch.bfloat16


def test_quantize_refuses_cuda_and_unknown_formats():
    with pytest.raises(CheckpointError, match="for CPU decode"):
        pick_precision(torch.device("cuda"), quantize="int8")
    with pytest.raises(CheckpointError, match="use none, int8 or int4"):
        pick_precision(torch.device("cpu"), quantize="fp8")
    assert pick_precision(torch.device("cpu"), matrix_params=10**6).decode is None


@pytest.mark.parametrize(
    ("capability", "kind"), [("AVX2", "float16"), ("AVX512", "float16"), ("DEFAULT", "kernel")]
)
def test_large_cpu_models_decode_through_the_cpus_faster_half_copy(capability, kind, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    kind = _off_x86(kind)
    assert pick_precision(torch.device("cpu"), matrix_params=10**9).decode == kind
    # --dtype bfloat16 asks for bf16 copies, whichever reads faster
    assert pick_precision(torch.device("cpu"), "bfloat16", matrix_params=10**9).decode == (
        "bfloat16"
    )


def test_embedding_tables_do_not_count_toward_a_large_model():
    """The plan's size is the matrices a decode step reads whole: d4's shapes hold 20M of
    them beside 50M of embedding tables, and get the 16-bit copies (measured 2x faster at
    batch 1 there); the embedded model's 2.7M keep fp32."""
    from chatcli.bench.models import synthetic_model
    from chatcli.model.model_build import LARGE_MODEL_MATRIX_PARAMS, saved_matrix_params

    model, _ = synthetic_model("d4")
    sd = model.state_dict()
    matrices = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert saved_matrix_params(sd) == matrices and model.num_params() - matrices > 50_000_000
    assert pick_precision(torch.device("cpu"), matrix_params=saved_matrix_params(sd)).decode
    embedded = read_state_dict(resolve_checkpoint(None).model_file)
    assert saved_matrix_params(embedded) < LARGE_MODEL_MATRIX_PARAMS


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only machine")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_cuda_device_on_a_machine_without_one_is_a_fix_it_error(device):
    with pytest.raises(CheckpointError, match=rf"Device '{device}' was asked for, but no CUDA GPU"):
        pick_device(device)


def test_mps_on_a_machine_without_it_is_a_fix_it_error(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(CheckpointError, match="no Apple GPU"):
        pick_device("mps")
    assert pick_device("cpu") == torch.device("cpu")


@needs_reference
def test_listing_shows_a_foreign_or_unreadable_checkpoint_with_its_own_file(tmp_path):
    _, meta, tok = _files("E")
    tag = tmp_path / "chatsft_checkpoints" / "d21"
    tag.mkdir(parents=True)
    (tmp_path / "tokenizer").mkdir()
    shutil.copy(tok, tmp_path / "tokenizer" / "tokenizer.pkl")
    torch.save({"foo": torch.zeros(2)}, tag / "model_000001.pt")  # tensors, not a GPT
    (tag / "meta_000001.json").write_text(json.dumps(meta))
    (tag / "model_650.pt").write_bytes(b"junk")  # no zero padding in its name
    (tag / "model_000700.pt").symlink_to(tmp_path / "gone.pt")  # a link to nothing
    found = [c for c in list_checkpoints(tmp_path) if c.name != "embedded"]
    assert [(c.step, c.path.name, c.era, c.num_params) for c in found] == [
        (1, "model_000001.pt", "-", 0),
        (650, "model_650.pt", "-", 0),
        (700, "model_000700.pt", "-", 0),
    ]
    assert "does not hold a nanochat model" in found[0].problem
    assert found[1].size_bytes == 4 and found[1].problem
    assert found[2].size_bytes == 0 and "is not there" in found[2].problem


@pytest.mark.parametrize("device", ["cuda:", "cuda:01", "gpu"])
def test_a_device_name_torch_would_choke_on_is_refused_first(device):
    with pytest.raises(CheckpointError, match="use auto, cpu, cuda, cuda:N or mps"):
        pick_device(device)


@needs_reference
def test_a_model_file_with_another_step_asked_is_an_error(tmp_path):
    folder = _flat(tmp_path)
    assert resolve_checkpoint(folder / "model_000650.pt", step=650).step == 650
    with pytest.raises(
        CheckpointError, match=r"model_000650\.pt is step 650, but step 7 was asked"
    ):
        resolve_checkpoint(folder / "model_000650.pt", step=7)


@needs_reference
def test_a_relative_path_names_its_folder_and_a_sources_folder_its_source(tmp_path, monkeypatch):
    folder = _flat(tmp_path)
    monkeypatch.chdir(folder)
    ref = resolve_checkpoint(".")
    assert ref.tag == "download" and ref.model_file == folder / "model_000650.pt"
    base = tmp_path / "base"
    (base / "base_checkpoints").mkdir(parents=True)
    shutil.copytree(folder, base / "base_checkpoints" / "d4")
    assert resolve_checkpoint(base / "base_checkpoints").source == "base"


@needs_reference
def test_listing_takes_what_model_takes_a_download_folder_or_a_sources_folder(tmp_path):
    folder = _flat(tmp_path)
    [listed] = [c for c in list_checkpoints(folder) if c.name != "embedded"]
    assert (listed.step, listed.path, listed.problem) == (650, folder / "model_000650.pt", None)
    base = tmp_path / "base"
    (base / "base_checkpoints").mkdir(parents=True)
    shutil.copytree(folder, base / "base_checkpoints" / "d4")
    [listed] = [c for c in list_checkpoints(base / "base_checkpoints") if c.name != "embedded"]
    assert (listed.source, listed.tag, listed.step) == ("base", "d4", 650)


@needs_reference
def test_listing_a_base_dir_with_weights_at_its_top_too_keeps_its_sources(tmp_path):
    *_, tok = _files("E")
    base = tmp_path / "nc"
    _flat(tmp_path)
    shutil.copytree(tmp_path / "download", base / "chatsft_checkpoints" / "d4")
    (base / "tokenizer").mkdir()
    shutil.copy(tok, base / "tokenizer" / "tokenizer.pkl")
    shutil.copy(base / "chatsft_checkpoints" / "d4" / "model_000650.pt", base)  # a stray copy
    shutil.copy(base / "chatsft_checkpoints" / "d4" / "meta_000650.json", base)
    listed = {(c.source, c.tag, c.step) for c in list_checkpoints(base) if c.name != "embedded"}
    assert ("sft", "d4", 650) in listed and (None, "nc", 650) in listed
    # a base dir named like a source (x/base_checkpoints/chatsft_checkpoints/d4): what
    # --model finds there is listed too
    odd = tmp_path / "x" / "base_checkpoints"
    shutil.copytree(base / "chatsft_checkpoints", odd / "chatsft_checkpoints")
    shutil.copytree(base / "tokenizer", odd / "tokenizer")
    listed = {(c.source, c.tag, c.step) for c in list_checkpoints(odd) if c.name != "embedded"}
    assert listed == {("sft", "d4", 650)}
    assert resolve_checkpoint(odd).source == "sft"


def test_weights_pickled_oddly_give_no_warning_of_torchs(tmp_path):
    # Found by the fuzzer: a damaged protocol byte made torch warn on stderr ("Detected pickle
    # protocol 75 ... please file an issue") beside chatcli's own line.
    import warnings
    import zipfile

    path = tmp_path / "model_000001.pt"
    torch.save({"w": torch.zeros(2)}, path)
    with zipfile.ZipFile(path) as z:
        files = {n: z.read(n) for n in z.namelist()}
    pkl = next(n for n in files if n.endswith("data.pkl"))
    files[pkl] = b"\x80\x4b" + files[pkl][2:]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        try:  # torch reads it despite the byte, or chatcli says it cannot: either is fine
            outcome = read_state_dict(path)
        except CheckpointError as e:
            outcome = e
    assert isinstance(outcome, dict | CheckpointError)
    assert [str(w.message) for w in shown] == []
