"""Train the embedded default model from nothing but this repo, on a CPU, in under 45 minutes.

    python -m chatcli.training.train --out runs/default            # the full run (~35 min)
    python -m chatcli.training.train --out /tmp/tiny --preset tiny  # a smoke run (seconds)
    python -m chatcli.training.train --out runs/avg --average-from 0.6  # averaged weights
    python -m chatcli.training.train --out runs/muon --optimizer muon   # Muon for the blocks

Stages: (1) generate seeded synthetic conversations (training/synthetic.py); (2) train a BPE
tokenizer on their text and save it as nanochat's tokenizer.pkl (a tiktoken Encoding with the
9 special tokens last); (3) train an era-E GPT with nanochat's SFT loss mask: the model learns
its own text, its calculator calls and <|assistant_end|>, while the calculator's injected
output is in its context but not in its loss; (4) write a nanochat-layout checkpoint
(tokenizer/ + chatsft_checkpoints/<tag>/model_*.pt + meta_*.json).

Owns the training loop; reuses the inference model (chatcli/model/gpt.py) unchanged, so what is
trained is exactly what ships.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from chatcli.model.gpt import ERAS, GPT, GPTConfig, has_value_embed
from chatcli.model.linear import pad_vocab_rows
from chatcli.model.special_tokens import SPECIAL_TOKENS
from chatcli.model.tokenizer import COPY_SPLIT_PATTERN, Tokenizer
from chatcli.training.loss_mask import render_for_training
from chatcli.training.muon import Muon
from chatcli.training.synthetic import generate_conversations

Optimizer = Literal["adamw", "muon"]


@dataclass(frozen=True)
class Preset:
    vocab_size: int
    n_layer: int
    n_embd: int
    n_head: int
    sequence_len: int
    batch_rows: int
    conversations: int
    steps: int  # the schedule (warmup, cosine decay, averaging) follows these alone
    # A wall-clock cap, or None: reached first, it stops the run before its schedule ends
    # (and says so). It never bends the schedule: a run is the same on any machine.
    minutes: float | None
    lr: float
    warmup_steps: int = 100
    compile: bool = False
    # Off by default (the shipped model is a last-step checkpoint): save a moving average of
    # the weights from this fraction of the budget on instead. Tried because held-out scores
    # of otherwise identical runs moved widely; it did not narrow that
    # (docs/training-history.md).
    average_from: float | None = None
    average_decay: float = 0.995
    # "muon": hidden-layer matrices step with Muon at matrix_lr (training/muon.py), the rest
    # with AdamW at lr, as nanochat trains. "adamw": everything with AdamW at lr.
    optimizer: Optimizer = "adamw"
    matrix_lr: float = 0.02
    # The forward and backward's matrix products in bf16 (torch.autocast); the weights, the
    # optimizer's state and the loss stay fp32. On this CPU (avx512_bf16) a compiled step of
    # the default preset takes 0.66 s against 0.94 in fp32 (`python scripts/bench_train_step.py
    # --precisions fp32,bf16 --compile`); a CPU without bf16 instructions emulates them, slower
    # than fp32.
    bf16: bool = False


PRESETS = {
    # Sized so the bf16 checkpoint ships in under 8 MB and trains in under 45 minutes on 2
    # cores. A 1280-token context, so that 20 short exchanges fit before the oldest is
    # dropped (a chat keeps a quarter of the context for the reply: with 1024, 19 of ~42
    # tokens each fitted): rows of 1280 tokens, 3 to a step, about the tokens of a step of the
    # earlier 8 rows of 512. The earlier recipe's 1374 steps saw about 5.6M tokens of a mix
    # with seven kinds; this mix has seventeen, and 3200 steps see about 12.3M (9600 of the
    # ~13,400 packed rows), in about 35 minutes with bf16 products (41 for 2700 in fp32).
    "default": Preset(
        vocab_size=1024,
        n_layer=6,
        n_embd=192,
        n_head=3,
        sequence_len=1280,
        batch_rows=3,
        conversations=150_000,
        steps=3200,
        minutes=None,
        lr=3e-3,
        compile=True,
        bf16=True,
    ),
    # For the test suite: the same pipeline end to end in seconds.
    "tiny": Preset(
        vocab_size=300,
        n_layer=2,
        n_embd=64,
        n_head=2,
        sequence_len=256,
        batch_rows=8,
        conversations=2_000,
        steps=150,
        minutes=None,
        lr=3e-3,
        warmup_steps=5,
        average_from=0.8,  # so the test run also covers --average-from
    ),
}


def conversation_text(conversation: list[dict]) -> str:
    """All text of a conversation, for tokenizer training."""
    parts = []
    for message in conversation:
        content = message["content"]
        if isinstance(content, str):
            parts.append(content)
        else:
            parts.extend(part["text"] for part in content)
    return "\n".join(parts)


# COPY_SPLIT_PATTERN (defined beside nanochat's in chatcli.model.tokenizer, which knows every
# pattern a tokenizer may split with) is nanochat's split pattern with two changes that make
# copying position-aligned, which is most of what this model does (operands into the
# calculator call, words into .count, names into the answer):
# - numbers split into single digits (\p{N} rather than \p{N}{1,2}). With digit pairs,
#   "4,892" is `4 , 89 2` but the call needs `48 92`: the model would re-chunk every number.
# - a run of letters never takes the character before it. nanochat's `[^\r\n\p{L}\p{N}]?+\p{L}+`
#   makes ` octopus`, `'octopus` and `"octopus` different token sequences, so copying a word
#   from the question into `"octopus".count(...)` or into the answer means translating between
#   them; for a word never seen in training that failed most. Now a word is the same tokens
#   wherever it stands (the space before it is its own token).
assert COPY_SPLIT_PATTERN.count("\\p{L}+") == 1 and "{1,2}" not in COPY_SPLIT_PATTERN


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """BPE over the training text with rustbpe (a training-time-only dependency)."""
    try:
        import rustbpe
    except ImportError:
        sys.exit("Training the tokenizer needs rustbpe: pip install -e '.[train]'")
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(
        iter(texts), vocab_size - len(SPECIAL_TOKENS), pattern=COPY_SPLIT_PATTERN
    )
    ranks = {bytes(k): v for k, v in trainer.get_mergeable_ranks()}
    return Tokenizer.from_ranks(ranks, pattern=COPY_SPLIT_PATTERN)


def pack_rows(
    conversations: list[list[dict]], tokenizer: Tokenizer, row_len: int, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole conversations packed greedily into rows of row_len + 1 tokens.

    Returns ids (N, row_len + 1) and a loss mask over targets (N, row_len): 1 where the target
    token is one the assistant writes (and is not marked unlearned, see loss_mask.py). Padding
    is <|bos|> with mask 0. A conversation never straddles two rows, so every one is seen from
    its start.
    """
    bos = tokenizer.get_bos_token_id()
    rows_ids, rows_mask = [], []
    cur_ids: list[int] = []
    cur_mask: list[int] = []

    def close_row() -> None:
        pad = row_len + 1 - len(cur_ids)
        rows_ids.append(cur_ids + [bos] * pad)
        rows_mask.append(cur_mask + [0] * pad)

    for conv in conversations:
        ids, mask = render_for_training(tokenizer, conv, max_tokens=row_len + 1)
        if len(cur_ids) + len(ids) > row_len + 1:
            close_row()
            cur_ids, cur_mask = [], []
        cur_ids.extend(ids)
        cur_mask.extend(mask)
    if cur_ids:
        close_row()
    order = list(range(len(rows_ids)))
    rng.shuffle(order)
    ids_t = torch.tensor([rows_ids[i] for i in order], dtype=torch.long)
    mask_t = torch.tensor([rows_mask[i] for i in order], dtype=torch.float32)
    return ids_t, mask_t[:, 1:]


