"""Prompt-lookup speculative decoding: a reply with drafting on is the reply without it, token
for token, in every era and on every decode path; forced calculator tokens, stops, budgets,
masks and logprobs are as without it; sampled tokens follow the model's distribution."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from builders import random_gpt
from fakes import SPECIAL_IDS, VOCAB_SIZE, ByteTokenizer, FakeConfig, tool_call
from step_paths import STEP_PATHS, engine_on_path
from torch import nn

from chatcli.engine.engine import Engine, GenerationStats
from chatcli.engine.logprobs import LogprobRecord
from chatcli.engine.scheduler import RowRequest, Scheduler
from chatcli.engine.speculation import Drafter
from chatcli.engine.warm_cache import WarmCache
from chatcli.model.checkpoint import load_model
from chatcli.model.gpt import ERAS
from chatcli.model.special_tokens import OUTPUT_END, OUTPUT_START

BYTES = ByteTokenizer()
# A prompt that repeats itself: a random model's greedy reply falls into a loop the drafts
# then copy, so verifications take drafts.
LOOPING = [5, 6, 7, 8, 9, 10, 11, 12] * 6


def _engine(model, path: str, speculate: bool, tokenizer=None) -> Engine:
    """An engine on `path` (step_paths.STEP_PATHS), drafting or not."""
    return engine_on_path(model, path, tokenizer, speculate=speculate)


def _reply(engine: Engine, prompt: list[int], **kwargs):
    """(tokens, masks, stats) of one row's generation."""
    stats = GenerationStats()
    tokens, masks = [], []
    for column, column_masks in engine.generate(prompt, stats=stats, **kwargs):
        tokens.append(column[0])
        masks.append(column_masks[0])
    return tokens, masks, stats


class PositionScriptedModel(nn.Module):
    """A fake whose logits at every position are a script of the tokens up to it (after the
    prompt), so a verify forward of several positions gets each one's own: what a real
    model does and tests/fakes.py's models (last position only) do not. One cache a
    history, positions overwritten where the cache was rewound."""

    def __init__(self, script) -> None:
        super().__init__()
        self.config = FakeConfig()
        self.script = script
        self.anchor = nn.Parameter(torch.zeros(1))
        self.histories: dict[int, list[int]] = {}
        self.prompt_lens: dict[int, int] = {}
        self.calls: list[int] = []  # T of every forward

    def get_device(self) -> torch.device:
        return self.anchor.device

    def forward(self, idx: torch.Tensor, kv_cache=None) -> torch.Tensor:
        T = idx.size(1)
        self.calls.append(T)
        key, pos = id(kv_cache), kv_cache.get_pos()
        history = self.histories.setdefault(key, [])
        del history[pos:]
        history.extend(idx[0].tolist())
        if pos == 0:
            self.prompt_lens[key] = T
        start = self.prompt_lens[key]
        logits = torch.zeros(1, T, VOCAB_SIZE)
        for t in range(T):
            end = pos + t + 1
            if end >= start:
                logits[0, t] = _as_logits(self.script(history[start:end]))
        kv_cache.prev_token = idx[:, -1]
        kv_cache.advance(T)
        return logits


def _as_logits(next_) -> torch.Tensor:
    if isinstance(next_, int):
        logits = torch.full((VOCAB_SIZE,), -50.0)
        logits[next_] = 0.0
        return logits
    return next_


# ---- greedy: the same reply ----------------------------------------------------------------------


@pytest.mark.parametrize("path", STEP_PATHS)
@pytest.mark.parametrize("era", list(ERAS))
def test_a_greedy_reply_is_the_plain_reply_token_for_token_with_drafts_taken(era, path):
    model = random_gpt(era)
    plain = _reply(_engine(model, path, False), LOOPING, max_tokens=48, temperature=0.0)
    drafted = _reply(_engine(model, path, True), LOOPING, max_tokens=48, temperature=0.0)
    assert drafted[0] == plain[0] and len(plain[0]) == 48
    assert drafted[1] == plain[1] == [1] * 48
    assert drafted[2].finish_reasons == plain[2].finish_reasons == ["length"]
    counts = drafted[2].speculation
    assert counts.accepted > 0 and counts.verifications > 0  # drafts were taken: not vacuous
    assert counts.tokens_per_verification > 1
    assert plain[2].speculation.verifications == 0


