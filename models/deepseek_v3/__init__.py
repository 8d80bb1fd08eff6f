"""DeepSeek-V3 (and V2 / V2-Lite) in Flax NNX with WNA16 (int4/int8) quantized experts."""

import dataclasses

from models.common.tokenizer import (
    ByteTokenizer,
    ChatTemplate,
    load_chat_template,
    load_tokenizer,
)
from models.deepseek_v3 import params, sharding, speculative
from models.deepseek_v3.config import DeepseekV3Config, QuantSpec, YarnScaling
from models.deepseek_v3.generate import (
    GenerateStats,
    GenerationDefaults,
    generate,
    load_generation_config,
)
from models.deepseek_v3.modeling import DeepseekV3ForCausalLM, KVCache, route
from models.deepseek_v3.params import load_pretrained, resolve_checkpoint, save_pretrained
from models.deepseek_v3.sharding import ShardingSpecs, init_random, make_mesh, shard_model
from models.registry import Family


def _released(make):
    """A preset of a released size that keeps its layer count consistent: with fewer
    `num_hidden_layers`, at most that many minus one dense layers lead."""

    def build(**overrides):
        cfg = make(**overrides)
        if "num_hidden_layers" in overrides:
            dense = min(cfg.first_k_dense_replace, cfg.num_hidden_layers - 1)
            cfg = dataclasses.replace(cfg, first_k_dense_replace=dense)
        return cfg

    return build


FAMILY = Family(
    name="deepseek_v3",
    model_types=("deepseek_v3", "deepseek_v2", "kimi_k2"),  # Kimi-K2: the V3 architecture
    architectures=("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"),
    names=params.NAMES,
    init_random=init_random,
    shard_model=shard_model,
    presets={
        "deepseek-v3": _released(DeepseekV3Config.deepseek_v3),
        "kimi-k2": _released(DeepseekV3Config.kimi_k2),
    },
    full_width=DeepseekV3Config.full_width,
)

__all__ = [
    "FAMILY",
    "ByteTokenizer",
    "ChatTemplate",
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    "GenerateStats",
    "GenerationDefaults",
    "KVCache",
    "QuantSpec",
    "ShardingSpecs",
    "YarnScaling",
    "generate",
    "init_random",
    "load_chat_template",
    "load_generation_config",
    "load_pretrained",
    "resolve_checkpoint",
    "load_tokenizer",
    "make_mesh",
    "params",
    "route",
    "save_pretrained",
    "shard_model",
    "sharding",
    "speculative",
]