def init_weights(model: GPT, seed: int) -> None:
    """nanochat-style init: zero output projections, small lm_head, neutral scalars."""
    g = torch.Generator().manual_seed(seed)
    C = model.config.n_embd
    bound = 3**0.5 * C**-0.5
    with torch.no_grad():
        model.transformer.wte.weight.normal_(0.0, 0.8, generator=g)
        model.lm_head.weight.normal_(0.0, 0.001, generator=g)
        for block in model.transformer.h:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v):
                lin.weight.uniform_(-bound, bound, generator=g)
            block.mlp.c_fc.weight.uniform_(-0.4 * bound, 0.4 * bound, generator=g)
            block.attn.c_proj.weight.zero_()
            block.mlp.c_proj.weight.zero_()
            if block.attn.ve_channels:
                block.attn.ve_gate.weight.zero_()
        for i in range(model.config.n_layer):
            if has_value_embed(i, model.config.n_layer):
                model.value_embeds[str(i)].weight.uniform_(-bound, bound, generator=g)
        model.resid_lambdas.fill_(1.0)
        model.x0_lambdas.fill_(0.1)
        model.smear_gate.weight.zero_()
        model.smear_lambda.zero_()
        model.backout_lambda.fill_(0.2)


def new_model(preset: Preset, vocab_size: int, seed: int) -> GPT:
    """The preset's era-E GPT, initialised and in training mode."""
    config = GPTConfig(
        sequence_len=preset.sequence_len,
        vocab_size=vocab_size,
        n_layer=preset.n_layer,
        n_head=preset.n_head,
        n_kv_head=preset.n_head,
        n_embd=preset.n_embd,
        window_pattern="L",
    )
    model = GPT(config, ERAS["E"])
    init_weights(model, seed)
    model.init_rotary()
    model.train()
    return model


