"""Fuzzing every file chatcli reads: a nanochat checkpoint (its meta, its state dict's keys,
shapes and types, its tokenizer.pkl), a transformers folder (config.json, tokenizer.json,
tokenizer_config.json, the safetensors header and index), the Hub cache's layout (refs, links,
blobs) and conversation files. Each case starts from a valid file, damages it, and holds
chatcli to tests/fuzzing.py's contract: it loads and behaves, or one ChatcliError says why;
nothing else, no hang, and nothing written beside the files it read.
"""

from __future__ import annotations

import copy
import json
import pickle
import shutil
import struct
from pathlib import Path

import pytest

pytest.importorskip("hypothesis", reason="needs the dev extra: pip install -e '.[dev]'")

import torch
from fuzzing import (
    Untouched,
    budget,
    fuzz,
    hostile_values,
    loads_or_one_error,
    mutated,
    mutated_bytes,
)
from hf_models import TOKENIZER, random_gpt, save_nanochat
from hub_fakes import commit_of, write_hub_cache
from hypothesis import given
from hypothesis import strategies as st

from chatcli.chat.conversation_export import export_json, export_markdown
from chatcli.chat.conversation_format import message_problem
from chatcli.chat.conversation_index import list_conversations, resolve_conversation
from chatcli.chat.conversation_reader import read_conversation
from chatcli.errors import ChatcliError
from chatcli.model.checkpoint import load_model
from chatcli.model.tokenizer import Tokenizer, encoding_parts

pytestmark = fuzz
META, WEIGHTS = "meta_000007.json", "model_000007.pt"


@pytest.fixture(scope="module")
def nanochat(tmp_path_factory) -> Path:
    """A valid flat nanochat checkpoint of era E (vocabulary 1024, 4 layers of 64)."""
    return save_nanochat(random_gpt("E"), tmp_path_factory.mktemp("valid") / "nanochat")


@pytest.fixture(scope="module")
def transformers_folder(nanochat, tmp_path_factory) -> Path:
    """The same model exported to the transformers format, with an index for its one shard."""
    from chatcli.model.hf_export import GenerationDefaults, export_model, read_source

    out = tmp_path_factory.mktemp("valid") / "hf"
    export_model(out, read_source(str(nanochat), "sft", None, None), GenerationDefaults(0.6, 50))
    return out


def behaves(loaded: tuple) -> None:
    """A loaded model answers: logits of the tokenizer's width, finite, for a short prompt."""
    model, tokenizer, _ = loaded
    ids = tokenizer.encode("Hi 12", prepend="<|bos|>")[: model.config.sequence_len]
    with torch.no_grad():
        logits = model(torch.tensor([ids]))
    assert logits.shape[:2] == (1, len(ids)) and logits.shape[2] >= tokenizer.get_vocab_size()
    assert torch.isfinite(logits).all()
    assert tokenizer.decode(tokenizer.encode("Hi 12")) == "Hi 12"


def load_case(folder: Path, root: Path) -> None:
    untouched = Untouched(root)
    loaded = loads_or_one_error(lambda: load_model(folder, device="cpu"))
    if not isinstance(loaded, ChatcliError):
        behaves(loaded)
    untouched.check()


def a_case(root_factory, valid: Path) -> tuple[Path, Path]:
    root = root_factory.mktemp("case")
    return root, Path(shutil.copytree(valid, root / valid.name))


# ---- nanochat checkpoints -------------------------------------------------------------------


@given(st.data())
@budget(150)
def test_a_damaged_meta_loads_or_is_one_error(tmp_path_factory, nanochat, data):
    root, folder = a_case(tmp_path_factory, nanochat)
    meta = json.loads((nanochat / META).read_text())
    (folder / META).write_text(json.dumps(data.draw(mutated(meta)), default=str))
    load_case(folder, root)


def _reshaped(t: torch.Tensor, draw: st.DrawFn) -> torch.Tensor:
    shape = list(t.shape)
    how = draw(st.sampled_from(["grow", "shrink", "flatten", "add-dim", "empty"]))
    if how == "grow" or (how == "shrink" and shape and shape[0] <= 1):
        shape[0] = shape[0] + 1 if shape else 2
    elif how == "shrink":
        shape[0] -= 1
    elif how == "flatten":
        return t.reshape(-1)
    elif how == "add-dim":
        return t.unsqueeze(0)
    else:
        shape[0] = 0
    return torch.zeros(shape, dtype=t.dtype)


