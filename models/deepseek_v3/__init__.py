"""DeepSeek-V3 (and V2 / V2-Lite) in Flax NNX with WNA16 (int4/int8) quantized experts."""

from models.common.tokenizer import (
    ByteTokenizer,
    ChatTemplate,
    load_chat_template,
    load_tokenizer,
)
from models.deepseek_v3 import sharding, speculative
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

__all__ = [
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
    "route",
    "save_pretrained",
    "shard_model",
    "sharding",
    "speculative",
]
