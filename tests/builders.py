"""Models the tests build: small GPTs of every era with random weights.

Shared here (not imported from another test module) so that a test file can move or go
without breaking the others.
"""

from __future__ import annotations

import torch

from chatcli.model.gpt import ERAS, GPT, GPTConfig


def random_gpt(
    era: str, seed: int = 0, sequence_len: int = 256, n_embd: int = 64, vocab_size: int = 200
) -> GPT:
    """A small GPT of the given era, every parameter randomised (lambdas and gates included)
    so every component matters."""
    config = GPTConfig(
        sequence_len=sequence_len,
        vocab_size=vocab_size,
        n_layer=4,
        n_head=4,
        n_kv_head=2,
        n_embd=n_embd,
        window_pattern="SSSL",
    )
    torch.manual_seed(seed)
    model = GPT(config, ERAS[era])
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.3 if p.ndim < 2 or "lambda" in name else 0.5 / p.shape[-1] ** 0.5
            p.normal_(0.0, std)
            if "lambdas" in name or "lambda" in name:
                p.add_(0.5)
    model.init_rotary()
    return model.eval()


def random_chat_gpt(era: str, sequence_len: int = 256, seed: int = 0) -> GPT:
    """A vocab-512 GPT of the given era, every parameter randomised: every id it writes
    decodes with the reference tokenizer (reference_tokenizer)."""
    config = GPTConfig(sequence_len, 512, 4, 4, 2, 64, window_pattern="SSSL")
    torch.manual_seed(seed)
    model = GPT(config, ERAS[era])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if p.ndim < 2 else 0.5 / p.shape[-1] ** 0.5)
            if "lambda" in name:
                p.add_(0.5)
    model.init_rotary()
    return model.eval()
