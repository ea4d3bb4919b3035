"""The chat page in a real headless Chromium: asking for a server's API key once and keeping it
for the tab, and words that fit the model it serves. The browser is test_web's."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("httpx", reason="needs the serve extra: pip install -e '.[serve]'")

from fakes import reply
from serving import END, scripted_worker, text_tokens
from test_web import CHROMIUM, Browser, open_page, send

from chatcli.serve.app import Limits, create_app
from chatcli.serve.runner import BackgroundServer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt-get install chromium)"),
]

KEY = "sk-page-key-42"
DIALOG_OPEN = "document.getElementById('key-dialog').open"


@pytest.fixture
def browser(tmp_path):
    b = Browser(str(tmp_path / "chromium-profile"))
    yield b
    b.close()


def serve(text: str, **options) -> tuple[BackgroundServer, object]:
    worker = scripted_worker(reply([*text_tokens(text), END]))
    app = create_app([worker], Limits(), options.pop("name", "scripted-web"), **options)
    return BackgroundServer(app).start(), worker


def enter_key(browser: Browser, key: str) -> None:
    browser.wait_for(DIALOG_OPEN)
    browser.js("document.getElementById('key-input').value = ''")
    browser.type("#key-input", key)
    browser.click("#key-dialog button[value=ok]")


def test_the_page_asks_for_the_key_once_and_keeps_it_for_the_tab(browser):
    server, _ = serve("Hello!", api_keys=[KEY, "sk-other"])
    try:
        open_page(browser, server.url)
        # Asked at once: the page's first call (/v1/models) met a 401.
        assert browser.wait_for(DIALOG_OPEN) is True
        assert browser.js("document.getElementById('model-name').textContent") == ""
        assert browser.js("document.getElementById('key-refused').hidden") is True

        enter_key(browser, "sk-wrong")
        # Refused: asked again, saying so; nothing kept.
        browser.wait_for("!document.getElementById('key-refused').hidden")
        assert browser.js(DIALOG_OPEN) is True
        assert browser.js("sessionStorage.getItem('chatcli.apiKey')") is None

        enter_key(browser, KEY)
        assert browser.wait_for("document.getElementById('model-name').textContent").startswith(
            "scripted-web"
        )
        assert browser.js(DIALOG_OPEN) is False
        send(browser, "hi")
        assert browser.js("document.querySelector('.msg.assistant .body').textContent") == "Hello!"
        assert browser.js("sessionStorage.getItem('chatcli.apiKey')") == KEY
        assert browser.js("localStorage.length") == 0  # never kept past the session

        # A reload in the same tab asks nothing: the key is the session's.
        browser.js("window.oldPage = true; location.reload()")
        # The new page, once it has named the model (its element may not be there at first).
        open_page_again = "!window.oldPage && document.getElementById('model-name')?.textContent"
        assert browser.wait_for(open_page_again).startswith("scripted-web")
        assert browser.js(DIALOG_OPEN) is False
        send(browser, "hi again")
        assert browser.js("document.querySelector('.msg.assistant .body').textContent") == "Hello!"
    finally:
        server.stop()


def test_declining_the_key_leaves_a_plain_message_and_sending_asks_again(browser):
    server, _ = serve("Hello!", api_keys=[KEY])
    try:
        open_page(browser, server.url)
        browser.wait_for(DIALOG_OPEN)
        browser.click("#key-dialog button[value=cancel]")
        browser.wait_for(f"!{DIALOG_OPEN}")

        browser.type("#input", "hi")
        browser.click("#send")
        browser.wait_for(DIALOG_OPEN)  # sending asks again
        browser.click("#key-dialog button[value=cancel]")
        browser.wait_for("document.querySelector('.msg.assistant')?.dataset.done === 'true'")
        shown = browser.js("document.querySelector('.msg.assistant').textContent")
        # Words for a person at a browser, not the header a program should send.
        assert shown == "Error: This server needs an API key. Send again to enter it."
        assert browser.js("document.getElementById('input').value") == "hi"  # kept to resend

        browser.click("#send")
        enter_key(browser, KEY)
        browser.wait_for("document.querySelectorAll('.msg.assistant')[1]?.dataset.done === 'true'")
        answer = browser.js("document.querySelectorAll('.msg.assistant')[1].textContent")
        assert answer.startswith("Hello!")
    finally:
        server.stop()


DEMO_REFUSAL = (
    "I'm too small to know that. I can do arithmetic and count letters; for general "
    "questions load a real nanochat model with --model."
)


def test_the_demo_model_is_described_as_it_is_and_its_terminal_advice_left_out(browser):
    server, worker = serve(DEMO_REFUSAL, name="chatcli-default", demo=True)
    try:
        open_page(browser, server.url)
        browser.wait_for("document.getElementById('model-name').textContent")
        placeholder = browser.js("document.getElementById('input').placeholder")
        assert "arithmetic" in placeholder and "count letters" in placeholder
        empty = browser.js("document.getElementById('empty').textContent")
        assert "demo model" in empty and "Ask anything" not in empty

        send(browser, "What is the capital of France?")
        shown = browser.js("document.querySelector('.msg.assistant .body').textContent")
        assert shown == "I'm too small to know that. I can do arithmetic and count letters."

        # The model is sent back its own words: only the page leaves the advice out.
        send(browser, "ok", reply=1)
        history = worker.engine.model.histories[-1]
        assert "--model" in worker.tokenizer.decode(history)
    finally:
        server.stop()


def test_another_model_is_named_and_its_words_shown_as_they_are(browser):
    server, _ = serve("Pass --model to pick one.", name="d20")
    try:
        open_page(browser, server.url)
        browser.wait_for("document.getElementById('model-name').textContent")
        assert browser.js("document.getElementById('input').placeholder").startswith("Message d20")
        assert "d20" in browser.js("document.getElementById('empty').textContent")
        send(browser, "hi")
        shown = browser.js("document.querySelector('.msg.assistant .body').textContent")
        assert shown == "Pass --model to pick one."
    finally:
        server.stop()