@st.composite
def damaged_state_dicts(draw: st.DrawFn, sd: dict) -> dict:
    sd = dict(sd)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(sd)))
        how = draw(st.sampled_from(["drop", "add", "reshape", "dtype", "not-a-tensor", "rename"]))
        if how == "drop" and len(sd) > 1:
            del sd[key]
        elif how == "add":
            sd[draw(st.sampled_from([key + ".x", "transformer.h.9.attn.c_q.weight", "x"]))] = sd[
                key
            ]
        elif how == "reshape":
            sd[key] = _reshaped(sd[key], draw) if isinstance(sd[key], torch.Tensor) else sd[key]
        elif how == "dtype" and isinstance(sd[key], torch.Tensor):
            dtype = draw(
                st.sampled_from(
                    [
                        torch.float16,
                        torch.bfloat16,
                        torch.float64,
                        torch.int64,
                        torch.bool,
                        torch.complex64,
                        torch.uint8,
                    ]
                )
            )
            sd[key] = sd[key].to(dtype)
        elif how == "not-a-tensor":
            sd[key] = draw(st.sampled_from([0, 1.5, "x", None, [1, 2], {"a": 1}]))
        else:
            sd[draw(st.sampled_from(["_orig_mod." + key, key.upper(), key + " "]))] = sd.pop(key)
    return sd


@given(st.data())
@budget(100)
def test_a_state_dict_of_other_keys_shapes_or_types_is_one_error(tmp_path_factory, nanochat, data):
    root, folder = a_case(tmp_path_factory, nanochat)
    sd = torch.load(nanochat / WEIGHTS, weights_only=True)
    torch.save(data.draw(damaged_state_dicts(sd)), folder / WEIGHTS)
    load_case(folder, root)


@given(st.data())
@budget(60)
def test_damaged_weight_bytes_are_one_error(tmp_path_factory, nanochat, data):
    root, folder = a_case(tmp_path_factory, nanochat)
    raw = (nanochat / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data.draw(mutated_bytes(raw)))
    load_case(folder, root)


def pickled_encoding(state: object) -> bytes:
    """`state` pickled as tiktoken pickles an Encoding (protocol 3, unframed): NEWOBJ of
    tiktoken.core.Encoding with no arguments, then BUILD with the state."""
    body = pickle.dumps(state, protocol=3)[2:-1]  # without its PROTO and STOP
    return b"\x80\x03ctiktoken.core\nEncoding\n)\x81" + body + b"b."


def _tokenizer_state() -> dict:
    enc = Tokenizer.from_file(TOKENIZER).enc
    parts = encoding_parts(enc)
    return {
        "name": enc.name,
        "pat_str": parts.pat_str,
        "mergeable_ranks": dict(parts.mergeable_ranks),
        "special_tokens": dict(parts.special_tokens),
    }


def tokenizer_behaves(path: Path, root: Path) -> None:
    untouched = Untouched(root)
    tokenizer = loads_or_one_error(lambda: Tokenizer.from_file(path))
    if not isinstance(tokenizer, ChatcliError):
        for text in ("Hello, world! 12345", "  \t\n", "ünïcödé ✓"):
            ids = loads_or_one_error(lambda text=text: tokenizer.encode(text))
            if not isinstance(ids, ChatcliError):
                assert tokenizer.decode(ids) == text
        conversation = [{"role": "user", "content": "hi"}]
        loads_or_one_error(lambda: tokenizer.render_for_completion(conversation))
    untouched.check()


