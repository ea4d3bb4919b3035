"""The terminal layer: what a person at a terminal sees and types.

Owns the prompt-toolkit REPL (`repl`), the Rich renderer of a streamed reply (`render`) and its
Markdown blocks (`markdown_blocks`), the keyboard while a reply streams (`keyboard`),
running slash commands against the screen (`slash_commands`), and the arena's side-by-side
duel, vote and commands (`arena_view`, `arena_turns`, `arena_commands`). May import the chat
layer and everything below it; never the serving or CLI layers. Rich and prompt-toolkit live here.
"""
