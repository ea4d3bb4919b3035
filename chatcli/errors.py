"""The project's error types.

Everything a user can get wrong (a path, a file, a setting, a request) raises a ChatcliError
whose message says what was wrong and how to fix it. Only the CLI turns these into a red line
and an exit code (2 for a UsageError, 1 for the rest); nothing below the UI prints.
"""

from __future__ import annotations


class ChatcliError(Exception):
    """Base class: an error whose message is meant for the person at the terminal."""


class CheckpointError(ChatcliError):
    """A model checkpoint, its meta or its tokenizer is missing, unreadable or inconsistent."""


class TokenizerError(ChatcliError):
    """A tokenizer file is missing, unsafe or malformed."""


class ConfigError(ChatcliError):
    """A setting (flag, env var, config file, slash command) has a bad value."""


class ConversationFileError(ChatcliError):
    """A saved conversation cannot be read or written."""


class ContextOverflowError(ChatcliError):
    """A prompt does not fit in the model's context window."""


class UsageError(ChatcliError):
    """The command line itself is wrong: an option's value, options that do not go together,
    a missing argument. The CLI exits 2 for it, as for click's own usage errors; 1 is for a
    command that was well asked but failed (a missing file, a server that refuses)."""


class SchemaError(ChatcliError):
    """A JSON schema for structured output cannot be read, or uses what its grammar cannot
    enforce; or the grammar library is not installed."""