def test_a_sampled_reply_is_the_plain_reply_for_the_same_seed_and_logprobs_match():
    model = random_gpt("E")
    got = []
    for speculate in (False, True):
        record = LogprobRecord(top=3)
        reply = _reply(
            _engine(model, "torch", speculate), LOOPING, max_tokens=40, temperature=0.8,
            top_k=50, seed=11, logprobs=record,
        )  # fmt: skip
        got.append((reply, record))
    (plain, plain_lp), (drafted, drafted_lp) = got
    assert drafted[0] == plain[0]
    assert drafted[2].speculation.verifications > 0
    for a, b in zip(plain_lp.columns, drafted_lp.columns, strict=True):
        assert a[0].token == b[0].token
        assert a[0].logprob == pytest.approx(b[0].logprob, abs=1e-4)
        assert [t for t, _ in a[0].top] == [t for t, _ in b[0].top]


def test_the_cache_holds_what_plain_decode_leaves_after_the_reply():
    # The next turn goes on from the warm cache: its tokens and position are plain decode's.
    model = random_gpt("E")
    ends = []
    for speculate in (False, True):
        engine = _engine(model, "torch", speculate)
        warm = WarmCache(engine)
        tokens, _, _ = _reply(engine, LOOPING, max_tokens=30, temperature=0.0, warm=warm)
        ends.append((warm.tokens, warm.cache.get_pos(), int(warm.cache.prev_token)))
        assert warm.tokens == LOOPING + tokens[:-1]
    assert ends[0] == ends[1]


# ---- the calculator, stops and budgets -----------------------------------------------------------

COPYING_DONE = [
    *BYTES.encode(" 84 and 84 and 84 and 84 and 84 done"),
    SPECIAL_IDS["<|assistant_end|>"],
]


def test_forced_calculator_tokens_and_the_stop_are_as_plain_and_drafted():
    prompt = BYTES.encode("what is 12*7? say 84 and 84 and 84")
    plain = _reply(
        Engine(PositionScriptedModel(tool_call("12*7", COPYING_DONE)), BYTES), prompt,
        temperature=0.0,
    )  # fmt: skip
    model = PositionScriptedModel(tool_call("12*7", COPYING_DONE))
    drafted = _reply(Engine(model, BYTES, speculate=True), prompt, temperature=0.0)
    assert drafted[:2] == plain[:2]
    tokens, masks, stats = drafted
    start, end = tokens.index(SPECIAL_IDS[OUTPUT_START]), tokens.index(SPECIAL_IDS[OUTPUT_END])
    assert BYTES.decode(tokens[start + 1 : end]) == "84"
    assert masks[start : end + 1] == [0] * (end + 1 - start)
    assert stats.finish_reasons == ["stop"] and tokens[-1] == SPECIAL_IDS["<|assistant_end|>"]
    assert stats.speculation.accepted > 0 and max(model.calls[1:]) > 1  # verify forwards ran
    assert len(model.calls) < len(tokens)  # fewer forwards than tokens


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 9, 13, 17, 24, 31])
def test_a_budget_ends_the_reply_where_plain_decode_ends_it(max_tokens):
    prompt = BYTES.encode("what is 12*7? say 84 and 84 and 84")
    plain = _reply(
        Engine(PositionScriptedModel(tool_call("12*7", COPYING_DONE)), BYTES), prompt,
        temperature=0.0, max_tokens=max_tokens,
    )  # fmt: skip
    drafted = _reply(
        Engine(PositionScriptedModel(tool_call("12*7", COPYING_DONE)), BYTES, speculate=True),
        prompt, temperature=0.0, max_tokens=max_tokens,
    )  # fmt: skip
    assert drafted[:2] == plain[:2]
    assert drafted[2].finish_reasons == plain[2].finish_reasons
    assert drafted[2].steps == plain[2].steps


def test_the_embedded_model_drafts_its_copied_numbers_and_replies_as_plain():
    model, tokenizer, _ = load_model(device="cpu")
    prompt = tokenizer.render_for_completion(
        {"messages": [{"role": "user", "content": "what is 1234 + 5678 + 1234 + 5678?"}]}
    )
    plain = _reply(Engine(model, tokenizer), prompt, temperature=0.0, max_tokens=64)
    drafted = _reply(
        Engine(model, tokenizer, speculate=True), prompt, temperature=0.0, max_tokens=64
    )
    assert drafted[:2] == plain[:2]
    assert drafted[2].speculation.accepted > 0


