"""POST /tokenize and /detokenize on a real server (the embedded model, batched, an API key):
vLLM's shapes, a conversation counted exactly as the chat route prefills it, special tokens
both ways, and a 400 in OpenAI's error shape naming the field for what is not a token.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")

import httpx

from chatcli.engine.scheduler import default_rows
from chatcli.model.special_tokens import ASSISTANT_START, BOS
from chatcli.serve.app import Worker, create_app
from chatcli.serve.guards import hosts_to_check
from chatcli.serve.runner import BackgroundServer

KEY = "tokenize-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = "Naïve café: 1234*56 = ? 🙂 " + " ".join(f"word{i}" for i in range(40))
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 1234*56?"},
    {"role": "assistant", "content": "It is [calc 1234*56 = 69104] 69104."},
    {"role": "user", "content": TEXT},
]


@pytest.fixture(scope="module")
def served():
    from chatcli.model.checkpoint import load_model

    model, tokenizer, _ = load_model(None, device="cpu")
    app = create_app(
        [Worker(model, tokenizer, batch=default_rows("cpu"))],
        model_name="chatcli-embedded",
        allowed_hosts=hosts_to_check("127.0.0.1"),
        api_keys=[KEY],
    )
    with BackgroundServer(app) as server:
        yield server, tokenizer, model.config.sequence_len


def post(server: BackgroundServer, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)


def test_a_prompt_is_its_tokens_with_bos_first_unless_asked_without(served):
    server, tokenizer, context = served
    r = post(server, "/tokenize", {"prompt": TEXT, "model": "chatcli-embedded"})
    assert r.status_code == 200, r.text
    ids = tokenizer.encode(TEXT, prepend=BOS)
    assert r.json() == {
        "count": len(ids),
        "max_model_len": context,
        "tokens": ids,
        "token_strs": None,
    }
    assert len(ids) > 64
    plain = post(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    assert plain["tokens"] == ids[1:] and plain["count"] == len(ids) - 1


def test_token_strs_show_each_token_and_the_special_ones_by_name(served):
    server, _, _ = served
    r = post(server, "/tokenize", {"prompt": "hello world", "return_token_strs": True})
    strs = r.json()["token_strs"]
    assert strs[0] == "<|bos|>" and "".join(strs[1:]) == "hello world"
    assert len(strs) == r.json()["count"]


def test_messages_count_exactly_what_the_chat_route_prefills(served):
    server, tokenizer, _ = served
    r = post(server, "/tokenize", {"messages": CONVERSATION})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert tokens[0] == tokenizer.get_bos_token_id()
    assert tokens[-1] == tokenizer.encode_special(ASSISTANT_START)
    chat = post(server, "/v1/chat/completions", {"messages": CONVERSATION, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    without = post(server, "/tokenize", {"messages": CONVERSATION, "add_generation_prompt": False})
    assert without.json()["tokens"] == tokens[:-1]


def test_detokenize_gives_the_text_back_special_tokens_included(served):
    server, _, _ = served
    tokens = post(server, "/tokenize", {"messages": CONVERSATION}).json()["tokens"]
    r = post(server, "/detokenize", {"tokens": tokens, "model": "chatcli-embedded"})
    assert r.status_code == 200, r.text
    text = r.json()["prompt"]
    assert text.startswith("<|bos|><|user_start|>You answer briefly.\n\nWhat is 1234*56?")
    # The calculator marker is replayed as the call and its forced result.
    assert "<|python_start|>1234*56<|python_end|><|output_start|>69104<|output_end|>" in text
    assert text.endswith(f"{TEXT}<|user_end|><|assistant_start|>")
    plain = post(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    assert post(server, "/detokenize", {"tokens": plain["tokens"]}).json() == {"prompt": TEXT}
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tokens": [1, 1024]}, "tokens", "tokens[1] is 1024"),
        ({"tokens": [-1]}, "tokens", "tokens[0] is -1"),
        ({"tokens": [1, True]}, "tokens[1]", "valid integer"),
        ({"tokens": ["5"]}, "tokens[0]", "valid integer"),
        ({"tokens": [2.5]}, "tokens[0]", "valid integer"),
        ({"tokens": "1 2"}, "tokens", "valid list"),
        ({}, "tokens", "required"),
    ],
)
def test_what_is_not_a_token_is_a_400_naming_the_field(served, body, param, says):
    server, _, _ = served
    r = post(server, "/detokenize", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert says in error["message"], error["message"]


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({}, None, "exactly one of them"),
        ({"prompt": "a", "messages": CONVERSATION}, None, "exactly one of them"),
        ({"prompt": 5}, "prompt", "valid string"),
        ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", "valid boolean"),
        ({"messages": []}, "messages", "at least one message"),
        ({"messages": CONVERSATION[:3]}, "messages", "the last message must be from the user"),
        ({"messages": CONVERSATION, "add_special_tokens": True}, None, "add_special_tokens"),
        ({"prompt": "x" * 32001}, "prompt", "the limit is 32000"),
    ],
)
def test_a_bad_tokenize_request_is_a_400_naming_the_field(served, body, param, says):
    server, _, _ = served
    r = post(server, "/tokenize", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_both_routes_need_json_and_the_key(served):
    server, _, _ = served
    for path in ("/tokenize", "/detokenize"):
        r = httpx.post(f"{server.url}{path}", json={"tokens": [1], "prompt": "a"}, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(
            f"{server.url}{path}", content="{", headers={**AUTH, "Content-Type": "application/json"}
        )
        assert (
            r.status_code == 400 and r.json()["error"]["message"] == "The body is not valid JSON."
        )
        r = httpx.post(
            f"{server.url}{path}", content="a", headers={**AUTH, "Content-Type": "text/plain"}
        )
        assert r.status_code == 415
