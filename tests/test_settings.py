from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

import pytest

from chatcli.chat.settings import (
    DEFAULTS,
    OTHER_ENV_VARS,
    SETTING_NAMES,
    Settings,
    config_path,
    conversations_dir,
    env_name,
    format_setting,
    history_path,
    load_settings,
    read_config_file,
    unknown_env_warnings,
    user_dir,
    validate_setting,
)
from chatcli.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parent.parent / "config.example.toml"


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_when_nothing_is_set(tmp_path: Path) -> None:
    settings = load_settings(env={}, config_file=tmp_path / "missing.toml")
    assert settings == Settings()
    assert settings.temperature == 0.6
    assert settings.top_k == 50
    assert settings.top_p == 1.0
    assert settings.max_tokens == 512
    assert settings.seed is None
    assert settings.model is None
    assert settings.source == "sft"
    assert settings.tools is True
    assert settings.raw is False
    assert settings.history is True


@pytest.mark.parametrize(
    ("in_file", "in_env", "in_flag", "expected"),
    [
        (None, None, None, 0.6),
        ("0.1", None, None, 0.1),
        ("0.1", "0.2", None, 0.2),
        ("0.1", "0.2", 0.3, 0.3),
        (None, "0.2", 0.3, 0.3),
        ("0.1", None, 0.3, 0.3),
        (None, "0.2", None, 0.2),
        (None, None, 0.3, 0.3),
    ],
)
def test_precedence_flag_beats_env_beats_file_beats_default(
    tmp_path: Path, in_file: str | None, in_env: str | None, in_flag: float | None, expected: float
) -> None:
    config = write_config(tmp_path, f"temperature = {in_file}\n" if in_file else "")
    env = {"CHATCLI_TEMPERATURE": in_env} if in_env else {}
    settings = load_settings(flags={"temperature": in_flag}, env=env, config_file=config)
    assert settings.temperature == expected


def test_precedence_is_per_key(tmp_path: Path) -> None:
    config = write_config(tmp_path, 'top_k = 10\nsource = "rl"\nmax_tokens = 100\n')
    env = {"CHATCLI_TOP_K": "20", "CHATCLI_MODEL": "d32"}
    settings = load_settings(flags={"top_k": None, "max_tokens": 7}, env=env, config_file=config)
    assert settings.top_k == 20
    assert settings.source == "rl"
    assert settings.max_tokens == 7
    assert settings.model == "d32"


def test_env_values_are_parsed_from_text(tmp_path: Path) -> None:
    env = {
        "CHATCLI_SEED": "123",
        "CHATCLI_TOP_P": "0.9",
        "CHATCLI_TOOLS": "off",
        "CHATCLI_RAW": "yes",
        "CHATCLI_STEP": "2000",
        "CHATCLI_DEVICE": "CUDA",
        "CHATCLI_SYSTEM": "Be brief.",
    }
    settings = load_settings(env=env, config_file=tmp_path / "none.toml")
    assert settings.seed == 123
    assert settings.top_p == 0.9
    assert settings.tools is False
    assert settings.raw is True
    assert settings.step == 2000
    assert settings.device == "cuda"
    assert settings.system == "Be brief."


def test_empty_env_var_counts_as_unset(tmp_path: Path) -> None:
    settings = load_settings(env={"CHATCLI_TEMPERATURE": ""}, config_file=tmp_path / "x.toml")
    assert settings.temperature == 0.6


def test_env_seed_random_overrides_file_seed(tmp_path: Path) -> None:
    config = write_config(tmp_path, "seed = 5\n")
    assert load_settings(env={}, config_file=config).seed == 5
    assert load_settings(env={"CHATCLI_SEED": "random"}, config_file=config).seed is None


def test_no_history_env_var_turns_history_off(tmp_path: Path) -> None:
    missing = tmp_path / "x.toml"
    assert load_settings(env={"CHATCLI_NO_HISTORY": "1"}, config_file=missing).history is False
    assert load_settings(env={"CHATCLI_NO_HISTORY": "0"}, config_file=missing).history is True
    env = {"CHATCLI_NO_HISTORY": "1", "CHATCLI_HISTORY": "on"}
    assert load_settings(env=env, config_file=missing).history is False
    # A flag still beats any env var.
    assert load_settings(flags={"history": True}, env=env, config_file=missing).history is True


def test_config_file_path_comes_from_env_when_not_given(tmp_path: Path) -> None:
    config = write_config(tmp_path, "max_tokens = 64\n")
    settings = load_settings(env={"CHATCLI_CONFIG": str(config)})
    assert settings.max_tokens == 64


