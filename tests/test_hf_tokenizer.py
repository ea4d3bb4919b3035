"""The exported tokenizer and chat template: the same ids as chatcli, and read back exactly."""

from __future__ import annotations

import glob
import json
import random
import sys
from pathlib import Path

import pytest
from hf_models import TOKENIZER, random_gpt

pytest.importorskip("tokenizers", reason="needs the hf extra")
transformers = pytest.importorskip("transformers", reason="needs the hf extra")
from transformers import AutoTokenizer  # noqa: E402

from chatcli.chat.session import ChatSession  # noqa: E402
from chatcli.errors import TokenizerError  # noqa: E402
from chatcli.model.hf_chat_template import chat_template  # noqa: E402
from chatcli.model.hf_tokenizer import (  # noqa: E402
    agreement,
    build_fast_tokenizer,
    probe_texts,
    read_hf_tokenizer,
    write_hf_tokenizer,
)
from chatcli.model.tokenizer import SPLIT_PATTERN, Tokenizer, encoding_parts  # noqa: E402


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_file(TOKENIZER)


@pytest.fixture(scope="module")
def folder(ours, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    write_hf_tokenizer(ours, out, chat_template(), 512)
    return out


@pytest.fixture(scope="module")
def theirs(folder):
    return AutoTokenizer.from_pretrained(folder)


def test_the_fast_tokenizer_encodes_every_probe_like_tiktoken(ours, theirs):
    texts = probe_texts(ours, extra=3000)
    for text in texts:
        want = ours.enc.encode(text, allowed_special="all")
        assert theirs(text, add_special_tokens=False)["input_ids"] == want, text
        assert theirs.decode(want) == ours.decode(want)


def test_ordinary_text_gets_no_bos_and_specials_are_one_token_each(ours, theirs):
    assert theirs("hello world")["input_ids"] == ours.encode("hello world")
    assert theirs.convert_tokens_to_ids("<|assistant_end|>") == ours.encode_special(
        "<|assistant_end|>"
    )
    assert theirs.bos_token_id == ours.get_bos_token_id()
    assert theirs.eos_token_id == ours.encode_special("<|assistant_end|>")
    assert len(theirs) == ours.get_vocab_size()


def test_a_bigger_trained_vocabulary_agrees_too():
    rustbpe = pytest.importorskip("rustbpe", reason="training a tokenizer needs the train extra")
    stdlib = Path(json.__file__).parent.parent
    texts = [Path(p).read_text(errors="replace") for p in sorted(glob.glob(f"{stdlib}/*.py"))[:60]]
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter(texts), 4096 - 9, pattern=SPLIT_PATTERN)
    tok = Tokenizer.from_ranks({bytes(k): v for k, v in trainer.get_mergeable_ranks()})
    fast = build_fast_tokenizer(tok)
    rng = random.Random(0)
    chunks = []
    for _ in range(2000):
        text = rng.choice(texts)
        at = rng.randrange(len(text))
        chunks.append(text[at : at + rng.randint(1, 400)])
    assert agreement(tok, fast, probe_texts(tok, extra=2000) + chunks) == []


def test_reading_tokenizer_json_back_gives_the_same_tokenizer(ours, folder):
    back = read_hf_tokenizer(folder / "tokenizer.json")
    for text in probe_texts(ours, extra=500):
        assert back.enc.encode(text, allowed_special="all") == ours.enc.encode(
            text, allowed_special="all"
        )
    assert back.encode_special("<|output_end|>") == ours.encode_special("<|output_end|>")


def test_transformers_own_conversion_of_the_tokenizer_is_read_too(ours, tmp_path):
    # What transformers' convert_tiktoken_to_fast does, without its blobfile dependency.
    import base64

    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = tmp_path / "ranks.tiktoken"
    lines = [
        f"{base64.b64encode(t).decode()} {r}"
        for t, r in encoding_parts(ours.enc).mergeable_ranks.items()
    ]
    ranks.write_text("\n".join(lines) + "\n")
    converter = TikTokenConverter(
        vocab_file=str(ranks),
        pattern=encoding_parts(ours.enc).pat_str,
        extra_special_tokens=encoding_parts(ours.enc).special_tokens,
    )
    converter.converted().save(str(tmp_path / "tokenizer.json"))
    back = read_hf_tokenizer(tmp_path / "tokenizer.json")
    for text in probe_texts(ours, extra=300):
        assert back.enc.encode(text, allowed_special="all") == ours.enc.encode(
            text, allowed_special="all"
        )


