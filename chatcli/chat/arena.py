"""The arena's votes: what one records, where it is kept, and what it becomes.

Owns the vote record (the conversation before the turn, both sides' replies with their
models, the outcome, the sampling settings), the outcomes a person can give and how they are
typed, reading every vote back from the saved conversations (a vote is a `vote` record in
its conversation's file, conversation_store.py), and the two exports: `dpo` (TRL's
conversational preference format: `prompt`, `chosen`, `rejected` as message lists, one line
per decisive vote) and `jsonl` (every vote, whole). The ratings are ratings.py's.

Knows nothing of models, tokens or terminals: replies come in as nanochat messages.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from chatcli.chat.calc_markers import text_from_parts
from chatcli.chat.conversation_format import SUFFIX
from chatcli.chat.ratings import Battle
from chatcli.chat.turns import Message

LABELS = ("A", "B")  # the sides as the person sees them, whatever model each is this turn
EXPORT_FORMATS = ("dpo", "jsonl")
VOTE_VERSION = 1
# What a person may type for each outcome (at the vote's question, or after /vote).
VOTE_WORDS = {
    "a": ("a", "A"),
    "b": ("b", "B"),
    "tie": ("t", "tie", "="),
    "bad": ("x", "bad", "both bad", "both-bad", "neither"),
}
VOTE_HELP = "a (A is better), b (B is better), t (tie) or x (both bad)"
OUTCOME_WORDS = {"a": "A is better", "b": "B is better", "tie": "a tie", "bad": "both bad"}


def parse_vote(answer: str) -> str | None:
    """The outcome (ratings.OUTCOMES) a typed answer names, or None for none."""
    word = " ".join(answer.split())
    for outcome, words in VOTE_WORDS.items():
        if word in words or word.lower() in words:
            return outcome
    return None


@dataclass(frozen=True)
class Side:
    """One side of a turn: the model that wrote it, its label this turn, and its reply."""

    label: str  # "A" or "B"
    model: str
    message: Message  # the assistant message, nanochat parts
    stats: Mapping[str, Any]  # TurnStats.as_dict()


def vote_record(
    prompt: Sequence[Message],
    sides: Sequence[Side],
    outcome: str,
    settings: Mapping[str, Any],
    now: datetime | None = None,
) -> dict[str, Any]:
    """What a conversation's file keeps of one vote. `prompt`: the messages before the reply,
    the system prompt and the turn's question included; `sides` in label order."""
    assert [s.label for s in sides] == list(LABELS)
    return {
        "version": VOTE_VERSION,
        "time": (now or datetime.now().astimezone()).isoformat(timespec="seconds"),
        "prompt": [dict(m) for m in prompt],
        "sides": [
            {
                "label": s.label,
                "model": s.model,
                "message": s.message,
                "finish_reason": s.stats.get("finish_reason"),
                "stats": dict(s.stats),
            }
            for s in sides
        ],
        "outcome": outcome,
        "settings": dict(settings),
    }


def winner_label(outcome: str) -> str | None:
    return {"a": "A", "b": "B"}.get(outcome)


def kept_label(outcome: str) -> str:
    """The side whose reply goes on in the conversation: the winner's, else A's."""
    return winner_label(outcome) or "A"


# ---- reading the votes back ---------------------------------------------------------------------


@dataclass(frozen=True)
class SavedVote:
    conversation: str  # the file's stem: its id or name
    record: dict[str, Any]

    @property
    def battle(self) -> Battle:
        a, b = self.record["sides"]
        return Battle(a["model"], b["model"], self.record["outcome"])


def _valid(vote: object) -> bool:
    """Whether a vote record has what the exports and ratings read (a hand-edited or
    damaged one is skipped)."""
    if not isinstance(vote, dict) or vote.get("outcome") not in VOTE_WORDS:
        return False
    sides, prompt = vote.get("sides"), vote.get("prompt")
    if not isinstance(prompt, list) or not isinstance(sides, list) or len(sides) != 2:
        return False
    return all(
        isinstance(s, dict)
        and isinstance(s.get("model"), str)
        and isinstance(s.get("message"), dict)
        and "content" in s["message"]
        for s in sides
    )


