"""The chat page in a real headless Chromium, driven over the DevTools protocol.

Chromium speaks the protocol over a pipe (--remote-debugging-pipe: it reads commands on fd 3 and
writes replies on fd 4, each a JSON message ended by a NUL byte), so this needs no websocket or
browser-driver package: only the `chromium` binary (Debian: apt-get install chromium).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import subprocess
import threading
import time
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("httpx", reason="needs the serve extra: pip install -e '.[serve]'")

from fakes import SPECIAL_IDS, reply, tool_call
from serving import END, scripted_worker, serve_workers, text_tokens, wait_until

from chatcli.serve.worker_pool import Worker

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt-get install chromium)"),
]

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--remote-debugging-pipe",
]


class Browser:
    """Just enough of the DevTools protocol: one page, evaluate, click, type."""

    def __init__(self, user_data_dir: str) -> None:
        commands_r, commands_w = os.pipe()
        replies_r, replies_w = os.pipe()
        # The shell puts the two pipe ends on fds 3 and 4, where Chromium looks for them.
        script = f'exec "$0" "$@" 3<&{commands_r} 4>&{replies_w}'
        self.proc = subprocess.Popen(
            ["bash", "-c", script, CHROMIUM, *FLAGS, f"--user-data-dir={user_data_dir}"],
            pass_fds=(commands_r, replies_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(commands_r)
        os.close(replies_w)
        self._out = os.fdopen(commands_w, "wb")
        self._in = os.fdopen(replies_r, "rb")
        self._replies: queue.Queue[dict] = queue.Queue()
        self._next_id = 0
        self.session: str | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buffer = b""
        while chunk := self._in.read1(65536):
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for m in messages:
                message = json.loads(m)
                if "id" in message:
                    self._replies.put(message)

    def send(self, method: str, params: dict | None = None, timeout: float = 20) -> dict:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if self.session and not method.startswith("Target."):
            message["sessionId"] = self.session
        self._out.write(json.dumps(message).encode() + b"\0")
        self._out.flush()
        deadline = time.monotonic() + timeout
        while True:
            reply = self._replies.get(timeout=max(deadline - time.monotonic(), 0.01))
            if reply["id"] == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", {"url": url})["targetId"]
        attached = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})
        self.session = attached["sessionId"]

    def js(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 15) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for: {expression}")

    def click(self, selector: str) -> None:
        """A real mouse click in the middle of the element."""
        box = self.js(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.send(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1},
            )

    def type(self, selector: str, text: str) -> None:
        self.js(f"document.querySelector({json.dumps(selector)}).focus()")
        self.send("Input.insertText", {"text": text})

    def close(self) -> None:
        # Chromium may exit before it answers Browser.close: the wait below is what counts.
        with contextlib.suppress(RuntimeError, queue.Empty, BrokenPipeError):
            self.send("Browser.close", timeout=5)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()


@pytest.fixture
def browser(tmp_path):
    b = Browser(str(tmp_path / "chromium-profile"))
    yield b
    b.close()


def test_chat_page_streams_a_reply_with_a_calculator_badge_and_stops(browser):
    # A calculator call, then text that goes on (20 tokens a second) until stopped or cut.
    worker = scripted_worker(tool_call("6*7", text_tokens(" so 42 and on and on")), delay=0.05)
    server = serve_workers([worker], name="scripted-web")
    try:
        browser.open(server.url + "/")
        browser.wait_for("document.readyState === 'complete' && !!document.getElementById('input')")
        assert browser.wait_for("document.getElementById('model-name').textContent").startswith(
            "scripted-web"
        )

        browser.type("#input", "what is 6*7?")
        browser.click("#send")
        badge = browser.wait_for(
            "document.querySelector('.msg.assistant .calc-badge')?.textContent"
        )
        assert badge == "calc 6*7 = 42"
        browser.wait_for(
            "document.querySelector('.msg.assistant').textContent.includes('so 42 and')"
        )
        assert browser.js("!document.getElementById('stop').hidden") is True
        assert worker.busy

        browser.click("#stop")
        browser.wait_for("document.querySelector('.msg.assistant').dataset.done === 'true'")
        first = browser.js("document.querySelector('.msg.assistant').textContent")
        assert first.startswith("calc 6*7 = 42 so 42 and")
        assert first.endswith("stopped")
        assert "[calc" not in first  # the marker is drawn as the badge, not as text
        assert browser.js("document.getElementById('send').hidden") is False
        assert wait_until(lambda: not worker.busy, timeout=5)  # the server stopped generating

        # The partial reply stays in the conversation: the next turn is accepted and replays it.
        browser.js("document.getElementById('max-tokens').value = '30'")
        browser.type("#input", "thanks")
        browser.click("#send")
        browser.wait_for("document.querySelectorAll('.msg.assistant')[1]?.dataset.done === 'true'")
        second = browser.js("document.querySelectorAll('.msg.assistant')[1].textContent")
        assert second.startswith("calc 6*7 = 42 so 42")
        assert re.search(r"length · 30 tokens · [\d.]+ tok/s$", second), second
        assert browser.js("document.querySelectorAll('.msg.user').length") == 2
        prompt = worker.engine.model.histories[0][: worker.engine.model.prompt_len]
        assert worker.tokenizer.encode("thanks") == prompt[-2 - len("thanks") : -2]

        browser.click("#new-chat")
        assert browser.js("document.querySelectorAll('.msg').length") == 0
    finally:
        server.stop()


def open_page(browser, url: str) -> None:
    browser.open(url + "/")
    browser.wait_for("document.readyState === 'complete' && !!document.getElementById('input')")


def send(browser, text: str, reply: int = 0) -> None:
    """Types `text`, sends it, and waits for the page's reply number `reply` to end."""
    browser.type("#input", text)
    browser.click("#send")
    browser.wait_for(
        f"document.querySelectorAll('.msg.assistant')[{reply}]?.dataset.done === 'true'"
    )


