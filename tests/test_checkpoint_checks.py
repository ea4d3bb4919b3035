"""A checkpoint is checked before anything is built from it: the meta's numbers (type, range,
against the weights' shapes), the tensors torch.load hands back, and the weights' values."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from reference import REFERENCE, needs_reference

from chatcli.errors import CheckpointError
from chatcli.model import checkpoint_checks
from chatcli.model.checkpoint import load_model, read_state_dict
from chatcli.model.checkpoint_checks import (
    check_config_against_weights,
    check_finite,
    check_tensors,
    config_from_meta,
)
from chatcli.model.gpt import GPTConfig

FIXTURE = REFERENCE / "E"
META = Path("meta_000001.json")
GOOD = {
    "sequence_len": 256,
    "vocab_size": 512,
    "n_layer": 4,
    "n_head": 4,
    "n_kv_head": 2,
    "n_embd": 64,
    "window_pattern": "SSSL",
}


def checkpoint(tmp_path: Path, meta: dict | None = None, sd: dict | None = None) -> Path:
    """The era-E reference checkpoint as a download folder, with its meta or weights changed."""
    source = FIXTURE / "chatsft_checkpoints" / "d4"
    folder = tmp_path / "ckpt"
    folder.mkdir()
    saved = torch.load(source / "model_000001.pt", weights_only=True)
    torch.save(saved if sd is None else sd, folder / "model_000001.pt")
    original = json.loads((source / "meta_000001.json").read_text())
    if meta is not None:
        original["model_config"] = {**original["model_config"], **meta}
    (folder / "meta_000001.json").write_text(json.dumps(original))
    shutil.copy(FIXTURE / "tokenizer" / "tokenizer.pkl", folder / "tokenizer.pkl")
    return folder


def reference_weights() -> dict[str, torch.Tensor]:
    return torch.load(FIXTURE / "chatsft_checkpoints" / "d4" / "model_000001.pt", weights_only=True)


# ---- the meta's numbers -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n_layer": True}, "n_layer is True, not a whole number"),
        ({"n_head": "4"}, "n_head is '4', not a whole number"),
        ({"n_embd": 64.0}, "n_embd is 64.0, not a whole number"),
        ({"vocab_size": None}, "vocab_size is None, not a whole number"),
        ({"sequence_len": [256]}, r"sequence_len is \[256\], not a whole number"),
        ({"n_layer": 10**9}, "n_layer is 1000000000, outside 1 to 4,096"),
        ({"sequence_len": 10**8}, "sequence_len is 100000000, outside 1 to 1,048,576"),
        ({"n_embd": 3 * 10**9}, "n_embd is 3000000000, outside 1 to 65,536"),
        ({"n_kv_head": 0}, "n_kv_head is 0, outside 1 to 4,096"),
        ({"vocab_size": -5}, "vocab_size is -5, outside"),
        (
            {"n_layer": 10**400},
            "n_layer is 1000000000000000000000000000000000000000000000000000000",
        ),
        ({"n_head": 3}, r"n_embd \(64\) must divide by n_head \(3\)"),
        ({"n_kv_head": 8}, r"n_head by n_kv_head \(8\)"),
        ({"window_pattern": "SSXL"}, "window_pattern 'SSXL' is not made of S and L"),
        ({"window_pattern": "S" * 5000}, "window_pattern 'S{50,}… is not made of S and L"),
        ({"window_pattern": 4}, "window_pattern 4 is not made of S and L"),
    ],
)
def test_every_config_number_is_checked_for_type_and_range(change, message):
    with pytest.raises(CheckpointError, match=message):
        config_from_meta({**GOOD, **change}, META)


def test_a_config_that_fits_gives_its_gptconfig():
    assert config_from_meta(GOOD, META) == GPTConfig(256, 512, 4, 4, 2, 64, "SSSL")
    assert config_from_meta({**GOOD, "window_pattern": None}, META).window_pattern == "L"


def test_rotary_tables_that_would_not_fit_in_memory_are_refused(monkeypatch):
    # 2**20 positions of head_dim 16: 10 * 2**20 * 16 * 4 bytes = 640 MiB of tables.
    config = {**GOOD, "sequence_len": 1 << 20}
    monkeypatch.setattr(checkpoint_checks, "physical_memory", lambda: 1 << 30)
    with pytest.raises(CheckpointError, match=r"would need 0\.6 GiB for the rotary tables"):
        config_from_meta(config, META)
    monkeypatch.setattr(checkpoint_checks, "physical_memory", lambda: 16 << 30)
    assert config_from_meta(config, META).sequence_len == 1 << 20


@needs_reference
@pytest.mark.parametrize("n_layer", [10**9, 4096, 1000])
def test_a_meta_claiming_many_layers_fails_in_under_a_second(tmp_path, n_layer):
    folder = checkpoint(tmp_path, {"n_layer": n_layer})
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=f"n_layer.*{n_layer}"):
        load_model(folder, device="cpu")
    assert time.perf_counter() - start < 1.0


@needs_reference
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n_embd": 128, "n_head": 8, "n_kv_head": 4}, "says n_embd=128, but the token embedding"),
        ({"n_layer": 6}, "says n_layer=6, but the weights have 4 layers"),
        ({"vocab_size": 1024}, "has 512 rows but the meta's vocab_size is 1024"),
        ({"n_kv_head": 4}, r"n_kv_head=4 make keys 64 wide, but .*c_k\.weight has 32 rows"),
        ({"n_head": 2, "n_kv_head": 2}, r"n_kv_head=2 make keys 64 wide, but .*has 32 rows"),
    ],
)
def test_the_config_is_checked_against_the_weights_shapes(change, message):
    config = config_from_meta({**GOOD, **change}, META)
    with pytest.raises(CheckpointError, match=message):
        check_config_against_weights(config, reference_weights(), Path("model_000001.pt"))


def test_weights_without_a_token_embedding_or_layers_are_named():
    config = config_from_meta(GOOD, META)
    with pytest.raises(CheckpointError, match=r"missing key transformer\.wte\.weight"):
        check_config_against_weights(config, {}, Path("m.pt"))
    with pytest.raises(CheckpointError, match=r"transformer\.wte\.weight has shape \(512,\)"):
        check_config_against_weights(
            config, {"transformer.wte.weight": torch.zeros(512)}, Path("m")
        )
    only_table = {"transformer.wte.weight": torch.zeros(512, 64)}
    with pytest.raises(CheckpointError, match="the weights have 0 layers"):
        check_config_against_weights(config, only_table, Path("m.pt"))


# ---- the tensors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            torch.zeros(1).expand(512, 64),
            r"shape \(512, 64\) \(32,768 values\) but its storage holds 1",
        ),
        (
            torch.zeros(512 * 64).as_strided((512, 64), (0, 1)),
            r"strides \(0, 1\) that read the same",
        ),
        (torch.zeros(2500).as_strided((50, 50), (1, 1)), r"strides \(1, 1\) that read the same"),
        (torch.zeros(4, dtype=torch.int64), "holds int64 values; model weights are floating"),
        (torch.zeros(4, dtype=torch.bool), "holds bool values"),
        (torch.zeros(4, dtype=torch.complex64), "holds complex64 values"),
        (torch.zeros(4, device="meta"), "is a torch.strided meta tensor, not a plain one"),
        (torch.zeros(4, 4).to_sparse(), "is a torch.sparse_coo cpu tensor"),
        ("weights", "lm_head.weight is a str, not a tensor"),
    ],
    ids=["storage-small", "stride-0", "overlap", "int", "bool", "complex", "meta", "sparse", "str"],
)
def test_tensors_that_cannot_be_weights_are_refused(value, message):
    with pytest.raises(CheckpointError, match=message):
        check_tensors({"lm_head.weight": value}, Path("m.pt"))


def test_a_key_that_is_not_a_name_is_refused():
    with pytest.raises(CheckpointError, match="has a key 7 that is not a name"):
        check_tensors({7: torch.zeros(2)}, Path("m.pt"))


def test_plain_tensors_pass_whatever_their_layout():
    check_tensors(
        {
            "a": torch.zeros(3, 4),
            "b": torch.zeros(3, 4).t(),
            "c": torch.zeros(20)[::2],
            "d": torch.zeros(0, 3),
            "e": torch.zeros((), dtype=torch.bfloat16),
            "f": torch.zeros(4, 5)[1:],
        },
        Path("m.pt"),
    )


@needs_reference
def test_a_crafted_file_with_a_tensor_bigger_than_its_storage_is_refused_at_read(tmp_path):
    sd = reference_weights()
    sd["lm_head.weight"] = torch.zeros(1).expand(512, 64)  # saved with a storage of one value
    folder = checkpoint(tmp_path, sd=sd)
    with pytest.raises(CheckpointError, match=r"lm_head\.weight has shape \(512, 64\)"):
        read_state_dict(folder / "model_000001.pt")


# ---- the values --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_anywhere_is_found(dtype, bad):
    for n in (1, 2, 3, 4, 7, 64):
        for at in range(n):
            base = torch.randn(n + 3).to(dtype)
            t = base[1 : 1 + n]  # not at the storage's start: the float32 pairs shift
            t[at] = bad
            what = "NaN" if bad != bad else "infinite"
            with pytest.raises(
                CheckpointError, match=rf"holds {what} values \(the first at index {at}\)"
            ):
                check_finite({"w": t}, Path("m.pt"))
        check_finite({"w": torch.randn(n).to(dtype)}, Path("m.pt"))


def test_finite_values_whose_sum_overflows_are_not_refused():
    check_finite({"w": torch.full((8,), 3e38)}, Path("m.pt"))
    check_finite({"w": torch.full((4,), 6e4, dtype=torch.float16)}, Path("m.pt"))


def test_a_large_table_is_checked_through_its_chunks():
    t = torch.randn(checkpoint_checks.FINITE_CHUNK * 2 + 5).bfloat16()
    check_finite({"w": t}, Path("m.pt"))
    t[checkpoint_checks.FINITE_CHUNK + 3] = float("nan")
    at = f"{checkpoint_checks.FINITE_CHUNK + 3:,}"
    with pytest.raises(CheckpointError, match=f"the first at index {at}"):
        check_finite({"w": t}, Path("m.pt"))


@needs_reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_checkpoint_with_nan_or_inf_weights_is_refused_at_load(tmp_path, dtype, bad):
    sd = {k: v.to(dtype) for k, v in reference_weights().items()}
    sd["transformer.h.2.mlp.c_fc.weight"][7, 3] = bad
    folder = checkpoint(tmp_path, sd=sd)
    with pytest.raises(
        CheckpointError, match=r"transformer\.h\.2\.mlp\.c_fc\.weight holds (NaN|infinite) values"
    ):
        load_model(folder, device="cpu")
