"""`chatcli serve`'s own options: --workers as a count or a range, --ray and its extra.

The servers themselves are tested in test_server.py (one machine) and test_ray_serve.py (Ray).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from chatcli.cli.app import app
from chatcli.cli.serve_command import replica_count
from chatcli.errors import ConfigError


def test_workers_is_a_count_or_with_ray_a_range():
    assert replica_count(None, ray=False) is None
    assert replica_count("3", ray=False) == (3, 3)
    assert replica_count("2", ray=True) == (2, 2)
    assert replica_count("1-4", ray=True) == (1, 4)
    assert replica_count(" 2 - 2 ", ray=True) == (2, 2)


@pytest.mark.parametrize(
    ("text", "ray", "message"),
    [
        ("1-4", False, "a range autoscales, which needs a Ray cluster: add --ray local"),
        ("two", True, "--workers takes a count (2) or, with --ray, a range (1-4); got 'two'."),
        ("0", False, "counts start at 1"),
        ("4-1", True, "a range goes up (1-4)"),
        ("-1", True, "--workers takes a count"),
    ],
)
def test_a_bad_workers_value_says_what_it_takes(text, ray, message):
    with pytest.raises(ConfigError, match="--workers") as caught:
        replica_count(text, ray)
    assert message in str(caught.value)


def test_a_range_without_ray_is_one_error_line_before_anything_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path))
    result = CliRunner().invoke(app, ["serve", "--model", "/no/such/model", "--workers", "1-2"])
    assert result.exit_code == 1
    assert result.output.startswith("Error: --workers 1-2: a range autoscales")
    assert "No model" not in result.output and "Traceback" not in result.output


def test_ray_without_the_extra_says_the_pip_command():
    # Ray is installed here: the program hides it, as a machine without the extra has none.
    program = (
        "import sys; sys.modules['ray'] = None; "
        "from chatcli.cli.app import main; "
        "sys.argv = ['chatcli', 'serve', '--ray', 'local', '--port', '0']; main()"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr == (
        "Error: chatcli serve --ray needs the ray extra: pip install 'chatcli[ray]'\n"
    )
    assert done.stdout == ""


def test_serve_help_tells_the_three_ways_to_serve():
    result = CliRunner().invoke(app, ["serve", "--help"], terminal_width=100)
    text = " ".join(result.output.split())
    assert result.exit_code == 0
    assert "Three ways to serve it. On one machine (the default)" in text
    assert "On a Ray cluster (--ray ADDRESS; pip install 'chatcli[ray]')" in text
    assert "`ray start --head`" in text and "`ray start --address HEAD:6379`" in text
    assert "As a transformers export under vLLM" in text
