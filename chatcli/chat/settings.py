"""The settings model, their values' rules and their precedence.

This module owns the one list of settings (`Settings`), the rule that checks each value
(`SETTING_RULES`, also used by slash commands so ranges live in one place), and
`load_settings`, which merges the four sources in the order flag > env var (CHATCLI_<NAME>) >
config file (TOML) > default. Where the files are is chatcli.chat.user_dirs'.

It knows nothing about models, terminals or commands: it only parses and validates values
and raises ConfigError with a message that names the source and says what would be valid.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from chatcli.chat.turns import SamplingOptions

# Where the files are lives in user_dirs; these names stay importable from here.
from chatcli.chat.user_dirs import (  # noqa: F401
    ENV_CONFIG,
    ENV_CONVERSATIONS_DIR,
    ENV_HOME,
    config_path,
    conversations_dir,
    env_path,
    history_path,
    user_dir,
)
from chatcli.errors import ConfigError
from chatcli.model.data_files import UnreadableFileError, parse_toml, read_small_file, shown

ENV_PREFIX = "CHATCLI_"
# A config file sets a dozen keys: a megabyte is a file that is not one (/dev/zero, a log).
CONFIG_MAX_BYTES = 1 << 20
ENV_NO_HISTORY = "CHATCLI_NO_HISTORY"
# The CHATCLI_* variables that are not a setting's (CHATCLI_<SETTING>): read elsewhere, named
# here so that a misspelt variable is told apart from them (a test finds every one in use).
OTHER_ENV_VARS = (
    ENV_HOME,
    ENV_CONFIG,
    ENV_CONVERSATIONS_DIR,
    ENV_NO_HISTORY,
    "CHATCLI_URL",
    "CHATCLI_API_KEY",
    "CHATCLI_NATIVE_KERNELS",
    "CHATCLI_KERNEL_OPENMP",
    "CHATCLI_REFERENCE_FIXTURES",
)
# Settings whose value is a number: in the TOML file a quoted one ("512") is a mistake, as
# `max_tokens = true` is, while their words ("off", "random", "latest") are strings.
NUMBER_SETTINGS = ("step", "temperature", "top_k", "top_p", "max_tokens", "seed")

SOURCES = ("sft", "rl", "base", "mid")
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "bfloat16")
QUANTIZE_MODES = ("none", "int8", "int4")
SPECULATE_MODES = ("auto", "off")
MARKDOWN_MODES = ("auto", "always", "never")

TEMPERATURE_MAX = 2.0
# top_k beyond a few hundred is indistinguishable from no top-k at all; the cap catches typos
# (top_k=50000) while 0 is the explicit "off".
TOP_K_MAX = 1000
MAX_TOKENS_MAX = 65536
SEED_MAX = 2**63 - 1  # torch.manual_seed accepts any int64

_SAMPLING = SamplingOptions()  # the sampling defaults, in the settings' words below
_TRUE_WORDS = ("on", "true", "yes", "1")
_FALSE_WORDS = ("off", "false", "no", "0")


@dataclass(frozen=True)
class Settings:
    """Every user-tunable setting, already validated. Change one with dataclasses.replace()."""

    model: str | None = None  # None: the embedded default model
    source: str = "sft"
    step: int | None = None  # None: the latest step found
    device: str = "auto"
    dtype: str = "auto"
    quantize: str = "none"  # int8/int4 copies of big matrices for CPU decode
    speculate: str = "auto"  # a reply drafts from the conversation, one forward verifies
    temperature: float = _SAMPLING.temperature
    top_k: int = _SAMPLING.top_k or 0  # 0: off
    top_p: float = _SAMPLING.top_p or 1.0  # 1.0: off
    max_tokens: int = _SAMPLING.max_tokens
    seed: int | None = _SAMPLING.seed  # None: a fresh random seed each turn
    system: str | None = None
    markdown: str = "auto"
    tools: bool = _SAMPLING.tools
    raw: bool = False
    history: bool = True  # persistent input history


SETTING_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Settings))
DEFAULTS = Settings()


class _Invalid(ValueError):
    """Raised by a parser; validate_setting turns it into a ConfigError with the source."""


@dataclass(frozen=True)
class SettingRule:
    """How one setting is parsed: `expected` completes "must be ...", `example` is a valid value."""

    expected: str
    example: str
    parse: Callable[[object], object]


def _words(raw: object) -> str:
    if not isinstance(raw, str):
        raise _Invalid
    return raw.strip().lower()


def _parse_float(raw: object) -> float:
    # bool is an int subclass: `temperature = true` is a mistake, not 1.0.
    if isinstance(raw, bool):
        raise _Invalid
    if isinstance(raw, (int, float)):
        value = float(raw)
    elif isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            raise _Invalid from None
    else:
        raise _Invalid
    if not math.isfinite(value):
        raise _Invalid
    return value


def _parse_int(raw: object) -> int:
    if isinstance(raw, bool):
        raise _Invalid
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str):
        try:
            return int(raw.strip())
        except ValueError:
            raise _Invalid from None
    raise _Invalid


def _parse_bool(raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    word = str(raw).strip().lower() if isinstance(raw, (str, int)) else None
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise _Invalid


def _choice(options: tuple[str, ...]) -> Callable[[object], object]:
    def parse(raw: object) -> str:
        word = _words(raw)
        if word not in options:
            raise _Invalid
        return word

    return parse


def _parse_model(raw: object) -> str | None:
    if not isinstance(raw, str):
        raise _Invalid
    return raw.strip() or None


def _parse_step(raw: object) -> int | None:
    if isinstance(raw, str) and raw.strip().lower() in ("latest", "last"):
        return None
    value = _parse_int(raw)
    if value < 0:
        raise _Invalid
    return value


def _parse_device(raw: object) -> str:
    word = _words(raw)
    if word in DEVICES:
        return word
    # cuda:N picks one GPU on a multi-GPU machine.
    prefix, _, index = word.partition(":")
    if prefix == "cuda" and index.isdigit():
        return word
    raise _Invalid


def _parse_temperature(raw: object) -> float:
    value = _parse_float(raw)
    if not 0.0 <= value <= TEMPERATURE_MAX:
        raise _Invalid
    return value


def _parse_top_k(raw: object) -> int:
    if isinstance(raw, str) and raw.strip().lower() == "off":
        return 0
    value = _parse_int(raw)
    if not 0 <= value <= TOP_K_MAX:
        raise _Invalid
    return value


def _parse_top_p(raw: object) -> float:
    if isinstance(raw, str) and raw.strip().lower() == "off":
        return 1.0
    value = _parse_float(raw)
    if not 0.0 < value <= 1.0:
        raise _Invalid
    return value


def _parse_max_tokens(raw: object) -> int:
    value = _parse_int(raw)
    if not 1 <= value <= MAX_TOKENS_MAX:
        raise _Invalid
    return value


def _parse_seed(raw: object) -> int | None:
    if isinstance(raw, str) and raw.strip().lower() in ("random", "none"):
        return None
    value = _parse_int(raw)
    if not 0 <= value <= SEED_MAX:
        raise _Invalid
    return value


def _parse_system(raw: object) -> str | None:
    if not isinstance(raw, str):
        raise _Invalid
    # An empty system prompt and no system prompt render identically; keep one spelling.
    return raw if raw.strip() else None


SETTING_RULES: Mapping[str, SettingRule] = {
    "model": SettingRule("a checkpoint path or tag (text)", "d20", _parse_model),
    "source": SettingRule("one of " + ", ".join(SOURCES), "sft", _choice(SOURCES)),
    "step": SettingRule("a whole number of at least 0, or latest", "latest", _parse_step),
    "device": SettingRule("one of auto, cpu, cuda, cuda:N, mps", "auto", _parse_device),
    "dtype": SettingRule("one of " + ", ".join(DTYPES), "auto", _choice(DTYPES)),
    "quantize": SettingRule("one of " + ", ".join(QUANTIZE_MODES), "int8", _choice(QUANTIZE_MODES)),
    "speculate": SettingRule(
        "one of " + ", ".join(SPECULATE_MODES), "off", _choice(SPECULATE_MODES)
    ),
    "temperature": SettingRule("a number between 0 and 2", "0.7", _parse_temperature),
    "top_k": SettingRule(
        f"a whole number between 0 and {TOP_K_MAX} (0 or off turns it off)", "50", _parse_top_k
    ),
    "top_p": SettingRule(
        "a number above 0 and at most 1 (1 or off turns it off)", "0.9", _parse_top_p
    ),
    "max_tokens": SettingRule(
        f"a whole number between 1 and {MAX_TOKENS_MAX}", "512", _parse_max_tokens
    ),
    "seed": SettingRule("a whole number from 0 to 2**63-1, or random", "42", _parse_seed),
    "system": SettingRule("a text", '"You are a helpful assistant."', _parse_system),
    "markdown": SettingRule("one of " + ", ".join(MARKDOWN_MODES), "auto", _choice(MARKDOWN_MODES)),
    "tools": SettingRule("on or off", "on", _parse_bool),
    "raw": SettingRule("on or off", "off", _parse_bool),
    "history": SettingRule("on or off", "on", _parse_bool),
}
assert set(SETTING_RULES) == set(SETTING_NAMES), "every setting needs exactly one rule"


def validate_setting(name: str, raw: object, source: str) -> object:
    """Parse and check one value, returning it typed (e.g. "0.3" -> 0.3, "random" -> None).

    `source` names where the value came from ("config file /x/config.toml", "CHATCLI_TOP_K",
    "--top-k", "/temperature") and starts the error message.
    """
    rule = SETTING_RULES.get(name)
    if rule is None:
        raise ConfigError(
            f"{source}: unknown setting {name!r}{_did_you_mean(name, SETTING_NAMES)}. Valid "
            f"settings: {', '.join(SETTING_NAMES)}"
        )
    try:
        return rule.parse(raw)
    except _Invalid:
        raise ConfigError(f"{source}: {name} must be {rule.expected}, got {shown(raw)}") from None


def _did_you_mean(name: str, names: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def format_setting(name: str, value: object) -> str:
    """A value as a person would type it back: None seed -> "random", top_k 0 -> "off"."""
    if name == "seed" and value is None:
        return "random"
    if name == "step" and value is None:
        return "latest"
    if name == "model" and value is None:
        return "(embedded default)"
    if name == "system" and value is None:
        return "(none)"
    if (name == "top_k" and value == 0) or (name == "top_p" and value == 1.0):
        return "off"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def env_name(name: str) -> str:
    """The environment variable for a setting: temperature -> CHATCLI_TEMPERATURE."""
    return ENV_PREFIX + name.upper()


def flag_name(name: str) -> str:
    """The command-line flag for a setting: max_tokens -> --max-tokens."""
    return "--" + name.replace("_", "-")


def read_config_file(path: Path, named_by: str | None = None) -> dict[str, object]:
    """The validated settings set in a TOML file; {} when the file does not exist, unless a
    variable (`named_by`, CHATCLI_CONFIG) named it: then that path is a mistake to report."""
    source = f"config file {path}"
    try:
        text = read_small_file(path, CONFIG_MAX_BYTES).decode("utf-8")
    except UnreadableFileError as e:
        if not e.missing:  # a folder, a link to nothing or to itself, no permission
            raise ConfigError(
                f"{source}: {e.why}. Fix it or point {ENV_CONFIG} at another file."
            ) from None
        if named_by is not None:
            raise ConfigError(
                f"{named_by}={path}: no such file. Create it (config.example.toml shows every "
                f"key) or unset {named_by}."
            ) from None
        return {}
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{source}: cannot be read (not UTF-8 text, byte {e.start}). Fix the file or point "
            f"{ENV_CONFIG} elsewhere."
        ) from None
    try:
        table = parse_toml(text)  # nested too deep for the parser is a ValueError there
    except ValueError as e:
        raise ConfigError(
            f"{source}: is not valid TOML ({e}). See config.example.toml for the format."
        ) from None
    unknown = [key for key in table if key not in SETTING_RULES]
    if unknown:
        raise ConfigError(
            f"{source}: unknown key {shown(unknown[0])}{_did_you_mean(unknown[0], SETTING_NAMES)}"
            f". Valid keys: {', '.join(SETTING_NAMES)}"
        )
    for key, raw in table.items():
        if key in NUMBER_SETTINGS and isinstance(raw, str) and _reads_as_number(raw):
            raise ConfigError(
                f"{source}: {key} is the string {raw!r}, not a number: write it without "
                f"quotes, {key} = {raw.strip()}"
            )
    return {key: validate_setting(key, raw, source) for key, raw in table.items()}


def _reads_as_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def unknown_env_warnings(env: Mapping[str, str]) -> list[str]:
    """One warning for each CHATCLI_* variable chatcli does not read, naming the closest one
    it does: a misspelt variable would otherwise change nothing, silently."""
    known = [env_name(name) for name in SETTING_NAMES] + list(OTHER_ENV_VARS)
    return [
        f"{key} is not a chatcli variable, so it changes nothing"
        + (f"; did you mean {close[0]}?" if (close := _closest(key, known)) else ".")
        for key in sorted(env)
        if key.startswith(ENV_PREFIX) and key not in known
    ]


def _closest(key: str, known: list[str]) -> list[str]:
    # Compared without the shared prefix, which would make every name look alike; a name
    # cut short (TEMP) or run on means the one it starts, before any look-alike.
    names = {k.removeprefix(ENV_PREFIX): k for k in known}
    typed = key.removeprefix(ENV_PREFIX)
    started = [n for n in names if n.startswith(typed) or typed.startswith(n)]
    close = difflib.get_close_matches(
        typed, started or list(names), n=1, cutoff=0 if started else 0.6
    )
    return [names[c] for c in close]


def read_env(env: Mapping[str, str]) -> dict[str, object]:
    """The validated settings set by CHATCLI_* variables; empty variables count as unset."""
    values: dict[str, object] = {}
    for name in SETTING_NAMES:
        key = env_name(name)
        raw = env.get(key, "")
        if raw.strip():
            values[name] = validate_setting(name, raw, key)
    no_history = env.get(ENV_NO_HISTORY, "")
    # An opt-out: CHATCLI_NO_HISTORY=1 wins over CHATCLI_HISTORY, =0 means nothing.
    if no_history.strip() and validate_setting("history", no_history, ENV_NO_HISTORY):
        values["history"] = False
    return values


def read_flags(flags: Mapping[str, object]) -> dict[str, object]:
    """The validated settings given as flags; a value of None means "flag not given"."""
    values: dict[str, object] = {}
    for name, raw in flags.items():
        if name not in SETTING_RULES:
            # The CLI passes its own parameters through here: a wrong name is a bug there.
            raise ValueError(f"not a setting: {name!r} (settings: {', '.join(SETTING_NAMES)})")
        if raw is not None:
            values[name] = validate_setting(name, raw, flag_name(name))
    return values


def load_settings(
    flags: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: Path | None = None,
) -> Settings:
    """Merge defaults < config file < env vars < flags into one Settings.

    `env` defaults to os.environ and `config_file` to config_path(env); a file that
    CHATCLI_CONFIG names must exist (the default one need not). Every source is validated in
    full, even where a later one overrides a value, so a broken config file is reported rather
    than hidden by a flag.
    """
    env = os.environ if env is None else env
    named = config_file is None and env_path(env, ENV_CONFIG) is not None
    path = config_path(env) if config_file is None else config_file
    merged: dict[str, object] = {}
    merged.update(read_config_file(path, named_by=ENV_CONFIG if named else None))
    merged.update(read_env(env))
    merged.update(read_flags(flags or {}))
    return Settings(**merged)  # type: ignore[arg-type]  # values are typed by their rules
