"""A nanochat model's shape and era as a transformers `config.json`, and back.

Owns: the two configs chatcli writes and reads. Era A is transformers' own `nanochat`
(`NanoChatForCausalLM`, no remote code); every other era is `chatcli_nanochat`, computed by
the modeling file chatcli ships in the export (hf_modeling/), which learns every constant of
its era from this config. Reading checks that a config describes exactly what chatcli's GPT
computes, and refuses anything else with a message saying what differs. Knows nothing about
weights, tokenizers or files other than the one config.

Windows: nanochat's window w lets query i see keys i-w..i (w+1 keys); transformers' and the
serving engines' `sliding_window` counts the keys, so it is w+1. The long window equals the
training context (sequence_len, = max_position_embeddings), so within the context a long
layer is plain causal attention: it is written as "full_attention".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from chatcli.errors import CheckpointError
from chatcli.model.checkpoint_checks import CONFIG_MAX
from chatcli.model.data_files import shown
from chatcli.model.gpt import (
    ERAS,
    SMEAR_CHANNELS,
    SOFTCAP,
    Architecture,
    GPTConfig,
    has_value_embed,
    window_sizes,
)
from chatcli.model.softcap import softcap_problem

NATIVE_MODEL_TYPE = "nanochat"  # transformers' own, era A
OUR_MODEL_TYPE = "chatcli_nanochat"  # eras B-E, through our modeling file
# The remote code an export of eras B-E carries (hf_modeling/), config first.
CONFIG_CODE, MODELING_CODE = "configuration_chatcli_nanochat", "modeling_chatcli_nanochat"
CODE_FILES = (f"{CONFIG_CODE}.py", f"{MODELING_CODE}.py")
AUTO_MAP = {
    "AutoConfig": f"{CONFIG_CODE}.ChatcliNanoChatConfig",
    "AutoModel": f"{MODELING_CODE}.ChatcliNanoChatModel",
    "AutoModelForCausalLM": f"{MODELING_CODE}.ChatcliNanoChatForCausalLM",
}
# torch's default RMSNorm eps for fp32 (torch.finfo(torch.float32).eps): what nanochat's
# F.rms_norm uses. transformers' NanoChatConfig defaults to 1e-6, so it is written out.
FP32_EPS = 2.0**-23
# The fields of ours that fix the computation: reading compares them with the era's.
_ARCHITECTURE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rope_theta",
    "rope_tables_bf16",
    "qk_scale",
    "residual_lambdas",
    "layer_windows",
    "layer_types",
    "sliding_window",
    "value_embed_layers",
    "value_gate_channels",
    "value_gate_scale",
    "smear_channels",
    "backout_layer",
)


# The config's sizes, by the name nanochat's meta gives each (checkpoint_checks' limits).
_NANOCHAT_NAMES = {
    "max_position_embeddings": "sequence_len",
    "vocab_size": "vocab_size",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "num_key_value_heads": "n_kv_head",
    "hidden_size": "n_embd",
}


@dataclass(frozen=True)
class TokenIds:
    """The special ids a config and a generation config name."""

    bos: int
    eos: int  # <|assistant_end|>: the end of a chat turn
    pad: int


@dataclass(frozen=True)
class HFModel:
    """What a transformers config.json says about a nanochat model."""

    config: GPTConfig
    arch: Architecture
    native: bool  # transformers' own nanochat (era A), else ours


def uses_native_class(arch: Architecture) -> bool:
    """Era A is transformers' NanoChatForCausalLM exactly (up to its fp32 rotary tables,
    which nanochat rounds to bf16; see docs/huggingface.md); every later era needs ours."""
    return arch.era == "A"


def hf_config(
    config: GPTConfig,
    arch: Architecture,
    ids: TokenIds,
    dtype: str,
    native: bool | None = None,
) -> dict[str, Any]:
    """The config.json of an export. native: write transformers' own nanochat (era A only;
    default: for era A)."""
    native = uses_native_class(arch) if native is None else native
    if native and not uses_native_class(arch):
        raise CheckpointError(
            f"Era {arch.era} cannot be written as transformers' own NanoChatForCausalLM: it "
            "has no " + _extras_of(arch) + "."
        )
    common = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": 4 * config.n_embd,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "max_position_embeddings": config.sequence_len,
        "final_logit_softcapping": arch.softcap,
        "bos_token_id": ids.bos,
        "eos_token_id": ids.eos,
        # No pad embedding: a padding_idx would freeze that token's row in fine-tuning, and
        # every nanochat token is a real one. Batched generation pads with generation_config's.
        "pad_token_id": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": dtype,
    }
    if native:
        return {
            "architectures": ["NanoChatForCausalLM"],
            "model_type": NATIVE_MODEL_TYPE,
            **common,
            "hidden_act": "relu2",
            "rms_norm_eps": FP32_EPS,
            "rope_parameters": {"rope_type": "default", "rope_theta": arch.rope_base},
            "attention_bias": False,
            "attention_dropout": 0.0,
        }
    windows = window_sizes(config, arch)
    long = config.sequence_len
    short = sorted({w for w in windows if w != long})
    L = config.n_layer
    return {
        "architectures": ["ChatcliNanoChatForCausalLM"],
        "model_type": OUR_MODEL_TYPE,
        "auto_map": dict(AUTO_MAP),
        "nanochat_era": arch.era,
        **common,
        "head_dim": config.head_dim,
        "rope_theta": arch.rope_base,
        "rope_tables_bf16": arch.rope_tables_bf16,
        "qk_scale": arch.qk_scale,
        "residual_lambdas": arch.lambdas,
        "layer_windows": windows,
        "layer_types": ["full_attention" if w == long else "sliding_attention" for w in windows],
        "sliding_window": short[0] + 1 if short else None,
        "value_embed_layers": [i for i in range(L) if has_value_embed(i, L)]
        if arch.ve_gate_channels
        else [],
        "value_gate_channels": arch.ve_gate_channels,
        "value_gate_scale": arch.ve_gate_scale,
        "smear_channels": SMEAR_CHANNELS if arch.smear else 0,
        "backout_layer": L // 2 if arch.backout else None,
    }


def _extras_of(arch: Architecture) -> str:
    parts = []
    if arch.lambdas:
        parts.append("residual lambdas")
    if arch.windows:
        parts.append("sliding windows")
    if arch.ve_gate_channels:
        parts.append("value embeddings")
    if arch.smear:
        parts.append("smear")
    if arch.backout:
        parts.append("backout")
    return ", ".join(parts) or "nothing"


# ---- reading ------------------------------------------------------------------------------


def read_hf_config(cfg: dict[str, Any], where: str, softcap: float | None = None) -> HFModel:
    """The nanochat model a config.json describes. `where` names the file in errors; softcap
    (checked by the caller) stands in for the config's final_logit_softcapping."""
    model_type = cfg.get("model_type")
    if model_type == NATIVE_MODEL_TYPE:
        return _read_native(cfg, where, softcap)
    if model_type == OUR_MODEL_TYPE:
        return _read_ours(cfg, where, softcap)
    raise CheckpointError(
        f"{where} has model_type {shown(model_type)}; chatcli runs {NATIVE_MODEL_TYPE!r} "
        f"(transformers' nanochat) and {OUR_MODEL_TYPE!r} (chatcli's export of later eras)."
    )