def test_a_calculator_call_cut_by_the_length_limit_shows_as_cut(browser):
    worker = scripted_worker(tool_call("1234*56", text_tokens(" done")))
    server = serve_workers([worker], name="scripted-web")
    try:
        open_page(browser, server.url)
        # <|python_start|> then "123": the length limit stops the call inside its expression.
        browser.js("document.getElementById('max-tokens').value = '4'")
        send(browser, "what is 1234*56?")
        badge = browser.js("document.querySelector('.msg.assistant .calc-badge').textContent")
        assert badge == "calc 123 … (cut)"
    finally:
        server.stop()


def long_chat(browser, refused: int | None = None) -> Worker:
    """Six questions through the page to a model with a 96-token context that answers each
    in 27 tokens: from the third exchange on, the oldest no longer fit. Question `refused`
    asks for a top_k the server refuses: it fails, unanswered. Returns the worker."""
    answer = [*text_tokens(" a rather long answer, really."), END]
    worker = scripted_worker(reply(answer), sequence_len=96)
    server = serve_workers([worker], name="scripted-web")
    try:
        open_page(browser, server.url)
        browser.wait_for("document.getElementById('model-name').textContent.includes('96')")
        for i in range(6):
            browser.js(f"document.getElementById('top-k').value = '{500 if i == refused else 50}'")
            send(browser, f"question number {i}", reply=i)
            browser.js("document.getElementById('input').value = ''")  # a failed one comes back
    finally:
        server.stop()
    return worker


def test_a_long_chat_drops_its_oldest_exchanges_instead_of_failing(browser):
    worker = long_chat(browser)
    assert browser.js("document.querySelectorAll('.msg.failed').length") == 0
    metas = browser.js(
        "[...document.querySelectorAll('.msg.assistant .meta')].map(m => m.textContent)"
    )
    assert all(m.startswith("stop") for m in metas), metas
    assert browser.js("document.querySelectorAll('.msg.out').length") >= 2
    assert "dropped" in browser.js("document.querySelector('.notice').textContent")
    # Every request carried only what fits: its prompt stayed within the context.
    assert max(len(h) for h in worker.engine.model.histories) <= 96


def test_a_stream_that_breaks_off_is_shown_as_an_error_not_an_end(browser):
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, StreamingResponse

    from chatcli.serve.app import _page
    from chatcli.serve.runner import BackgroundServer

    app = FastAPI()

    @app.get("/")
    async def page() -> HTMLResponse:
        return HTMLResponse(_page())

    @app.post("/v1/chat/completions")
    async def completions() -> StreamingResponse:
        async def body():  # two words, then the stream ends: no finish_reason, no [DONE]
            for word in ("word ", "word "):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': word}}]})}\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    server = BackgroundServer(app).start()
    try:
        open_page(browser, server.url)
        send(browser, "hello")
        text = browser.js("document.querySelector('.msg.assistant').textContent")
        assert text == "word word error: the connection ended before the reply was finished"
    finally:
        server.stop()


def test_dropping_exchanges_dims_the_right_bubbles_after_a_failed_turn(browser):
    long_chat(browser, refused=1)
    dimmed = browser.js("[...document.querySelectorAll('.msg.out')].map(m => m.textContent)")
    assert dimmed, "nothing was dropped"
    assert "question number 1" not in dimmed  # never in the conversation: not dropped
    users = [t for t in dimmed if t.startswith("question")]
    answers = [t for t in dimmed if not t.startswith("question")]
    assert len(users) == len(answers)  # whole exchanges, question and reply
    assert users == [f"question number {i}" for i in (0, 2, 3, 4)][: len(users)]


