"""`python -m chatcli` is the same as the `chatcli` command."""

from chatcli.cli import main

main()
