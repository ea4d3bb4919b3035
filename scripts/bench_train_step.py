"""Time one training step of the default preset's model with each optimizer.

    python scripts/bench_train_step.py            # 2 threads, 6 timed steps after 2 warm-up
    python scripts/bench_train_step.py --threads 1

Random token ids, uncompiled, 8 rows of 512 tokens as in the default preset. Prints, per
optimizer, the whole step (forward, backward, optimizer) and the optimizer step alone.
AdamW and Muon are interleaved twice, since this host's speed drifts within a minute.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from chatcli.training.train import PRESETS, make_optimizers, masked_loss, new_model


def time_steps(optimizer: str, steps: int) -> tuple[float, float]:
    preset = replace(PRESETS["default"], optimizer=optimizer)
    model = new_model(preset, preset.vocab_size, seed=0)
    optimizers = make_optimizers(model, preset)
    ids = torch.randint(0, preset.vocab_size, (preset.batch_rows, preset.sequence_len + 1))
    mask = torch.ones(preset.batch_rows, preset.sequence_len)

    def step() -> None:
        loss = masked_loss(model, ids, mask)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in optimizers:
            opt.step()

    for _ in range(2):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    whole = (time.perf_counter() - t0) / steps
    t0 = time.perf_counter()
    for _ in range(steps):  # the gradients of the last step are still there
        for opt in optimizers:
            opt.step()
    return whole, (time.perf_counter() - t0) / steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for optimizer in ("adamw", "muon", "adamw", "muon"):
        whole, opt_only = time_steps(optimizer, args.steps)
        print(
            f"{optimizer:>5}: step {whole * 1e3:6.0f} ms, optimizer alone {opt_only * 1e3:6.1f} ms"
        )


if __name__ == "__main__":
    main()
