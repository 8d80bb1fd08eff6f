"""Qwen2-MoE and Qwen3-MoE in Flax NNX with WNA16 (int4/int8) quantized experts."""

import functools

from models.qwen_moe import params, sharding
from models.qwen_moe.config import GPTQ_INT4, MODEL_TYPES, PRESETS, QwenMoeConfig
from models.qwen_moe.modeling import KVCache, QwenMoeForCausalLM, dequantize_model, route
from models.qwen_moe.params import load_pretrained, save_pretrained
from models.qwen_moe.sharding import init_random, shard_model
from models.registry import Family

FAMILY = Family(
    name="qwen_moe",
    model_types=tuple(MODEL_TYPES),
    architectures=tuple(MODEL_TYPES.values()),
    names=params.NAMES,
    init_random=init_random,
    shard_model=shard_model,
    presets={name: functools.partial(QwenMoeConfig.preset, name) for name in sorted(PRESETS)},
)

__all__ = [
    "FAMILY",
    "GPTQ_INT4",
    "KVCache",
    "PRESETS",
    "QwenMoeConfig",
    "QwenMoeForCausalLM",
    "dequantize_model",
    "init_random",
    "load_pretrained",
    "route",
    "save_pretrained",
    "shard_model",
    "sharding",
]
