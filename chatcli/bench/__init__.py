"""The bench layer: `chatcli bench`, measuring our engine against a plain reference.

Owns the measurements (`bench`), the plain eager reference decode they compare against
(`baseline`), and the report drawn from their JSON (`report`). May import every layer but
the CLI: it times the chat session's real path, and draws its report with the terminal's
renderer.
"""