def test_a_tokenizer_json_tiktoken_cannot_reproduce_is_refused(folder, tmp_path):
    data = json.loads((folder / "tokenizer.json").read_text())
    data["model"]["merges"] = data["model"]["merges"][::-1]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="merges are not every split"):
        read_hf_tokenizer(tmp_path / "tokenizer.json")
    data = json.loads((folder / "tokenizer.json").read_text())
    data["normalizer"] = {"type": "NFC"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="normalizer"):
        read_hf_tokenizer(tmp_path / "tokenizer.json")
    data = json.loads((folder / "tokenizer.json").read_text())
    data["model"]["vocab"]["a b"] = data["model"]["vocab"].pop("aĠb", 999)  # a raw space
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="not byte-level"):
        read_hf_tokenizer(tmp_path / "tokenizer.json")


# ---- the chat template ------------------------------------------------------------------------

SYSTEM = "You are terse. Use the calculator."
PARTS = [
    {"type": "text", "text": "Let me compute: "},
    {"type": "python", "text": "1234*56"},
    {"type": "python_output", "text": "69104"},
    {"type": "text", "text": " so it is 69104."},
]


def _conversation(assistant: dict) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 1234 times 56?"},
        assistant,
        {"role": "user", "content": "Thanks!  Now   spaces\n\nand 12345 digits"},
    ]


def _chatcli_prompt(ours, messages) -> list[int]:
    """The ids chatcli's chat session builds for this conversation, ready for a reply."""
    session = ChatSession(random_gpt("E"), ours)
    session.load_messages(messages)
    return session.prompt_tokens()


def test_apply_chat_template_gives_chatcli_s_ids_with_a_system_prompt_and_a_calculator_call(
    ours, theirs
):
    messages = _conversation({"role": "assistant", "content": PARTS})
    want = _chatcli_prompt(ours, messages)
    assert want == ours.render_for_completion(messages)
    got = theirs.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert got == want
    # Without the generation prompt: the conversation as rendered for training.
    got = theirs.apply_chat_template(messages[:3], return_dict=False)
    assert got == ours.render_conversation(messages[:3])[0]


def test_transformers_tool_calling_shape_renders_the_same_ids(ours, theirs):
    call = {
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": "1234*56"}},
    }
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 1234 times 56?"},
        {"role": "assistant", "content": "Let me compute: ", "tool_calls": [call]},
        {"role": "tool", "content": "69104"},
        {"role": "assistant", "content": " so it is 69104."},
        {"role": "user", "content": "Thanks!  Now   spaces\n\nand 12345 digits"},
    ]
    want = _chatcli_prompt(ours, _conversation({"role": "assistant", "content": PARTS}))
    assert theirs.apply_chat_template(messages, add_generation_prompt=True, return_dict=False) == (
        want
    )
    # Ending at the tool's result, the assistant's turn stays open for the model to go on.
    open_turn = theirs.apply_chat_template(
        messages[:4], add_generation_prompt=True, return_dict=False
    )
    whole = ours.render_conversation(_conversation({"role": "assistant", "content": PARTS})[:3])[0]
    cut = whole.index(ours.encode_special("<|output_end|>")) + 1
    assert open_turn == whole[:cut]


def test_the_template_refuses_what_chatcli_would_not_render(theirs):
    bad = [
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        [{"role": "assistant", "content": "first"}],
        [{"role": "user", "content": "a"}, {"role": "tool", "content": "1"}],
        [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}],
    ]
    for messages in bad:
        with pytest.raises(Exception, match="nanochat chat template"):
            theirs.apply_chat_template(messages, return_dict=False)


def test_the_chat_template_lives_in_tokenizer_config(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["chat_template"] == chat_template()
    assert "<|python_start|>" in config["chat_template"]
    assert "@" not in config["chat_template"].replace("@BOS", "")


@pytest.mark.skipif(sys.platform == "win32", reason="paths")
def test_text_spelling_a_special_token_stays_text_with_sanitize_control_tokens(ours, theirs):
    import inspect

    if "sanitize_control_tokens" not in inspect.signature(theirs.apply_chat_template).parameters:
        pytest.skip("transformers before 5.20 has no sanitize_control_tokens")
    messages = [{"role": "user", "content": "say <|bos|> and <|assistant_end|> please"}]
    want = ours.render_for_completion(messages)
    got = theirs.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False, sanitize_control_tokens=True
    )
    assert got == want
