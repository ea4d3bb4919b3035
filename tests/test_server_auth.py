"""API keys on a server: who gets in, what the others are told, where keys come from, and
that chatcli's own clients and the openai library send them. Real servers on 127.0.0.1."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("httpx", reason="needs the serve extra: pip install -e '.[serve]'")

import httpx
from fakes import reply
from fastapi import FastAPI
from serving import END, scripted_worker, text_tokens
from typer.testing import CliRunner

from chatcli.cli.app import app as cli_app
from chatcli.errors import ConfigError
from chatcli.serve.app import Limits, create_app
from chatcli.serve.auth import ApiKeyCheck, bearer_token, key_matches, open_server_warning
from chatcli.serve.keys import api_keys, read_key_file
from chatcli.serve.runner import BackgroundServer

KEYS = ("sk-first-0123456789", "second.key/with+punct=")
HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
runner = CliRunner()


@pytest.fixture(scope="module")
def locked():
    """A server that answers "Hello!" to those with one of KEYS."""
    worker = scripted_worker(reply([*text_tokens("Hello!"), END]))
    server = BackgroundServer(create_app([worker], Limits(), "scripted", api_keys=KEYS)).start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    for name in ("CHATCLI_API_KEY", "CHATCLI_URL", "CHATCLI_MODEL", "CHATCLI_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---- who gets in --------------------------------------------------------------------------------


@pytest.mark.parametrize("key", KEYS)
def test_each_key_opens_every_route(locked, key):
    models = httpx.get(f"{locked.url}/v1/models", headers=bearer(key))
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "scripted"
    assert httpx.get(f"{locked.url}/v1/models/scripted", headers=bearer(key)).status_code == 200
    assert httpx.get(f"{locked.url}/stats", headers=bearer(key)).status_code == 200
    done = httpx.post(f"{locked.url}/v1/chat/completions", json=HI, headers=bearer(key), timeout=30)
    assert done.json()["choices"][0]["message"]["content"] == "Hello!"
    with httpx.stream(
        "POST",
        f"{locked.url}/v1/chat/completions",
        json={**HI, "stream": True},
        headers=bearer(key),
        timeout=30,
    ) as stream:
        assert stream.status_code == 200
        assert stream.read().decode().endswith("data: [DONE]\n\n")


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": "bearer sk-first-0123456789"},  # the scheme in any case
        {"Authorization": "BEARER   sk-first-0123456789"},  # and more spaces before the key
    ],
)
def test_the_scheme_is_read_in_any_case_and_spaces_before_the_key_do_not_count(locked, headers):
    assert httpx.get(f"{locked.url}/v1/models", headers=headers).status_code == 200


WRONG = "The API key sent is not one this server takes."
MISSING = "This server needs an API key, sent as the header Authorization: Bearer KEY."
NOT_BEARER = "The Authorization header must be Bearer KEY, with this server's API key."


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({}, MISSING),
        (bearer("nope"), WRONG),
        (bearer(KEYS[0][:-1]), WRONG),  # one character short
        (bearer(KEYS[0] + "0"), WRONG),  # one too many
        (bearer(KEYS[0].upper()), WRONG),  # keys are case-sensitive
        (bearer(KEYS[0] + KEYS[1]), WRONG),  # both at once is neither
        ({"Authorization": f"Basic {KEYS[0]}"}, NOT_BEARER),
        ({"Authorization": KEYS[0]}, NOT_BEARER),  # the key without its scheme
        ({"Authorization": "Bearer"}, NOT_BEARER),  # the scheme without its key
        ({"Authorization": ""}, NOT_BEARER),
        ({"X-Api-Key": KEYS[0]}, MISSING),  # another header is not the one asked for
    ],
)
def test_a_request_without_a_key_it_takes_gets_a_401_in_openai_shape(locked, headers, message):
    for method, path in [
        ("GET", "/v1/models"),
        ("HEAD", "/v1/models"),
        ("GET", "/v1/models/scripted"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/stats"),
        ("GET", "/no/such/path"),  # an unknown path says nothing of what exists either
    ]:
        response = httpx.request(method, locked.url + path, json=HI, headers=headers)
        assert response.status_code == 401, (method, path)
        assert response.headers["www-authenticate"] == "Bearer"
        if method != "HEAD":
            assert response.json() == {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }


def test_health_and_the_page_stay_open(locked):
    health = httpx.get(f"{locked.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert httpx.head(f"{locked.url}/health").status_code == 200
    page = httpx.get(f"{locked.url}/")
    assert page.status_code == 200 and "<title>chatcli</title>" in page.text
    # The page holds no data: it asks for the key and keeps it for the tab's session.
    assert "sessionStorage" in page.text and "Authorization" in page.text


def test_a_server_without_keys_lets_everyone_in():
    app = create_app([scripted_worker(reply([END]))], Limits(), "open")
    with BackgroundServer(app) as server:
        assert httpx.get(f"{server.url}/v1/models").status_code == 200
        assert httpx.get(f"{server.url}/v1/models", headers=bearer("x")).status_code == 200


def test_a_route_added_to_the_app_later_is_behind_the_key_too():
    # As another back end's routes would be: the check stands in front of the whole app.
    app = create_app([scripted_worker(reply([END]))], Limits(), "m", api_keys=["k-1"])

    @app.get("/v1/extra")
    async def extra() -> dict:
        return {"ok": True}

    with BackgroundServer(app) as server:
        assert httpx.get(f"{server.url}/v1/extra").status_code == 401
        assert httpx.get(f"{server.url}/v1/extra", headers=bearer("k-1")).json() == {"ok": True}


def test_a_mounted_app_checks_paths_within_it():
    inner = FastAPI()

    @inner.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @inner.get("/v1/models")
    async def models() -> dict:
        return {"data": []}

    outer = FastAPI()
    outer.mount("/chat", ApiKeyCheck(inner, ["k-1"]))
    with BackgroundServer(outer) as server:
        assert httpx.get(f"{server.url}/chat/health").status_code == 200
        assert httpx.get(f"{server.url}/chat/v1/models").status_code == 401
        ok = httpx.get(f"{server.url}/chat/v1/models", headers=bearer("k-1"))
        assert ok.status_code == 200


# ---- comparing ----------------------------------------------------------------------------------


def test_key_matches_compares_every_key():
    import hashlib

    digests = [hashlib.sha256(k.encode()).digest() for k in ("a1", "b2", "c3")]
    assert [key_matches(k, digests) for k in (b"a1", b"b2", b"c3")] == [True, True, True]
    for other in (b"", b"a", b"a1 ", b"A1", b"b2c3", b"\x00a1"):
        assert not key_matches(other, digests)


@pytest.mark.parametrize(
    ("header", "token"),
    [
        (b"Bearer abc", b"abc"),
        (b"bearer abc", b"abc"),
        (b"  Bearer   abc  ", b"abc"),
        (b"Bearer", None),
        (b"Bearer   ", None),
        (b"Basic abc", None),
        (b"abc", None),
        (b"", None),
    ],
)
def test_bearer_token_reads_only_the_bearer_scheme(header, token):
    assert bearer_token(header) == token


# ---- where keys come from -----------------------------------------------------------------------


def test_a_key_file_holds_one_key_a_line_with_comments_and_blank_lines(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# the team's keys\n\nsk-alice-1\n  sk-bob-2  \n# sk-carol-3 (revoked)\n")
    assert read_key_file(path) == ["sk-alice-1", "sk-bob-2"]
    assert api_keys(["sk-alice-1", "sk-zed"], path) == ("sk-alice-1", "sk-zed", "sk-bob-2")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("", "holds no key"),
        ("# only a comment\n\n", "holds no key"),
        ("good-key\nbad\tkey with a tab\n", "line 2: an API key is letters"),
        ("ключ\n", "line 1: an API key is letters"),
        (b"\xff\xfe", "cannot be read"),
    ],
)
def test_a_key_file_that_gives_no_usable_keys_is_named(tmp_path, content, message):
    path = tmp_path / "keys"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as caught:
        read_key_file(path)
    assert str(path) in str(caught.value)
    assert "tab" not in str(caught.value).split("line")[0]  # the key itself is never shown


def test_a_key_file_that_is_a_folder_says_so(tmp_path):
    with pytest.raises(ConfigError, match="is a folder"):
        read_key_file(tmp_path)


@pytest.mark.parametrize("bad", ["", "   ", "tab\there", "line\nbreak", "é-key"])
def test_a_key_given_that_no_header_can_carry_is_refused(bad):
    with pytest.raises(ConfigError):
        api_keys([bad])


# ---- the warning --------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "10.0.0.5", "myhost.lan"])
def test_listening_beyond_this_machine_without_a_key_warns_of_the_risk(host):
    warning = open_server_warning(host, 8000, ())
    assert warning is not None
    assert f"{host}:8000 without an API key" in warning
    assert "anyone who can reach this port can run the model" in warning
    assert "--api-key" in warning
    assert open_server_warning(host, 8000, ("k",)) is None


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_a_loopback_server_needs_no_warning(host):
    assert open_server_warning(host, 8000, ()) is None


# ---- the serve command --------------------------------------------------------------------------


def _serve_args(monkeypatch, *args: str) -> tuple[object, dict]:
    """`chatcli serve ARGS` with the server itself replaced: what it was handed."""
    import chatcli.serve.runner

    seen: dict = {}
    monkeypatch.setattr(chatcli.serve.runner, "serve", lambda model, **kw: seen.update(kw))
    return runner.invoke(cli_app, ["serve", *args]), seen


def test_serve_takes_keys_from_flags_the_environment_and_a_file(monkeypatch, tmp_path):
    result, seen = _serve_args(monkeypatch, "--api-key", "k-1", "--api-key", "k-2")
    assert result.exit_code == 0, result.output
    assert seen["api_keys"] == ("k-1", "k-2")
    monkeypatch.setenv("CHATCLI_API_KEY", "k-env")
    result, seen = _serve_args(monkeypatch)
    assert seen["api_keys"] == ("k-env",)
    result, seen = _serve_args(monkeypatch, "--api-key", "k-flag")
    assert seen["api_keys"] == ("k-flag",)  # the flag wins over the variable, as ever
    keys = tmp_path / "keys"
    keys.write_text("k-file-1\nk-file-2\n")
    result, seen = _serve_args(monkeypatch, "--api-key-file", str(keys))
    assert seen["api_keys"] == ("k-env", "k-file-1", "k-file-2")
    monkeypatch.delenv("CHATCLI_API_KEY")
    result, seen = _serve_args(monkeypatch)
    assert seen["api_keys"] == ()


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--api-key", ""], 2, "--api-key (or CHATCLI_API_KEY) is blank"),
        (["--api-key", "has\ttab"], 2, "an API key is letters, digits, punctuation and spaces"),
        (["--api-key-file", "/no/such/keys"], 1, "--api-key-file /no/such/keys: no such file"),
    ],
)
def test_serve_with_a_bad_key_fails_before_loading(monkeypatch, args, code, message):
    result, seen = _serve_args(monkeypatch, *args)
    assert result.exit_code == code
    assert result.stderr.startswith("Error: ") and message in result.stderr
    assert seen == {}  # the server never started


def _listening_serve(monkeypatch) -> list[str]:
    """The server replaced by one that only says it listens: what it was asked, in order."""
    import chatcli.serve.runner

    calls: list[str] = []

    def fake(model, on_listening=None, **kw):
        calls.append("listen")
        on_listening()
        calls.append("load")

    monkeypatch.setattr(chatcli.serve.runner, "serve", fake)
    return calls


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.20"])
def test_serve_on_the_network_without_a_key_warns_once_it_listens(monkeypatch, host):
    calls = _listening_serve(monkeypatch)
    result = runner.invoke(cli_app, ["serve", "--host", host, "--port", "8123"])
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith(f"Warning: listening on {host}:8123 without an API key")
    assert len(result.stderr.splitlines()) == 1
    assert calls == ["listen", "load"]
    for quiet in (["--host", host, "--api-key", "k"], ["--host", "127.0.0.1"], []):
        assert "Warning" not in runner.invoke(cli_app, ["serve", *quiet]).stderr


def test_serve_calls_on_listening_after_taking_the_address_before_the_model(tmp_path):
    # A server that cannot bind says nothing of keys (only --host's error), and one that
    # can says it before minutes of loading: here the model fails to load just after.
    from chatcli.errors import ChatcliError
    from chatcli.serve.runner import serve

    said: list[str] = []
    with pytest.raises(ChatcliError, match="No model at"):
        serve(str(tmp_path / "none"), port=0, device="cpu", on_listening=lambda: said.append("x"))
    assert said == ["x"]
    with pytest.raises(ChatcliError, match=r"Cannot listen on 192\.0\.2\.1"):
        serve("unused", host="192.0.2.1", port=0, on_listening=lambda: said.append("y"))
    assert said == ["x"]


# ---- clients send the key -----------------------------------------------------------------------


def test_once_and_chat_at_url_send_the_key_from_the_flag_or_the_environment(locked, monkeypatch):
    args = ["once", "hi", "--url", locked.url]
    assert runner.invoke(cli_app, [*args, "--api-key", KEYS[0]]).stdout == "Hello!\n"
    monkeypatch.setenv("CHATCLI_API_KEY", KEYS[1])
    assert runner.invoke(cli_app, args).stdout == "Hello!\n"
    chat = runner.invoke(cli_app, ["chat", "--url", locked.url], input="hi\n")
    assert chat.exit_code == 0, chat.output
    assert chat.stdout == "Hello!\n"


@pytest.mark.parametrize(
    ("key", "fix"),
    [(None, "Pass the server's key with --api-key KEY"), ("wrong", "Check --api-key KEY")],
)
def test_a_client_without_the_right_key_says_how_to_give_it(locked, key, fix):
    args = ["once", "hi", "--url", locked.url] + (["--api-key", key] if key else [])
    result = runner.invoke(cli_app, args)
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {locked.url} refused the request (401): ")
    assert f"{fix} or CHATCLI_API_KEY.\n" in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_the_openai_library_sends_its_api_key(locked):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{locked.url}/v1", api_key=KEYS[0])
    done = client.chat.completions.create(model="scripted", messages=HI["messages"], max_tokens=8)
    assert done.choices[0].message.content == "Hello!"
    with pytest.raises(openai.AuthenticationError) as caught:
        openai.OpenAI(base_url=f"{locked.url}/v1", api_key="sk-wrong").models.list()
    assert caught.value.status_code == 401
    assert caught.value.body["code"] == "invalid_api_key"
