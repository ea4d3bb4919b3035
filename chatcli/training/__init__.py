"""Training the embedded default model (never needed at run time).

Owns the synthetic chat data and its phrasings, the training loop, the Muon optimizer and the
held-out evaluation. May import the chat, engine, model and kernels layers: it trains the
inference model unchanged and scores it through the engine's real path.
"""
