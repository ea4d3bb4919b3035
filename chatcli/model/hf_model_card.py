"""The README.md model card of an export: what the model is, how to load and serve it.

Owns: the card's text, made from the config.json the export writes. Knows nothing about
weights or files.
"""

from __future__ import annotations

from typing import Any

from chatcli.model.hf_config import NATIVE_MODEL_TYPE

_ERA_PARTS = {
    "A": "the original nanochat GPT",
    "B": "residual lambdas and sliding windows",
    "C": "residual lambdas, sliding windows and value embeddings",
    "D": "residual lambdas, sliding windows, value embeddings and a q/k scale",
    "E": "residual lambdas, sliding windows, value embeddings, a q/k scale, smear and backout",
}


def model_card(config: dict[str, Any], origin: str, num_params: int, dtype: str) -> str:
    native = config["model_type"] == NATIVE_MODEL_TYPE
    era = "A" if native else config["nanochat_era"]
    remote = "" if native else ", trust_remote_code=True"
    heads = config["num_attention_heads"]
    kv = config["num_key_value_heads"]
    shape = (
        f"{num_params / 1e6:.1f}M parameters: {config['num_hidden_layers']} layers, width "
        f"{config['hidden_size']}, {heads} attention heads ({kv} key/value), a context of "
        f"{config['max_position_embeddings']} tokens, a vocabulary of {config['vocab_size']}"
    )
    weights = {
        "keep": "each tensor as nanochat saved it",
        "float32": "float32",
        "bfloat16": "bfloat16 (rounded from the saved weights)",
    }[dtype]
    if native:
        code = (
            "It is transformers' own `NanoChatForCausalLM` (no remote code). transformers "
            "computes its rotary tables in float32 where nanochat rounded them to bfloat16, so "
            "float32 logits differ from nanochat's by a few 1e-3; `chatcli export "
            "--remote-code` writes chatcli's modeling file instead, which matches them."
        )
    else:
        code = (
            f"Era {era} adds {_ERA_PARTS[era]} to the original nanochat GPT, which "
            "transformers' own `NanoChatForCausalLM` does not compute, so this folder carries "
            "chatcli's modeling code (`modeling_chatcli_nanochat.py` and its config's file, loaded with "
            "`trust_remote_code=True`). It computes exactly what nanochat computes. The "
            "tokenizer is transformers' built-in `PreTrainedTokenizerFast`: "
            "`PreTrainedTokenizerFast.from_pretrained(PATH)` loads it without any code; "
            "`AutoTokenizer` reads config.json first, so it asks for `trust_remote_code=True` "
            "too (it runs the config's file only)."
        )
    if era == "E":
        serve = (
            "Era E smears each token's embedding with the previous token's, which the "
            "Transformers backends of vLLM and SGLang do not pass when they decode, so they "
            "cannot serve it; the modeling file refuses rather than answer wrongly. Serve it "
            "with chatcli:\n\n```sh\nchatcli serve --model PATH\n```\n"
        )
    else:
        flag = "" if native else " --trust-remote-code"
        serve = (
            "vLLM and SGLang run it through their Transformers backend:\n\n"
            f"```sh\nvllm serve PATH{flag}\nchatcli chat --url http://localhost:8000/v1\n```\n"
        )
        if config.get("value_embed_layers"):
            serve += "\nValue embeddings need a tensor-parallel size of 1.\n"
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags:
- nanochat
- chatcli
---
# nanochat, era {era}

A [nanochat](https://github.com/karpathy/nanochat) GPT of {shape}. Exported by chatcli from
{origin}; the weights are {weights}.

{code}

## Load it

PATH is this folder, or its repository id on the Hugging Face Hub.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("PATH"{remote})
model = AutoModelForCausalLM.from_pretrained("PATH"{remote})
messages = [{{"role": "user", "content": "What is 12 * 7?"}}]
inputs = tokenizer.apply_chat_template(
    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
)
out = model.generate(**inputs, max_new_tokens=128)
print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
```

`generation_config.json` holds chatcli's default sampling (temperature, top-k); a reply ends at
`<|assistant_end|>`. chatcli runs this folder as it is: `chatcli chat --model PATH`.

## Serve it

{serve}
## Chat format

The chat template renders a conversation to exactly the tokens nanochat was trained on: a system
message goes before the first user message's text; an assistant's calculator call is
`<|python_start|>expression<|python_end|>` and its result `<|output_start|>result<|output_end|>`,
written either as content parts (`{{"type": "python", "text": "12*7"}}`,
`{{"type": "python_output", "text": "84"}}`) or as a `tool_calls` entry (arguments
`{{"expression": "12*7"}}`) followed by a `tool` message with the result.
"""
