"""nanochat GPTs of every era for transformers: the modeling file chatcli ships in an export.

`chatcli export` copies this file and its config's beside config.json (`auto_map`), and
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` runs them. It computes
what chatcli's GPT (and nanochat's own full-sequence forward) computes, for every era: the
config says which parts the era has (residual lambdas, sliding windows, value embeddings and
their gates, the q/k scale, smear, backout, bf16-rounded rotary tables) and holds every
constant. It is written on transformers' public extension points only: PreTrainedConfig,
PreTrainedModel with GenerationMixin, its Cache classes and mask helpers, and the attention
interface (ALL_ATTENTION_FUNCTIONS), so that generate(), every attn_implementation and the
Transformers backends of serving engines drive it. It runs on transformers 5.19 and later
(the cache argument changed its name in 5.24: both are taken).

What a serving engine's backend (which runs the model without its cache, one flat batch of
sequences, swapping in its own attention) can serve: eras A-D. Era E's smear mixes each
token's embedding with the previous token's, which such a backend does not pass when it
decodes; so era E refuses a continuation without `smear_prev_ids` rather than computing
something else. Value embeddings (C-E) need the token ids (not input embeddings) and a
tensor-parallel size of 1.

These two files stand alone (they import torch and transformers, nothing of chatcli's).
"""

import copy
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    create_causal_mask,
    create_sliding_window_causal_mask,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel

from .configuration_chatcli_nanochat import ChatcliNanoChatConfig

# transformers 5.24 renamed `past_key_values` to `cache` (outputs and mask helpers alike).
_CACHE_FIELD = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
)
_MASK_CACHE_ARG = (
    "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
)


def norm(x: torch.Tensor) -> torch.Tensor:
    # RMSNorm without a weight, eps torch's default for the dtype: nanochat's exactly.
    return F.rms_norm(x, (x.size(-1),))


def rotary(config: ChatcliNanoChatConfig, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos, sin (B, T, 1, head_dim/2) at each position, as nanochat's tables hold them:
    fp32 angles, rounded to bf16 in eras A-C, then in the compute dtype."""
    hd = config.head_dim
    device = position_ids.device
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd)
    )
    angles = position_ids[..., None].float() * inv_freq
    cos, sin = angles.cos(), angles.sin()
    if config.rope_tables_bf16:
        cos, sin = cos.bfloat16(), sin.bfloat16()
    return cos.to(dtype).unsqueeze(2), sin.to(dtype).unsqueeze(2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, T, H, D) by halves (not interleaved), nanochat's layout."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


def eager_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    """Plain attention over (B, H, T, D): the fallback for attn_implementation="eager"."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask[:, :, :, : key.shape[-2]]
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class ChatcliNanoChatAttention(nn.Module):
    def __init__(self, config: ChatcliNanoChatConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        # Counted in keys, as transformers' attention functions take it (nanochat's w + 1).
        self.sliding_window = config.layer_windows[layer_idx] + 1
        C, H, Hkv, D = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            self.head_dim,
        )
        self.q_proj = nn.Linear(C, H * D, bias=False)
        self.k_proj = nn.Linear(C, Hkv * D, bias=False)
        self.v_proj = nn.Linear(C, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, C, bias=False)
        self.gate_channels = (
            config.value_gate_channels if layer_idx in config.value_embed_layers else 0
        )
        if self.gate_channels:
            self.ve_gate = nn.Linear(self.gate_channels, Hkv, bias=False)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        value_embed: torch.Tensor | None,
        attention_mask,
        cache: Cache | None,
        **kwargs,
    ) -> torch.Tensor:
        B, T, _ = h.shape
        D = self.head_dim
        q = self.q_proj(h).view(B, T, -1, D)
        k = self.k_proj(h).view(B, T, -1, D)
        v = self.v_proj(h).view(B, T, -1, D)
        if value_embed is not None:
            if v.shape[2] != self.config.num_key_value_heads:
                raise ValueError(
                    "nanochat's value embeddings (eras C-E) span every key/value head: run "
                    "this model with a tensor-parallel size of 1."
                )
            gate = self.config.value_gate_scale * torch.sigmoid(
                self.ve_gate(h[..., : self.gate_channels])
            )
            v = v + gate.unsqueeze(-1) * value_embed.view(B, T, -1, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # rope before the qk-norm
        q, k = norm(q), norm(k)
        if self.config.qk_scale is not None:
            q, k = q * self.config.qk_scale, k * self.config.qk_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        attend: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention
        )
        y, _ = attend(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        return self.o_proj(y.reshape(B, T, -1))


class ChatcliNanoChatMLP(nn.Module):
    def __init__(self, config: ChatcliNanoChatConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)).square())


