"""Structured output: a reply under a JSON schema's grammar parses and validates against the
schema (or ends with finish reason length), in the one sampler, per row, for Engine.generate,
a server's batch beside free rows, the openai client and `chatcli once`."""

from __future__ import annotations

import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("llguidance", reason="needs the structured extra: pip install -e '.[dev]'")
pytest.importorskip("jsonschema", reason="needs the dev extra: pip install -e '.[dev]'")

import jsonschema
from typer.testing import CliRunner

from chatcli.cli.app import app
from chatcli.engine.engine import Engine, GenerationStats
from chatcli.engine.grammar import SAFE_INTEGER, bounded, json_grammar
from chatcli.engine.scheduler import RowRequest, Scheduler
from chatcli.errors import SchemaError
from chatcli.model.checkpoint import load_model
from chatcli.model.special_tokens import ASSISTANT_END

# The embedded model never learned to close a JSON string: an unbounded one can run on until
# the budget cuts it (finish reason length), so the name has a maxLength, as a schema for a
# small model should. Its integer is unbounded (the grammar keeps it to JSON's exact ones).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "paid": {"type": "boolean"},
        "items": {"type": "array", "items": {"enum": ["tea", "cake"]}, "maxItems": 3},
        "table": {"type": "integer", "minimum": 1, "maximum": 20},
    },
    "required": ["paid", "items", "table"],
    "additionalProperties": False,
}
runner = CliRunner()


@pytest.fixture(scope="module")
def embedded():
    model, tokenizer, _ = load_model(None, device="cpu")
    return model, tokenizer


def _prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.render_for_completion([{"role": "user", "content": text}])


def _reply(engine: Engine, prompt: list[int], **kwargs) -> tuple[list[int], list[int], str]:
    stats = GenerationStats()
    tokens, masks = [], []
    for column, column_masks in engine.generate(prompt, stats=stats, **kwargs):
        tokens.append(column[0])
        masks.append(column_masks[0])
    return tokens, masks, stats.finish_reasons[0]


def _valid(tokenizer, tokens: list[int], schema: dict) -> dict:
    """The reply's JSON, checked against `schema`; it ends with <|assistant_end|>."""
    assert tokens[-1] == tokenizer.encode_special(ASSISTANT_END)
    value = json.loads(tokenizer.decode(tokens[:-1]))
    jsonschema.validate(value, schema)
    return value


# ---- the engine -------------------------------------------------------------------------------


def test_the_embedded_model_writes_valid_objects_for_20_seeds_of_20_at_temperature_1(embedded):
    model, tokenizer = embedded
    engine = Engine(model, tokenizer)
    grammar = json_grammar(PERSON)
    prompt = _prompt(tokenizer, "Tell me about someone you know.")
    colors = set()
    for seed in range(20):
        tokens, masks, reason = _reply(
            engine, prompt, max_tokens=200, temperature=1.0, seed=seed, grammar=grammar
        )
        assert reason == "stop"
        assert all(masks)  # every token sampled: no calculator, no filler
        colors.add(_valid(tokenizer, tokens, PERSON)["color"])
    assert len(colors) > 1  # the seeds sample, they do not all give one reply


def test_the_embedded_model_on_its_own_writes_no_json(embedded):
    model, tokenizer = embedded
    tokens, _, _ = _reply(
        Engine(model, tokenizer),
        _prompt(tokenizer, "Tell me about someone you know."),
        max_tokens=200,
        temperature=1.0,
        seed=0,
    )
    with pytest.raises(ValueError):
        json.loads(tokenizer.decode(tokens[:-1]))


def test_a_reply_the_budget_cuts_ends_with_length_and_follows_the_grammar_so_far(embedded):
    model, tokenizer = embedded
    tokens, _, reason = _reply(
        Engine(model, tokenizer),
        _prompt(tokenizer, "Who are you?"),
        max_tokens=12,
        temperature=1.0,
        seed=1,
        grammar=json_grammar(PERSON),
    )
    assert reason == "length" and len(tokens) == 12
    assert tokenizer.decode(tokens).startswith('{"name": "')
    with pytest.raises(ValueError):
        json.loads(tokenizer.decode(tokens))


