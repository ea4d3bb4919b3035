"""Time one training step of the default preset's model with each optimizer, or each shape.

    python scripts/bench_train_step.py            # 2 threads, 6 timed steps after 2 warm-up
    python scripts/bench_train_step.py --threads 1
    python scripts/bench_train_step.py --shapes 8x512,4x1024 --optimizers adamw

Random token ids, uncompiled, rows x tokens as in the default preset unless --shapes says
otherwise. Prints, per optimizer and shape, the whole step (forward, backward, optimizer), its
CPU time over all threads, and the optimizer step alone. The settings are interleaved twice, since this host's speed drifts
within a minute; comparing shapes in one run gives their ratio on a busy host too.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from chatcli.training.train import PRESETS, make_optimizers, masked_loss, new_model


def time_steps(
    optimizer: str, steps: int, shape: tuple[int, int] | None
) -> tuple[float, float, float]:
    preset = replace(PRESETS["default"], optimizer=optimizer)
    if shape is not None:
        preset = replace(preset, batch_rows=shape[0], sequence_len=shape[1])
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
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    whole = (time.perf_counter() - t0) / steps
    # CPU time (every thread's) hardly moves when other processes share the cores.
    cpu = (time.process_time() - cpu0) / steps
    t0 = time.perf_counter()
    for _ in range(steps):  # the gradients of the last step are still there
        for opt in optimizers:
            opt.step()
    return whole, (time.perf_counter() - t0) / steps, cpu


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--optimizers", default="adamw,muon", help="comma-separated")
    parser.add_argument(
        "--shapes", default=None, help="comma-separated ROWSxTOKENS, e.g. 8x512,4x1024"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [None]
    if args.shapes:
        shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    settings = [(o, shape) for o in args.optimizers.split(",") for shape in shapes]
    for optimizer, shape in settings * 2:
        whole, opt_only, cpu = time_steps(optimizer, args.steps, shape)
        name = optimizer if shape is None else f"{optimizer} {shape[0]}x{shape[1]}"
        print(
            f"{name:>5}: step {whole * 1e3:6.0f} ms (CPU time {cpu * 1e3:6.0f} ms), "
            f"optimizer alone {opt_only * 1e3:6.1f} ms"
        )


if __name__ == "__main__":
    main()
