"""Peak memory of the bench's bf16 copy of a model (how `chatcli bench` makes ours' weights
on a GPU), against the deepcopy it replaced, on the CPU where peak RSS shows it.

    python scripts/cast_memory.py [--synthetic d12] [--way ours|deepcopy]

Run each way in its own process: a process's peak RSS only grows.
"""

from __future__ import annotations

import argparse
import copy
import resource

import torch

from chatcli.bench.models import cast_copy, synthetic_model


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic", choices=["d4", "d12", "d20"], default="d12")
    parser.add_argument("--way", choices=["ours", "deepcopy"], default="ours")
    args = parser.parse_args()
    model, _ = synthetic_model(args.synthetic)
    before = peak_mb()
    if args.way == "deepcopy":
        cast = copy.deepcopy(model).to(torch.bfloat16)
        cast.init_rotary()
    else:
        cast = cast_copy(model, torch.bfloat16)
    grew = peak_mb() - before
    bf16_mb = sum(p.numel() * p.element_size() for p in cast.parameters()) / 2**20
    print(
        f"{args.synthetic}, {args.way}: the bf16 copy is {bf16_mb:.0f} MB; "
        f"the peak grew {grew:.0f} MB while making it"
    )


if __name__ == "__main__":
    main()