def test_a_config_file_that_chatcli_config_names_must_exist(tmp_path: Path) -> None:
    missing = tmp_path / "c.toml"
    with pytest.raises(ConfigError) as info:
        load_settings(env={"CHATCLI_CONFIG": str(missing)})
    assert str(info.value) == (
        f"CHATCLI_CONFIG={missing}: no such file. Create it (config.example.toml shows every "
        "key) or unset CHATCLI_CONFIG."
    )
    # The default file may well not exist: that is no mistake of the user's.
    assert load_settings(env={"CHATCLI_HOME": str(tmp_path)}) == Settings()


def test_config_file_error_names_file_and_key(tmp_path: Path) -> None:
    config = write_config(tmp_path, 'temperature = "hot"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(env={}, config_file=config)
    assert str(info.value) == (
        f"config file {config}: temperature must be a number between 0 and 2, got 'hot'"
    )


def test_env_error_names_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^CHATCLI_TOP_K: top_k must be a whole number"):
        load_settings(env={"CHATCLI_TOP_K": "many"}, config_file=tmp_path / "x.toml")


def test_flag_error_names_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--max-tokens: max_tokens must be"):
        load_settings(flags={"max_tokens": 0}, env={}, config_file=tmp_path / "x.toml")


def test_overridden_bad_file_value_is_still_reported(tmp_path: Path) -> None:
    config = write_config(tmp_path, "top_p = 3\n")
    with pytest.raises(ConfigError, match="top_p"):
        load_settings(flags={"top_p": 0.5}, env={}, config_file=config)


def test_unknown_config_key_names_key_file_and_valid_keys(tmp_path: Path) -> None:
    config = write_config(tmp_path, "temprature = 0.5\n")
    with pytest.raises(ConfigError) as info:
        load_settings(env={}, config_file=config)
    message = str(info.value)
    assert "'temprature'" in message
    assert str(config) in message
    for name in SETTING_NAMES:
        assert name in message


def test_config_table_is_an_unknown_key(tmp_path: Path) -> None:
    config = write_config(tmp_path, "[chat]\ntemperature = 0.5\n")
    with pytest.raises(ConfigError, match="unknown key 'chat'"):
        load_settings(env={}, config_file=config)


def test_invalid_toml_is_a_config_error(tmp_path: Path) -> None:
    config = write_config(tmp_path, "temperature = = 1\n")
    with pytest.raises(ConfigError, match=r"is not valid TOML"):
        load_settings(env={}, config_file=config)


def test_unknown_flag_name_is_a_programming_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a setting"):
        load_settings(flags={"resume": "x"}, env={}, config_file=tmp_path / "x.toml")


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("temperature", "0.3", 0.3),
        ("temperature", 0, 0.0),
        ("temperature", "2", 2.0),
        ("top_k", "0", 0),
        ("top_k", "off", 0),
        ("top_k", 1000, 1000),
        ("top_p", "off", 1.0),
        ("top_p", "0.95", 0.95),
        ("top_p", 1, 1.0),
        ("max_tokens", "1", 1),
        ("max_tokens", 65536, 65536),
        ("seed", "random", None),
        ("seed", "RANDOM", None),
        ("seed", "0", 0),
        ("seed", 42, 42),
        ("step", "latest", None),
        ("step", 0, 0),
        ("source", "RL", "rl"),
        ("source", "mid", "mid"),
        ("device", "mps", "mps"),
        ("device", "cuda:1", "cuda:1"),
        ("dtype", "bfloat16", "bfloat16"),
        ("quantize", "int4", "int4"),
        ("markdown", "never", "never"),
        ("tools", "on", True),
        ("tools", False, False),
        ("raw", "true", True),
        ("history", "0", False),
        ("model", "  /ckpt/d20  ", "/ckpt/d20"),
        ("model", "", None),
        ("system", "Be terse.", "Be terse."),
        ("system", "   ", None),
    ],
)
def test_validate_setting_parses_good_values(name: str, raw: object, expected: object) -> None:
    value = validate_setting(name, raw, "test")
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    ("name", "raw", "needs"),
    [
        ("temperature", "hot", "a number between 0 and 2"),
        ("temperature", "-0.1", "a number between 0 and 2"),
        ("temperature", "2.5", "a number between 0 and 2"),
        ("temperature", "nan", "a number between 0 and 2"),
        ("temperature", True, "a number between 0 and 2"),
        ("top_k", "-1", "a whole number between 0 and 1000"),
        ("top_k", "1001", "a whole number between 0 and 1000"),
        ("top_k", "5.5", "a whole number between 0 and 1000"),
        ("top_k", 5.0, "a whole number between 0 and 1000"),
        ("top_p", "0", "a number above 0 and at most 1"),
        ("top_p", "1.5", "a number above 0 and at most 1"),
        ("max_tokens", "0", "a whole number between 1 and 65536"),
        ("max_tokens", "65537", "a whole number between 1 and 65536"),
        ("seed", "-3", "or random"),
        ("seed", "abc", "or random"),
        ("step", "-1", "or latest"),
        ("source", "chat", "one of sft, rl, base, mid"),
        ("device", "tpu", "one of auto, cpu, cuda"),
        ("device", "cuda:x", "one of auto, cpu, cuda"),
        ("dtype", "float16", "one of auto, float32, bfloat16"),
        ("quantize", "int2", "one of none, int8, int4"),
        ("speculate", "maybe", "one of auto, off"),
        ("markdown", "sometimes", "one of auto, always, never"),
        ("tools", "maybe", "on or off"),
        ("raw", 2, "on or off"),
        ("history", "", "on or off"),
        ("model", 5, "a checkpoint path or tag"),
        ("system", 5, "a text"),
    ],
)
def test_validate_setting_rejects_bad_values(name: str, raw: object, needs: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_setting(name, raw, "SRC")
    message = str(info.value)
    assert message.startswith(f"SRC: {name} must be ")
    assert needs in message
    assert message.endswith(f"got {raw!r}")


def test_validate_setting_unknown_name() -> None:
    with pytest.raises(ConfigError, match="unknown setting 'colour'"):
        validate_setting("colour", "red", "SRC")


def test_every_setting_field_has_a_default_matching_the_spec() -> None:
    assert asdict(DEFAULTS) == {
        "model": None,
        "source": "sft",
        "step": None,
        "device": "auto",
        "dtype": "auto",
        "quantize": "none",
        "speculate": "auto",
        "temperature": 0.6,
        "top_k": 50,
        "top_p": 1.0,
        "max_tokens": 512,
        "seed": None,
        "system": None,
        "markdown": "auto",
        "tools": True,
        "raw": False,
        "history": True,
    }


def test_settings_are_frozen() -> None:
    with pytest.raises(AttributeError):
        DEFAULTS.temperature = 1.0  # type: ignore[misc]


def test_example_config_loads_and_gives_the_defaults() -> None:
    settings = load_settings(env={}, config_file=EXAMPLE)
    assert settings == DEFAULTS


def test_example_config_documents_every_key_with_a_comment() -> None:
    lines = EXAMPLE.read_text(encoding="utf-8").splitlines()
    for name in SETTING_NAMES:
        pattern = re.compile(rf"^(# )?{name} = ")
        at = [i for i, line in enumerate(lines) if pattern.match(line)]
        assert len(at) == 1, f"{name} should appear once in config.example.toml"
        line_before = lines[at[0] - 1]
        assert line_before.startswith("# ") and not pattern.match(line_before), name


def test_example_config_commented_values_are_valid(tmp_path: Path) -> None:
    # The commented-out examples, once uncommented, must also load.
    text = EXAMPLE.read_text(encoding="utf-8")
    names = "|".join(SETTING_NAMES)
    uncommented = re.sub(rf"^# ({names}) = ", r"\1 = ", text, flags=re.MULTILINE)
    settings = load_settings(env={}, config_file=write_config(tmp_path, uncommented))
    assert settings.model == "d20"
    assert settings.system == "You are a helpful assistant."


def test_user_dir_precedence(tmp_path: Path) -> None:
    assert user_dir({"CHATCLI_HOME": str(tmp_path / "h")}) == tmp_path / "h"
    assert user_dir({"XDG_CONFIG_HOME": str(tmp_path)}) == tmp_path / "chatcli"
    assert user_dir({"XDG_CONFIG_HOME": "relative"}) == Path.home() / ".config" / "chatcli"
    assert user_dir({}) == Path.home() / ".config" / "chatcli"
    both = {"CHATCLI_HOME": str(tmp_path / "h"), "XDG_CONFIG_HOME": str(tmp_path)}
    assert user_dir(both) == tmp_path / "h"


def test_paths_follow_user_dir_and_overrides(tmp_path: Path) -> None:
    env = {"CHATCLI_HOME": str(tmp_path)}
    assert config_path(env) == tmp_path / "config.toml"
    assert conversations_dir(env) == tmp_path / "conversations"
    assert history_path(env).parent == tmp_path
    env["CHATCLI_CONFIG"] = str(tmp_path / "other.toml")
    env["CHATCLI_CONVERSATIONS_DIR"] = str(tmp_path / "convs")
    assert config_path(env) == tmp_path / "other.toml"
    assert conversations_dir(env) == tmp_path / "convs"


def test_user_dir_reads_os_environ_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHATCLI_HOME", str(tmp_path))
    assert user_dir() == tmp_path
    assert config_path() == tmp_path / "config.toml"


@pytest.mark.parametrize(
    ("name", "value", "text"),
    [
        ("seed", None, "random"),
        ("seed", 7, "7"),
        ("top_k", 0, "off"),
        ("top_k", 40, "40"),
        ("top_p", 1.0, "off"),
        ("tools", True, "on"),
        ("raw", False, "off"),
        ("temperature", 0.6, "0.6"),
        ("step", None, "latest"),
    ],
)
def test_format_setting(name: str, value: object, text: str) -> None:
    assert format_setting(name, value) == text


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ('max_tokens = "512"', "max_tokens"),
        ('temperature = "0.7"', "temperature"),
        ('top_p = "1e-1"', "top_p"),
        ('seed = "42"', "seed"),
        ('step = "650"', "step"),
        ('top_k = "50"', "top_k"),
    ],
)
def test_a_quoted_number_in_the_config_file_is_an_error(tmp_path: Path, line: str, key: str):
    path = tmp_path / "config.toml"
    path.write_text(line + "\n")
    value = line.split('"')[1]
    with pytest.raises(ConfigError) as info:
        read_config_file(path)
    assert str(info.value) == (
        f"config file {path}: {key} is the string {value!r}, not a number: write it without "
        f"quotes, {key} = {value}"
    )