def test_greedy_and_sample_rows_each_follow_the_grammar(embedded):
    model, tokenizer = embedded
    engine = Engine(model, tokenizer)
    prompt = _prompt(tokenizer, "What did you order?")
    grammar = json_grammar(ORDER)
    tokens, _, reason = _reply(engine, prompt, max_tokens=100, temperature=0.0, grammar=grammar)
    assert reason == "stop"
    _valid(tokenizer, tokens, ORDER)
    rows: list[list[int]] = [[] for _ in range(4)]
    for column, _ in engine.generate(
        prompt, 4, max_tokens=100, temperature=1.0, seed=7, grammar=grammar
    ):
        for row, token in zip(rows, column, strict=True):
            if not row or row[-1] != tokenizer.encode_special(ASSISTANT_END):
                row.append(token)
    for row in rows:
        _valid(tokenizer, row, ORDER)


def test_a_row_under_a_grammar_does_not_call_the_calculator(embedded):
    model, tokenizer = embedded
    engine = Engine(model, tokenizer)
    prompt = _prompt(tokenizer, "What is 1234*56?")
    free, free_masks, _ = _reply(engine, prompt, max_tokens=30, temperature=0.0)
    assert tokenizer.encode_special("<|python_start|>") in free and 0 in free_masks
    shaped, masks, reason = _reply(
        engine, prompt, max_tokens=60, temperature=0.0, grammar=json_grammar(ORDER)
    )
    assert reason == "stop" and all(masks)
    _valid(tokenizer, shaped, ORDER)


def test_batched_rows_with_different_schemas_and_none_share_each_step(embedded):
    model, tokenizer = embedded
    engine = Engine(model, tokenizer)
    prompts = [_prompt(tokenizer, t) for t in ("Who are you?", "Lunch?", "Tell me a story.")]
    requests = [
        RowRequest(prompts[0], 120, 1.0, seed=3, grammar=json_grammar(PERSON)),
        RowRequest(prompts[1], 120, 1.0, seed=4, grammar=json_grammar(ORDER)),
        RowRequest(prompts[2], 40, 1.0, top_k=50, seed=5),
    ]
    batch = Scheduler(engine, rows=3)
    rows = [batch.join(r) for r in requests]
    got: dict[int, list[int]] = {i: [] for i in range(3)}
    shared = 0  # steps where more than one row produced a token
    while batch.running:
        stepped = batch.step()
        shared += len(stepped.tokens) > 1
        for row, token, _ in stepped.tokens:
            got[rows.index(row)].append(token)
    assert shared > 10
    _valid(tokenizer, got[0], PERSON)
    _valid(tokenizer, got[1], ORDER)
    # The free row is what it is alone: the grammars of its neighbours never touched it.
    alone, _, _ = _reply(engine, prompts[2], max_tokens=40, temperature=1.0, top_k=50, seed=5)
    assert got[2] == alone


# ---- schemas ----------------------------------------------------------------------------------


def test_an_unbounded_integer_is_kept_to_jsons_exact_ones_and_bounds_given_are_kept():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": ["integer", "null"], "minimum": 0},
            "c": {"type": "integer", "enum": [1, 2], "default": {"type": "integer"}},
        },
    }
    out = bounded(schema)
    assert out["properties"]["a"] == {
        "type": "integer",
        "minimum": -SAFE_INTEGER,
        "maximum": SAFE_INTEGER,
    }
    assert out["properties"]["b"] == {
        "type": ["integer", "null"],
        "minimum": 0,
        "maximum": SAFE_INTEGER,
    }
    assert out["properties"]["c"]["default"] == {"type": "integer"}  # data, not a schema
    assert schema["properties"]["a"] == {"type": "integer"}  # the caller's is left alone


def test_a_schema_the_grammar_cannot_enforce_is_refused_naming_the_keyword():
    with pytest.raises(SchemaError, match=r'cannot enforce \(Unimplemented keys: \["not"\]\)'):
        json_grammar({"type": "object", "not": {"required": ["a"]}})
    with pytest.raises(SchemaError, match="is a JSON object, not list"):
        json_grammar([1, 2])  # type: ignore[arg-type]


