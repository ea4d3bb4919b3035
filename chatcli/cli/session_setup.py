"""What the commands that load a model share: settings in order of precedence, the session.

Owns: reading settings (flag > CHATCLI_* env > config file > default), the sampling options a
session starts with, loading a local model's session or a client of a server at --url, and the
banner's facts. torch is imported only inside `load_session`, so `--help` stays fast.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict
from typing import Any

from chatcli.chat.settings import (
    SETTING_NAMES,
    Settings,
    load_settings,
    read_flags,
    unknown_env_warnings,
)
from chatcli.errors import ChatcliError, ConfigError, ConversationFileError, UsageError


def settings_from(**flags: Any) -> Settings:
    """The settings, flag > CHATCLI_* > config file > default. A bad flag's value is a usage
    error (exit 2), said before any other source is read; a bad config file or variable is
    not (exit 1)."""
    try:
        read_flags(flags)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    # config_file follows CHATCLI_CONFIG, which must then name a file that exists.
    settings = load_settings(flags=flags, env=os.environ)
    warnings = unknown_env_warnings(os.environ)
    if warnings:  # on stderr: the reply on stdout stays the reply alone
        from chatcli.terminal.render import make_console, render_notice

        console = make_console(file=sys.stderr)
        for warning in warnings:
            render_notice(console, warning)
    return settings


def move_old_files_saying() -> None:
    """Moves the conversations and history an earlier chatcli kept beside the config to
    where they live now (chatcli.chat.user_dirs), saying so on stderr: once."""
    from chatcli.chat.user_dirs import move_old_files
    from chatcli.terminal.render import make_console, render_notice

    said = move_old_files()
    if said:
        notes = make_console(file=sys.stderr)
        for line in said:
            render_notice(notes, line)


def setting_flags(params: dict[str, Any]) -> dict[str, Any]:
    """A command's parameters that are settings (the rest, like --json, are not)."""
    return {name: value for name, value in params.items() if name in SETTING_NAMES}


def sampling_options(settings: Settings):
    from chatcli.chat.turns import SamplingOptions

    return SamplingOptions(
        temperature=settings.temperature,
        top_k=settings.top_k or None,
        top_p=settings.top_p if settings.top_p < 1.0 else None,
        max_tokens=settings.max_tokens,
        seed=settings.seed,
        tools=settings.tools,
    )


def load_session(
    settings: Settings,
    softcap: float | None,
    url: str | None = None,
    api_key: str | None = None,
    model_flag: str | None = None,
    compile_model: bool = False,
    local_flags: list[str] | None = None,
) -> tuple[Any, dict]:
    """A session and its banner info: a local model, or a client of a server at `url`.
    `local_flags` are the local-model flags given, refused with a server rather than ignored."""
    if url is not None:
        if local_flags:
            named = ", ".join(local_flags)
            raise UsageError(
                f"{named} is a local model's: it picks or shapes the model chatcli loads, "
                f"and a server at --url chooses its own. Drop {named} or --url."
                if len(local_flags) == 1
                else f"{named} are a local model's: they pick or shape the model chatcli "
                "loads, and a server at --url chooses its own. Drop them or --url."
            )
        try:
            from chatcli.serve.client import RemoteSession
        except ImportError as e:
            if (e.name or "").startswith("chatcli"):
                raise  # a bug of ours, not a missing extra
            raise ChatcliError("--url needs the serve extra: pip install -e '.[serve]'") from None
        # Only an explicit --model names the server's model: a checkpoint path from the
        # config file means nothing to a server.
        remote = RemoteSession(
            url,
            api_key=api_key,
            model=model_flag,
            options=sampling_options(settings),
            system=settings.system,
        )
        return remote, remote.describe()

    from chatcli.chat.session import ChatSession
    from chatcli.engine.cpu_plan import apply_cpu_plan
    from chatcli.model.checkpoint import load_model

    model, tokenizer, _ = load_model(
        settings.model,
        source=settings.source,
        step=settings.step,
        device=settings.device,
        dtype=settings.dtype,
        softcap=softcap,
        quantize=settings.quantize,
    )
    apply_cpu_plan(model)
    session = ChatSession(
        model,
        tokenizer,
        sampling_options(settings),
        system=settings.system,
        compile=compile_model,
        speculate=settings.speculate == "auto",
    )
    info = banner_info(asdict(model.info))
    if model.info.device == "cpu":  # a silent fallback to torch's ops costs a small model ~10x
        from chatcli.kernels.status import kernels_line

        info["kernels"] = kernels_line()
    return session, info


def banner_info(info: dict) -> dict:
    return {
        "path": "embedded default model" if info["embedded"] else info["path"],
        "tag": info["tag"],
        "source": info["source"],
        "step": info["step"],
        "era": info["era"],
        "params": info["num_params"],
        "device": info["device"],
        "dtype": info["dtype"],
        "context_len": info["sequence_len"],
        "load_s": info["load_s"],
        "device_note": info.get("device_note"),
    }


def system_on_resume(
    console: Any, session: Any, wanted: str | None, flag: str | None, conversation: Any
) -> Any:
    """A --system given with --resume replaces the resumed conversation's system prompt, in
    its file too; returns the file (None once it cannot be written)."""
    from chatcli.terminal.render import render_notice

    if flag is None or wanted == session.system:
        return conversation
    session.set_system(wanted)
    render_notice(console, "The system prompt is --system's from here on.")
    if conversation is not None:
        try:
            conversation.append_system(session.system)
        except ConversationFileError as e:
            render_notice(console, f"{e} This conversation is not saved from here on.")
            return None
    return conversation