def lr_at(step: int, progress: float, preset: Preset) -> float:
    """Linear warmup, then cosine decay to 5% (progress: 0..1 of the steps)."""
    if step < preset.warmup_steps:
        return preset.lr * (step + 1) / preset.warmup_steps
    return preset.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


class WeightAverage:
    """A moving average of a model's floating-point state, kept in fp32.

    A plain mean of the steps seen until there are 1 / (1 - decay) of them, then exponential
    with that horizon, so the snapshot it starts from never dominates a short average.
    """

    def __init__(self, model: GPT, decay: float) -> None:
        self.decay = decay
        self.updates = 1
        self.state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: GPT) -> None:
        self.updates += 1
        weight = max(1.0 - self.decay, 1.0 / self.updates)
        for k, v in model.state_dict().items():
            if v.is_floating_point():
                self.state[k].lerp_(v.detach().float(), weight)

    def load_into(self, model: GPT) -> None:
        model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in self.state.items()})


def make_optimizers(model: GPT, preset: Preset) -> list[torch.optim.Optimizer]:
    """AdamW for the scalars (at 0.3x the rate) and every matrix, or with preset.optimizer
    "muon", Muon for the matrices inside the blocks (attention, MLP, value-embedding gates)
    and AdamW for the rest (embeddings, lm_head, the smear gate, scalars).

    Every param group carries its own base_lr, which set_lr scales by the schedule.
    """
    hidden = {id(p) for p in model.transformer.h.parameters() if p.ndim == 2}
    matrices = [p for p in model.parameters() if p.ndim == 2]
    scalars = [p for p in model.parameters() if p.ndim < 2]
    # The residual and skip lambdas scale whole layers: a smaller rate keeps them steady.
    adam_groups = [{"params": scalars, "base_lr": 0.3 * preset.lr}]
    optimizers: list[torch.optim.Optimizer] = []
    if preset.optimizer == "muon":
        muon_group = {
            "params": [p for p in matrices if id(p) in hidden],
            "base_lr": preset.matrix_lr,
        }
        optimizers.append(Muon([muon_group], lr=preset.matrix_lr))
        adam_groups.append({"params": [p for p in matrices if id(p) not in hidden]})
    elif preset.optimizer == "adamw":
        adam_groups.append({"params": matrices})
    else:
        raise ValueError(
            f"optimizer must be one of {get_args(Optimizer)}, not {preset.optimizer!r}"
        )
    for group in adam_groups:
        group.setdefault("base_lr", preset.lr)
    adamw = torch.optim.AdamW(
        adam_groups, lr=preset.lr, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0
    )
    return [adamw, *optimizers]


def set_lr(optimizers: list[torch.optim.Optimizer], factor: float) -> None:
    """Every param group's rate: its base_lr times the schedule's factor (0..1)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = factor * group["base_lr"]


def products_in(bf16: bool) -> torch.autocast:
    """The precision of a step's forward and backward: bf16 matrix products under autocast, or
    fp32 throughout (`Preset.bf16`)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)


def masked_loss(model: GPT, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    losses = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none"
    )
    return (losses * mask.reshape(-1)).sum() / mask.sum().clamp(min=1)


def save_checkpoint(
    model: GPT, tokenizer: Tokenizer, out: Path, tag: str, step: int, extra: dict
) -> Path:
    """nanochat layout; weights stored bf16 (the loaders convert to fp32 on CPU)."""
    tokenizer.save(out / "tokenizer" / "tokenizer.pkl")
    ckpt_dir = out / "chatsft_checkpoints" / tag
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    for old in ckpt_dir.glob("*_*.*"):
        old.unlink()
    sd = {
        k: (v.detach().bfloat16() if v.ndim == 2 else v.detach().float()).contiguous()
        for k, v in model.state_dict().items()
    }
    # Padded as nanochat's are: its loader reads no other shape.
    torch.save(pad_vocab_rows(sd, model.config.vocab_size), ckpt_dir / f"model_{step:06d}.pt")
    meta = {"step": step, "model_config": asdict(model.config), **extra}
    (ckpt_dir / f"meta_{step:06d}.json").write_text(json.dumps(meta, indent=2) + "\n")
    return ckpt_dir


