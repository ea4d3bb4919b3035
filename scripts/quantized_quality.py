"""How far `--quantize int8` and `int4` move a model's logits and greedy replies from fp32.

    python scripts/quantized_quality.py                      # every era's model, the embedded one
    python scripts/quantized_quality.py -m runs/d20 --prompts 8 --tokens 64 --json
    python scripts/quantized_quality.py --synthetic d20 --prompts 4 --tokens 32

For each model (by default the reference fixtures of eras A and E, random era B, C and D
models made as tests/hf_models.py makes them, and the embedded model; or each -m and
--synthetic given) it loads the fp32 model and its int8 and int4 copies as `chatcli chat --quantize ...` loads them
(load_model, then the CPU plan's threads), and runs each through its Engine on the CPU:

- the teacher: fp32's greedy reply to each of N held-out chat prompts (rendered with the chat
  template, the calculator on as in a chat), up to M tokens;
- teacher-forced logits: each copy reads the prompt (a prefill, as a turn's first step) and
  then fp32's reply one token at a time through the engine's decode step (our whole-step
  kernel where it applies, else torch's ops), and its logits at every reply position are set
  beside fp32's: the largest absolute difference, the mean absolute difference over the
  position's fp32 logit standard deviation, KL(fp32 || copy) in nats, and the share of
  positions whose top token agrees;
- greedy agreement: each copy's own greedy replies against fp32's: the share of tokens equal
  up to each reply's first difference, and how many replies are identical; and the share
  again with every prompt a client of one server batch ("batch": slots of one scheduler,
  prompts prefilled in chunks beside the other rows' decode).

Where our kernel runs a copy's step, that copy is measured again through torch's ops (the
"ops" rows: what a model the kernel does not take runs). --kernels off measures the copies
as a machine without our kernels builds them (CHATCLI_NATIVE_KERNELS=0): int8 through
fbgemm, which rounds each product's input to 7-bit integers too.

"quantized" is the share of the matrix weights that a copy holds: int4 takes only matrices
whose inputs come in whole groups of 128, so a small model keeps most of its matrices fp32.
Random weights (eras B-D, and the step-1 fixtures of A and E) give logits with little
structure; the embedded model's and a trained checkpoint's rows are the ones that say how a
chat changes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from chatcli.bench.models import SYNTHETIC_DEPTHS, synthetic_model
from chatcli.engine.cpu_plan import apply_cpu_plan
from chatcli.engine.engine import Engine
from chatcli.engine.scheduler import CPU_ROWS, RowRequest, Scheduler
from chatcli.errors import ChatcliError
from chatcli.model.checkpoint import load_model
from chatcli.model.gpt import GPT
from chatcli.model.linear import Linear
from chatcli.model.special_tokens import ASSISTANT_END, ASSISTANT_START, BOS, USER_END, USER_START
from chatcli.training.eval_sets import EVAL_KINDS, generate_eval_set

KINDS = ("int8", "int4")
EVAL_SEED = 1234  # chatcli.training.evaluate's held-out prompts
RANDOM_ERAS = ("B", "C", "D")
# A --quantize value ("none", "int8", "int4") -> the model so loaded and its tokenizer.
Loader = Callable[[str], tuple[GPT, Any]]


@dataclass(frozen=True)
class Teacher:
    """fp32's run of one model: the prompts, its greedy replies (up to and including the
    stop token) and its logits at each reply position, (len(reply), V) a prompt."""

    prompts: list[list[int]]
    replies: list[list[int]]
    logits: list[torch.Tensor]


@dataclass(frozen=True)
class QualityRow:
    """One copy of one model against fp32."""

    model: str
    era: str
    kind: str  # int8, int4
    step: str  # what ran its decode step: our kernel or torch's ops
    quantized: float  # share of matrix weights read from the copy
    positions: int  # teacher-forced positions compared
    max_abs: float  # largest |logit - fp32 logit|
    mean_rel: float  # mean |logit - fp32 logit| / the position's fp32 logit std
    kl: float  # mean KL(fp32 || copy) over positions, nats
    top1: float  # share of positions whose argmax agrees with fp32's
    greedy: float  # share of greedy tokens equal up to each reply's first difference
    identical: int  # greedy replies identical to fp32's
    replies: int
    batched: float  # greedy, with the prompts run together as a server's batch runs them


def chat_prompts(tokenizer: Any, n: int, room: int, context: int) -> list[list[int]]:
    """The first n held-out chat prompts (one of each eval kind in turn, multi-turn ones
    among them), rendered for completion, that leave `room` tokens of the context."""
    per_kind = max(2, -(-n // len(EVAL_KINDS)) * 2)
    items = generate_eval_set(per_kind, EVAL_SEED)
    by_kind = [[it for it in items if it.kind == k] for k in EVAL_KINDS]
    ordered = [by_kind[j][i] for i in range(per_kind) for j in range(len(EVAL_KINDS))]
    prompts = []
    for item in ordered:
        ids = render(tokenizer, item.messages)
        if len(ids) + room <= context:
            prompts.append(ids)
        if len(prompts) == n:
            return prompts
    raise SystemExit(f"only {len(prompts)} prompts leave {room} tokens of a {context} context")


def load_for_chat(path: str | None, quantize: str) -> tuple[GPT, Any]:
    """The model as `chatcli chat --quantize` loads it on this CPU: its copies and threads.
    quantize "none" is fp32 throughout, as `--dtype float32` loads it: by default a large
    model would read 16-bit copies in decode."""
    model, tokenizer, _ = load_model(path, device="cpu", dtype="float32", quantize=quantize)
    apply_cpu_plan(model)
    return model, tokenizer


def checkpoint_loader(path: str | None) -> Loader:
    """Loads the checkpoint at path (None: the embedded model) with a --quantize value."""
    return lambda quantize: load_for_chat(path, quantize)


def synthetic_loader(name: str) -> Loader:
    """`chatcli bench --synthetic`'s random model of nanochat's shapes (d4, d12, d20), its
    copies added as the loader adds a checkpoint's (build_model)."""

    def load(quantize: str) -> tuple[GPT, Any]:
        model, tokenizer = synthetic_model(name)
        if quantize != "none":
            model.add_decode_weights(quantize)
        apply_cpu_plan(model)
        return model, tokenizer

    return load


