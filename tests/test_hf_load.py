"""Transformers-format folders as --model, and the export command around them.

An export loads back bit for bit; transformers' own nanochat folders load too; the command
writes what its flags say and fails in one line; and a folder chatcli cannot run exactly is
refused with a message saying what is wrong, without running any of its code.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys

import pytest
import torch
from hf_models import era_checkpoint, exported, random_gpt, save_nanochat
from reference import needs_reference
from typer.testing import CliRunner

from chatcli.cli.app import app
from chatcli.errors import CheckpointError
from chatcli.model.checkpoint import load_model
from chatcli.model.hf_weights import read_safetensors

pytest.importorskip("safetensors", reason="needs the hf extra")
runner = CliRunner()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf-load")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("CHATCLI_MODEL", "CHATCLI_CONFIG", "CHATCLI_STEP", "CHATCLI_SOURCE"):
        monkeypatch.delenv(name, raising=False)


def _case(name, root, remote_code=False):
    if name in ("A", "E") and not era_checkpoint(name, root).is_dir():
        pytest.skip("reference fixtures not found")
    return era_checkpoint(name, root), exported(name, root, remote_code)


@pytest.mark.parametrize("name", ["A", "B", "C", "C-padded", "D", "E"])
def test_an_export_loads_back_bit_for_bit(name, root):
    checkpoint, out = _case(name, root)
    before, tok_before, _ = load_model(checkpoint, device="cpu")
    after, tok_after, meta = load_model(out, device="cpu")
    assert meta["format"] == "transformers"
    assert after.arch.era == before.arch.era and after.info.era == before.arch.era
    assert after.config == before.config
    want, got = before.state_dict(), after.state_dict()
    assert want.keys() == got.keys()
    for key, tensor in want.items():
        rows = got[key].shape[0]
        # The vocabulary's padding rows are left out: nothing reads them.
        assert torch.equal(got[key], tensor[:rows] if rows < tensor.shape[0] else tensor), key
    ids = torch.randint(0, 500, (1, 150), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(after(ids), before(ids))
    assert tok_after.encode("Hello  world 123") == tok_before.encode("Hello  world 123")


def test_keep_writes_each_tensor_as_saved_and_float32_widens(root, tmp_path):
    _, out = _case("C-padded", root)  # bf16 tables, fp32 matrices
    tensors = read_safetensors(out / "model.safetensors")
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["model.value_embeds.3.weight"].dtype == torch.bfloat16
    assert tensors["lm_head.weight"].dtype == torch.float32
    assert tensors["model.embed_tokens.weight"].shape[0] == 1024  # not the 1088 padded rows
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    for dtype in ("float32", "bfloat16"):
        model = str(era_checkpoint("C-padded", root))
        result = runner.invoke(
            app, ["export", str(tmp_path / dtype), "--model", model, "--dtype", dtype]
        )
        assert result.exit_code == 0, result.output
        written = read_safetensors(tmp_path / dtype / "model.safetensors")
        assert {t.dtype for t in written.values()} == {getattr(torch, dtype)}
        assert json.loads((tmp_path / dtype / "config.json").read_text())["dtype"] == dtype
    widened = read_safetensors(tmp_path / "float32" / "model.safetensors")
    assert torch.equal(widened["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])


def test_an_export_starts_its_weights_on_64_byte_boundaries_as_safetensors_reads_them(root):
    # MKL's products can round differently on data aligned otherwise: an export read in
    # place must compute what the checkpoint computes, at d20's sizes too.
    from safetensors.torch import load_file

    _, out = _case("E", root)
    ours = read_safetensors(out / "model.safetensors")
    theirs = load_file(out / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
        if tensor.ndim == 2 and tensor.numel() * tensor.element_size() % 64 == 0:
            assert tensor.data_ptr() % 64 == 0, name


@pytest.mark.parametrize("name", ["A", "C"])
def test_a_softcap_override_is_written_and_read_back(name, root, tmp_path):
    # The March 2026 variant capped at 20, which nothing in a checkpoint records.
    checkpoint = era_checkpoint(name, root)
    if not checkpoint.is_dir():
        pytest.skip("reference fixtures not found")
    out = tmp_path / "cap20"
    result = runner.invoke(app, ["export", str(out), "--model", str(checkpoint), "--softcap", "20"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["final_logit_softcapping"] == 20.0
    want, _, _ = load_model(checkpoint, device="cpu", softcap=20)
    got, _, _ = load_model(out, device="cpu")
    assert got.arch.softcap == 20.0
    ids = torch.tensor([[7, 8, 9, 10, 11]])
    with torch.no_grad():
        assert torch.equal(got(ids), want(ids))


def test_a_sharded_export_writes_an_index_and_loads_in_both(root, tmp_path):
    from chatcli.model.hf_export import GenerationDefaults, export_model, read_source

    src = read_source(str(era_checkpoint("D", root)), "sft", None, None)
    out = tmp_path / "sharded"
    export_model(out, src, GenerationDefaults(0.6, 50), max_shard_size=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    ours, _, _ = load_model(out, device="cpu")
    want, _, _ = load_model(era_checkpoint("D", root), device="cpu")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(ours(ids), want(ids))
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, dtype=torch.float32
    )
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, want(ids), atol=1e-4, rtol=0)


def test_loading_an_export_needs_only_safetensors_of_the_hf_libraries(root, monkeypatch):
    _, out = _case("B", root)
    for name in ("tokenizers", "transformers", "huggingface_hub"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    model, tokenizer, _ = load_model(out, device="cpu")
    assert model.arch.era == "B" and tokenizer.get_vocab_size() == 1024
    monkeypatch.setitem(sys.modules, "safetensors", None)
    result = runner.invoke(app, ["once", "hi", "--model", str(out)])
    assert result.exit_code == 1
    assert "needs the safetensors package: pip install 'chatcli[hf]'" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_once_runs_an_export_as_it_runs_the_checkpoint(root):
    checkpoint, out = _case("E", root)
    args = ["once", "What is 2+2?", "-t", "0", "--max-tokens", "12"]
    want = runner.invoke(app, [*args, "--model", str(checkpoint)])
    got = runner.invoke(app, [*args, "--model", str(out)])
    assert want.exit_code == 0 and got.exit_code == 0, got.output
    assert got.stdout == want.stdout and got.stdout.strip()


def test_transformers_own_nanochat_folder_loads(root, tmp_path):
    transformers = pytest.importorskip("transformers")
    checkpoint, out = _case("A", root)
    native = transformers.NanoChatForCausalLM.from_pretrained(out, dtype=torch.float32)
    theirs = tmp_path / "saved-by-transformers"
    native.save_pretrained(theirs)  # transformers' own config.json, all its defaults
    shutil.copyfile(out / "tokenizer.json", theirs / "tokenizer.json")
    config = json.loads((theirs / "config.json").read_text())
    assert config["model_type"] == "nanochat"
    ours, _, _ = load_model(theirs, device="cpu")
    want, _, _ = load_model(checkpoint, device="cpu")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(ours(ids), want(ids))


# ---- the command ------------------------------------------------------------------------------


@needs_reference
def test_export_writes_the_folder_and_says_what_it_wrote(tmp_path):
    out = tmp_path / "e"
    result = runner.invoke(app, ["export", str(out), "--model", str(era_checkpoint("E", tmp_path))])
    assert result.exit_code == 0, result.output
    assert "era E" in result.stdout and "trust_remote_code" in result.stdout
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "README.md",
        "config.json",
        "configuration_chatcli_nanochat.py",
        "generation_config.json",
        "model.safetensors",
        "modeling_chatcli_nanochat.py",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["temperature"] == 0.6 and generation["top_k"] == 50  # chatcli's defaults
    # The fixture's vocabulary is 512: <|bos|> is 503, <|assistant_end|> 507.
    assert generation["eos_token_id"] == [507, 503]
    assert generation["pad_token_id"] == 507
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (503, 507)
    assert config["auto_map"]["AutoModelForCausalLM"].startswith("modeling_chatcli_nanochat.")
    card = (out / "README.md").read_text()
    assert "era E" in card and "chatcli serve" in card
    assert not list(tmp_path.glob(".e.partial-*"))


def test_export_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    result = runner.invoke(app, ["export", str(tmp_path / "taken")])
    assert result.exit_code == 1
    assert "is not an empty folder" in result.output and len(result.output.splitlines()) == 1
    assert (tmp_path / "taken" / "x").read_text() == "mine"


def test_export_refuses_an_unknown_dtype_before_reading_the_model(tmp_path):
    result = runner.invoke(
        app, ["export", str(tmp_path / "x"), "--model", "/nowhere", "--dtype", "fp8"]
    )
    assert result.exit_code == 1
    assert "Unknown --dtype 'fp8'; use keep, float32, bfloat16." in result.output


def test_export_without_the_hf_extra_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    result = runner.invoke(app, ["export", str(tmp_path / "x")])
    assert result.exit_code == 1
    assert "pip install 'chatcli[hf]'" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


# ---- refusals ---------------------------------------------------------------------------------


def _copy(root, tmp_path, name="B"):
    _, out = _case(name, root)
    folder = tmp_path / "copy"
    shutil.copytree(out, folder)
    return folder


def test_a_folder_with_pickled_weights_only_is_refused(root, tmp_path):
    folder = _copy(root, tmp_path)
    (folder / "model.safetensors").unlink()
    torch.save({}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="only as safetensors"):
        load_model(folder, device="cpu")


def test_weights_no_nanochat_has_are_refused(root, tmp_path):
    from safetensors.torch import save_file

    folder = _copy(root, tmp_path)
    tensors = dict(read_safetensors(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"no nanochat model has: .*q_norm"):
        load_model(folder, device="cpu")


def test_a_config_of_another_era_than_the_weights_is_refused(root, tmp_path):
    folder = _copy(root, tmp_path, "C")
    config = json.loads((folder / "config.json").read_text())
    config["nanochat_era"] = "B"
    config["value_embed_layers"], config["value_gate_channels"] = [], 0
    config["value_gate_scale"] = 0.0
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"era B, but the weights .* era C"):
        load_model(folder, device="cpu")


def test_a_config_that_does_not_match_its_era_is_refused(root, tmp_path):
    folder = _copy(root, tmp_path, "D")
    config = json.loads((folder / "config.json").read_text())
    config["qk_scale"] = 1.3
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"qk_scale is 1\.3 \(expected 1\.15\)"):
        load_model(folder, device="cpu")


def test_a_native_config_nanochat_did_not_train_is_refused(root, tmp_path):
    folder = _copy(root, tmp_path, "A") if era_checkpoint("A", root).is_dir() else None
    if folder is None:
        pytest.skip("reference fixtures not found")
    config = json.loads((folder / "config.json").read_text())
    config["hidden_act"] = "silu"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="hidden_act is 'silu'"):
        load_model(folder, device="cpu")


def test_a_cut_or_lying_safetensors_file_is_refused(root, tmp_path):
    folder = _copy(root, tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a whole safetensors file"):
        load_model(folder, device="cpu")
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 4  # claims more bytes than its shape holds
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    with pytest.raises(
        CheckpointError, match=r"not a whole .*\(invalid shape, data type, or offset"
    ):
        load_model(folder, device="cpu")


def test_an_index_naming_files_outside_its_folder_is_refused(root, tmp_path):
    folder = _copy(root, tmp_path)
    index = {"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside its folder"):
        load_model(folder, device="cpu")


def test_a_step_for_a_transformers_folder_is_refused(root):
    _, out = _case("B", root)
    with pytest.raises(CheckpointError, match="not steps"):
        load_model(out, step=3, device="cpu")


def test_a_nanochat_folder_with_a_config_json_stays_nanochat(tmp_path):
    folder = save_nanochat(random_gpt("B"), tmp_path / "n")
    (folder / "config.json").write_text("{}")
    model, _, meta = load_model(folder, device="cpu")
    assert model.arch.era == "B" and meta["step"] == 7
