"""The nanochat GPT, one implementation for every checkpoint era (A-E).

Owns: the network, its era-dependent variants, the full-sequence forward (the ground truth),
the cached forward that the engine drives, and a slow uncached `generate` kept as the reference
the fast path is tested against; its attention is attention.py's, its matrices linear.py's.
Knows nothing about files (see checkpoint.py) or text.

The eras differ only in which weights exist and a few constants; `Architecture` holds those
constants and `infer_architecture` derives them from the weights and meta, never from names.
See ../shared/docs/nanochat-format.md for the table this follows.

Shapes: B batch, T time (this call), H query heads, Hkv key/value heads, D head dim,
C n_embd, V vocab (padded to a multiple of 64 in recent checkpoints; logits are sliced back).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from chatcli.model.attention import attend, attend_shared
from chatcli.model.kv_cache import KVCache, SharedPrefixCache
from chatcli.model.linear import Linear, embedding, through_copy
from chatcli.model.quantize import DecodeWeight, make_decode_weight, supports
from chatcli.model.sampling import sample_next_token
from chatcli.model.softcap import SOFTCAP, checked_softcap

SMEAR_CHANNELS = 24


@dataclass(frozen=True)
class GPTConfig:
    """The `model_config` of a checkpoint's meta file."""

    sequence_len: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    window_pattern: str = "L"

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclass(frozen=True)
class Architecture:
    """What distinguishes one era's model from another's (nothing of it is saved on disk)."""

    era: str
    rope_base: float
    rope_tables_bf16: bool  # eras A-C stored cos/sin as bf16, even when computing in fp32
    qk_scale: float | None  # multiplies q and k after the qk-norm (D, E)
    lambdas: bool  # resid_lambdas / x0_lambdas (B+)
    windows: bool  # sliding windows from window_pattern (B+)
    ve_gate_channels: int  # 0: no value embeddings; else gate input width (C: 32, D+: 12)
    ve_gate_scale: float  # gate = scale * sigmoid(...)
    smear: bool  # E
    backout: bool  # E
    softcap: float = SOFTCAP
    padded_vocab_size: int = 0  # rows of wte / lm_head as stored

    def short_window(self, sequence_len: int) -> int:
        """The 'S' window of window_pattern, in tokens (the 'L' window is sequence_len)."""
        if self.era in ("B", "C"):
            return sequence_len // 2
        divisor = 3 if self.era == "D" else 4
        return math.ceil(sequence_len / divisor / 128) * 128


ERAS: dict[str, Architecture] = {
    "A": Architecture("A", 10000.0, True, None, False, False, 0, 0.0, False, False),
    "B": Architecture("B", 10000.0, True, None, True, True, 0, 0.0, False, False),
    "C": Architecture("C", 10000.0, True, None, True, True, 32, 2.0, False, False),
    "D": Architecture("D", 100000.0, False, 1.15, True, True, 12, 3.0, False, False),
    "E": Architecture("E", 100000.0, False, 1.2, True, True, 12, 3.0, True, True),
}


def has_value_embed(layer: int, n_layer: int) -> bool:
    # Alternating layers carry a value embedding, always including the last one.
    return layer % 2 == (n_layer - 1) % 2


def infer_era(state_dict: Mapping[str, torch.Tensor], config: GPTConfig) -> str:
    """The era from which weights exist and their shapes (see the format document)."""
    if "smear_gate.weight" in state_dict:
        return "E"
    gates = [k for k in state_dict if k.endswith("attn.ve_gate.weight")]
    if gates:
        width = state_dict[gates[0]].shape[-1]
        return "D" if width == 12 else "C"
    if "resid_lambdas" in state_dict:
        return "B"
    return "A"


def infer_architecture(
    state_dict: Mapping[str, torch.Tensor], config: GPTConfig, softcap: float | None = None
) -> Architecture:
    arch = ERAS[infer_era(state_dict, config)]
    padded = state_dict["transformer.wte.weight"].shape[0]
    return replace(arch, softcap=checked_softcap(softcap), padded_vocab_size=padded)


def norm(x: torch.Tensor) -> torch.Tensor:
    # RMSNorm without a weight; eps is torch's default for the dtype, as in the reference.
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, T, H, D) by per-position angles; cos/sin are (1, T, 1, D/2). Halves layout."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


def window_sizes(config: GPTConfig, arch: Architecture) -> list[int]:
    """Per-layer attention window w (query i sees keys i-w..i); the last layer is always long."""
    long = config.sequence_len
    if not arch.windows:
        return [long] * config.n_layer
    pattern = (config.window_pattern or "L").upper()
    short = arch.short_window(config.sequence_len)
    sizes = [short if pattern[i % len(pattern)] == "S" else long for i in range(config.n_layer)]
    sizes[-1] = long
    return sizes