def render(tokenizer: Any, messages: list[dict]) -> list[int]:
    """The chat template's ids for a conversation ending in a user message; a synthetic
    model's byte tokenizer has no template, so its ids are spelled out here (user turns)."""
    if hasattr(tokenizer, "render_for_completion"):
        return tokenizer.render_for_completion(messages)
    ids = [tokenizer.get_bos_token_id()]
    for m in messages:
        if m["role"] == "user":
            ids += [tokenizer.encode_special(USER_START), *tokenizer.encode(m["content"])]
            ids.append(tokenizer.encode_special(USER_END))
        else:  # its text alone: calculator calls and results are the template's
            content = m["content"]
            text = content if isinstance(content, str) else "".join(p["text"] for p in content)
            ids += [tokenizer.encode_special(ASSISTANT_START), *tokenizer.encode(text)]
            ids.append(tokenizer.encode_special(ASSISTANT_END))
    return [*ids, tokenizer.encode_special(ASSISTANT_START)]


def step_name(engine: Engine, model: GPT) -> str:
    """What runs the engine's decode step: our whole-step kernel, or torch's ops with the
    copies' own product (fbgemm's int8 rounds the activations too), or the module's forward."""
    step = engine.decode_step
    if step is None:
        return "forward"
    if step.kernel is not None:
        return step.kernel
    copies = model.decode_weights()
    product = getattr(copies[0], "one_row_kernel", "torch") if copies else "fp32"
    return f"ops, {product.removesuffix(' (native)')}"


def quantized_share(model: GPT) -> float:
    """The share of the matrix weights a compact decode copy holds."""
    stacked = model.stacked_linears()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    held = sum(m.weight.numel() for m in linears if m.decode_weight or id(m) in stacked)
    return held / sum(m.weight.numel() for m in linears)


