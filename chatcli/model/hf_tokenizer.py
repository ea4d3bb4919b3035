"""nanochat's tokenizer as a transformers fast tokenizer (`tokenizer.json`), and back.

Owns: writing `tokenizer.json` (built with the `tokenizers` library: byte-level BPE over the
same split pattern, vocabulary and special tokens) and `tokenizer_config.json` (special
tokens, chat template); checking that the written tokenizer encodes every string exactly as
ours (`agreement`); and reading a `tokenizer.json` back into our tiktoken-based Tokenizer,
refusing one that tiktoken could not reproduce exactly. Knows nothing about models.

Why the two agree: tiktoken merges, within each piece the split pattern cuts, the adjacent
pair whose joined bytes have the lowest rank, and emits a piece that is a token whole.
`tokenizers`' BPE gives the same with `ignore_merges` (a whole-piece token first) and a merge
list that holds every split of every token into two tokens, ordered by the rank of the token
they make. Reading checks a tokenizer.json for exactly that shape.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import tiktoken

from chatcli.errors import TokenizerError
from chatcli.model.data_files import UnreadableFileError, read_json_file, regular_file, shown
from chatcli.model.special_tokens import ASSISTANT_END, BOS, SPECIAL_TOKENS
from chatcli.model.tokenizer import Tokenizer, encoding_parts

T = TypeVar("T", str, bytes)
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# nanochat's 65,536 tokens with every split as a merge are tens of MB; a file far past that
# is not a tokenizer of a model chatcli runs.
MAX_TOKENIZER_BYTES = 1 << 30


def byte_alphabet() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's choice, which every
    byte-level tokenizer.json uses): printable Latin-1 bytes stand for themselves, the other
    68 take the code points from 256 up, in byte order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return alphabet


_ALPHABET = byte_alphabet()
# str.translate tables both ways: a 65536-token vocabulary converts in C, not a Python loop.
_TO_TEXT = {b: c for b, c in _ALPHABET.items()}
_TO_LATIN1: dict[int, int | str] = {b: "\uffff" for b in range(256)}  # not in the alphabet
_TO_LATIN1.update({ord(c): b for b, c in _ALPHABET.items()})


def _text_of(token: bytes) -> str:
    return token.decode("latin-1").translate(_TO_TEXT)


def _bytes_of(text: str) -> bytes:
    """The bytes a byte-level token stands for; KeyError for a character outside the
    alphabet (latin-1 cannot encode what translate left above U+00FF)."""
    try:
        return text.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        raise KeyError(text) from None


def all_merges(ranks: Mapping[T, int]) -> list[tuple[T, T]]:
    """Every split of every token into two tokens, ordered by the rank of the token made
    (then by the ranks of its parts, which tell the splits of one token apart). Tokens as
    bytes, or as byte-level text (a character a byte: the same splits, the same order)."""
    found = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                found.append((rank, ranks[left], ranks[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


# ---- writing ----------------------------------------------------------------------------------


def build_fast_tokenizer(tokenizer: Tokenizer) -> Any:
    """Our tokenizer as a `tokenizers.Tokenizer` (needs the hf extra)."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as FastTokenizer

    enc = tokenizer.enc
    ranks: dict[bytes, int] = encoding_parts(enc).mergeable_ranks
    vocab = {_text_of(token): rank for token, rank in ranks.items()}
    merges = [(_text_of(a), _text_of(b)) for a, b in all_merges(ranks)]
    fast = FastTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False))
    fast.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(encoding_parts(enc).pat_str), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    fast.decoder = decoders.ByteLevel()
    specials = sorted(encoding_parts(enc).special_tokens.items(), key=lambda kv: kv[1])
    # Added in id order past the vocabulary, each takes its own id (checked below).
    fast.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, _ in specials])
    wrong = [t for t, i in specials if fast.token_to_id(t) != i]
    if wrong:
        raise TokenizerError(
            f"The special tokens {', '.join(wrong)} do not follow the vocabulary in id order; "
            "a fast tokenizer cannot give them the same ids."
        )
    return fast