def test_a_schema_nested_past_what_python_walks_is_refused_in_one_line():
    schema: dict = {"type": "integer"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(SchemaError, match="nested too deeply: name a repeated part once"):
        json_grammar(schema)


def test_without_llguidance_structured_output_says_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance raises ImportError
    with pytest.raises(SchemaError) as e:
        json_grammar({**PERSON, "title": "a schema no test built before"})
    assert str(e.value) == (
        "Structured output needs the structured extra: pip install 'chatcli[structured]'"
    )


# ---- the server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(embedded):
    pytest.importorskip("fastapi")
    from chatcli.engine.scheduler import default_rows
    from chatcli.serve.app import Limits, Worker, create_app
    from chatcli.serve.runner import BackgroundServer

    model, tokenizer = embedded
    worker = Worker(model, tokenizer, batch=default_rows("cpu"))  # `chatcli serve`'s default
    running = BackgroundServer(create_app([worker], Limits(), "chatcli")).start()
    yield running
    running.stop()


def _schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_clients_at_once_with_different_schemas_and_one_without_get_what_they_asked(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

    def ask(text: str, response_format: dict | None, seed: int, stream: bool = False):
        extra = {} if response_format is None else {"response_format": response_format}
        args = dict(
            model="chatcli",
            messages=[{"role": "user", "content": text}],
            temperature=1.0,
            max_tokens=150,
            seed=seed,
            **extra,
        )
        if not stream:
            choice = client.chat.completions.create(**args).choices[0]
            return choice.message.content, choice.finish_reason
        chunks = list(client.chat.completions.create(stream=True, **args))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        return text, reasons[-1]

    asks = [
        ("Who are you?", _schema_format("person", PERSON), 11, False),
        ("What will you have?", _schema_format("order", ORDER), 12, True),
        ("Who is your friend?", _schema_format("person", PERSON), 13, True),
        ("Tell me a story.", None, 14, False),
        ("What will you have?", _schema_format("order", ORDER), 15, False),
    ]
    with ThreadPoolExecutor(len(asks)) as pool:
        replies = list(pool.map(lambda a: ask(*a), asks))
    for (_, response_format, _, _), (text, reason) in zip(asks, replies, strict=True):
        assert reason == "stop"
        if response_format is not None:
            jsonschema.validate(json.loads(text), response_format["json_schema"]["schema"])
    assert replies[3] == ask("Tell me a story.", None, 14)  # as it is alone


def test_json_object_gives_an_object_or_the_budgets_cut(server):
    httpx = pytest.importorskip("httpx")
    for seed in range(3):
        body = {
            "messages": [{"role": "user", "content": "Describe your day."}],
            "response_format": {"type": "json_object"},
            "max_tokens": 60,
            "seed": seed,
        }
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
        choice = reply["choices"][0]
        text = choice["message"]["content"]
        assert text.startswith("{")
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert choice["finish_reason"] == "length"
            assert reply["usage"]["completion_tokens"] == 60


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        (
            _schema_format("neg", {"type": "object", "not": {"type": "null"}}),
            'cannot enforce (Unimplemented keys: ["not"])',
        ),
        ({"type": "xml"}, "type 'xml' is not one chatcli serves"),
        ({"type": "json_schema"}, 'needs "json_schema": {"name": ..., "schema": {...}}'),
        (_schema_format("a b", PERSON), "json_schema.name must be 1 to 64 letters"),
        (
            {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": 0}},
            "json_schema.strict must be true or false",
        ),
    ],
)
def test_a_response_format_that_cannot_be_served_is_a_400_naming_it(
    server, response_format, message
):
    httpx = pytest.importorskip("httpx")
    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": response_format}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "response_format"
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("Invalid 'response_format': ")
    assert message in error["message"]


def test_text_response_format_is_free_text(server):
    httpx = pytest.importorskip("httpx")
    body = {"messages": [{"role": "user", "content": "Hi!"}], "seed": 1, "max_tokens": 20}
    url = f"{server.url}/v1/chat/completions"
    plain = httpx.post(url, json=body, timeout=30).json()
    text = httpx.post(url, json={**body, "response_format": {"type": "text"}}, timeout=30).json()
    assert text["choices"] == plain["choices"]


# ---- chatcli once -----------------------------------------------------------------------------


def test_once_json_schema_prints_an_object_that_follows_it(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON))
    result = runner.invoke(app, ["once", "Who are you?", "--json-schema", str(path), "-t", "1"])
    assert result.exit_code == 0, result.output
    jsonschema.validate(json.loads(result.output), PERSON)
    result = runner.invoke(app, ["once", "Hi", "--format", "json", "--json", "--max-tokens", "40"])
    out = json.loads(result.output)
    assert out["text"].startswith("{") and out["tools"] == []