# ---- sampling: the model's distribution ----------------------------------------------------------

# Tokens 65..68 ("ABCD"): the next is the one after the last (mod 4) with p 0.6, the last
# again with p 0.2, the other two with 0.1 each: the prompt's cycle is what the drafts copy.
CYCLE = [65, 66, 67, 68]
ODDS = {1: 0.6, 0: 0.2, 2: 0.1, 3: 0.1}  # offset from the last token -> probability


def _cycle_logits(generated: list[int], before: int) -> torch.Tensor:
    last = generated[-1] if generated else before
    logits = torch.full((VOCAB_SIZE,), float("-inf"))
    for offset, p in ODDS.items():
        logits[CYCLE[(CYCLE.index(last) + offset) % 4]] = math.log(p)
    return logits


def test_sampled_tokens_with_drafts_follow_the_models_distribution():
    prompt = CYCLE * 8
    model = PositionScriptedModel(lambda generated: _cycle_logits(generated, prompt[-1]))
    engine = Engine(model, BYTES, speculate=True)
    runs, positions = 1500, 3
    joint: Counter[tuple[int, ...]] = Counter()
    accepted = 0
    for seed in range(runs):
        tokens, _, stats = _reply(engine, prompt, temperature=1.0, max_tokens=positions, seed=seed)
        joint[tuple(tokens)] += 1
        accepted += stats.speculation.accepted
    assert accepted > runs // 5  # drafts were taken: the rule was exercised
    # Chi-square of the first three tokens' joint histogram against the exact distribution.
    chi2, cells = 0.0, 0
    for a in CYCLE:
        for b in CYCLE:
            for c in CYCLE:
                p = 1.0
                last = prompt[-1]
                for t in (a, b, c):
                    p *= ODDS[(CYCLE.index(t) - CYCLE.index(last)) % 4]
                    last = t
                expected = runs * p
                chi2 += (joint[(a, b, c)] - expected) ** 2 / expected
                cells += 1
    # 63 degrees of freedom: P(chi2 > 120) is about 1e-5 for the right distribution.
    assert chi2 < 120, chi2
    assert sum(joint.values()) == runs


# ---- drafting --------------------------------------------------------------------------------------


