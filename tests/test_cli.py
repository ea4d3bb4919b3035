"""The CLI through Typer's runner: flags, settings precedence, errors as one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from reference import REFERENCE, needs_reference
from typer.testing import CliRunner

from chatcli.chat.conversation_index import latest_conversation
from chatcli.chat.conversation_reader import read_conversation
from chatcli.chat.settings import conversations_dir
from chatcli.cli.app import app

FIXTURE = REFERENCE / "E"
needs_fixture = needs_reference
runner = CliRunner()


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path / "home"))
    for name in ("CHATCLI_TEMPERATURE", "CHATCLI_MODEL", "CHATCLI_CONFIG", "CHATCLI_URL"):
        monkeypatch.delenv(name, raising=False)


def test_help_lists_every_command():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("chat", "once", "models", "config", "serve", "bench"):
        assert command in result.output


def test_help_does_not_import_torch():
    code = "import sys; from chatcli.cli.app import app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_config_path_follows_chatcli_home(tmp_path):
    result = runner.invoke(app, ["config", "path"])
    assert result.output.strip() == str(tmp_path / "home" / "config.toml")


@needs_fixture
def test_once_json_reports_text_usage_and_seed():
    args = [
        "once",
        "hello there",
        "--model",
        str(FIXTURE),
        "--json",
        "-t",
        "0",
        "--max-tokens",
        "5",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["finish_reason"] in ("stop", "length")
    assert out["usage"]["completion_tokens"] <= 5
    assert (
        out["usage"]["total_tokens"]
        == out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]
    )
    assert out["model"].endswith("model_000001.pt")


def test_once_shows_a_call_cut_by_max_tokens_as_cut_not_failed():
    # The embedded model opens its calculator call at once: 5 tokens stop inside "1234*56".
    args = ["once", "What is 1234*56?", "-t", "0", "--max-tokens", "5"]
    plain = runner.invoke(app, args)
    assert plain.exit_code == 0, plain.output
    assert plain.output.startswith("[calc 1234") and plain.output.endswith(" … cut]\n")
    out = json.loads(runner.invoke(app, [*args, "--json"]).output)
    [call] = out["tools"]
    assert call["status"] == "cut" and call["output"] is None
    assert "1234*56".startswith(call["expression"])
    assert out["finish_reason"] == "length"


def test_once_never_cuts_a_calculator_result_in_half():
    # 12 tokens stop inside the result the calculator forces: it is written whole all the same.
    args = ["once", "What is 1111*22?", "-t", "0", "--max-tokens", "12"]
    assert runner.invoke(app, args).output == "[calc 1111*22 = 24442]\n"
    out = json.loads(runner.invoke(app, [*args, "--json"]).output)
    assert out["tools"] == [{"expression": "1111*22", "output": "24442", "status": "ok"}]
    assert out["parts"][-1] == {"type": "python_output", "text": "24442"}


@needs_fixture
def test_once_greedy_is_reproducible_and_reads_stdin():
    args = ["once", "-", "--model", str(FIXTURE), "-t", "0", "--max-tokens", "8"]
    first = runner.invoke(app, args, input="What is 2+2?\n")
    second = runner.invoke(app, ["once", "What is 2+2?", *args[2:]])
    assert first.exit_code == second.exit_code == 0
    assert first.output == second.output and first.output.endswith("\n")


@needs_fixture
def test_flag_beats_env_beats_config_file(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text("max_tokens = 3\n")
    monkeypatch.setenv("CHATCLI_MAX_TOKENS", "4")
    base = ["once", "hi", "--model", str(FIXTURE), "--json", "-t", "1", "--seed", "5"]
    out = json.loads(runner.invoke(app, base).output)
    assert out["usage"]["completion_tokens"] <= 4 and out["seed"] == 5
    out = json.loads(runner.invoke(app, [*base, "--max-tokens", "2"]).output)
    assert out["usage"]["completion_tokens"] <= 2


def test_errors_are_one_line_and_exit_nonzero():
    result = runner.invoke(app, ["once", "hi", "--model", "/no/such/model"])
    assert result.exit_code == 1
    assert "No model at /no/such/model" in result.output
    assert "Traceback" not in result.output
    result = runner.invoke(app, ["once", "hi", "--temperature", "9"])
    assert result.exit_code == 2 and "temperature" in result.output  # a usage error
    result = runner.invoke(app, ["serve", "--cache-slots", "0"])
    assert result.exit_code == 2 and "cache-slots" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["once", "hi", "--bogus"], "Error: No such option: --bogus. See chatcli once --help."),
        (
            ["once", "hi", "-t", "abc"],
            "Error: --temperature: temperature must be a number between 0 and 2, got 'abc'",
        ),
        (
            ["chat", "--max-tokens", "0"],
            "Error: --max-tokens: max_tokens must be a whole number between 1 and 65536, got '0'",
        ),
        (
            ["once", "hi", "--step", "x"],
            "Error: --step: step must be a whole number of at least 0, or latest, got 'x'",
        ),
        (["chta"], "Error: No such command 'chta'. Did you mean 'chat'? See chatcli --help."),
    ],
)
def test_usage_errors_are_one_line_on_stderr_with_exit_code_2(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr == message + "\n"


def test_top_k_and_top_p_flags_take_off_as_their_error_message_says():
    bad = runner.invoke(app, ["once", "hi", "--top-k", "-5"])
    assert bad.exit_code == 2 and "(0 or off turns it off)" in bad.stderr
    args = ["once", "hi", "--top-k", "off", "--top-p", "off", "-t", "1", "--max-tokens", "3"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["usage"]["completion_tokens"] <= 3


def test_chat_with_piped_stdin_answers_each_line_in_plain_text():
    # No trailing newline: the last line is answered all the same.
    result = runner.invoke(app, ["chat", "-t", "0"], input="/top_k 7\nWhat is 1234*56?")
    assert result.exit_code == 0, result.output
    assert "Input is not a terminal" not in result.stderr
    assert "\r" not in result.stdout and ">>>" not in result.stdout
    reply = next(line for line in result.stdout.splitlines() if line.startswith("[calc"))
    assert reply.startswith("[calc 1234*56 = 69104]") and reply.endswith("69104.")
    said = (result.stdout + result.stderr).splitlines()
    assert "top_k = 7" in said
    assert said[-1].startswith("Saved as ")


def test_chat_with_piped_stdin_keeps_the_banner_out_of_stdout():
    # `printf 'What is 2+2?\n' | chatcli chat > replies.txt`: the file holds the replies.
    result = runner.invoke(app, ["chat", "-t", "0", "--max-tokens", "4"], input="hi\n")
    assert result.exit_code == 0, result.output
    assert "Type /help for commands, Ctrl-D to exit." in result.stderr.splitlines()
    assert "embedded default model" in result.stderr.splitlines()
    assert "chatcli · " not in result.stdout and "/help" not in result.stdout
    assert result.stdout.strip()  # the reply


def test_system_given_with_resume_replaces_the_conversations_own(monkeypatch):
    first = runner.invoke(app, ["chat", "-t", "0", "--max-tokens", "4"], input="hello")
    assert first.exit_code == 0, first.output
    resumed = runner.invoke(
        app, ["chat", "-r", "last", "--system", "Be terse.", "--max-tokens", "4"], input="/system"
    )
    assert resumed.exit_code == 0, resumed.output
    # Piped: what cli.py says of the resume goes to stderr, as the banner does.
    assert "The system prompt is --system's from here on." in resumed.stderr
    assert "Resumed " in resumed.stderr and "Resumed " not in resumed.stdout
    assert "System prompt: Be terse." in resumed.stdout + resumed.stderr
    path = latest_conversation(conversations_dir())
    assert read_conversation(path).messages[0] == {"role": "system", "content": "Be terse."}
    # A configured system prompt (not the flag) leaves the conversation's own, and says so.
    monkeypatch.setenv("CHATCLI_SYSTEM", "Be loud.")
    again = runner.invoke(app, ["chat", "-r", "last", "--max-tokens", "4"], input="/system")
    assert again.exit_code == 0, again.output
    assert "keeps its own system prompt" in again.stderr
    assert read_conversation(path).messages[0] == {"role": "system", "content": "Be terse."}


def test_models_with_a_base_dir_that_does_not_exist_says_so(tmp_path):
    missing = tmp_path / "nope"
    result = runner.invoke(app, ["models", "--base-dir", str(missing)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: No folder at {missing}. Pass --base-dir")
    assert len(result.stderr.splitlines()) == 1


def test_bad_config_file_is_named(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text("temprature = 0.5\n")
    result = runner.invoke(app, ["once", "hi"])
    assert result.exit_code == 1
    assert "temprature" in result.output and "config.toml" in result.output


@needs_fixture
def test_models_lists_checkpoints_of_a_base_dir():
    result = runner.invoke(app, ["models", "--base-dir", str(FIXTURE)])
    assert result.exit_code == 0
    header, _, *rows = result.output.splitlines()
    assert header.split()[:5] == ["model", "source", "tag", "step", "era"]
    listed = [row.split()[1:5] for row in rows if row.split()]
    assert ["sft", "d4", "1", "E"] in listed  # the base dir's checkpoint (the embedded one too)


def test_once_without_a_prompt_on_a_terminal_says_how_to_use_it(monkeypatch):
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    result = runner.invoke(app, ["once"])
    assert result.exit_code == 2


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["chat", "--resume"], ["chat", "--resume", "last"]),
        (["chat", "--resume", "--model", "x"], ["chat", "--resume", "last", "--model", "x"]),
        (["chat", "-r", "20261121-0532"], ["chat", "-r", "20261121-0532"]),
        (["chat", "--model", "x"], ["chat", "--model", "x"]),
    ],
)
def test_a_bare_resume_means_the_last_conversation(argv, want):
    from chatcli.cli.app import bare_resume_means_last

    assert bare_resume_means_last(argv) == want


def test_once_url_talks_to_a_server_and_shows_the_calculator():
    pytest.importorskip("fastapi")
    from serving import END, scripted_worker, serve_workers, text_tokens

    call = [261, *text_tokens("6*7"), 262]  # <|python_start|>6*7<|python_end|> in byte ids
    sentence = text_tokens(" It is 42.")

    def script(history: list[int]) -> int:
        if len(history) < len(call):
            return call[len(history)]
        if 264 not in history:  # the server forces <|output_start|>42<|output_end|> itself
            return END
        written = history[history.index(264) + 1 :]
        return sentence[len(written)] if len(written) < len(sentence) else END

    server = serve_workers([scripted_worker(script)])
    try:
        result = runner.invoke(app, ["once", "6*7?", "--url", server.url, "-t", "0"])
    finally:
        server.stop()
    assert result.exit_code == 0, result.output
    assert result.output == "[calc 6*7 = 42] It is 42.\n"


def test_once_quantized_answers_and_a_bad_format_says_the_choices():
    args = ["once", "What is 1234*56?", "--quantize", "int8", "-t", "0", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["finish_reason"] == "stop"
    bad = runner.invoke(app, ["once", "hi", "--quantize", "int3"])
    assert bad.exit_code != 0
    assert "none, int8, int4" in bad.output


def test_bench_table_names_the_step_kernel_and_the_threads_decode_settled_on(monkeypatch):
    import chatcli.bench.bench

    result = {
        "model": "embedded default model",
        "params": 3637394,
        "weights": "float32",
        "threads": {"baseline": 2, "ours": 1},
        "plan": "3.6M params: dispatch-bound, torch's ops on one thread",
        "decode_path": "decode_step",
        "step_kernel": "rows_step",
        "decode_threads": {1: 2, 8: 1},
        "one_row_kernels": [],
        "sample_rows_kernels": [],
        "bandwidth_gbs": 33.9,
        "weight_mb_per_token": 11.4,
        "roofline_tps": 2973.5,
        "prefill_tps": {"baseline": 13078.9, "ours": 13617.7},
        "decode_tps": {"baseline": 278.4, "ours": 2407.9, "ratio": 8.65},
        "decode8_tps": {"baseline": 1290.8, "ours": 7605.5, "ratio": 5.89},
        "single_sampled_tps": 1914.4,
        "samples8_vs_single": 3.97,
        "ttft_s": {
            "baseline": {1: 0.0049, 5: 0.0109, 10: 0.0193},
            "ours": {1: 0.0056, 5: 0.0064, 10: 0.0065},
            "ours_turn10_over_turn1": 1.17,
            "baseline_turn10_over_turn1": 3.91,
        },
        "roofline_fraction": 0.81,
        "bf16_roofline_tps": 5946.9,
        "bf16_roofline_fraction": 0.405,
        "roofline_fraction_paired": 0.93,
        "bf16_roofline_fraction_paired": 0.465,
        "greedy_identical_fp32": True,
        "greedy_agreement": 1.0,
        "peak_rss_mb": 847.2,
    }
    monkeypatch.setattr(chatcli.bench.bench, "run_bench", lambda *args, **kwargs: result)
    out = runner.invoke(app, ["bench"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "decode via decode_step through our rows_step kernel" in out.output
    assert "1 (decode: 2 at 1 row, 1 at 8 rows)" in out.output
    assert "8.65x" in out.output and "5.89x" in out.output
    rows = {line.split(" (s)")[0]: line for line in out.output.splitlines() if " (s) " in line}
    assert rows["time to first token, turn 1"].split()[-2:] == ["1.14x", "slower"]
    prefill = next(line for line in out.output.splitlines() if line.startswith("prefill"))
    assert prefill.split()[-1] == "1.04x"  # 13617.7 / 13078.9
    assert rows["time to first token, turn 10"].split()[-2:] == ["2.97x", "faster"]
    assert "beside a decode run: 0.93, bf16 0.465" in " ".join(out.output.split())


def test_once_that_fails_does_not_say_interrupted():
    pytest.importorskip("fastapi")
    from serving import END, scripted_worker, serve_workers

    # The server takes top_k up to 200: it refuses the request once the reply is asked for,
    # and nobody pressed Ctrl-C.
    server = serve_workers([scripted_worker(lambda history: END)])
    try:
        result = runner.invoke(app, ["once", "hi", "--url", server.url, "--top-k", "500"])
    finally:
        server.stop()
    assert result.exit_code == 1
    assert "[interrupted]" not in result.stdout
    assert "refused the request (400)" in result.stderr


def test_once_with_a_source_the_embedded_model_lacks_says_so():
    result = runner.invoke(app, ["once", "hi", "--source", "base"])
    assert result.exit_code == 1
    assert "only an sft checkpoint, not 'base'" in result.stderr


def test_bench_refuses_a_model_and_a_synthetic_one_together():
    result = runner.invoke(app, ["bench", "--model", "d20", "--synthetic", "d4"])
    assert result.exit_code == 2
    assert "Pass --model or --synthetic, not both." in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "mps"], "The bench runs on auto, cpu, cuda or cuda:N; not 'mps'."),
        (["--device", "cuda:x"], "not 'cuda:x'"),
    ],
)
def test_bench_says_which_devices_it_measures(args, message):
    result = runner.invoke(app, ["bench", *args])
    assert result.exit_code == 2 and message in result.stderr


def test_bench_on_cuda_without_one_says_to_use_the_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks a CPU-only machine's message")
    result = runner.invoke(app, ["bench", "--device", "cuda"])
    assert result.exit_code == 1
    assert "this torch sees no CUDA device" in result.stderr and "--device cpu" in result.stderr


def test_step_takes_latest_as_the_config_does():
    result = runner.invoke(app, ["once", "What is 2+2?", "--step", "latest", "-t", "0"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["once", "hi", "--step", "soon"])
    assert result.exit_code == 2
    assert "--step: step must be a whole number of at least 0, or latest" in result.stderr


def test_models_lists_a_checkpoint_it_cannot_read_and_says_why(tmp_path):
    tag = tmp_path / "chatsft_checkpoints" / "d20"
    tag.mkdir(parents=True)
    (tag / "model_000650.pt").write_bytes(b"not a checkpoint")
    result = runner.invoke(app, ["models", "--base-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if "model_000650.pt" in line)
    assert row.split()[:6] == [str(tmp_path), "sft", "d20", "650", "-", "-"]
    assert row.rstrip().endswith("(unreadable)")
    assert f"{tag / 'model_000650.pt'}: No tokenizer.pkl found" in result.stderr
    assert "No checkpoints in" not in result.stderr


def test_help_gives_the_built_in_defaults_the_settings_have():
    from chatcli.chat.settings import Settings

    defaults = Settings()
    out = " ".join(runner.invoke(app, ["once", "--help"], env={"COLUMNS": "200"}).output.split())
    for shown in (
        f"default {defaults.temperature}",
        f"default {defaults.top_k}",
        f"default {defaults.max_tokens}",
        f"{defaults.source} (default)",
        f"{defaults.markdown} (default)",
    ):
        assert shown in out, shown


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf", "1e39", "1e38", "0.5"])
def test_softcap_must_be_a_number_in_its_range(value):
    # 1e38 is a float32, yet logits / 1e38 underflow: every reply was NUL characters.
    for command in ("once", "chat", "serve", "bench", "export"):
        result = runner.invoke(app, [command, "--softcap", value])
        assert result.exit_code == 2
        assert "must be a number from 1 to 1,000,000" in result.output


def test_softcap_is_shown_in_help_and_taken_by_serve_and_bench():
    for command in ("once", "chat", "serve", "bench"):
        assert "--softcap" in runner.invoke(app, [command, "--help"]).output


def test_bench_takes_quantize_none_as_float32_and_says_what_it_measures():
    help_text = runner.invoke(app, ["bench", "--help"]).output
    assert "baseline runs the model the plain way" in " ".join(help_text.split())
    bad = runner.invoke(app, ["bench", "--quantize", "int3"])
    assert "float32 (or none)" in bad.output


def test_softcap_with_a_synthetic_model_or_a_server_is_refused_not_ignored():
    bench = runner.invoke(app, ["bench", "--synthetic", "d4", "--softcap", "20"])
    assert bench.exit_code == 2 and "a --synthetic model caps at 15" in bench.stderr
    once = runner.invoke(app, ["once", "hi", "--url", "http://127.0.0.1:9", "--softcap", "20"])
    assert once.exit_code == 2 and "--softcap is a local model's" in once.stderr


@pytest.mark.parametrize("command", [["once", "hi"], ["chat"]])
def test_url_without_the_serve_extra_says_how_to_install_it(command, monkeypatch):
    monkeypatch.setitem(sys.modules, "httpx", None)  # `import httpx` fails, as uninstalled
    monkeypatch.delitem(sys.modules, "chatcli.serve.client", raising=False)  # imported afresh
    result = runner.invoke(app, [*command, "--url", "http://127.0.0.1:9"], input="hi\n")
    assert result.exit_code == 1
    assert result.stderr == "Error: --url needs the serve extra: pip install -e '.[serve]'\n"


@pytest.mark.parametrize(
    "flag",
    [
        ["--source", "base"],
        ["--step", "1"],
        ["--device", "cpu"],
        ["--dtype", "float32"],
        ["--quantize", "int8"],
        ["--compile"],
        ["--softcap", "20"],
    ],
)
@pytest.mark.parametrize("command", [["once", "hi"], ["chat"]])
def test_local_model_flags_with_a_server_are_refused_not_ignored(command, flag):
    result = runner.invoke(app, [*command, "--url", "http://127.0.0.1:9", *flag], input="hi\n")
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {flag[0]} is a local model's: it picks or shapes the model chatcli loads, "
        f"and a server at --url chooses its own. Drop {flag[0]} or --url.\n"
    )


def test_several_local_model_flags_with_a_server_are_named_together():
    args = ["once", "hi", "--url", "http://127.0.0.1:9", "--device", "cpu", "--compile"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: --device, --compile are a local model's:")


def test_local_model_settings_from_the_environment_do_not_stop_a_server(monkeypatch):
    # Only the flags given for this run are refused: CHATCLI_QUANTIZE is a standing default.
    monkeypatch.setenv("CHATCLI_QUANTIZE", "int8")
    result = runner.invoke(app, ["once", "hi", "--url", "http://127.0.0.1:9"])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: Cannot reach http://127.0.0.1:9:")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_empty_url_means_the_local_model(how, monkeypatch):
    monkeypatch.setenv("CHATCLI_URL", "http://127.0.0.1:9" if how == "flag" else "")
    args = ["once", "What is 2+2?", "-t", "0", "--max-tokens", "4", "--json"]
    result = runner.invoke(app, [*args, "--url", ""] if how == "flag" else args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"] == "embedded default model"


def test_once_takes_the_words_of_its_prompt_unquoted():
    options = ["-t", "0", "--max-tokens", "12", "--json"]
    quoted = runner.invoke(app, ["once", "What is 1234*56?", *options])
    words = runner.invoke(app, ["once", "What", "is", "1234*56?", *options])
    assert quoted.exit_code == words.exit_code == 0, words.output
    assert json.loads(words.stdout)["text"] == json.loads(quoted.stdout)["text"]
    assert json.loads(words.stdout)["usage"] == json.loads(quoted.stdout)["usage"]


def test_a_prompt_that_starts_with_a_dash_is_told_to_go_after_double_dash():
    result = runner.invoke(app, ["once", "-5 + 3"])
    assert result.exit_code == 2
    assert result.stderr == (
        "Error: No such option: -5. A prompt that starts with - goes after --: "
        'chatcli once -- "-5 + 3"\n'
    )
    number = runner.invoke(app, ["once", "-12"])
    assert number.stderr.endswith('goes after --: chatcli once -- "-12"\n')
    # Unquoted, its other words are the prompt's too (up to an option of chatcli's).
    words = runner.invoke(app, ["once", "-5", "+", "3", "--json"])
    assert words.stderr.endswith('goes after --: chatcli once -- "-5 + 3"\n')
    fixed = runner.invoke(app, ["once", "-t", "0", "--max-tokens", "2", "--", "-5 + 3"])
    assert fixed.exit_code == 0, fixed.output


@pytest.mark.parametrize(
    "command", [[], ["chat"], ["once"], ["serve"], ["bench"], ["models"], ["config"]]
)
def test_help_shows_no_value_after_a_flag_and_takes_h(command):
    full = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    short = runner.invoke(app, [*command, "-h"], env={"COLUMNS": "200"})
    assert full.exit_code == short.exit_code == 0
    assert short.stdout == full.stdout
    assert "<bool>" not in full.stdout
    assert "--help" in full.stdout


def test_version_prints_the_version():
    from chatcli import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"chatcli {__version__}\n"


@pytest.mark.parametrize("command", [[], ["config"]])
def test_a_bare_group_prints_its_help_and_exits_0(command):
    result = runner.invoke(app, command)
    assert result.exit_code == 0
    assert result.stdout.lstrip().startswith(" ".join(["Usage: chatcli", *command]))


def test_help_gives_the_top_p_range_the_settings_check():
    out = " ".join(runner.invoke(app, ["once", "--help"], env={"COLUMNS": "200"}).stdout.split())
    assert "--top-p P Above 0, at most 1; 1 or off = off (default)." in out


def test_a_chatcli_config_that_does_not_exist_is_an_error(tmp_path, monkeypatch):
    missing = tmp_path / "nope.toml"
    monkeypatch.setenv("CHATCLI_CONFIG", str(missing))
    result = runner.invoke(app, ["once", "hi"])
    assert result.exit_code == 1
    assert result.stderr == (
        f"Error: CHATCLI_CONFIG={missing}: no such file. Create it (config.example.toml "
        "shows every key) or unset CHATCLI_CONFIG.\n"
    )


def test_once_shows_the_special_tokens_when_raw_is_set(monkeypatch):
    # raw in the config or CHATCLI_RAW: what `chat` shows, `once` shows too.
    args = ["once", "What is 2*3?", "-t", "0", "--max-tokens", "24"]
    plain = runner.invoke(app, args)
    monkeypatch.setenv("CHATCLI_RAW", "1")
    raw = runner.invoke(app, args)
    assert raw.exit_code == 0, raw.output
    assert "<|python_start|>" in raw.stdout and "<|python_start|>" not in plain.stdout


def test_serve_hands_max_queue_to_the_servers_limits(monkeypatch):
    pytest.importorskip("fastapi")
    import chatcli.serve.runner

    seen = {}
    monkeypatch.setattr(chatcli.serve.runner, "serve", lambda model, **kw: seen.update(kw))
    result = runner.invoke(app, ["serve", "--max-queue", "5"])
    assert result.exit_code == 0, result.output
    assert seen["limits"].max_queue == 5
    assert runner.invoke(app, ["serve", "--max-queue", "-1"]).exit_code == 2