def test_quoted_words_and_unquoted_numbers_stay_valid(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('seed = "random"\nstep = "latest"\ntop_k = "off"\ntop_p = "off"\n')
    assert read_config_file(path) == {"seed": None, "step": None, "top_k": 0, "top_p": 1.0}
    path.write_text('max_tokens = 512\ntemperature = 0.7\nsystem = "512"\nmodel = "1"\n')
    assert read_config_file(path)["system"] == "512"  # a text setting's digits are text


def test_a_config_value_too_deep_or_too_long_is_reported_short(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("temperature = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=r"is not valid TOML \(nested too deeply to read"):
        read_config_file(path)
    path.write_text("system = " + "[" * 50 + "]" * 50 + '\nmodel = "' + "m" * 100_000 + '"\n')
    with pytest.raises(ConfigError) as info:
        read_config_file(path)
    assert len(str(info.value)) < 300


@pytest.mark.parametrize(
    ("variable", "meant"),
    [
        ("CHATCLI_TEMPRATURE", "CHATCLI_TEMPERATURE"),
        ("CHATCLI_TEMP", "CHATCLI_TEMPERATURE"),
        ("CHATCLI_MAX_TOKEN", "CHATCLI_MAX_TOKENS"),
        ("CHATCLI_NOHISTORY", "CHATCLI_NO_HISTORY"),
        ("CHATCLI_CONFG", "CHATCLI_CONFIG"),
        ("CHATCLI_APIKEY", "CHATCLI_API_KEY"),
    ],
)
def test_a_misspelt_variable_names_the_closest_real_one(variable: str, meant: str) -> None:
    assert unknown_env_warnings({variable: "1", "CHATCLI_TEMPERATURE": "0.3", "HOME": "/"}) == [
        f"{variable} is not a chatcli variable, so it changes nothing; did you mean {meant}?"
    ]


def test_a_variable_like_no_other_is_still_said_and_known_ones_are_not() -> None:
    assert unknown_env_warnings({"CHATCLI_XYZZY": "1"}) == [
        "CHATCLI_XYZZY is not a chatcli variable, so it changes nothing."
    ]
    known = {env_name(name): "1" for name in SETTING_NAMES} | dict.fromkeys(OTHER_ENV_VARS, "1")
    assert unknown_env_warnings({**known, "CHATCLIX": "1", "MY_CHATCLI_TEMP": "1"}) == []


def test_every_chatcli_variable_the_code_reads_is_known() -> None:
    # A variable read somewhere but missing from OTHER_ENV_VARS would be warned about as a
    # misspelling: the list is held to the code.
    package = Path(__file__).resolve().parent.parent / "chatcli"
    found = set()
    for source in package.rglob("*.py"):
        found |= set(re.findall(r"\bCHATCLI_[A-Z][A-Z0-9_]*[A-Z0-9]\b", source.read_text()))
    settings_vars = {env_name(name) for name in SETTING_NAMES}
    assert found - settings_vars - set(OTHER_ENV_VARS) == set()
    assert "CHATCLI_URL" in found and "CHATCLI_HOME" in found
