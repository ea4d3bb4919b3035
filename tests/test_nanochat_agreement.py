"""nanochat's own loader, tokenizer and Engine run the embedded model as chatcli does
(scripts/nanochat_agreement.py), where a nanochat checkout is at hand."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from chatcli.model.checkpoint import EMBEDDED_DIR

NANOCHAT = Path(os.environ.get("NANOCHAT_SRC", "/work/nanochat-src"))
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "nanochat_agreement.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (NANOCHAT / "nanochat" / "gpt.py").is_file(),
        reason=f"no nanochat checkout at {NANOCHAT}: git clone "
        "https://github.com/karpathy/nanochat /work/nanochat-src, or set NANOCHAT_SRC to one",
    ),
]


def _script():
    # nanochat's own imports: its tokenizer needs rustbpe, its base dir handling filelock.
    pytest.importorskip("rustbpe", reason="nanochat's tokenizer needs rustbpe: pip install rustbpe")
    pytest.importorskip("filelock", reason="nanochat needs filelock: pip install filelock")
    spec = importlib.util.spec_from_file_location("nanochat_agreement", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_nanochat_gives_the_embedded_model_the_same_prompts_and_greedy_replies():
    agreement = _script()
    # One-turn and multi-turn prompts (earlier turns holding calculator calls and results).
    kinds = ("arithmetic", "followup", "cross_followup", "expression")
    items = agreement.held_out_prompts(4, kinds=kinds)
    assert [it.kind for it in items] == list(kinds)
    assert all(len(it.messages) > 1 for it in items[1:3])

    report = agreement.compare(NANOCHAT, items=items, max_tokens=60)

    assert Path(report.model_file).parent.parent.parent == EMBEDDED_DIR
    assert report.same_prompt == [True] * 4
    assert report.same_reply == [True] * 4, report.divergences
    assert report.divergences == []
    # The calculator's results were compared too, not only the model's own tokens.
    assert sum(report.forced_tokens) > 0
    assert max(report.logit_diff) < 1e-4


def test_a_differing_reply_is_reported_with_its_first_difference():
    agreement = _script()
    assert agreement.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert agreement.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert agreement.first_difference([1, 2], [1, 2, 3]) == 2
