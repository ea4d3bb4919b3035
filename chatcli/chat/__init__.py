"""The chat layer: a conversation as turns, rendered to token ids and streamed back as text.

Owns the conversation (`turns`), the session that keeps one conversation's warm cache and
runs its turns through the engine (`session`), the conversation files (`conversation_format`,
`conversation_store` writes, `conversation_reader` reads, `conversation_index` finds),
the token-stream decoder (`stream`), calculator markers and stop text, settings, and parsing
slash commands (`command_parsing`), and the arena's votes and exports (`arena`) and ratings
(`ratings`). May import the engine, model, kernels and errors layers;
never the terminal, serving or CLI layers, and it never prints: the layers above draw.
"""