class ChatcliNanoChatDecoderLayer(nn.Module):
    def __init__(self, config: ChatcliNanoChatConfig, layer_idx: int):
        super().__init__()
        self.self_attn = ChatcliNanoChatAttention(config, layer_idx)
        self.mlp = ChatcliNanoChatMLP(config)


class ChatcliNanoChatPreTrainedModel(PreTrainedModel):
    config_class = ChatcliNanoChatConfig
    config: ChatcliNanoChatConfig
    base_model_prefix = "model"
    _no_split_modules = ["ChatcliNanoChatDecoderLayer"]  # noqa: RUF012
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, ChatcliNanoChatModel):
            if module.resid_lambdas is not None:
                init.ones_(module.resid_lambdas)
                init.zeros_(module.x0_lambdas)
            for name in ("smear_lambda", "backout_lambda"):
                if getattr(module, name) is not None:
                    init.zeros_(getattr(module, name))


class ChatcliNanoChatModel(ChatcliNanoChatPreTrainedModel):
    def __init__(self, config: ChatcliNanoChatConfig):
        super().__init__(config)
        C, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
        self.embed_tokens = nn.Embedding(V, C)
        self.layers = nn.ModuleList([ChatcliNanoChatDecoderLayer(config, i) for i in range(L)])
        kv_dim = config.num_key_value_heads * config.head_dim
        self.value_embeds = nn.ModuleDict(
            {str(i): nn.Embedding(V, kv_dim) for i in config.value_embed_layers}
        )
        self.resid_lambdas = nn.Parameter(torch.ones(L)) if config.residual_lambdas else None
        self.x0_lambdas = nn.Parameter(torch.zeros(L)) if config.residual_lambdas else None
        if config.smear_channels:
            self.smear_gate = nn.Linear(config.smear_channels, 1, bias=False)
            self.smear_lambda = nn.Parameter(torch.zeros(1))
        else:
            self.smear_gate = self.smear_lambda = None
        self.backout_lambda = (
            nn.Parameter(torch.zeros(1)) if config.backout_layer is not None else None
        )
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cache: Cache | None = None,
        smear_prev_ids: torch.LongTensor | None = None,
        **kwargs,
    ):
        """smear_prev_ids (B,): era E's token before input_ids[:, 0] when continuing a
        sequence (generate() passes it; a continuation without it is refused)."""
        return_dict = kwargs.pop("return_dict", True)
        for unused in ("output_attentions", "output_hidden_states", "cache_position"):
            kwargs.pop(unused, None)
        cache = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        if input_ids is None and (len(self.value_embeds) or self.smear_gate is not None):
            raise ValueError(
                f"nanochat era {self.config.nanochat_era} looks up value embeddings or smears "
                "by token: pass input_ids, not inputs_embeds."
            )
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = x.shape[:2]
        if use_cache is None:
            use_cache = self.config.use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = (torch.arange(T, device=x.device) + past).unsqueeze(0)
        position_ids = position_ids.expand(B, -1)

        x = norm(x)
        if self.smear_gate is not None:
            x = self._smear(x, input_ids, position_ids, smear_prev_ids)
        masks = self._masks(x, attention_mask, cache, position_ids, past + T)
        cos, sin = rotary(self.config, position_ids, x.dtype)
        x0, saved = x, None
        for i, layer in enumerate(self.layers):
            if self.resid_lambdas is not None:
                x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](input_ids) if str(i) in self.value_embeds else None
            kind = self.config.layer_types[i]
            if kind == "full_attention" and "long_window" in masks:
                kind = "long_window"
            x = x + layer.self_attn(norm(x), cos, sin, ve, masks.get(kind), cache, **kwargs)
            x = x + layer.mlp(norm(x))
            if i == self.config.backout_layer:
                saved = x
        if saved is not None:
            x = x - self.backout_lambda * saved
        x = norm(x)
        if not return_dict:
            return (x, cache)
        return BaseModelOutputWithPast(last_hidden_state=x, **{_CACHE_FIELD: cache})

    def _smear(self, x, input_ids, position_ids, prev_ids):
        """x[t] += smear_lambda * sigmoid(smear_gate(x[t][:24])) * x[t-1], with x[t-1] the
        previous token's un-smeared embedding, at every position past a sequence's first."""
        if prev_ids is not None:
            first = norm(self.embed_tokens(prev_ids.reshape(-1, 1)))
        else:
            if bool((position_ids[:, 0] > 0).any()):
                raise ValueError(
                    "nanochat era E smears each token with the one before it: continuing a "
                    "sequence needs smear_prev_ids (the token before input_ids), which "
                    "generate() passes. A serving backend that runs the model without its "
                    "cache cannot give it: serve era E with chatcli."
                )
            first = torch.zeros_like(x[:, :1])
        before = torch.cat([first, x[:, :-1]], dim=1)
        gate = self.smear_lambda * torch.sigmoid(
            self.smear_gate(x[..., : self.config.smear_channels])
        )
        return torch.where((position_ids > 0).unsqueeze(-1), x + gate * before, x)

    def _masks(self, x, attention_mask, cache, position_ids, total: int) -> dict:
        """The attention masks, by layer type. A long window is the training context: plain
        causal attention within it, a window of its own past it."""
        if isinstance(attention_mask, dict):  # prepared by generate() for a static cache
            return attention_mask
        if self.config._attn_implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
            # An attention function registered without a mask function (a serving engine's)
            # masks by itself, from the config's layer types or each call's sliding_window.
            return {}
        args = dict(
            config=self.config,
            inputs_embeds=x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{_MASK_CACHE_ARG: cache},
        )
        types = self.config.layer_types
        masks = {"full_attention": create_causal_mask(**args)}
        if "sliding_attention" in types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**args)
        long = self.config.max_position_embeddings
        if total > long + 1 and "full_attention" in types:
            wide = copy.copy(self.config)
            wide.sliding_window = long + 1
            args["config"] = wide
            masks["long_window"] = create_sliding_window_causal_mask(
                **args, layer_idx=types.index("full_attention")
            )
        return masks


class ChatcliNanoChatForCausalLM(ChatcliNanoChatPreTrainedModel, GenerationMixin):
    def __init__(self, config: ChatcliNanoChatConfig):
        super().__init__(config)
        self.model = ChatcliNanoChatModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        step = inputs.get("input_ids")
        if self.config.smear_channels and step is not None and step.shape[1] < input_ids.shape[1]:
            # Era E smears the first new token with the one before it, which the cache lacks.
            inputs["smear_prev_ids"] = input_ids[:, -step.shape[1] - 1]
        return inputs

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache: Cache | None = None,
        smear_prev_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        return_dict = kwargs.pop("return_dict", True)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            smear_prev_ids=smear_prev_ids,
            **kwargs,
        )
        hidden = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :]).float()
        cap = self.config.final_logit_softcapping
        logits = cap * torch.tanh(logits / cap)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        cache_out = getattr(out, _CACHE_FIELD)
        if not return_dict:
            return (loss, logits, cache_out) if loss is not None else (logits, cache_out)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache_out})
