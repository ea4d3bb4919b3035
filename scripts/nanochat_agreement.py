"""Does nanochat's own code run a chatcli checkpoint as chatcli does? (a check that prints numbers)

    python scripts/nanochat_agreement.py --nanochat /work/nanochat-src         # embedded model
    python scripts/nanochat_agreement.py --nanochat SRC --model /tmp/tiny --n 20

SRC is a checkout of karpathy/nanochat (git clone https://github.com/karpathy/nanochat); it goes
on sys.path and nothing of it is copied here. For N held-out prompts (chatcli.training.eval_sets,
one kind after another, so multi-turn follow-ups whose earlier turns hold calculator calls are
among them):

1. nanochat's loader builds the model and its RustBPETokenizer reads tokenizer.pkl: for a base
   dir, checkpoint_manager.load_model_from_dir picks the tag and step itself (and must pick the
   ones chatcli picks); for a flat folder or a model_*.pt, checkpoint_manager.build_model.
   chatcli's load_model builds ours. Both on the CPU, in fp32.
2. Both tokenizers render the conversation (nanochat's render_for_completion, as its
   chat_eval does); the prompt ids must be identical.
3. Both models run the prompt's full sequence; the largest logit difference is shown.
4. Both Engines generate greedily, each with its own calculator, up to --max-tokens tokens
   (the one ending the reply included). The token sequences, calculator results included,
   must be identical ("by calc": how many of them the calculator wrote). chatcli writes a
   calculator result still queued at the limit past it, nanochat cuts it: tokens past the
   limit are not compared.

Exit code 0 when everything agrees, 1 when a prompt or a reply differs, 2 when nanochat cannot
load the checkpoint (its message is printed).

Shims: none. At nanochat 92d63d4 (July 2026) with torch 2.13 on the CPU, no module of nanochat
is patched: its current code is era E's. It refuses vocabulary tables (wte, lm_head,
value_embeds) whose rows are not padded to a multiple of 64, as every nanochat since Dec 2025
saves them; chatcli's trainer saves them so too. The checkout is on sys.path for the import
only. Two of nanochat's own environment variables are set, each only while it is read:
- NANOCHAT_DTYPE=float32: nanochat picks its compute dtype once, at import, from the machine
  (bf16 wherever a CUDA GPU of SM 8.0+ is present, even for a model then kept on the CPU).
  chatcli computes in fp32 on the CPU; both must run at one precision to be compared.
- NANOCHAT_BASE_DIR: its loader reads the tokenizer from <base>/tokenizer/tokenizer.pkl. It is
  the checkpoint's base dir, or for a flat folder a temporary one holding a link to its
  tokenizer.pkl.
Its flash-attention module falls back to PyTorch's SDPA by itself without CUDA, and its loader
widens bf16 weights to fp32 on the CPU by itself. Its calculator times itself with SIGALRM,
which only the main thread may set (elsewhere every call silently fails), so the comparison
refuses to run off the main thread.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from chatcli.engine.engine import Engine
from chatcli.model.checkpoint import EMBEDDED_DIR, load_model
from chatcli.model.checkpoint_paths import SOURCES, CheckpointRef, resolve_checkpoint
from chatcli.model.special_tokens import ASSISTANT_END, BOS
from chatcli.training.eval_sets import EVAL_KINDS, EvalItem, generate_eval_set

DEFAULT_NANOCHAT = Path("/work/nanochat-src")
EVAL_SEED = 1234  # chatcli.training.evaluate's held-out prompts


class NanochatLoadError(Exception):
    """nanochat's own loader refused the checkpoint (its message says why)."""


@dataclass
class Divergence:
    kind: str
    index: int  # which prompt
    what: str  # "prompt ids" or "greedy reply"
    position: int
    nanochat: str  # the token there, described
    chatcli: str


@dataclass
class Agreement:
    nanochat_commit: str
    model_file: str
    step: int
    max_tokens: int
    kinds: list[str] = field(default_factory=list)  # one per prompt
    same_prompt: list[bool] = field(default_factory=list)
    same_reply: list[bool] = field(default_factory=list)
    logit_diff: list[float] = field(default_factory=list)
    reply_tokens: list[int] = field(default_factory=list)
    forced_tokens: list[int] = field(default_factory=list)  # written by the calculator
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        return all(self.same_prompt) and all(self.same_reply)