def test_the_drafter_copies_what_followed_the_latest_match_of_the_longest_suffix():
    d = Drafter([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert d.draft(3) == [7, 8, 5]  # (2, 3) last came before 7 8 5
    d.append(4)
    assert d.draft(2) == []  # 4 never came before
    run = Drafter([7, 7, 7])
    assert run.draft(4) == [7, 7, 7, 7]  # a repeating run goes on past the end
    cycle = Drafter([1, 2, 1, 2])
    assert cycle.draft(5) == [1, 2, 1, 2, 1]


# ---- the bench's rows ------------------------------------------------------------------------------


def test_the_bench_rows_replay_drafts_all_taken_and_none_taken_with_the_same_replies():
    from chatcli.bench.models import SyntheticTokenizer
    from chatcli.bench.speculation_rows import run_speculation_bench

    model = random_gpt("E", vocab_size=300)
    tokenizer = SyntheticTokenizer(300)
    engine = Engine(model, tokenizer)
    rows = {r["workload"]: r for r in run_speculation_bench(engine, tokenizer, True)}
    assert list(rows) == [
        "copy", "copy replayed, all taken", "copy replayed, none taken", "open-ended"
    ]  # fmt: skip
    assert all(
        r["same_reply"] and r["plain_tps"] > 0 and r["speculate_tps"] > 0 for r in rows.values()
    )
    taken, missed = rows["copy replayed, all taken"], rows["copy replayed, none taken"]
    assert taken["acceptance"] == 1.0 and taken["tokens_per_verification"] > 4
    assert missed["acceptance"] == 0.0 and missed["tokens_per_verification"] == 1.0
    # The back-off: after a few rejected verifications the row decodes plainly.
    assert 0 < missed["verifications"] < missed["tokens"] // 4
    assert engine.speculate is False  # the engine is left as it was given


# ---- a server's rows ------------------------------------------------------------------------------


def _slot_run(engine: Engine, requests: list[RowRequest], join_at: list[int]):
    """Each request joined at its step into a 3-row batch, stepped to the end: each row's
    tokens and the generations."""
    batch = Scheduler(engine, rows=3, prefill_chunk=16)
    produced: dict[int, list[int]] = {}
    gens: list = [None] * len(requests)
    step = 0
    while step <= max(join_at) or batch.running:
        for i, at in enumerate(join_at):
            if at == step:
                gens[i] = batch.join(requests[i])
        for gen, token, _ in batch.step().tokens:
            produced.setdefault(id(gen), []).append(token)
        step += 1
    return [produced.get(id(g), []) for g in gens], gens


@pytest.mark.parametrize("path", STEP_PATHS)
def test_a_servers_rows_draft_while_one_decodes_alone_and_give_the_plain_tokens(path):
    model = random_gpt("E")
    prompts = [LOOPING, [*LOOPING[3:], 40, 41], [9, 10, 11, 12] * 5]
    requests = [
        RowRequest(prompts[0], max_tokens=40, temperature=0.0),
        RowRequest(prompts[1], max_tokens=12, temperature=0.9, seed=3),
        RowRequest(prompts[2], max_tokens=40, temperature=0.0),
    ]
    join_at = [0, 9, 30]  # alone, then together, then alone again
    plain, _ = _slot_run(_engine(model, path, False), requests, join_at)
    drafted, gens = _slot_run(_engine(model, path, True), requests, join_at)
    assert drafted == plain
    assert [len(t) for t in plain] == [40, 12, 40]
    assert sum(g.stats.speculation.accepted for g in gens) > 0
    for gen, tokens in zip(gens, drafted, strict=True):  # the slot keeps the conversation
        assert gen.warm.tokens == gen.request.tokens + tokens[:-1]
        assert gen.warm.cache.get_pos() == len(gen.warm.tokens)


@pytest.mark.parametrize("path", STEP_PATHS)
def test_a_few_server_rows_draft_together_and_give_the_plain_tokens(path, monkeypatch):
    from chatcli.engine import scheduler

    # Three rows decode at once from the start, one joining while the others' prompts are
    # still in: each copy-able row drafts in the shared forward, its tokens the plain ones.
    monkeypatch.setattr(scheduler, "SPECULATE_MAX_ROWS", 3)
    model = random_gpt("E")
    prompts = [LOOPING, [*LOOPING[3:], 40, 41], [9, 10, 11, 12] * 5]
    requests = [
        RowRequest(prompts[0], max_tokens=40, temperature=0.0),
        RowRequest(prompts[1], max_tokens=30, temperature=0.9, seed=3),
        RowRequest(prompts[2], max_tokens=40, temperature=0.0),
    ]
    join_at = [0, 0, 1]
    plain, _ = _slot_run(_engine(model, path, False), requests, join_at)
    drafted, gens = _slot_run(_engine(model, path, True), requests, join_at)
    assert drafted == plain
    if _engine(model, path, True).takes_prompt_rows:  # drafts ride the batch's forward
        assert gens[0].stats.speculation.accepted > 0 and gens[2].stats.speculation.accepted > 0
    for gen, tokens in zip(gens, drafted, strict=True):
        assert gen.warm.tokens == gen.request.tokens + tokens[:-1]
        assert gen.warm.cache.get_pos() == len(gen.warm.tokens)


def test_more_rows_than_speculate_max_rows_decode_plainly(monkeypatch):
    from chatcli.engine import scheduler

    # Three prompts of 5 tokens, all in at the first step (chunks of 16): then three rows
    # decode together to the end, past the limit of 2; at 3 they draft.
    model = random_gpt("E")
    requests = [RowRequest([9, 10, 11, 12, 9], max_tokens=30, temperature=0.0)] * 3
    plain, _ = _slot_run(_engine(model, STEP_PATHS[0], False), requests, [0, 0, 0])
    for limit, drafts in ((2, False), (3, True)):
        monkeypatch.setattr(scheduler, "SPECULATE_MAX_ROWS", limit)
        drafted, gens = _slot_run(_engine(model, STEP_PATHS[0], True), requests, [0, 0, 0])
        assert drafted == plain
        assert all((g.stats.speculation.verifications > 0) == drafts for g in gens)


# ---- the setting ------------------------------------------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    for name in ("CHATCLI_TEMPERATURE", "CHATCLI_MODEL", "CHATCLI_CONFIG", "CHATCLI_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("CHATCLI_SPECULATE", raising=False)
    return monkeypatch


def test_once_replies_the_same_with_speculate_auto_off_and_from_the_environment(home):
    from typer.testing import CliRunner

    from chatcli.cli.app import app

    runner = CliRunner()
    args = ["once", "Repeat after me: 4821, 7730, 1299, 3356, 4821, 7730.", "-t", "0", "-n", "40"]
    auto = runner.invoke(app, [*args, "--speculate", "auto"])
    off = runner.invoke(app, [*args, "--speculate", "off"])
    assert auto.exit_code == off.exit_code == 0, auto.output
    assert auto.output == off.output and "4821" in auto.output
    home.setenv("CHATCLI_SPECULATE", "sometimes")
    bad = runner.invoke(app, args)
    assert bad.exit_code == 1
    assert "CHATCLI_SPECULATE: speculate must be one of auto, off, got 'sometimes'" in bad.output
    home.setenv("CHATCLI_SPECULATE", "off")
    assert runner.invoke(app, args).output == off.output


def test_once_json_says_how_many_drafts_the_reply_took(home):
    import json

    from typer.testing import CliRunner

    from chatcli.cli.app import app

    runner = CliRunner()
    args = ["once", "Repeat after me: 4821, 7730, 1299, 3356, 4821, 7730.", "-t", "0", "-n", "40"]
    auto = json.loads(runner.invoke(app, [*args, "--json"]).output)
    off = json.loads(runner.invoke(app, [*args, "--json", "--speculate", "off"]).output)
    assert auto["text"] == off["text"]
    drafts = auto["speculation"]
    assert drafts["verifications"] > 0 and 0 < drafts["accepted"] <= drafts["drafted"]
    assert drafts["acceptance"] == round(drafts["accepted"] / drafts["drafted"], 4)
    assert off["speculation"] == {
        "verifications": 0,
        "drafted": 0,
        "accepted": 0,
        "acceptance": 0.0,
    }


def test_a_chat_session_drafts_by_default_and_not_when_off(home):
    from chatcli.chat.settings import load_settings
    from chatcli.cli.session_setup import load_session

    session, _ = load_session(load_settings(env={}), None)
    assert session.engine.speculate is True
    session, _ = load_session(load_settings(env={"CHATCLI_SPECULATE": "off"}), None)
    assert session.engine.speculate is False


def test_a_reply_under_a_json_schema_does_not_draft_and_is_the_plain_reply():
    from chatcli.engine.grammar import json_grammar

    model, tokenizer, _ = load_model(device="cpu")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    prompt = tokenizer.render_for_completion(
        {"messages": [{"role": "user", "content": "Tell me about Ann, who is 34. Ann is 34."}]}
    )
    kwargs = {"max_tokens": 80, "temperature": 0.0, "grammar": json_grammar(schema)}
    plain = _reply(Engine(model, tokenizer), prompt, **kwargs)
    drafted = _reply(Engine(model, tokenizer, speculate=True), prompt, **kwargs)
    assert drafted[:2] == plain[:2]
    assert drafted[2].speculation.verifications == 0


@pytest.mark.parametrize("stop_after", [3, 7, 12])
def test_a_reply_closed_early_leaves_the_cache_as_plain_decode_leaves_it(stop_after):
    # A chat's stop text or Ctrl-C closes the generation mid-verification: the drafts past
    # the last token taken are not left in the conversation's cache.
    model = random_gpt("E")
    ends = []
    for speculate in (False, True):
        engine = _engine(model, "torch", speculate)
        warm = WarmCache(engine)
        stats = GenerationStats()
        columns = engine.generate(LOOPING, max_tokens=40, temperature=0.0, warm=warm, stats=stats)
        taken = [column[0] for _, (column, _) in zip(range(stop_after), columns, strict=False)]
        columns.close()
        ends.append((taken, warm.tokens, warm.cache.get_pos(), int(warm.cache.prev_token)))
    assert ends[0] == ends[1]
    assert ends[1][2] == len(LOOPING) + stop_after - 1
