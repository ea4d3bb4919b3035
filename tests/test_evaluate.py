"""Tests for chatcli.training.evaluate and eval_report: grading, the settings scored, the
spread over seeds (the shipped model's floors are in test_default_model)."""

import argparse
import json
from dataclasses import replace

import pytest

from chatcli.chat.settings import DEFAULTS
from chatcli.model.checkpoint import EMBEDDED_DIR
from chatcli.training import evaluate as evaluate_module
from chatcli.training.eval_report import Setting, format_table, spread
from chatcli.training.eval_sets import EVAL_KINDS, EvalItem
from chatcli.training.evaluate import grade, parse_kinds, settings_from_flags, summarize


def _counting_item() -> EvalItem:
    messages = [{"role": "user", "content": "number of 'n's in need?"}]
    return EvalItem("counting", messages, "1", '"need".count("n")')


def _reply(call: str, output: str, sentence: str) -> list[dict[str, str]]:
    return [
        {"type": "python", "text": call},
        {"type": "python_output", "text": output},
        {"type": "text", "text": sentence},
    ]


def test_a_miscopied_call_can_be_right_by_chance_but_is_not_exact():
    lucky = grade(
        _counting_item(), _reply('"number".count("n")', "1", "There is 1 n in number."), True
    )
    assert lucky.correct and lucky.called_tool and not lucky.exact_call
    exact = grade(_counting_item(), _reply('"need".count("n")', "1", "There is 1 n in need."), True)
    assert exact.correct and exact.exact_call
    wrong = grade(
        _counting_item(), _reply('"need".count("e")', "2", "There are 2 e's in need."), True
    )
    assert not wrong.correct and not wrong.exact_call


def test_summary_reports_exact_calls_per_tool_kind():
    graded = [
        grade(
            _counting_item(), _reply('"number".count("n")', "1", "There is 1 n in number."), True
        ),
        grade(_counting_item(), _reply('"need".count("n")', "1", "There is 1 n in need."), True),
    ]
    summary = summarize(graded)
    assert summary["counting_accuracy"] == 1.0
    assert summary["counting_exact_call"] == 0.5
    assert "arithmetic_exact_call" not in summary  # no arithmetic items were graded


def test_a_reply_that_never_ends_is_counted_as_not_ended():
    graded = [
        grade(_counting_item(), _reply('"need".count("n")', "1", "There is 1 n in need."), True),
        grade(_counting_item(), _reply('"need".count("n")', "1", "There is 1 n in need."), False),
    ]
    summary = summarize(graded)
    assert summary["counting_accuracy"] == 1.0 and summary["ended_rate"] == 0.5


def test_beyond_the_calculator_is_right_when_it_says_so_and_calls_nothing():
    item = EvalItem("beyond", [{"role": "user", "content": "What is 2^10?"}], None, None)
    said = [{"type": "text", "text": "My calculator only does +, -, *, / and parentheses."}]
    assert grade(item, said, True).correct
    tried = [{"type": "python", "text": "2^10"}, *said]
    assert not grade(item, tried, True).correct
    declined = [{"type": "text", "text": "I'm too small to know that."}]
    assert not grade(item, declined, True).correct


def test_by_default_it_scores_greedy_and_the_chat_defaults(monkeypatch):
    assert settings_from_flags(None, None) == [
        Setting(0.0, None),
        Setting(DEFAULTS.temperature, DEFAULTS.top_k),
    ]
    assert (DEFAULTS.temperature, DEFAULTS.top_k) == (0.6, 50)
    # The defaults are read from the one place the chat reads them, not written here again.
    monkeypatch.setattr(evaluate_module, "DEFAULTS", replace(DEFAULTS, temperature=0.9, top_k=7))
    assert evaluate_module.settings_from_flags(None, None)[1] == Setting(0.9, 7)


def test_a_temperature_given_is_the_one_setting_scored():
    assert settings_from_flags(0.8, None) == [Setting(0.8, DEFAULTS.top_k)]
    assert settings_from_flags(0.8, 0) == [Setting(0.8, None)]  # top-k 0 is off
    assert settings_from_flags(0.0, None)[0].greedy
    assert settings_from_flags(None, 20)[1] == Setting(DEFAULTS.temperature, 20)


def test_kinds_are_named_by_group_or_listed():
    assert parse_kinds("all") == EVAL_KINDS
    assert parse_kinds("base") == ("arithmetic", "counting", "followup", "identity", "out_of_scope")
    assert parse_kinds("percent, beyond") == ("percent", "beyond")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown eval kinds"):
        parse_kinds("percent,poetry")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--temperature", "3"], "between 0 and 2"),
        (["--top-k", "-1"], "0 or more"),
        (["--seeds", "0"], "at least 1"),
        (["--kinds", "poetry"], "unknown eval kinds"),
    ],
)
def test_bad_flags_are_refused_before_any_model_loads(argv, message, capsys):
    with pytest.raises(SystemExit):
        evaluate_module.main(argv)
    assert message in capsys.readouterr().err


def test_spread_gives_mean_range_and_deviation_over_runs():
    runs = [
        {"items": 10, "seconds": 1.0, "failures": [], "counting_accuracy": 0.9},
        {"items": 10, "seconds": 2.0, "failures": [], "counting_accuracy": 1.0},
        {"items": 10, "seconds": 1.5, "failures": [], "counting_accuracy": 0.8},
    ]
    assert spread(runs) == {
        "counting_accuracy": {"mean": 0.9, "min": 0.8, "max": 1.0, "std": 0.0816}
    }
    assert spread(runs[:1])["counting_accuracy"]["std"] == 0.0


def test_the_table_has_a_column_per_setting_with_the_spread_of_sampled_runs():
    greedy = {"label": "greedy", "runs": [{}], "spread": {"counting_accuracy": _stats(0.97)}}
    sampled = {
        "label": "temperature 0.6, top-k 50",
        "runs": [{}] * 5,
        "spread": {"counting_accuracy": {"mean": 0.952, "min": 0.94, "max": 0.97, "std": 0.011}},
    }
    assert format_table([greedy, sampled]).splitlines() == [
        "measure            greedy  temperature 0.6, top-k 50, 5 seeds",
        "-----------------  ------  ----------------------------------",
        "counting_accuracy  97.0%   95.2% (94-97, sd 1.1)",
    ]


def _stats(value: float) -> dict[str, float]:
    return {"mean": value, "min": value, "max": value, "std": 0.0}


@pytest.mark.skipif(
    not (EMBEDDED_DIR / "chatsft_checkpoints").is_dir(), reason="embedded model not built"
)
def test_the_command_scores_greedy_once_and_sampling_once_per_seed(capsys):
    argv = ["--n", "2", "--kinds", "arithmetic,beyond", "--seeds", "2", "--json"]
    evaluate_module.main(argv)
    out = json.loads(capsys.readouterr().out)
    greedy, sampled = out["results"]
    assert (greedy["label"], len(greedy["runs"]), greedy["seeds"]) == ("greedy", 1, [])
    assert (sampled["temperature"], sampled["top_k"], sampled["seeds"]) == (0.6, 50, [0, 1])
    assert [run["items"] for run in sampled["runs"]] == [4, 4]
    assert set(sampled["spread"]) >= {"arithmetic_accuracy", "beyond_accuracy", "ended_rate"}
    # A sampled run is repeatable: the same seed gives the same replies.
    evaluate_module.main(argv)
    again = json.loads(capsys.readouterr().out)["results"][1]
    assert [r["failures"] for r in again["runs"]] == [r["failures"] for r in sampled["runs"]]
    assert again["spread"] == sampled["spread"]
