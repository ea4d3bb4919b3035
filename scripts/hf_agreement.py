"""How closely transformers runs chatcli's exports, era by era (a measurement, not a test).

    python scripts/hf_agreement.py

For each test case of tests/hf_models.py (the reference checkpoints of eras A and E, random
models of eras B, C, D, C with a padded vocabulary, B with a context its prompt outruns):
export it, load it in transformers in fp32, and print the largest logit difference from
chatcli's over a 200-token prompt, and whether 32 greedy tokens agree. Era A is shown twice:
transformers' own NanoChatForCausalLM (fp32 rotary tables, where nanochat rounds to bf16)
and chatcli's modeling file (--remote-code).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from hf_models import era_checkpoint, exported
from transformers import AutoModelForCausalLM

from chatcli.engine.engine import Engine
from chatcli.model.checkpoint import load_model

CASES = [("A", False), ("A", True), ("B", False), ("B-short", False), ("C", False)]
CASES += [("C-padded", False), ("D", False), ("E", False)]


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="chatcli-hf-agreement-"))
    rows = []
    for name, remote in CASES:
        checkpoint = era_checkpoint(name, root)
        if not checkpoint.is_dir():
            print(f"{name}: reference fixtures not found, skipped")
            continue
        out = exported(name, root, remote)
        ours, tokenizer, _ = load_model(checkpoint, device="cpu")
        theirs = AutoModelForCausalLM.from_pretrained(
            out, trust_remote_code=True, dtype=torch.float32
        ).eval()
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, 500, (200,), generator=g).tolist()
        with torch.no_grad():
            diff = (ours(torch.tensor([prompt])) - theirs(torch.tensor([prompt])).logits).abs()
        same = None  # B-short's context is too short for chatcli's engine to run the prompt
        if ours.config.sequence_len >= 150 + 32:
            with torch.no_grad():
                got = theirs.generate(
                    torch.tensor([prompt[:150]]), do_sample=False, max_new_tokens=32
                )[0, 150:].tolist()
            done, _ = Engine(ours, tokenizer).generate_batch(
                prompt[:150], max_tokens=32, temperature=0.0
            )
            want = done[0][150:]
            same = got[: len(want)] == want[: len(got)]
        label = f"{name}{' (remote code)' if remote else ''}"
        kind = type(theirs).__name__
        rows.append(
            {"case": label, "class": kind, "max_abs_diff": diff.max().item(), "greedy_32": same}
        )
        print(
            f"{label:>20}  {kind:>28}  max |logit diff| {diff.max().item():.2e}  greedy same: {same}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
