"""`python -m chatcli` is the same as the `chatcli` command."""

from chatcli.cli.app import main

main()