def import_nanochat(src: Path) -> dict[str, ModuleType]:
    """nanochat's checkpoint_manager, engine and tokenizer modules, imported from `src`."""
    if not (src / "nanochat" / "gpt.py").is_file():
        raise FileNotFoundError(
            f"{src} is not a nanochat checkout (no nanochat/gpt.py). Get one: "
            f"git clone https://github.com/karpathy/nanochat {src}"
        )
    # On the path for the import only (its checkout also holds packages named scripts, tasks
    # and tests); NANOCHAT_DTYPE is read once, when nanochat.common is first imported.
    sys.path.insert(0, str(src))
    try:
        with _environ("NANOCHAT_DTYPE", "float32"):
            import nanochat.checkpoint_manager as checkpoint_manager
            import nanochat.common as common
            import nanochat.engine as engine
            import nanochat.tokenizer as tokenizer
    finally:
        sys.path.remove(str(src))
    if Path(common.__file__).resolve().parent.parent != src.resolve():
        raise RuntimeError(f"another nanochat is imported already: {common.__file__}")
    dtype = common.COMPUTE_DTYPE
    if dtype != torch.float32:
        raise RuntimeError(
            f"nanochat computes in {dtype} ({common.COMPUTE_DTYPE_REASON}); "
            "run this in a fresh process"
        )
    return {"checkpoint_manager": checkpoint_manager, "engine": engine, "tokenizer": tokenizer}


def nanochat_commit(src: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(src), "log", "-1", "--format=%h (%cs)"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit (not a git checkout)"
    return out.stdout.strip()


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def load_with_nanochat(
    ref: CheckpointRef, nc: dict[str, ModuleType], pick: bool = True
) -> tuple[Any, Any]:
    """(model, tokenizer) as nanochat's own loader builds them from chatcli's checkpoint. With
    `pick`, a checkpoint in a base dir is found by nanochat itself (the largest tag, the last
    step), which must be the one chatcli found."""
    manager = nc["checkpoint_manager"]
    cpu = torch.device("cpu")
    checkpoints = ref.model_file.parent.parent  # <base>/chatsft_checkpoints, in the layout
    base = checkpoints.parent
    in_layout = (
        checkpoints.name in SOURCES.values()
        and (base / "tokenizer" / "tokenizer.pkl").resolve() == ref.tokenizer_file.resolve()
    )
    with contextlib.ExitStack() as stack:
        if not in_layout:  # a flat folder: a base dir for nanochat to find the tokenizer in
            base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="nanochat-")))
            (base / "tokenizer").mkdir()
            (base / "tokenizer" / "tokenizer.pkl").symlink_to(ref.tokenizer_file.resolve())
        stack.enter_context(_environ("NANOCHAT_BASE_DIR", str(base)))
        try:
            if in_layout and pick:
                tag = manager.find_largest_model(str(checkpoints))
                model, tokenizer, meta = manager.load_model_from_dir(
                    str(checkpoints), cpu, phase="eval"
                )
            else:
                tag = ref.model_file.parent.name
                model, tokenizer, meta = manager.build_model(
                    str(ref.model_file.parent), ref.step, cpu, phase="eval"
                )
        except (RuntimeError, AssertionError, KeyError, OSError) as e:
            raise NanochatLoadError(f"{type(e).__name__}: {e}") from e
    if (tag, meta["step"]) != (ref.model_file.parent.name, ref.step):
        raise NanochatLoadError(
            f"nanochat picked {tag} step {meta['step']}, chatcli "
            f"{ref.model_file.parent.name} step {ref.step}"
        )
    return model, tokenizer