def tokenizer_config(tokenizer: Tokenizer, template: str, max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: a fast tokenizer with nanochat's special tokens and template.
    No BOS is added by encoding (as ours): the chat template and nanochat's documents start
    with it explicitly."""
    others = [t for t in SPECIAL_TOKENS if t not in (BOS, ASSISTANT_END)]
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": ASSISTANT_END,
        "pad_token": ASSISTANT_END,
        "unk_token": None,
        "extra_special_tokens": others,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": template,
    }


def write_hf_tokenizer(tokenizer: Tokenizer, folder: Path, template: str, max_length: int) -> Any:
    """Write tokenizer.json and tokenizer_config.json; returns the fast tokenizer."""
    fast = build_fast_tokenizer(tokenizer)
    fast.save(str(folder / TOKENIZER_FILE))
    config = tokenizer_config(tokenizer, template, max_length)
    (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return fast


# ---- checking ---------------------------------------------------------------------------------

# Text a tokenizer must split the same way: runs of whitespace and digits, contractions,
# punctuation runs, scripts and emoji, special-token spellings inside text.
PROBES = (
    "Hello, world! How's it going? I'd've thought they'll LL'VE it.",
    "def f(x):\n    return x ** 2  # square\n\n\n\tprint(f(3))\r\n",
    "1234567890 12 123 1,234.56 3.14159 -42 1e-9 0x1F 2026-03-14",
    "    leading spaces, trailing spaces    \n  \n\n\n   \t\t  \u00a0\u3000 end",
    "Ünïcödé: 日本語のテキスト, 中文, 한국어, العربية, עברית, Ελληνικά, русский",
    "emoji 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 and combining e\u0301 a\u0308 \ufeff zero\u200bwidth",
    "!!!??? ... --- *** ``` ~~~ ((())) [[[]]] {{{}}} <<<>>> /// \\\\ ||| ###",
    "<|bos|>text<|user_start|> spelled <|assistant_end|> specials <|python_start|>1+1",
    "a" * 50 + " " * 37 + "\n" * 9 + "7" * 23 + "ab" * 20 + "\t" * 11,
)


def probe_texts(tokenizer: Tokenizer, extra: int = 2000, seed: int = 0) -> list[str]:
    """PROBES, runs of 1-40 of each whitespace character, every token that is whole UTF-8
    text alone, and `extra` random strings made of tokens and probe pieces."""
    texts = list(PROBES)
    for ch in (" ", "\n", "\t", "\r\n", "\u00a0", "0", "9", ".", "'"):
        texts += [ch * n for n in range(1, 41)]
        texts += [f"x{ch * n}y" for n in range(1, 41)]
    pieces = []
    for token in encoding_parts(tokenizer.enc).mergeable_ranks:
        try:
            pieces.append(token.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    texts += pieces
    rng = random.Random(seed)
    stock = pieces + [p[i : i + 7] for p in PROBES for i in range(0, len(p), 7)]
    stock += list(SPECIAL_TOKENS)
    for _ in range(extra):
        texts.append("".join(rng.choice(stock) for _ in range(rng.randint(1, 12))))
    return texts


def agreement(tokenizer: Tokenizer, fast: Any, texts: list[str]) -> list[str]:
    """The texts (at most 5) that `fast` encodes otherwise than ours, special tokens read as
    specials by both (tiktoken's allowed_special="all")."""
    theirs = fast.encode_batch(texts, add_special_tokens=False)
    wrong = []
    for text, enc in zip(texts, theirs, strict=True):
        if enc.ids != tokenizer.enc.encode(text, allowed_special="all"):
            wrong.append(text)
            if len(wrong) == 5:
                break
    return wrong


# ---- reading ----------------------------------------------------------------------------------


def read_hf_tokenizer(path: Path) -> Tokenizer:
    """Our Tokenizer from a byte-level BPE tokenizer.json that tiktoken reproduces exactly
    (the shape this module writes, and transformers' conversion of a tiktoken tokenizer)."""
    try:
        data = read_json_file(regular_file(path), MAX_TOKENIZER_BYTES)
    except UnreadableFileError as e:
        raise TokenizerError(f"{e}: a tokenizer.json is a JSON file.") from None
    except ValueError as e:
        raise TokenizerError(f"Cannot read {path} as JSON ({e}).") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise TokenizerError(f"{path} is not a tokenizers tokenizer.json (no model).")
    model = data["model"]
    if model.get("type") != "BPE":
        raise TokenizerError(
            f"{path}: a {shown(model.get('type'))} model; nanochat's is byte-level BPE."
        )
    pattern = _split_pattern(data, path)
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not all(
        isinstance(k, str) and isinstance(v, int) for k, v in vocab.items()
    ):
        raise TokenizerError(f"{path}: the BPE vocab is not a map of strings to ids.")
    try:
        ranks = {_bytes_of(text): rank for text, rank in vocab.items()}
    except KeyError:
        raise TokenizerError(f"{path}: the vocab is not byte-level (GPT-2's alphabet).") from None
    added = data.get("added_tokens") or []
    if not isinstance(added, list):
        raise TokenizerError(
            f"{path}: added_tokens is {shown(added)}, not a list of tokens; nanochat's special "
            "tokens are listed there."
        )
    specials = {
        t["content"]: t["id"]
        for t in added
        if isinstance(t, dict)
        and isinstance(t.get("content"), str)
        and isinstance(t.get("id"), int)
        and not isinstance(t.get("id"), bool)
    }
    _check_merges(model, vocab, path)
    ids = sorted([*ranks.values(), *specials.values()])
    if ids != list(range(len(ids))):
        raise TokenizerError(f"{path}: token ids are not 0..{len(ids) - 1}, each once.")
    try:
        enc = tiktoken.Encoding(
            name=f"hf:{path.parent.name}",
            pat_str=pattern,
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
    except Exception as e:  # tiktoken validates the pattern and ranks, raising several types
        raise TokenizerError(f"{path} cannot be read as a tiktoken tokenizer: {e}") from e
    return Tokenizer(enc)


_PRE = "nanochat's are a Sequence of a regex Split then ByteLevel"


def _split_pattern(data: dict[str, Any], path: Path) -> str:
    if data.get("normalizer") is not None:
        raise TokenizerError(f"{path}: has a normalizer; nanochat's tokenizer has none.")
    pre = data.get("pre_tokenizer") or {}
    if not isinstance(pre, dict):
        raise TokenizerError(f"{path}: pre_tokenizer is {shown(pre)}, not an object; {_PRE}.")
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        raise TokenizerError(
            f"{path}: the pre_tokenizer's pretokenizers are {shown(steps)}, not a list of "
            f"objects; {_PRE}."
        )
    kinds = [s.get("type") for s in steps]
    if kinds != ["Split", "ByteLevel"]:
        raise TokenizerError(f"{path}: pre-tokenizers {shown(kinds)}; {_PRE}.")
    split, byte_level = steps
    pattern = split.get("pattern")
    regex = pattern.get("Regex") if isinstance(pattern, dict) else None
    ok = (
        isinstance(regex, str)
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and not byte_level.get("add_prefix_space")
        and byte_level.get("use_regex", True) is False
    )
    if not ok:
        raise TokenizerError(
            f"{path}: the Split/ByteLevel settings are not nanochat's (an isolated regex "
            "split, then bytes with no prefix space and no second regex)."
        )
    return regex


def _check_merges(model: dict[str, Any], vocab: dict[str, int], path: Path) -> None:
    """Compared as byte-level text, as the file holds them: [left, right] pairs (or, in older
    files, "left right" strings)."""
    merges = model.get("merges")
    if not isinstance(merges, list):
        raise TokenizerError(f"{path}: the BPE model has no merges list.")
    if merges and isinstance(merges[0], str):
        merges = [m.split(" ") if isinstance(m, str) else m for m in merges]
    expected = [list(pair) for pair in all_merges(vocab)]
    if not model.get("ignore_merges") or merges != expected:
        raise TokenizerError(
            f"{path}: its BPE merges are not every split of every token in rank order (with "
            "ignore_merges), so tiktoken could not reproduce its encoding exactly. chatcli "
            "reads tokenizers converted from nanochat's tokenizer.pkl."
        )
