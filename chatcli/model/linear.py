"""The GPT's matrices: linear layers that may read a compact decode copy, and embedding tables.

Owns: Linear (a bias-free layer, its rows through its compact copy where it keeps one:
quantize.py), the weight-major product a few rows through a big fp32 weight take on the CPU,
the embedding tables' construction and names, and the vocabulary tables' padding as nanochat
saves it. Knows nothing about the network around them.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from chatcli.model.quantize import DecodeWeight

# An fp32 weight of at least this many elements (1 MB) is read from memory by every product
# on the CPU, rather than from the caches; up to WEIGHT_MAJOR_ROWS rows then go through it
# as W @ x.T (Linear._weight_major).
STREAMED_WEIGHT_NUMEL = 1 << 18
WEIGHT_MAJOR_ROWS = 128


class Linear(nn.Linear):
    """A bias-free linear layer that can also keep a compact copy of its weight for decode.

    Decode of a big model on CPU is bandwidth-bound: rows go through the copy (fp16, bf16,
    int8 or int4: quantize.py), which reads a half to an eighth of the bytes, up to the
    copy's max_rows: fbgemm's fp16 kernel serves sample rows, chat chunks and prompts of up
    to 1024 tokens, and so does our int8 kernel (fbgemm's int8 16 rows), int4 up to 64,
    bf16 one (its matrix-matrix kernel is far slower than fp32's). More rows use the
    fp32 weight. Activations stay fp32 between products
    (inside one, the copy's kernel may round them: quantize.py).
    """

    decode_weight: DecodeWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.decode_weight is not None:
            y = through_copy(self.decode_weight, x)
            if y is not None:
                return y
        return linear(x, self.weight)


def through_copy(w: DecodeWeight, x: torch.Tensor) -> torch.Tensor | None:
    """x (..., in) @ the compact copy w, or None where x has more rows than w serves."""
    rows = x.numel() // x.size(-1)
    if rows == 1:
        return w.matvec(x.reshape(-1)).view(*x.shape[:-1], -1)
    if rows <= w.max_rows:  # a few sample rows, where int8 still wins
        return w.matmul(x.reshape(rows, -1)).view(*x.shape[:-1], -1)
    return None


def weight_major(weight: torch.Tensor, rows: int) -> bool:
    """Whether `rows` rows go through `weight` as W @ x.T (the weight as MKL's left operand)
    rather than x @ W.T (F.linear): faster for a few to a hundred rows through a weight
    that streams from memory, as in sample rows and a chat turn's chunk (past that the
    transposed result's copy costs more than it saves; on one thread only up to 4 rows
    gain). Small matrices, which stay in the caches, gain nothing and keep F.linear. The
    figures: docs/performance-notes.md ("A few rows through a big matrix go weight-major")."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False
    if weight.numel() < STREAMED_WEIGHT_NUMEL or not 2 <= rows <= WEIGHT_MAJOR_ROWS:
        return False
    return rows <= 4 or torch.get_num_threads() > 1


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (..., in) @ weight.T, weight-major where that is the faster way (weight_major)."""
    rows = x.numel() // x.size(-1)
    if weight_major(weight, rows):
        y = torch.mm(weight, x.reshape(rows, -1).t()).t().contiguous()
        return y.view(*x.shape[:-1], -1)
    return F.linear(x, weight)


def embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding table left uninitialised: every weight is loaded or set by the trainer.

    Skipping nn.Embedding's own normal_() matters on the meta device, where the first call
    lazily imports torch's compiler stack (~2 s of a cold `chatcli once`).
    """
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


def is_embedding_table(key: str) -> bool:
    """Whether a state-dict key names an embedding table (looked up a row per token, never
    read whole): the token embedding and era C+'s value embeddings."""
    return key == "transformer.wte.weight" or (
        key.startswith("value_embeds.") and key.endswith(".weight")
    )


# nanochat (from Dec 2025, so every era-E model) builds its vocabulary tables with this many
# rows' multiple, and its loader refuses a checkpoint whose tables have any other count.
VOCAB_ROWS_MULTIPLE = 64


def pad_vocab_rows(sd: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """`sd` with the tables of a row per token (wte, value_embeds, lm_head) grown by zero rows
    to a multiple of VOCAB_ROWS_MULTIPLE, as nanochat saves them. Logits are sliced back to
    vocab_size and no token id reaches the added rows, so they are never read."""
    rows = -(-vocab_size // VOCAB_ROWS_MULTIPLE) * VOCAB_ROWS_MULTIPLE
    padded = dict(sd)
    for k, v in sd.items():
        if (is_embedding_table(k) or k == "lm_head.weight") and v.shape[0] < rows:
            padded[k] = torch.cat([v, v.new_zeros(rows - v.shape[0], *v.shape[1:])])
    return padded
