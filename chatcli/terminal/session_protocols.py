"""What running a chat's lines needs of the chat session and of the terminal.

Owns the Protocols between the terminal's command runner (turn_runner.py, slash_commands.py)
and what it drives: a Session (session.ChatSession, or client.RemoteSession against a
server), the Screen (repl.ChatUI) and one reply's view on it (render.ReplyRenderer). Pure
typing: no behaviour, so tests pass fakes of each.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from chatcli.chat.stream import StreamEvent

if TYPE_CHECKING:
    from chatcli.chat.token_probs import TokenProb
    from chatcli.chat.turns import Reply, SamplingOptions, TurnNotice, TurnStats


class Session(Protocol):
    """What the commands need of a chat session (session.ChatSession, remote.RemoteSession)."""

    can_sample_replies: bool  # /samples: n replies over one prefill (a local model's)
    can_show_raw: bool  # a `raw` flag makes its replies the exact token text
    can_show_probs: bool  # /probs: its replies keep their tokens' probabilities
    options: SamplingOptions
    system: str | None
    last_reply: Reply | None
    history_stats: list[TurnStats]

    @property
    def messages(self) -> list[dict[str, Any]]: ...

    @property
    def transcript(self) -> tuple[list[dict[str, Any]], list[str | None]]:
        """The whole conversation (exchanges dropped for the context included) and each
        message's finish_reason where known: what /save and /export write."""
        ...

    @property
    def context_len(self) -> int: ...

    def send(self, text: str) -> Iterator[StreamEvent]: ...

    def regenerate(self) -> Iterator[StreamEvent]: ...

    def continue_reply(self) -> Iterator[StreamEvent]: ...

    def sample_replies(self, text: str, n: int) -> list[Reply]: ...

    def accept_reply(self, reply: Reply) -> None: ...

    def undo(self) -> bool: ...

    def pop_last_reply(self) -> dict[str, Any] | None: ...

    def clear(self) -> None: ...

    def set_system(self, text: str | None) -> None: ...

    def load_messages(
        self, messages: list[dict[str, Any]], finishes: Sequence[str | None] | None = None
    ) -> None: ...

    def take_notices(self) -> list[TurnNotice]: ...

    def reply_probs(self) -> list[TokenProb]:
        """The last reply's tokens with their probabilities (a ChatcliError where none
        were recorded)."""
        ...


class ReplyView(Protocol):
    """One streamed reply on the screen (render.ReplyRenderer)."""

    def handle(self, event: StreamEvent) -> None: ...

    def finish(self, finish_reason: str) -> None: ...


class Screen(Protocol):
    """What the commands need of the terminal (repl.ChatUI): places to draw, one question
    asked of the person for /samples, and how replies are drawn (/markdown sets it)."""

    markdown_mode: str  # auto, always or never

    def renderer(self, raw: bool = False) -> ReplyView:
        """A view for one reply; `raw`: the reply is exact token text, special tokens
        included, to show as it is (never read as Markdown)."""
        ...

    def notice(self, message: str) -> None: ...

    def error(self, message: str) -> None: ...

    def status(self, stats: Mapping[str, object]) -> None: ...

    def text(self, message: str) -> None: ...

    def interrupted(self) -> None: ...

    def table(self, headers: Sequence[str], rows: Iterable[Sequence[str]]) -> None: ...

    def replies(
        self, replies: Sequence[tuple[Sequence[Mapping[str, str]], str]], tools: bool = True
    ) -> None:
        """Alternative replies side by side: each as its parts and a one-line subtitle.
        tools: whether the calculator ran (off: a call without a result was not run)."""
        ...

    def ask(self, question: str) -> str | None:
        """A one-line answer; None when the person declined (Ctrl-C). Ctrl-D, or the end of
        piped input, is an empty answer, as Enter."""
        ...

    def recap(self, messages: Sequence[Mapping[str, object]]) -> None:
        """Where a loaded conversation left off: its last question and reply."""
        ...

    def probs(self, probs: Sequence[TokenProb], position: int | None = None) -> None:
        """A reply's tokens shaded by probability; with `position` (from 1), the
        alternatives the model had at that token instead."""
        ...
