"""Tests for chatcli.training.evaluate's grading (the full run is in test_default_model)."""

from chatcli.training.eval_sets import EvalItem
from chatcli.training.evaluate import grade, summarize


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