def _votes_in(path: Path) -> Iterator[dict[str, Any]]:
    try:
        lines = path.read_bytes().splitlines()
    except OSError:
        return  # a file that went, or cannot be read: its votes are not counted
    for line in lines:
        if b'"vote"' not in line:
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue  # a line cut by a killed process
        if isinstance(record, dict) and record.get("type") == "vote" and _valid(record.get("vote")):
            yield record["vote"]


def read_votes(folder: Path) -> list[SavedVote]:
    """Every vote saved in the conversations of `folder`, oldest conversation first."""
    if not folder.is_dir():
        return []
    votes = []
    for path in sorted(folder.glob("*" + SUFFIX)):
        votes += [SavedVote(path.stem, vote) for vote in _votes_in(path)]
    return votes


# ---- exports ------------------------------------------------------------------------------------


def _as_text(message: Mapping[str, Any]) -> dict[str, str]:
    """A message with its content as one string, calculator calls as `[calc ...]` markers:
    what a trainer's chat template reads."""
    return {"role": str(message["role"]), "content": text_from_parts(message["content"])}


def dpo_record(vote: Mapping[str, Any]) -> dict[str, Any] | None:
    """TRL's conversational preference record for a decisive vote; None for a tie or both
    bad, which prefer neither."""
    won = winner_label(vote["outcome"])
    if won is None:
        return None
    sides = {s["label"]: s for s in vote["sides"]}
    lost = "B" if won == "A" else "A"
    return {
        "prompt": [_as_text(m) for m in vote["prompt"]],
        "chosen": [_as_text(sides[won]["message"])],
        "rejected": [_as_text(sides[lost]["message"])],
    }


def full_record(saved: SavedVote) -> dict[str, Any]:
    """Everything a vote kept, with each reply's text beside its parts and the winner named."""
    vote = saved.record
    won = winner_label(vote["outcome"])
    return {
        "conversation": saved.conversation,
        "time": vote.get("time"),
        "prompt": [_as_text(m) for m in vote["prompt"]],
        "sides": [
            {**s, "content": text_from_parts(s["message"]["content"])} for s in vote["sides"]
        ],
        "outcome": vote["outcome"],
        "winner": next((s["model"] for s in vote["sides"] if s["label"] == won), None),
        "settings": vote.get("settings", {}),
    }


def export_lines(votes: Sequence[SavedVote], fmt: str) -> list[str]:
    """The export's lines, one JSON record each: `dpo` the decisive votes, `jsonl` all."""
    if fmt == "dpo":
        records = [r for r in (dpo_record(v.record) for v in votes) if r is not None]
    else:
        records = [full_record(v) for v in votes]
    return [json.dumps(r, ensure_ascii=False) for r in records]


# ---- this session's tally -----------------------------------------------------------------------


def session_tally(outcomes: Sequence[tuple[str, str, str]]) -> list[tuple[str, int, int, int, int]]:
    """(model, wins, losses, ties, both bad) for each model, from (model A, model B,
    outcome) triples: /stats in the arena."""
    rows: dict[str, list[int]] = {}
    for a, b, outcome in outcomes:
        for model in (a, b):
            rows.setdefault(model, [0, 0, 0, 0])
        if outcome == "tie":
            rows[a][2] += 1
            rows[b][2] += 1
        elif outcome == "bad":
            rows[a][3] += 1
            rows[b][3] += 1
        else:
            winner, loser = (a, b) if outcome == "a" else (b, a)
            rows[winner][0] += 1
            rows[loser][1] += 1
    return [(m, *counts) for m, counts in rows.items()]  # type: ignore[misc]
