"""Where chatcli keeps its files, as the XDG base directories put them, and moving the files
an earlier chatcli kept elsewhere.

    config         $XDG_CONFIG_HOME/chatcli/config.toml   (~/.config/chatcli)
    conversations  $XDG_DATA_HOME/chatcli/conversations   (~/.local/share/chatcli)
    input history  $XDG_STATE_HOME/chatcli/input_history  (~/.local/state/chatcli)

CHATCLI_HOME puts all three in one folder instead (config.toml, conversations/,
input_history); CHATCLI_CONFIG names the config file and CHATCLI_CONVERSATIONS_DIR the
conversations' folder. Earlier versions kept conversations and history beside the config:
`move_old_files` moves them once, and says so.

Knows nothing of settings' values, conversations' contents or terminals: nothing here prints.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

ENV_HOME = "CHATCLI_HOME"
ENV_CONFIG = "CHATCLI_CONFIG"
ENV_CONVERSATIONS_DIR = "CHATCLI_CONVERSATIONS_DIR"
APP = "chatcli"
CONVERSATIONS = "conversations"
HISTORY = "input_history"

# (variable, default under the home folder) of each XDG base directory chatcli uses.
XDG_CONFIG = ("XDG_CONFIG_HOME", (".config",))
XDG_DATA = ("XDG_DATA_HOME", (".local", "share"))
XDG_STATE = ("XDG_STATE_HOME", (".local", "state"))


def env_path(env: Mapping[str, str], key: str) -> Path | None:
    """A path a variable names, ~ expanded; None when it is unset or empty."""
    value = env.get(key, "").strip()
    return Path(value).expanduser() if value else None


def _base(env: Mapping[str, str], xdg: tuple[str, tuple[str, ...]]) -> Path:
    """chatcli's folder in one XDG base directory, or CHATCLI_HOME where it is set."""
    override = env_path(env, ENV_HOME)
    if override is not None:
        return override
    variable, default = xdg
    path = env_path(env, variable)
    # The XDG spec: a relative path in these variables is invalid and must be ignored.
    if path is not None and path.is_absolute():
        return path / APP
    return Path.home().joinpath(*default, APP)


def user_dir(env: Mapping[str, str] | None = None) -> Path:
    """The config's folder: $CHATCLI_HOME, else $XDG_CONFIG_HOME/chatcli, else
    ~/.config/chatcli. Not created here; writers create what they need."""
    return _base(os.environ if env is None else env, XDG_CONFIG)


def data_dir(env: Mapping[str, str] | None = None) -> Path:
    """$CHATCLI_HOME, else $XDG_DATA_HOME/chatcli, else ~/.local/share/chatcli."""
    return _base(os.environ if env is None else env, XDG_DATA)


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """$CHATCLI_HOME, else $XDG_STATE_HOME/chatcli, else ~/.local/state/chatcli."""
    return _base(os.environ if env is None else env, XDG_STATE)


def config_path(env: Mapping[str, str] | None = None) -> Path:
    """The TOML config file: $CHATCLI_CONFIG, else user_dir()/config.toml."""
    env = os.environ if env is None else env
    return env_path(env, ENV_CONFIG) or user_dir(env) / "config.toml"


def conversations_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where conversations are saved: $CHATCLI_CONVERSATIONS_DIR, else data_dir()/conversations."""
    env = os.environ if env is None else env
    return env_path(env, ENV_CONVERSATIONS_DIR) or data_dir(env) / CONVERSATIONS


def history_path(env: Mapping[str, str] | None = None) -> Path:
    """The persistent input-history file (Up/Down, Ctrl-R at the prompt)."""
    return state_dir(env) / HISTORY


# ---- files an earlier chatcli kept beside the config ----------------------------------------


def _move(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(source, target)  # a rename on one file system, a copy and delete across two


def move_old_files(env: Mapping[str, str] | None = None) -> list[str]:
    """Moves the conversations and input history an earlier chatcli kept in the config's
    folder to where they live now; returns what it did, one line a move, for the person to
    read (nothing when there was nothing to move, or CHATCLI_HOME keeps all in one place;
    nor conversations where CHATCLI_CONVERSATIONS_DIR names their folder).
    A conversation whose name is taken in the new place moves under another (name-2); a
    move that fails is reported, never raised: what was not moved is still there, whole."""
    env = os.environ if env is None else env
    old = user_dir(env)
    said: list[str] = []
    old_conversations, new_conversations = old / CONVERSATIONS, conversations_dir(env)
    # With CHATCLI_CONVERSATIONS_DIR, conversations were never saved in the old place.
    chosen = env_path(env, ENV_CONVERSATIONS_DIR) is not None
    if old_conversations.is_dir() and old_conversations != new_conversations and not chosen:
        said += _move_conversations(old_conversations, new_conversations)
    old_history, new_history = old / HISTORY, history_path(env)
    if old_history.is_file() and old_history != new_history and not new_history.exists():
        try:
            _move(old_history, new_history)
            said.append(f"Moved the input history from {old_history} to {new_history}.")
        except OSError as e:
            said.append(f"Could not move the input history {old_history} ({e}); it is not used.")
    return said


def _free_name(folder: Path, name: str) -> str:
    """`name`, or where a file has it in `folder`, the first of stem-2, stem-3, ... free."""
    if not (folder / name).exists():
        return name
    stem, suffix = os.path.splitext(name)
    n = 2
    while (folder / f"{stem}-{n}{suffix}").exists():
        n += 1
    return f"{stem}-{n}{suffix}"


def _move_conversations(source: Path, target: Path) -> list[str]:
    moved, renamed = 0, []
    try:
        for path in sorted(source.iterdir()):
            if not path.is_file():
                continue
            # A name taken in the new place (a conversation saved there since): both kept.
            name = _free_name(target, path.name)
            if name != path.name:
                renamed.append(f"{path.name} as {name}")
            _move(path, target / name)
            moved += 1
    except OSError as e:
        return [
            f"Could not move the conversations in {source} to {target} ({e}); "
            f"{moved} moved. Move the rest by hand: chatcli looks in {target}."
        ]
    with contextlib.suppress(OSError):  # what else lives there (a folder of one's own) stays
        source.rmdir()  # empty now: the move is done, once
    if not moved:
        return []
    plural = "s" if moved > 1 else ""
    said = f"Moved {moved} saved conversation{plural} from {source} to {target}"
    if renamed:
        said += f" ({', '.join(renamed)}: the name was taken)"
    return [said + "."]
