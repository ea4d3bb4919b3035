"""Tiny nanochat checkpoints of every era for the transformers-format tests.

Eras A and E come from the reference fixtures (made by nanochat itself); B, C and D (and
variants: padded vocabularies, bf16 tables as nanochat's GPU runs save them) are random GPTs
made here with the embedded model's tokenizer, every parameter drawn so every part matters,
saved in nanochat's layout.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import torch
from reference import REFERENCE

from chatcli.model.checkpoint_paths import EMBEDDED_DIR
from chatcli.model.gpt import ERAS, GPT, GPTConfig
from chatcli.model.linear import is_embedding_table

TOKENIZER = EMBEDDED_DIR / "tokenizer" / "tokenizer.pkl"  # vocabulary of 1024
VOCAB = 1024


def random_gpt(era: str, sequence_len: int = 256, padded: int | None = None, seed: int = 0) -> GPT:
    config = GPTConfig(
        sequence_len=sequence_len,
        vocab_size=VOCAB,
        n_layer=4,
        n_head=4,
        n_kv_head=2,
        n_embd=64,
        window_pattern="SSSL",
    )
    torch.manual_seed(seed)
    model = GPT(config, replace(ERAS[era], padded_vocab_size=padded or VOCAB))
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.3 if p.ndim < 2 or "lambda" in name else 0.5 / p.shape[-1] ** 0.5
            p.normal_(0.0, std)
            if "lambda" in name:
                p.add_(0.5)
    model.init_rotary()
    return model.eval()


def save_nanochat(model: GPT, folder: Path, tables: torch.dtype | None = None) -> Path:
    """A flat nanochat download folder: model_000007.pt, meta_000007.json, tokenizer.pkl.
    tables: save the embedding tables in this dtype (nanochat's GPU runs save bf16)."""
    folder.mkdir(parents=True, exist_ok=True)
    sd = {
        k: v.to(tables) if tables is not None and is_embedding_table(k) else v
        for k, v in model.state_dict().items()
    }
    torch.save(sd, folder / "model_000007.pt")
    meta = {"step": 7, "model_config": asdict(model.config)}
    (folder / "meta_000007.json").write_text(json.dumps(meta))
    shutil.copyfile(TOKENIZER, folder / "tokenizer.pkl")
    return folder


_CHECKPOINTS: dict[str, Path] = {}


def era_checkpoint(name: str, root: Path) -> Path:
    """A nanochat checkpoint folder for a test case name: A and E are the reference
    fixtures; B, C, D random; 'C-padded' pads the vocabulary to 1088 rows and saves its
    tables in bf16; 'B-short' has a 64-token context (prompts run past its long window).
    Made once per test session."""
    if name in ("A", "E"):
        return REFERENCE / name
    if name not in _CHECKPOINTS:
        era, _, variant = name.partition("-")
        folder = root / "nanochat" / name
        if variant == "padded":
            model, tables = random_gpt(era, padded=VOCAB + 64), torch.bfloat16
        elif variant == "short":
            model, tables = random_gpt(era, sequence_len=64), None
        else:
            model, tables = random_gpt(era), None
        _CHECKPOINTS[name] = save_nanochat(model, folder, tables)
    return _CHECKPOINTS[name]


_EXPORTS: dict[tuple[str, bool], Path] = {}


def exported(name: str, root: Path, remote_code: bool = False) -> Path:
    """The test case's checkpoint exported with chatcli's defaults (once per test session)."""
    from chatcli.model.hf_export import GenerationDefaults, export_model, read_source

    key = (name, remote_code)
    if key not in _EXPORTS:
        src = read_source(str(era_checkpoint(name, root)), "sft", None, None)
        out = root / "hf" / (name + ("-remote" if remote_code else ""))
        export_model(out, src, GenerationDefaults(0.6, 50), remote_code=remote_code)
        _EXPORTS[key] = out
    return _EXPORTS[key]
