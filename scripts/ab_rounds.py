"""What an A/B against a git revision needs (ab_rows_step.py, rows_step_phases.py): a file as
it was at that revision, and the command line of a comparison against one."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def source_at(revision: str, path: str) -> str:
    """The text of `path` (relative to the repository) as it was at `revision`."""
    return subprocess.run(
        ["git", "show", f"{revision}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def comparison_parser(doc: str) -> argparse.ArgumentParser:
    """--against REV and --rounds N (checked by `rounds`), for a script documented by `doc`."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--against", required=True, help="git revision to compare with")
    parser.add_argument("--rounds", type=int, default=12, help="at least 2 (for quartiles)")
    return parser


def rounds(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The rounds asked for, or the parser's error: the quartiles need two ratios."""
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: the quartiles need two ratios")
    return args.rounds
