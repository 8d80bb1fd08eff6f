"""Qwen2-MoE / Qwen3-MoE checkpoints: the name table the loader engine reads and writes.

`models.common.loader` does the reading (float, GPTQ, AWQ, compressed-tensors or FP8 weights
as config.json's quantization_config says; scales as stored), placement on a mesh and
`save_pretrained`; this module gives it Qwen's names and shapes.
"""

from __future__ import annotations

from collections.abc import Callable

from models.common import loader
from models.qwen_moe import sharding
from models.qwen_moe.config import QwenMoeConfig
from models.qwen_moe.modeling import QwenMoeForCausalLM

# One row per HF tensor (models.common.loader.Row): "layer." stands for "model.layers.{i}.";
# the module path is the name's, but a projection's bias "self_attn.q_proj.bias" lives on the
# attention as "self_attn.q_bias" (`module_path`).
# fmt: off
NAME_TABLE: tuple[loader.Row, ...] = (
    *loader.DECODER_ROWS,
    ("layer.self_attn.q_proj",                "linear",  "Nq H",  "always",   "attention"),
    ("layer.self_attn.k_proj",                "linear",  "Nkv H", "always",   "attention"),
    ("layer.self_attn.v_proj",                "linear",  "Nkv H", "always",   "attention"),
    ("layer.self_attn.o_proj",                "linear",  "H Nq",  "always",   "attention"),
    ("layer.self_attn.q_proj.bias",           "param",   "Nq",    "qkv_bias", None),
    ("layer.self_attn.k_proj.bias",           "param",   "Nkv",   "qkv_bias", None),
    ("layer.self_attn.v_proj.bias",           "param",   "Nkv",   "qkv_bias", None),
    ("layer.self_attn.o_proj.bias",           "param",   "H",     "o_bias",   None),
    ("layer.self_attn.q_norm",                "weight",  "D",     "qk_norm",  None),
    ("layer.self_attn.k_norm",                "weight",  "D",     "qk_norm",  None),
    ("layer.mlp.gate",                        "weight",  "E H",   "moe",      None),
    ("layer.mlp.experts",                     "experts", "E I H", "moe",      "experts"),
    ("layer.mlp.shared_expert.gate_proj",     "linear",  "Is H",  "shared",   "shared_experts"),
    ("layer.mlp.shared_expert.up_proj",       "linear",  "Is H",  "shared",   "shared_experts"),
    ("layer.mlp.shared_expert.down_proj",     "linear",  "H Is",  "shared",   "shared_experts"),
    ("layer.mlp.shared_expert_gate",          "linear",  "1 H",   "shared",   None),
)
# fmt: on

_DIMS: dict[str, Callable[[QwenMoeConfig], int]] = {
    "1": lambda c: 1,
    "V": lambda c: c.vocab_size,
    "H": lambda c: c.hidden_size,
    "D": lambda c: c.head_dim,
    "Nq": lambda c: c.num_attention_heads * c.head_dim,
    "Nkv": lambda c: c.num_key_value_heads * c.head_dim,
    "F": lambda c: c.intermediate_size,
    "E": lambda c: c.num_experts,
    "I": lambda c: c.moe_intermediate_size,
    "Is": lambda c: c.shared_expert_intermediate_size,
}
_PRESENT: dict[str, Callable[[QwenMoeConfig, int | None], bool]] = {
    "always": lambda c, i: True,
    "untied": lambda c, i: not c.tie_word_embeddings,
    "qkv_bias": lambda c, i: c.qkv_bias,
    "o_bias": lambda c, i: c.model_type == "qwen3_moe" and c.attention_bias,
    "qk_norm": lambda c, i: c.qk_norm,
    "dense": lambda c, i: not c.is_moe_layer(i),
    "moe": lambda c, i: c.is_moe_layer(i),
    "shared": lambda c, i: c.is_moe_layer(i) and c.shared_expert,
}


def module_path(name: str) -> tuple:
    """The module path of an HF name (q/k/v/o biases on the attention as q_bias, ...)."""
    return loader.hf_module_path(name.replace("_proj.bias", "_bias"))


# The table, the sizes of its letters and its conditions, for this model and config.
NAMES = loader.NameTable(
    NAME_TABLE,
    _DIMS,
    _PRESENT,
    QwenMoeForCausalLM,
    QwenMoeConfig,
    module_path=module_path,
    shard_model=sharding.shard_model,
)

load_pretrained = NAMES.load_pretrained
save_pretrained = NAMES.save_pretrained