def train(out: Path, preset: Preset, seed: int = 0, log=print) -> Path:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    t0 = time.perf_counter()

    conversations = generate_conversations(preset.conversations, seed=seed, split="train")
    log(f"generated {len(conversations)} conversations in {time.perf_counter() - t0:.1f}s")

    texts = [conversation_text(c) for c in conversations[:50_000]]
    tokenizer = train_tokenizer(texts, preset.vocab_size)
    log(f"tokenizer: {tokenizer.get_vocab_size()} tokens ({time.perf_counter() - t0:.1f}s)")

    ids, mask = pack_rows(conversations, tokenizer, preset.sequence_len, rng)
    n_targets = int(mask.sum())
    log(f"packed {ids.size(0)} rows of {preset.sequence_len}; {n_targets} supervised targets")

    model = new_model(preset, tokenizer.get_vocab_size(), seed)
    log(f"model: era E, {model.num_params() / 1e6:.2f}M parameters, {model.config}")

    optimizers = make_optimizers(model, preset)
    budget_s = preset.minutes * 60 if preset.minutes is not None else math.inf
    # Compiling costs a while once and makes each step faster (scripts/bench_train_step.py).
    loss_fn = torch.compile(masked_loss) if preset.compile else masked_loss
    t_train = time.perf_counter()
    step, seen, ema = 0, 0, None
    average: WeightAverage | None = None
    average_step = 0
    order = torch.randperm(ids.size(0), generator=torch.Generator().manual_seed(seed))
    capped = False
    while step < preset.steps:
        elapsed = time.perf_counter() - t_train
        if elapsed >= budget_s:
            capped = True
            break
        progress = step / preset.steps
        lr = lr_at(step, progress, preset)
        set_lr(optimizers, lr / preset.lr)
        if seen + preset.batch_rows > ids.size(0):
            order = torch.randperm(
                ids.size(0), generator=torch.Generator().manual_seed(seed + step)
            )
            seen = 0
        batch = order[seen : seen + preset.batch_rows]
        seen += preset.batch_rows
        with products_in(preset.bf16):
            loss = loss_fn(model, ids[batch], mask[batch])
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
        averaging = preset.average_from is not None and progress >= preset.average_from
        if average is None and averaging:
            average, average_step = WeightAverage(model, preset.average_decay), step
            log(f"averaging weights from step {step} (decay {preset.average_decay})")
        elif average is not None:
            average.update(model)
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 50 == 0:
            log(f"step {step:5d}  loss {ema:.4f}  lr {lr:.2e}  {elapsed / 60:5.1f} min")
        step += 1

    model.eval()
    if average is not None:
        # The last step's own weights stay beside the checkpoint, for comparing the two.
        out.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), out / "last_step_weights.pt")
        average.load_into(model)
    extra = {
        "trained_by": "python -m chatcli.training.train",
        "preset": asdict(preset),
        "seed": seed,
        "train_steps": step,
        "stopped_by": "time cap" if capped else "steps",
        "final_loss": round(ema or 0.0, 4),
        "weights": f"moving average, decay {preset.average_decay}, from step {average_step}"
        if average is not None
        else "last step",
        "train_minutes": round((time.perf_counter() - t0) / 60, 2),
        "torch": torch.__version__,
    }
    ckpt = save_checkpoint(model, tokenizer, out, f"d{preset.n_layer}", step, extra)
    log(f"saved {ckpt} after {step} steps, loss {ema:.4f}")
    if capped:
        log(
            f"warning: --minutes stopped the run at step {step} of {preset.steps}, before its "
            "learning rate had decayed: this is not the preset's model (run it without "
            "--minutes for that)."
        )
    if step < 2 * preset.warmup_steps:
        # The cap counts the one-off compile (~50 s): a short one can end in the warmup.
        log(
            f"warning: only {step} steps, and the learning rate warms up over "
            f"{preset.warmup_steps}: this model has barely learned. Give "
            + ("--minutes more time." if capped else "it more --steps.")
        )
    return ckpt


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="output base dir")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help="default: the embedded model's recipe (~35 min); tiny: a smoke run of the pipeline",
    )
    parser.add_argument(
        "--minutes",
        type=_positive,
        help="a time cap: the run stops there even if its steps are not done (none by default)",
    )
    parser.add_argument("--steps", type=_positive_int, help="training steps (overrides preset)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the data, the weights and the order (0)"
    )
    parser.add_argument("--optimizer", choices=get_args(Optimizer), help="overrides the preset")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch threads (every core)"
    )
    parser.add_argument(
        "--average-from",
        type=float,
        help="save a moving average of the weights from this fraction of training on "
        "(e.g. 0.6) instead of the last step's",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    given = {
        "minutes": args.minutes,
        "steps": args.steps,
        "average_from": args.average_from,
        "optimizer": args.optimizer,
    }
    preset = replace(PRESETS[args.preset], **{k: v for k, v in given.items() if v is not None})
    train(args.out, preset, seed=args.seed, log=lambda s: print(s, flush=True))


if __name__ == "__main__":
    main()
