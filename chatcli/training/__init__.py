"""Training the embedded default model (not needed at run time)."""