@given(st.data())
@budget(150)
def test_a_damaged_tokenizer_pkl_loads_or_is_one_error(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("case")
    state = _tokenizer_state()
    if data.draw(st.booleans()):  # damaged in its values, pickled as tiktoken does
        small = {**state, "mergeable_ranks": dict(list(state["mergeable_ranks"].items())[:300])}
        value = data.draw(mutated(small, max_changes=2))
        raw = pickled_encoding(value)
    else:  # damaged in its bytes
        raw = data.draw(mutated_bytes(TOKENIZER.read_bytes()))
    (root / "tokenizer.pkl").write_bytes(raw)
    tokenizer_behaves(root / "tokenizer.pkl", root)


# ---- transformers folders --------------------------------------------------------------------


@given(st.data(), st.sampled_from(["config.json", "tokenizer.json", "tokenizer_config.json"]))
@budget(150)
def test_a_damaged_transformers_json_file_loads_or_is_one_error(
    tmp_path_factory, transformers_folder, data, name
):
    root, folder = a_case(tmp_path_factory, transformers_folder)
    valid = json.loads((transformers_folder / name).read_text())
    if name == "tokenizer.json":  # its vocab and merges are large: damage the rest more often
        valid = {**valid, "model": {k: v for k, v in valid["model"].items()}}
    value = data.draw(mutated(valid, max_changes=2))
    (folder / name).write_text(json.dumps(value, default=str))
    load_case(folder, root)


def _safetensors_parts(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


@given(st.data())
@budget(150)
def test_a_damaged_safetensors_header_is_one_error(tmp_path_factory, transformers_folder, data):
    root, folder = a_case(tmp_path_factory, transformers_folder)
    header, body = _safetensors_parts(transformers_folder / "model.safetensors")
    if data.draw(st.booleans()):
        text = json.dumps(data.draw(mutated(header, max_changes=2)), default=str).encode()
        raw = struct.pack("<Q", len(text)) + text + body
    else:
        text = json.dumps(header).encode()
        raw = data.draw(mutated_bytes(struct.pack("<Q", len(text)) + text)) + body
    (folder / "model.safetensors").write_bytes(raw)
    load_case(folder, root)


@given(st.data())
@budget(100)
def test_a_damaged_safetensors_index_is_one_error(tmp_path_factory, transformers_folder, data):
    root, folder = a_case(tmp_path_factory, transformers_folder)
    header, _ = _safetensors_parts(transformers_folder / "model.safetensors")
    index = {
        "metadata": {"total_size": 1},
        "weight_map": {k: "model.safetensors" for k in header if k != "__metadata__"},
    }
    value = data.draw(mutated({**index, "weight_map": dict(list(index["weight_map"].items())[:4])}))
    if isinstance(value, dict) and isinstance(value.get("weight_map"), dict):
        value["weight_map"] = {**index["weight_map"], **value["weight_map"]}
    (folder / "model.safetensors.index.json").write_text(json.dumps(value, default=str))
    load_case(folder, root)


# ---- the Hub cache ----------------------------------------------------------------------------


class HubCache:
    """huggingface_hub pointed at `cache`, offline, for the block: as HF_HUB_CACHE and
    HF_HUB_OFFLINE do when it is imported."""

    def __init__(self, cache: Path) -> None:
        import huggingface_hub

        self.constants = huggingface_hub.constants
        self.cache = cache

    def __enter__(self) -> None:
        self.saved = (self.constants.HF_HUB_CACHE, self.constants.HF_HUB_OFFLINE)
        self.constants.HF_HUB_CACHE, self.constants.HF_HUB_OFFLINE = str(self.cache), True

    def __exit__(self, *exc: object) -> None:
        self.constants.HF_HUB_CACHE, self.constants.HF_HUB_OFFLINE = self.saved


@given(st.data())
@budget(60)
def test_a_damaged_hub_cache_loads_lists_or_is_one_error(tmp_path_factory, nanochat, data):
    pytest.importorskip("huggingface_hub")
    from chatcli.model.hub_cache import list_cached_models

    root = tmp_path_factory.mktemp("case")
    cache = root / "hub"
    files = {p.name: p.read_bytes() for p in nanochat.iterdir()}
    commit = commit_of("fuzz")
    snapshot = write_hub_cache(cache, "org/name", files, commit)
    repo = snapshot.parent.parent
    for _ in range(data.draw(st.integers(1, 3))):
        how = data.draw(
            st.sampled_from(["ref", "dangling", "loop", "folder", "outside", "no-blob", "stray"])
        )
        link = snapshot / data.draw(st.sampled_from(sorted(files)))
        if how == "ref":
            ref = data.draw(st.sampled_from(["", "\n", commit[:7], "../../x", commit + "\n", "zz"]))
            (repo / "refs" / "main").write_text(
                data.draw(st.text(max_size=50)) if ref == "zz" else ref
            )
        elif how in ("dangling", "loop", "folder", "outside") and link.is_symlink():
            link.unlink()
            if how == "folder":
                link.mkdir()
            else:
                target = {
                    "dangling": "../../blobs/gone",
                    "loop": link.name,
                    "outside": "/etc/hostname",
                }
                link.symlink_to(target[how])
        elif how == "no-blob":
            blobs = sorted((repo / "blobs").iterdir())
            if blobs:
                data.draw(st.sampled_from(blobs)).unlink()
        else:
            where = data.draw(st.sampled_from([repo / "snapshots", repo / "refs", cache, repo]))
            stray = where / data.draw(st.sampled_from(["x", ".lock", "models--a--b", "main"]))
            if not stray.exists():
                stray.mkdir()
    untouched = Untouched(root)
    with HubCache(cache):
        listed = loads_or_one_error(list_cached_models)
        assert isinstance(listed, list | ChatcliError)
        loaded = loads_or_one_error(lambda: load_model("hf:org/name", device="cpu"))
        if not isinstance(loaded, ChatcliError):
            behaves(loaded)
    untouched.check()


# ---- conversation files ----------------------------------------------------------------------

VALID_RECORDS = [
    {"type": "header", "version": 1, "id": "c1", "created": "2026-01-02T03:04:05", "model": "d6"},
    {"type": "name", "name": "a talk"},
    {"type": "system", "text": "Be brief."},
    {"type": "message", "message": {"role": "user", "content": "What is 2+2?"}},
    {
        "type": "message",
        "message": {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "It is "},
                {"type": "python", "text": "2+2"},
                {"type": "python_output", "text": "4"},
            ],
        },
        "meta": {"finish_reason": "stop", "tokens": 9},
    },
    {"type": "message", "message": {"role": "user", "content": "And 3+3?"}},
    {"type": "replace_last", "message": {"role": "assistant", "content": "6"}},
    {"type": "undo"},
    {"type": "clear"},
]