class Attention(nn.Module):
    def __init__(self, config: GPTConfig, arch: Architecture, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head, self.n_kv_head, self.head_dim = (
            config.n_head,
            config.n_kv_head,
            config.head_dim,
        )
        C = config.n_embd
        self.c_q = Linear(C, self.n_head * self.head_dim, bias=False)
        self.c_k = Linear(C, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = Linear(C, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = Linear(C, C, bias=False)
        # The compact decode copy of c_q, c_k and c_v stacked (GPT.add_decode_weights): one
        # product instead of three.
        self.qkv_decode_weight: DecodeWeight | None = None
        self.qkv_sizes = [self.n_head * self.head_dim] + [self.n_kv_head * self.head_dim] * 2
        self.ve_channels = arch.ve_gate_channels if has_value_embed(layer, config.n_layer) else 0
        self.ve_scale = arch.ve_gate_scale
        self.qk_scale = arch.qk_scale
        if self.ve_channels:
            self.ve_gate = Linear(self.ve_channels, self.n_kv_head, bias=False)

    def forward(
        self,
        h: torch.Tensor,
        ve: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        window: int,
        kv_cache: KVCache | SharedPrefixCache | None,
        pos: int,
    ) -> torch.Tensor:
        B, T, _ = h.shape
        qkv = None if self.qkv_decode_weight is None else through_copy(self.qkv_decode_weight, h)
        if qkv is None:
            q, k, v = self.c_q(h), self.c_k(h), self.c_v(h)
        else:
            q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim)
        k = k.view(B, T, self.n_kv_head, self.head_dim)
        v = v.view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:
            gate = self.ve_scale * torch.sigmoid(self.ve_gate(h[..., : self.ve_channels]))
            v = v + gate.unsqueeze(-1) * ve.view(B, T, self.n_kv_head, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # rope BEFORE the qk-norm
        q, k = norm(q), norm(k)
        if self.qk_scale is not None:
            q, k = q * self.qk_scale, k * self.qk_scale

        if isinstance(kv_cache, SharedPrefixCache):
            return self.c_proj(
                self._attend_shared(q, k, v, window, kv_cache, pos).reshape(B, T, -1)
            )
        if kv_cache is not None:
            k_cache, v_cache = kv_cache.get_layer_cache(self.layer)  # (B, Tmax, Hkv, D)
            k_cache[:, pos : pos + T] = k
            v_cache[:, pos : pos + T] = v
            # Only keys some query of this call can see: the window bounds the start.
            start = max(0, pos - window)
            k, v = k_cache[:, start : pos + T], v_cache[:, start : pos + T]
        else:
            start = 0
        y = attend(q, k, v, q_pos=pos, k_pos=start, window=window)
        return self.c_proj(y.reshape(B, T, -1))

    def _attend_shared(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int,
        cache: SharedPrefixCache,
        pos: int,
    ) -> torch.Tensor:
        if q.size(1) != 1:
            raise ValueError("a shared-prefix cache decodes one token per row at a time")
        P = cache.prefix_len
        pk, pv = cache.prefix.get_layer_cache(self.layer)  # (1, Tp, Hkv, D)
        sk, sv = cache.suffix.get_layer_cache(self.layer)  # (N, Ts, Hkv, D)
        s = pos - P  # this token's index in the suffix
        sk[:, s : s + 1] = k
        sv[:, s : s + 1] = v
        start = max(0, pos - window)  # the window may cut into the prefix, or the suffix
        return attend_shared(
            q,
            pk[:, min(start, P) : P],
            pv[:, min(start, P) : P],
            sk[:, max(0, start - P) : s + 1],
            sv[:, max(0, start - P) : s + 1],
        )


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config: GPTConfig, arch: Architecture, layer: int) -> None:
        super().__init__()
        self.attn = Attention(config, arch, layer)
        self.mlp = MLP(config)


class GPT(nn.Module):
    """A nanochat GPT of any era. `model(ids)` gives float32 logits (B, T, vocab_size)."""

    supports_shared_prefix = True  # forward accepts a SharedPrefixCache for sample rows

    def __init__(self, config: GPTConfig, arch: Architecture | None = None) -> None:
        super().__init__()
        arch = arch or ERAS["E"]
        if not arch.padded_vocab_size:
            arch = replace(arch, padded_vocab_size=config.vocab_size)
        self.config, self.arch = config, arch
        V, C, L = arch.padded_vocab_size, config.n_embd, config.n_layer
        self.transformer = nn.ModuleDict(
            {
                "wte": embedding(V, C),
                "h": nn.ModuleList([Block(config, arch, i) for i in range(L)]),
            }
        )
        self.lm_head = Linear(C, V, bias=False)
        if arch.lambdas:
            self.resid_lambdas = nn.Parameter(torch.ones(L))
            self.x0_lambdas = nn.Parameter(torch.zeros(L))
        if arch.ve_gate_channels:
            kv_dim = config.n_kv_head * config.head_dim
            self.value_embeds = nn.ModuleDict(
                {str(i): embedding(V, kv_dim) for i in range(L) if has_value_embed(i, L)}
            )
        if arch.smear:
            self.smear_gate = Linear(SMEAR_CHANNELS, 1, bias=False)
            self.smear_lambda = nn.Parameter(torch.zeros(1))
        if arch.backout:
            self.backout_lambda = nn.Parameter(torch.zeros(1))
        self.windows = window_sizes(config, arch)
        # Like the reference, rotary tables cover 10x the training context.
        self.max_positions = 10 * config.sequence_len
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    # ---- set-up ---------------------------------------------------------------------------

    def init_rotary(self) -> None:
        """(Re)compute the rotary tables on the model's device, in the era's table dtype."""
        hd, device = self.config.head_dim, self.lm_head.weight.device
        # 1 / base**(c/hd), not base**(-c/hd): the two differ in the last bit for about a
        # third of the channels, and eras A-C round the tables to bf16, where such a bit can
        # tip an entry to the next bf16 step (head_dim 128 from position 104 on).
        inv_freq = 1.0 / (
            self.arch.rope_base ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd)
        )
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        angles = torch.outer(t, inv_freq)
        cos, sin = angles.cos(), angles.sin()
        if self.arch.rope_tables_bf16:
            cos, sin = cos.bfloat16(), sin.bfloat16()
        compute = self.compute_dtype
        # Eras A-C round to bf16 and then compute in the weights' dtype (fp32 on CPU).
        self.cos = cos.to(compute)[None, :, None, :]
        self.sin = sin.to(compute)[None, :, None, :]

    def add_decode_weights(self, kind: str = "bfloat16") -> None:
        """Keep a compact copy (quantize.QUANTIZE_KINDS) of every large matrix (or q/k/v
        stack) for batch-1 decode. One the format cannot take (int4 needs whole groups)
        keeps fp32.

        c_q, c_k and c_v share one copy of the three stacked (the attention's
        qkv_decode_weight). No format's scale spans output rows (int8's and int4's are per
        row or group; fp16 through torch.mv divides the input they share), so the stacked
        product equals the three apart (a test holds it to that) in one kernel call."""
        self.drop_decode_weights()
        for module in self.modules():
            if isinstance(module, Attention):
                parts = (module.c_q, module.c_k, module.c_v)
                qkv = torch.cat([m.weight.detach() for m in parts])  # fp32, freed right after
                if qkv.numel() >= 4096 and supports(qkv, kind):
                    module.qkv_decode_weight = make_decode_weight(qkv, kind)
                del qkv
        stacked = self.stacked_linears()
        for module in self.modules():
            if isinstance(module, Linear) and id(module) not in stacked:
                large = module.weight.numel() >= 4096
                if large and supports(module.weight, kind):
                    module.decode_weight = make_decode_weight(module.weight, kind)

    def stacked_linears(self) -> set[int]:
        """ids of the Linear modules whose decode reads their attention's stacked copy."""
        return {
            id(m)
            for a in self.modules()
            if isinstance(a, Attention) and a.qkv_decode_weight is not None
            for m in (a.c_q, a.c_k, a.c_v)
        }

    def drop_decode_weights(self) -> None:
        """Back to reading the fp32 weights everywhere."""
        for module, name in self._copy_slots():
            setattr(module, name, None)

    @contextlib.contextmanager
    def decode_weights_set_aside(self) -> Iterator[None]:
        """Read the fp32 weights everywhere inside the block; the copies come back after it
        (a few attribute writes, no copy made again)."""
        kept = [(m, name, getattr(m, name)) for m, name in self._copy_slots()]
        self.drop_decode_weights()
        try:
            yield
        finally:
            for module, name, copy in kept:
                setattr(module, name, copy)

    def _copy_slots(self) -> Iterator[tuple[nn.Module, str]]:
        """(module, attribute) of every place a compact decode copy may be kept."""
        for module in self.modules():
            if isinstance(module, Linear):
                yield module, "decode_weight"
            elif isinstance(module, Attention):
                yield module, "qkv_decode_weight"

    def decode_weights(self) -> list[DecodeWeight]:
        """Every compact decode copy the model keeps."""
        found = (getattr(module, name) for module, name in self._copy_slots())
        return [w for w in found if w is not None]

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activations' dtype: the lm_head's, whatever the compact decode copies are.
        The embedding tables may be narrower (a checkpoint's bf16 tables stay bf16 on the
        CPU: is_embedding_table); their rows widen to this dtype as they are looked up."""
        return self.lm_head.weight.dtype

    def look_up(self, table: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
        """Rows of an embedding table in the compute dtype (exact: bf16 and fp16 widen to
        fp32 without rounding, so a narrow table gives what its widened copy would)."""
        rows = table(idx)
        compute = self.compute_dtype
        return rows if rows.dtype == compute else rows.to(compute)

    def get_device(self) -> torch.device:
        return self.lm_head.weight.device

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---- forward ---------------------------------------------------------------------------

    def embed(self, idx: torch.Tensor, prev_token: torch.Tensor | None) -> torch.Tensor:
        """norm(wte(idx)), smeared with the previous token's embedding in era E.

        prev_token (B,) is the token before idx[:, 0] when idx continues a cached sequence;
        the full-sequence forward is the truth, so that first position is smeared too.
        """
        x = norm(self.look_up(self.transformer.wte, idx))
        if not self.arch.smear:
            return x
        if prev_token is not None:
            prev = norm(self.look_up(self.transformer.wte, prev_token)).unsqueeze(1)
            before = torch.cat([prev, x[:, :-1]], dim=1)
            gate = self.smear_lambda * torch.sigmoid(self.smear_gate(x[..., :SMEAR_CHANNELS]))
            return x + gate * before
        if x.size(1) == 1:
            return x
        gate = self.smear_lambda * torch.sigmoid(self.smear_gate(x[:, 1:, :SMEAR_CHANNELS]))
        return torch.cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1)

    def forward(
        self,
        idx: torch.Tensor,
        kv_cache: KVCache | SharedPrefixCache | None = None,
        *,
        last_only: bool = False,
    ) -> torch.Tensor:
        """idx (B, T) -> float32 logits (B, T, vocab_size), or (B, 1, vocab_size) if last_only.

        With a kv_cache, idx continues the cached sequence: its K/V are written at the cache's
        position, which advances by T after the last layer. last_only skips the vocabulary
        projection of all but the last position: a prefill only needs that one.
        """
        T = idx.size(1)
        pos = kv_cache.get_pos() if kv_cache is not None else 0
        if pos + T > self.max_positions:
            raise ValueError(f"position {pos + T} exceeds the model's {self.max_positions}")
        if self.cos.numel() == 0:
            self.init_rotary()
        cos, sin = self.cos[:, pos : pos + T], self.sin[:, pos : pos + T]
        prev = kv_cache.prev_token if kv_cache is not None and pos > 0 else None

        x = self.embed(idx, prev)
        x0 = x
        saved = None
        for i, block in enumerate(self.transformer.h):
            if self.arch.lambdas:
                x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.look_up(self.value_embeds[str(i)], idx) if block.attn.ve_channels else None
            x = x + block.attn(norm(x), ve, cos, sin, self.windows[i], kv_cache, pos)
            x = x + block.mlp(norm(x))
            if self.arch.backout and i == self.config.n_layer // 2:
                saved = x
        if saved is not None:
            x = x - self.backout_lambda * saved
        if last_only:
            x = x[:, -1:]
        x = norm(x)
        if kv_cache is not None:
            kv_cache.prev_token = idx[:, -1]
            kv_cache.advance(T)
        logits = self.lm_head(x)[..., : self.config.vocab_size].float()
        # Softcap in place: over a large vocabulary, fresh temporaries each step cost more
        # than the arithmetic (page faults on MB-sized buffers).
        cap = self.arch.softcap
        if logits.requires_grad:  # training: autograd needs tanh's output untouched
            return cap * torch.tanh(logits / cap)
        return logits.div_(cap).tanh_().mul_(cap)

    # ---- reference generation ----------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self,
        tokens: list[int],
        max_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int = 42,
    ) -> Iterator[int]:
        """Slow and obvious: the full sequence is re-run for every token, no cache.

        Kept as the reference that the engine's cached decode is tested against.
        """
        device = self.get_device()
        rng = torch.Generator(device=device)
        rng.manual_seed(seed)
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        for _ in range(max_tokens):
            if ids.size(1) >= self.max_positions:
                return
            logits = self.forward(ids)[:, -1, :]
            next_id = sample_next_token(logits, rng, temperature, top_k)
            ids = torch.cat([ids, next_id], dim=1)
            yield int(next_id.item())