def test_once_refuses_a_bad_schema_or_format_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": {}}')
    for args, code, words in [
        (["--json-schema", str(bad)], 1, 'cannot enforce (Unimplemented keys: ["not"])'),
        (["--json-schema", str(tmp_path / "none.json")], 1, "does not exist: give the path"),
        (["--format", "xml"], 2, "--format 'xml': the one format is json"),
    ]:
        result = runner.invoke(app, ["once", "hi", *args])
        assert result.exit_code == code
        assert words in result.output and "Traceback" not in result.output


def test_a_bitmask_reads_token_by_token_as_the_grammar_library_writes_it(embedded):
    import llguidance
    import llguidance.torch

    from chatcli.engine.grammar import grammar_tokenizer
    from chatcli.engine.grammar_rows import forbidden_tokens

    _, tokenizer = embedded
    matcher = llguidance.LLMatcher(grammar_tokenizer(tokenizer), json_grammar(ORDER))
    for token in tokenizer.encode('{"paid": true, "items": ["tea"'):
        assert matcher.consume_token(token)
    bitmask = llguidance.torch.allocate_token_bitmask(1, 1024)
    llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
    forbidden = forbidden_tokens(bitmask, 1024)[0]
    allowed = [t for t in range(1024) if not forbidden[t]]
    words = {tokenizer.decode([t]) for t in allowed}
    assert ", " in words or "," in words  # another item
    assert "]" in words and "}" not in words and "1" not in words
    assert all(bool(bitmask[0, t // 32] >> (t % 32) & 1) != bool(forbidden[t]) for t in range(1024))


# ---- the chat ---------------------------------------------------------------------------------


def test_format_in_the_chat_makes_the_next_replies_json_until_text(embedded, tmp_path):
    from test_slash_commands import FakeScreen

    from chatcli.chat.conversation_store import ConversationFile
    from chatcli.chat.session import ChatSession
    from chatcli.chat.settings import Settings
    from chatcli.chat.turns import SamplingOptions
    from chatcli.terminal.slash_commands import ChatCommands

    model, tokenizer = embedded
    session = ChatSession(model, tokenizer, SamplingOptions(temperature=1.0, seed=2))
    screen = FakeScreen()
    conversation = ConversationFile.create(tmp_path, model="embedded")
    chat = ChatCommands(session, screen, Settings(history=False), conversation, tmp_path, {})
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON))

    chat.handle(f"/format {path}")
    chat.handle("Who are you?")
    jsonschema.validate(json.loads(session.last_reply.text), PERSON)
    chat.handle("/format")
    chat.handle("/format json")
    chat.handle("And your friend?")
    assert isinstance(json.loads(session.last_reply.text), dict)
    chat.handle("/format text")
    chat.handle("Hi!")
    assert session.last_reply.text == "Happy to help!"  # free text again
    chat.handle(f"/format {tmp_path / 'none.json'}")
    notices = [value for kind, value in screen.drawn if kind in ("notice", "error")]
    assert notices == [
        f"format = {path}",
        f"format = {path} (/format text|json|FILE changes it)",
        "format = json",
        "format = text",
        f"The JSON Schema file {tmp_path / 'none.json'} does not exist: give the path of a "
        "schema file.",
    ]


def test_a_row_that_is_over_or_in_error_may_only_end(embedded):
    from chatcli.engine.grammar import grammar_tokenizer
    from chatcli.engine.grammar_rows import RowsGrammar

    _, tokenizer = embedded
    for end in (tokenizer.encode_special(ASSISTANT_END), 31, 63):  # 31, 63: a word's sign bit
        rows = RowsGrammar(grammar_tokenizer(tokenizer), json_grammar(ORDER), 3, end)
        logits = torch.zeros(3, 1024)
        first = rows.mask(logits)
        assert torch.isfinite(first[:, ord("{")]).all()  # '{' is a token of its own here
        rows.advance([ord("{"), ord("{"), end], [True, True, False])  # row 2 is over
        rows.matchers[1].consume_token(ord("}"))  # '}' cannot follow '{' here: an error
        masked = rows.mask(logits)
        for row in (1, 2):
            assert torch.isfinite(masked[row]).nonzero().flatten().tolist() == [end]
        assert torch.isfinite(masked[0, ord('"')]) and not torch.isfinite(masked[0, end])


def test_a_worker_of_one_row_and_once_url_follow_the_schema_too(embedded, tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    from chatcli.serve.app import Limits, Worker, create_app
    from chatcli.serve.runner import BackgroundServer

    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    model, tokenizer = embedded
    path = tmp_path / "order.json"
    path.write_text(json.dumps(ORDER))
    one_row = Worker(model, tokenizer, batch=1)  # `chatcli serve --batch 1`: Engine.generate
    server = BackgroundServer(create_app([one_row], Limits(), "chatcli")).start()
    try:
        args = ["once", "Lunch?", "--url", server.url, "--json-schema", str(path), "--json"]
        result = runner.invoke(app, [*args, "-t", "1", "--seed", "5"])
    finally:
        server.stop()
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["text"]), ORDER)