@given(st.data())
@budget(300)
def test_a_damaged_conversation_file_reads_back_or_is_one_error(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("case")
    folder = root / "conversations"
    folder.mkdir()
    records = data.draw(mutated(copy.deepcopy(VALID_RECORDS), max_changes=4))
    lines = [json.dumps(r, default=str) for r in records] if isinstance(records, list) else ["{}"]
    raw = ("\n".join(lines) + "\n").encode()
    if data.draw(st.booleans()):
        raw = data.draw(mutated_bytes(raw))
    path = folder / "c1.jsonl"
    path.write_bytes(raw)
    untouched = Untouched(root)
    loaded = loads_or_one_error(lambda: read_conversation(path))
    if not isinstance(loaded, ChatcliError):
        messages = loaded.messages
        assert all(message_problem(m) is None for m in messages), messages
        turns = messages[1:] if messages and messages[0]["role"] == "system" else messages
        assert all(m["role"] == ("user", "assistant")[i % 2] for i, m in enumerate(turns))
        assert len(loaded.finishes) == len(messages)
        export_markdown(messages)
        json.loads(export_json(messages))
        tokenizer = Tokenizer.from_file(TOKENIZER)
        if turns and turns[-1]["role"] == "user":
            loads_or_one_error(lambda: tokenizer.render_for_completion(messages))
    listed = loads_or_one_error(lambda: list_conversations(folder))
    assert isinstance(listed, list | ChatcliError)
    found = loads_or_one_error(
        lambda: resolve_conversation(
            folder, data.draw(st.sampled_from(["c1", "a talk", "last", "x"]))
        )
    )
    assert isinstance(found, Path | ChatcliError)
    untouched.check()


@given(hostile_values())
@budget(100)
def test_any_json_line_in_a_conversation_is_read_or_skipped(tmp_path_factory, value):
    root = tmp_path_factory.mktemp("case")
    path = root / "c.jsonl"
    lines = [json.dumps(r) for r in VALID_RECORDS[:4]] + [json.dumps(value, default=str)]
    path.write_text("\n".join(lines) + "\n")
    loaded = loads_or_one_error(lambda: read_conversation(path))
    assert not isinstance(loaded, ChatcliError), loaded  # three good records: never refused
    assert loaded.messages[-1] == VALID_RECORDS[3]["message"] or len(loaded.messages) >= 1