MARKDOWN_REPLY = (
    "**Sure**: `x<b>` & <i>no</i>\n\n"
    "- one *two*\n- 6*7*7 and 2 * 3 * 4\n\n"
    "```\na *b* <c>\n```\n"
    "[site](https://example.com) [bad](javascript:alert(1))\n"
    "line two\n\n"
    "- item "
)


def test_a_reply_is_drawn_as_markdown_without_running_any_html(browser):
    call = [SPECIAL_IDS["<|python_start|>"], *text_tokens("6*7"), SPECIAL_IDS["<|python_end|>"]]
    forced = [0] * 4  # <|output_start|>42<|output_end|>: the engine's, whatever the model says
    answer = [*text_tokens(MARKDOWN_REPLY), *call, *forced, *text_tokens(" done\n- last"), END]
    worker = scripted_worker(reply(answer))
    server = serve_workers([worker], name="scripted-web")
    try:
        open_page(browser, server.url)
        send(browser, "show me markdown")
        q = "document.querySelector('.msg.assistant .body')"
        assert browser.js(f"{q}.querySelector('p strong').textContent") == "Sure"
        assert browser.js(f"{q}.querySelector('p code').textContent") == "x<b>"
        assert browser.js(f"{q}.querySelectorAll('i, b, c, script').length") == 0
        assert "<i>no</i>" in browser.js(f"{q}.querySelector('p').textContent")
        items = browser.js(f"[...{q}.querySelectorAll('ul')[0].children].map(li => li.innerHTML)")
        # arithmetic keeps its stars
        assert items == ["<p>one <em>two</em></p>", "<p>6*7*7 and 2 * 3 * 4</p>"]
        assert browser.js(f"{q}.querySelector('pre code').textContent") == "a *b* <c>"
        links = browser.js(f"[...{q}.querySelectorAll('a')].map(a => [a.href, a.textContent])")
        assert links == [["https://example.com/", "site (https://example.com)"]]
        assert "[bad](javascript:alert(1))" in browser.js(f"{q}.textContent")
        assert (
            browser.js(f"{q}.querySelectorAll(':scope > p')[1].querySelectorAll('br').length") == 1
        )
        # The calculator's badge sits where the call was, inside the last list's first item.
        last = browser.js(
            f"[...[...{q}.querySelectorAll('ul')].at(-1).children].map(li => li.textContent)"
        )
        assert last == ["item calc 6*7 = 42 done", "last"]
        assert browser.js(f"{q}.querySelectorAll('.calc-badge').length") == 1
    finally:
        server.stop()


# What the page draws for a reply's text (renderReply, evaluated in the page itself).
DRAWN = [
    ("# Plan\r\nStep one.", "<h1>Plan</h1><p>Step one.</p>"),  # a CRLF reply
    (
        "1. Install:\n   ```bash\n   pip install x\n   ```\n2. Run it",
        "<ol><li><p>Install:</p><pre><code>pip install x</code></pre></li><li><p>Run it</p></li></ol>",
    ),
    (
        "- fruit\n  - apple\n- veg",
        "<ul><li><p>fruit</p><ul><li><p>apple</p></li></ul></li><li><p>veg</p></li></ul>",
    ),
    ("```\ncode\n```python\nmore\n```", "<pre><code>code\n```python\nmore</code></pre>"),
    (
        "[w](https://x.org/Foo_(bar)) a_b_c",
        '<p><a href="https://x.org/Foo_(bar)" target="_blank" rel="noopener noreferrer">w'
        '<span class="url"> (https://x.org/Foo_(bar))</span></a> a_b_c</p>',
    ),
]


def test_the_page_draws_markdown_as_it_should_quickly_and_never_loses_a_reply(browser):
    worker = scripted_worker(reply([*text_tokens("ok"), END]))
    server = serve_workers([worker], name="scripted-web")
    try:
        open_page(browser, server.url)
        draw = (
            "(text) => { const el = document.createElement('div'); const t0 = performance.now();"
            " renderReply(el, {text, tools: []}); return [el.innerHTML, performance.now() - t0]; }"
        )
        for text, html in DRAWN:
            assert browser.js(f"({draw})({json.dumps(text)})")[0] == html
        # Hostile replies: deep quotes and thousands of unclosed marks draw in milliseconds
        # (they froze the tab or overflowed the stack).
        for text in (">" * 4000 + " x", "__x " * 2000, "*x " * 3000, "`c` " * 1000 + "**x " * 1000):
            html, ms = browser.js(f"({draw})({json.dumps(text)})")
            assert html and ms < 500, (text[:10], ms)
    finally:
        server.stop()