def test_masks_computed_on_a_thread_give_the_tokens_computed_at_once(embedded, monkeypatch):
    from chatcli.engine import grammar_rows

    model, tokenizer = embedded
    engine = Engine(model, tokenizer)
    prompt = _prompt(tokenizer, "Tell me about someone you know.")
    grammar = json_grammar(PERSON)
    at_once = _reply(engine, prompt, max_tokens=80, temperature=1.0, seed=9, grammar=grammar)
    seen = []
    monkeypatch.setattr(grammar_rows, "THREAD_ABOVE_S", 0.0)  # every grammar is "dear"
    monkeypatch.setattr(grammar_rows, "FILLS_MEASURED", 1)
    fill = grammar_rows.RowsGrammar._fill

    def noted_fill(rows):
        seen.append(threading.current_thread().name)
        fill(rows)

    monkeypatch.setattr(grammar_rows.RowsGrammar, "_fill", noted_fill)
    threaded = _reply(engine, prompt, max_tokens=80, temperature=1.0, seed=9, grammar=grammar)
    assert threaded == at_once and at_once[2] == "stop"
    assert seen[0] == threading.current_thread().name  # the first, measured at once
    assert all(name.startswith("chatcli-grammar") for name in seen[1:]) and len(seen) > 10


def test_continue_goes_on_with_a_json_reply_the_budget_cut(embedded):
    from chatcli.chat.session import ChatSession
    from chatcli.chat.turns import SamplingOptions

    model, tokenizer = embedded
    options = SamplingOptions(temperature=1.0, seed=4, max_tokens=10, json_schema=PERSON)
    session = ChatSession(model, tokenizer, options)
    list(session.send("Who are you?"))
    cut = session.last_reply.text
    assert session.last_reply.stats.finish_reason == "length" and cut.startswith("{")
    options.max_tokens = 200
    list(session.continue_reply())
    whole = session.last_reply.text
    assert whole.startswith(cut) and session.last_reply.stats.finish_reason == "stop"
    jsonschema.validate(json.loads(whole), PERSON)
    # A reply written under another format cannot go on under this one.
    options.max_tokens, options.json_schema = 10, None
    list(session.send("And you?"))
    options.json_schema = PERSON
    with pytest.raises(SchemaError, match="does not follow the reply format's schema"):
        list(session.continue_reply())
