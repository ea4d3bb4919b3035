"""The config of chatcli's nanochat modeling file (modeling_chatcli_nanochat.py).

A nanochat GPT of one era: the shapes, and every part and constant the era has, written
out so that the modeling file needs no table of eras. Stands alone (it imports transformers
and huggingface_hub, nothing of chatcli's).
"""

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig


@strict
class ChatcliNanoChatConfig(PreTrainedConfig):
    """A nanochat GPT of one era. layer_windows[i] = w: query i sees keys i-w..i; layer_types
    and sliding_window (= the short window + 1, counted in keys) say the same in the terms
    transformers' caches and the serving engines read."""

    model_type = "chatcli_nanochat"
    # Plain class attributes, as transformers' own configs and models declare them.
    base_model_tp_plan = {  # noqa: RUF012
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.fc1": "colwise",
        "layers.*.mlp.fc2": "rowwise",
    }

    nanochat_era: str = "E"
    vocab_size: int = 65536
    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 20
    num_attention_heads: int = 10
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rope_theta: float = 100000.0
    rope_tables_bf16: bool = False
    qk_scale: float | None = None
    residual_lambdas: bool = False
    layer_windows: list[int] | None = None
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    value_embed_layers: list[int] | None = None
    value_gate_channels: int = 0
    value_gate_scale: float = 0.0
    smear_channels: int = 0
    backout_layer: int | None = None
    final_logit_softcapping: float = 15.0
    initializer_range: float = 0.02
    use_cache: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_windows is None:
            self.layer_windows = [self.max_position_embeddings] * self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.value_embed_layers is None:
            self.value_embed_layers = []
        super().__post_init__(**kwargs)