def _int(cfg: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    """A positive whole number: a string, a bool or 4.0 is the wrong type, said as such."""
    value = cfg.get(key)
    if value is None and default is not None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(
            f"{where}: {key} must be a whole number written without quotes, not "
            f"{shown(value)} ({_json_type(value)})."
        )
    most = CONFIG_MAX[_NANOCHAT_NAMES[key]]
    if not 1 <= value <= most:
        raise CheckpointError(
            f"{where}: {key} is {value:,}, outside 1 to {most:,}: no nanochat model has that. "
            "The config is damaged or belongs to something else."
        )
    return value


def _json_type(value: object) -> str:
    """The JSON name of a value's type, as the file's writer sees it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    names = {str: "a string", int: "a whole number", float: "a fraction", list: "a list"}
    return names.get(type(value), "an object")


def _shape(cfg: dict[str, Any], where: str) -> GPTConfig:
    C, H = _int(cfg, "hidden_size", where), _int(cfg, "num_attention_heads", where)
    Hkv = _int(cfg, "num_key_value_heads", where, default=H)
    config = GPTConfig(
        sequence_len=_int(cfg, "max_position_embeddings", where),
        vocab_size=_int(cfg, "vocab_size", where),
        n_layer=_int(cfg, "num_hidden_layers", where),
        n_head=H,
        n_kv_head=Hkv,
        n_embd=C,
    )
    if C % H or H % Hkv:
        raise CheckpointError(
            f"{where}: hidden_size ({C}) must divide by num_attention_heads ({H}) and that by "
            f"num_key_value_heads ({Hkv})."
        )
    return config


def _softcap(cfg: dict[str, Any], where: str, override: float | None) -> float:
    if override is not None:
        return float(override)
    cap = cfg.get("final_logit_softcapping", SOFTCAP)
    problem = softcap_problem(cap)
    if problem is not None:
        raise CheckpointError(
            f"{where}: final_logit_softcapping {problem}. Set it to the model's cap, or pass "
            "--softcap."
        )
    return float(cap)


def _read_native(cfg: dict[str, Any], where: str, softcap: float | None) -> HFModel:
    config = _shape(cfg, where)
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{where}: rope_parameters is {shown(rope)}, not an object.")
    theta = rope.get("rope_theta", cfg.get("rope_theta", ERAS["A"].rope_base))
    wanted = {
        "hidden_act": ("relu2", cfg.get("hidden_act", "relu2")),
        "attention_bias": (False, cfg.get("attention_bias", False)),
        "tie_word_embeddings": (False, cfg.get("tie_word_embeddings", False)),
        "intermediate_size": (4 * config.n_embd, cfg.get("intermediate_size")),
        "head_dim": (config.head_dim, cfg.get("head_dim") or config.head_dim),
        "rope_parameters.rope_type": ("default", rope.get("rope_type", "default")),
        "rope_parameters.rope_theta": (ERAS["A"].rope_base, theta),
    }
    _refuse_differences(wanted, where, "transformers' nanochat as nanochat trained it")
    arch = replace(
        ERAS["A"], softcap=_softcap(cfg, where, softcap), padded_vocab_size=config.vocab_size
    )
    return HFModel(config, arch, native=True)


def _read_ours(cfg: dict[str, Any], where: str, softcap: float | None) -> HFModel:
    era = cfg.get("nanochat_era")
    if not isinstance(era, str) or era not in ERAS:
        raise CheckpointError(
            f"{where}: nanochat_era is {shown(era)}; expected one of {', '.join(ERAS)}. Export the "
            "model again with chatcli export."
        )
    shape = _shape(cfg, where)
    arch = replace(
        ERAS[era], softcap=_softcap(cfg, where, softcap), padded_vocab_size=shape.vocab_size
    )
    pattern = _window_pattern(cfg.get("layer_windows"), shape, arch, where)
    config = replace(shape, window_pattern=pattern)
    ids = TokenIds(0, 0, 0)  # not compared
    expected = hf_config(config, arch, ids, "float32", native=False)
    wanted = {k: (expected[k], cfg.get(k)) for k in _ARCHITECTURE_FIELDS}
    _refuse_differences(wanted, where, f"nanochat's era {era}")
    return HFModel(config, arch, native=False)


def _window_pattern(windows: object, shape: GPTConfig, arch: Architecture, where: str) -> str:
    """The S/L pattern whose tiling gives these per-layer windows (checked by the caller,
    which compares the windows it implies with the file's)."""
    if not arch.windows:
        return "L"
    if not isinstance(windows, list) or len(windows) != shape.n_layer:
        raise CheckpointError(
            f"{where}: layer_windows must list one window per layer ({shape.n_layer})."
        )
    short = arch.short_window(shape.sequence_len)
    return "".join("S" if w == short else "L" for w in windows)


def _refuse_differences(wanted: dict[str, tuple[object, object]], where: str, what: str) -> None:
    bad = [
        f"{k} is {shown(got)} (expected {want!r})"
        for k, (want, got) in wanted.items()
        if not _same(want, got)
    ]
    if bad:
        raise CheckpointError(
            f"{where} does not describe {what}, which is what chatcli runs: "
            + "; ".join(bad[:4])
            + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else "")
            + "."
        )


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return (
            isinstance(a, (int, float))
            and isinstance(b, (int, float))
            and not isinstance(b, bool)
            and math.isclose(a, b, rel_tol=0, abs_tol=0)
        )
    return a == b
