"""Qwen2-MoE and Qwen3-MoE in Flax NNX with WNA16 (int4/int8) quantized experts."""

from models.qwen_moe import sharding
from models.qwen_moe.config import GPTQ_INT4, PRESETS, QwenMoeConfig
from models.qwen_moe.modeling import (
    KVCache,
    QwenMoeForCausalLM,
    dequantize_model,
    init_random,
    route,
)
from models.qwen_moe.params import load_pretrained
from models.qwen_moe.sharding import shard_model

__all__ = [
    "GPTQ_INT4",
    "KVCache",
    "PRESETS",
    "QwenMoeConfig",
    "QwenMoeForCausalLM",
    "dequantize_model",
    "init_random",
    "load_pretrained",
    "route",
    "shard_model",
    "sharding",
]