def held_out_prompts(n: int, seed: int = EVAL_SEED, kinds: tuple[str, ...] = EVAL_KINDS):
    """n held-out items, one of each kind in turn (so every kind is in the first len(kinds))."""
    per_kind = -(-n // len(kinds))
    items = generate_eval_set(per_kind, seed, kinds)
    by_kind = [[it for it in items if it.kind == k] for k in kinds]
    return [by_kind[j][i] for i in range(per_kind) for j in range(len(kinds))][:n]


def _greedy(stream: Iterator, stops: set[int], max_tokens: int) -> tuple[list[int], list[int]]:
    """One row's tokens and masks (1 sampled, 0 forced by the calculator) up to its stop."""
    tokens, masks = [], []
    for column, column_masks in stream:
        if len(tokens) == max_tokens:
            break
        tokens.append(column[0])
        masks.append(column_masks[0])
        if column[0] in stops:
            break
    return tokens, masks


def _describe(tokenizer: Any, ids: list[int], masks: list[int] | None, i: int) -> str:
    if i >= len(ids):
        return "(ended)"
    how = "" if masks is None else (" sampled" if masks[i] else " forced")
    return f"{ids[i]} {tokenizer.decode([ids[i]])!r}{how}"


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(
    nanochat_src: Path,
    model_path: Path | None = None,
    items: list[EvalItem] | None = None,
    n: int = 20,
    max_tokens: int = 100,
) -> Agreement:
    """nanochat's loader, tokenizer and Engine against chatcli's on held-out prompts."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("nanochat's calculator needs the main thread (SIGALRM)")
    nc = import_nanochat(nanochat_src)
    ref = resolve_checkpoint(model_path if model_path is not None else EMBEDDED_DIR)
    # nanochat finds the checkpoint itself where a base dir (or nothing) was named.
    named_base = model_path is None or model_path.resolve() == ref.model_file.parents[2].resolve()
    theirs, their_tok = load_with_nanochat(ref, nc, pick=named_base)
    ours, our_tok, _ = load_model(ref.model_file, device="cpu", dtype="float32")
    their_engine = nc["engine"].Engine(theirs, their_tok)
    our_engine = Engine(ours, our_tok)
    stops = {our_tok.encode_special(ASSISTANT_END), our_tok.encode_special(BOS)}
    report = Agreement(nanochat_commit(nanochat_src), str(ref.model_file), ref.step, max_tokens)
    for index, item in enumerate(items if items is not None else held_out_prompts(n)):
        # nanochat's render_for_completion drops a last assistant message, as in its chat_eval.
        convo = {"messages": [*item.messages, {"role": "assistant", "content": ""}]}
        their_prompt = their_tok.render_for_completion(convo)
        our_prompt = our_tok.render_for_completion(item.messages)
        report.kinds.append(item.kind)
        report.same_prompt.append(their_prompt == our_prompt)
        _note_divergence(report, item.kind, index, "prompt ids", our_tok, their_prompt, our_prompt)
        with torch.inference_mode():
            ids = torch.tensor([our_prompt])
            diff = (theirs(ids) - ours(ids)).abs().max().item()
        report.logit_diff.append(diff)
        their_reply, their_masks = _greedy(
            their_engine.generate(our_prompt, max_tokens=max_tokens, temperature=0.0),
            stops,
            max_tokens,
        )
        our_reply, our_masks = _greedy(
            our_engine.generate(our_prompt, max_tokens=max_tokens, temperature=0.0),
            stops,
            max_tokens,
        )
        report.same_reply.append(their_reply == our_reply)
        report.reply_tokens.append(len(our_reply))
        report.forced_tokens.append(our_masks.count(0))
        _note_divergence(
            report, item.kind, index, "greedy reply", our_tok, their_reply, our_reply,
            their_masks, our_masks,
        )  # fmt: skip
    return report


def _note_divergence(
    report: Agreement,
    kind: str,
    index: int,
    what: str,
    tokenizer: Any,
    theirs: list[int],
    ours: list[int],
    their_masks: list[int] | None = None,
    our_masks: list[int] | None = None,
) -> None:
    """Where `theirs` and `ours` first differ, if they do, added to the report."""
    at = first_difference(theirs, ours)
    if at is not None:
        report.divergences.append(
            Divergence(
                kind,
                index,
                what,
                at,
                _describe(tokenizer, theirs, their_masks, at),
                _describe(tokenizer, ours, our_masks, at),
            )
        )


def print_report(report: Agreement) -> None:
    print(f"nanochat {report.nanochat_commit} against chatcli")
    print(f"checkpoint {report.model_file} (step {report.step})")
    print(f"greedy, up to {report.max_tokens} tokens a reply, both on the CPU in fp32\n")
    header = f"{'kind':<16}{'prompts':>8}{'same ids':>10}{'same reply':>12}"
    print(header + f"{'tokens':>8}{'by calc':>9}{'max |logit diff|':>18}")
    rows = [(k, [i for i, kind in enumerate(report.kinds) if kind == k]) for k in EVAL_KINDS]
    rows = [r for r in rows if r[1]] + [("all", list(range(len(report.kinds))))]
    for name, idx in rows:
        same_ids = sum(report.same_prompt[i] for i in idx)
        same_reply = sum(report.same_reply[i] for i in idx)
        tokens = sum(report.reply_tokens[i] for i in idx)
        forced = sum(report.forced_tokens[i] for i in idx)
        diff = max(report.logit_diff[i] for i in idx)
        print(
            f"{name:<16}{len(idx):>8}{same_ids:>10}{same_reply:>12}{tokens:>8}{forced:>9}"
            f"{diff:>18.2e}"
        )
    for d in report.divergences:
        print(
            f"differs: prompt {d.index} ({d.kind}), {d.what} at position {d.position}: "
            f"nanochat {d.nanochat}, chatcli {d.chatcli}"
        )
    print("agree" if report.agrees else "DIFFER")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanochat", type=Path, default=DEFAULT_NANOCHAT, help="a checkout")
    parser.add_argument("--model", type=Path, help="default: the embedded model")
    parser.add_argument("--n", type=int, default=20, help="held-out prompts")
    parser.add_argument("--max-tokens", type=int, default=100, help="per reply")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    try:
        report = compare(args.nanochat, args.model, n=args.n, max_tokens=args.max_tokens)
    except NanochatLoadError as e:
        print(f"nanochat's loader refused the checkpoint: {e}")
        return 2
    print_report(report)
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0 if report.agrees else 1


if __name__ == "__main__":
    sys.exit(main())
