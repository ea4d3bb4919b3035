"""The CLI layer, at the top: the `chatcli` command and its subcommands (Typer).

Owns parsing the command line and the configuration's overrides (`options`), the commands
themselves (`app`), turning project errors into one red line and an exit code, and choosing
how OpenMP threads wait before torch loads (`openmp_wait`). May import every layer below.
"""

from __future__ import annotations


def main() -> None:
    from chatcli.cli.app import main as run

    run()


__all__ = ["main"]
