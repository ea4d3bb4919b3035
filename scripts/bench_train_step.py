"""Time one training step of the default preset's model with each optimizer, shape or precision.

    python scripts/bench_train_step.py            # 2 threads, 6 timed steps after 2 warm-up
    python scripts/bench_train_step.py --threads 1
    python scripts/bench_train_step.py --shapes 8x512,4x1024 --optimizers adamw
    python scripts/bench_train_step.py --optimizers adamw --precisions fp32,bf16 --compile

Random token ids, rows x tokens as in the default preset unless --shapes says otherwise;
uncompiled unless --compile (as the recipe trains; the first steps then include compiling,
and they are the warm-up). `bf16` runs the forward and backward under bf16 autocast, as the
recipe does. Prints, per setting, the whole step (forward, backward, optimizer), its CPU time
over all threads, and the optimizer step alone. The settings are interleaved twice, since this
host's speed drifts within a minute; comparing settings in one run gives their ratio on a busy
host too.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from chatcli.training.train import PRESETS, make_optimizers, masked_loss, new_model, products_in


def time_steps(
    optimizer: str,
    steps: int,
    shape: tuple[int, int] | None,
    bf16: bool = False,
    compiled: bool = False,
) -> tuple[float, float, float]:
    preset = replace(PRESETS["default"], optimizer=optimizer)
    if shape is not None:
        preset = replace(preset, batch_rows=shape[0], sequence_len=shape[1])
    model = new_model(preset, preset.vocab_size, seed=0)
    optimizers = make_optimizers(model, preset)
    ids = torch.randint(0, preset.vocab_size, (preset.batch_rows, preset.sequence_len + 1))
    mask = torch.ones(preset.batch_rows, preset.sequence_len)

    loss_fn = torch.compile(masked_loss) if compiled else masked_loss

    def step() -> None:
        with products_in(bf16):
            loss = loss_fn(model, ids, mask)
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
    parser.add_argument("--precisions", default="fp32", help="comma-separated: fp32, bf16")
    parser.add_argument("--compile", action="store_true", help="torch.compile the loss")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [None]
    if args.shapes:
        shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    precisions = args.precisions.split(",")
    if unknown := set(precisions) - {"fp32", "bf16"}:
        parser.error(f"unknown precisions {sorted(unknown)}: choose from fp32, bf16")
    settings = [
        (o, shape, p) for o in args.optimizers.split(",") for shape in shapes for p in precisions
    ]
    for optimizer, shape, precision in settings * 2:
        whole, opt_only, cpu = time_steps(
            optimizer, args.steps, shape, precision == "bf16", args.compile
        )
        name = optimizer if shape is None else f"{optimizer} {shape[0]}x{shape[1]}"
        name += f" {precision}"
        print(
            f"{name:>10}: step {whole * 1e3:6.0f} ms (CPU time {cpu * 1e3:6.0f} ms), "
            f"optimizer alone {opt_only * 1e3:6.1f} ms"
        )


if __name__ == "__main__":
    main()