def greedy_replies(engine: Engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt's greedy reply as a chat turn runs it (the calculator on), up to and
    including <|assistant_end|> or <|bos|>, at most `tokens` tokens."""
    tok = engine.tokenizer
    stops = {tok.encode_special(ASSISTANT_END), tok.encode_special(BOS)}
    replies = []
    for prompt in prompts:
        reply: list[int] = []
        for column, _ in engine.generate(prompt, max_tokens=tokens, temperature=0.0):
            reply.append(column[0])
            if column[0] in stops or len(reply) == tokens:
                break
        replies.append(reply)
    return replies


def batched_replies(engine: Engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt's greedy reply as a server's batch runs it: every prompt a client at once,
    in slots of one scheduler of CPU_ROWS rows (their prompts prefilled in chunks beside the
    others' decode rows), cut as greedy_replies cuts them."""
    batch = Scheduler(engine, rows=min(CPU_ROWS, len(prompts)), slots=len(prompts))
    waiting = list(enumerate(prompts))
    replies: list[list[int]] = [[] for _ in prompts]
    index: dict[int, int] = {}
    while waiting or batch.running:
        while waiting and batch.free_rows:
            i, prompt = waiting.pop(0)
            index[id(batch.join(RowRequest(prompt, tokens, temperature=0.0)))] = i
        for gen, token, _ in batch.step().tokens:
            replies[index[id(gen)]].append(token)
    return [r[:tokens] for r in replies]


@torch.inference_mode()
def forced_logits(engine: Engine, prompt: list[int], reply: list[int]) -> torch.Tensor:
    """The logits (len(reply), V) before each reply token: the prompt prefilled as a turn
    prefills it, then the reply fed a token at a time through the decode step."""
    cache = engine.new_cache(1, len(prompt) + len(reply))
    rows = [engine.forward_prompt(torch.tensor([prompt]), cache)]
    for token in reply[:-1]:
        rows.append(engine.forward_last(torch.tensor([[token]]), cache))
    return torch.cat(rows).float()


def teach(engine: Engine, prompts: list[list[int]], tokens: int) -> Teacher:
    replies = greedy_replies(engine, prompts, tokens)
    logits = [forced_logits(engine, p, r) for p, r in zip(prompts, replies, strict=True)]
    return Teacher(prompts, replies, logits)


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[float, int]:
    """(tokens equal up to each pair's first difference over the longer reply's tokens,
    summed; how many pairs are identical)."""
    same = total = identical = 0
    for a, b in zip(ours, theirs, strict=True):
        total += max(len(a), len(b))
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            same += 1
        identical += a == b
    return same / max(total, 1), identical


def logit_error(reference: torch.Tensor, copy: torch.Tensor) -> dict[str, float]:
    """max_abs, mean_rel, kl and top1 of copy's logits (P, V) against the reference's."""
    diff = (copy - reference).abs()
    scale = reference.std(dim=-1).clamp_min(1e-12)
    log_p = torch.log_softmax(reference, dim=-1)
    log_q = torch.log_softmax(copy, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {
        "max_abs": diff.max().item(),
        "mean_rel": (diff.mean(-1) / scale).mean().item(),
        "kl": kl.mean().item(),
        "top1": (copy.argmax(-1) == reference.argmax(-1)).float().mean().item(),
    }


def compare(
    name: str, era: str, kind: str, engine: Engine, model: GPT, teacher: Teacher, tokens: int
) -> QualityRow:
    """One copy's row: its engine's teacher-forced logits and its own greedy replies."""
    pairs = zip(teacher.prompts, teacher.replies, strict=True)
    copy = torch.cat([forced_logits(engine, p, r) for p, r in pairs])
    error = logit_error(torch.cat(teacher.logits), copy)
    greedy, identical = agreement(greedy_replies(engine, teacher.prompts, tokens), teacher.replies)
    batched, _ = agreement(batched_replies(engine, teacher.prompts, tokens), teacher.replies)
    return QualityRow(
        model=name,
        era=era,
        kind=kind,
        step=step_name(engine, model),
        quantized=quantized_share(model),
        positions=copy.size(0),
        greedy=greedy,
        identical=identical,
        replies=len(teacher.replies),
        batched=batched,
        **error,
    )


def measure(
    load: Loader,
    name: str,
    kinds: tuple[str, ...] = KINDS,
    prompts: int = 8,
    tokens: int = 48,
    ops_too: bool = True,
) -> list[QualityRow]:
    """Every copy in `kinds` of the model `load` gives against its fp32 self (load("none"));
    each copy whose step is our kernel also through torch's ops (ops_too)."""
    model, tokenizer = load("none")
    era = model.arch.era
    engine = Engine(model, tokenizer)
    ids = chat_prompts(tokenizer, prompts, tokens, model.config.sequence_len)
    teacher = teach(engine, ids, tokens)
    del model, engine
    gc.collect()
    rows = []
    for kind in kinds:
        model, tokenizer = load(kind)
        engine = Engine(model, tokenizer)
        rows.append(compare(name, era, kind, engine, model, teacher, tokens))
        if ops_too and engine.decode_step is not None and engine.decode_step.kernel:
            engine.decode_step.use_kernel(False)
            rows.append(compare(name, era, kind, engine, model, teacher, tokens))
        del model, engine
        gc.collect()
    return rows


def default_models(root: Path) -> Iterator[tuple[Loader, str]]:
    """(loader, name) of every era's model and the embedded one: A's and E's reference
    fixtures (where tests/reference.py finds them), and random B, C and D models saved under
    root as the tests make them (no reference checkpoint of those eras exists)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from hf_models import era_checkpoint
    from reference import REFERENCE

    for era in ("A", *RANDOM_ERAS, "E"):
        if era in ("A", "E") and not (REFERENCE / era).is_dir():
            print(
                f"era {era}: no reference fixture at {REFERENCE / era} (set "
                "CHATCLI_REFERENCE_FIXTURES), skipped"
            )
            continue
        label = f"fixture {era}" if era in ("A", "E") else f"random {era}"
        yield checkpoint_loader(str(era_checkpoint(era, root))), label
    yield checkpoint_loader(None), "embedded"


def print_table(rows: list[QualityRow]) -> None:
    head = (
        f"{'model':<14} {'era':>3} {'copy':>4} {'step':<26} {'quant':>5} {'pos':>5} "
        f"{'max|d|':>7} {'mean|d|/sd':>10} {'KL':>8} {'top-1':>6} {'greedy':>6} {'same':>5} "
        f"{'batch':>6}"
    )
    print(head)
    for r in rows:
        print(
            f"{r.model:<14} {r.era:>3} {r.kind:>4} {r.step:<26} {r.quantized:>5.2f} "
            f"{r.positions:>5} {r.max_abs:>7.4f} {r.mean_rel:>10.5f} {r.kl:>8.1e} "
            f"{r.top1:>6.3f} {r.greedy:>6.3f} {r.identical:>2}/{r.replies:<2} {r.batched:>6.3f}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "-m", "--model", action="append", help="a checkpoint (repeatable; default: every era's)"
    )
    parser.add_argument(
        "--synthetic",
        action="append",
        choices=sorted(SYNTHETIC_DEPTHS),
        help="`chatcli bench --synthetic`'s random model of those shapes (repeatable)",
    )
    parser.add_argument("--prompts", type=int, default=8, help="held-out chat prompts (N)")
    parser.add_argument("--tokens", type=int, default=48, help="reply tokens per prompt (M)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="copies: int8,int4")
    parser.add_argument("--no-ops", action="store_true", help="skip the torch-ops rows")
    parser.add_argument(
        "--kernels",
        choices=("on", "off"),
        default="on",
        help="off: as CHATCLI_NATIVE_KERNELS=0 runs (no C compiler): torch's ops and fbgemm",
    )
    parser.add_argument("--json", action="store_true", help="print JSON rows instead")
    args = parser.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not set(kinds) <= set(KINDS):
        raise SystemExit(f"--kinds takes {', '.join(KINDS)}; not {args.kinds!r}")
    if args.kernels == "off":  # read when a kernel is first loaded, which is after this
        os.environ["CHATCLI_NATIVE_KERNELS"] = "0"
    rows = []
    with tempfile.TemporaryDirectory(prefix="chatcli-quality-") as root:
        models = [(checkpoint_loader(m), Path(m).name or m) for m in args.model or []]
        models += [(synthetic_loader(d), f"synthetic {d}") for d in args.synthetic or []]
        try:
            for load, name in models or default_models(Path(root)):
                rows += measure(load, name, kinds, args.prompts, args.tokens, not args.no_ops)
        except ChatcliError as e:  # a checkpoint that does not load: its one-line reason
            raise SystemExit(f"Error: {e}") from None
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print_table(rows)


if __name__ == "__main__":
    main()
