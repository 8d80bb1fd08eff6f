"""gpt-oss (openai/gpt-oss-20b, -120b) in Flax NNX with MXFP4 routed experts."""

import functools

from models.gpt_oss import params
from models.gpt_oss.config import ARCHITECTURE, MODEL_TYPE, PRESETS, GptOssConfig, YarnRope
from models.gpt_oss.modeling import (
    GptOssForCausalLM,
    KVCache,
    dequantize_model,
    init_random,
    route,
    shard_model,
)
from models.gpt_oss.params import load_pretrained, save_pretrained
from models.registry import Family

FAMILY = Family(
    name="gpt_oss",
    model_types=(MODEL_TYPE,),
    architectures=(ARCHITECTURE,),
    names=params.NAMES,
    init_random=init_random,
    shard_model=shard_model,
    presets={name: functools.partial(GptOssConfig.preset, name) for name in sorted(PRESETS)},
)

__all__ = [
    "FAMILY",
    "PRESETS",
    "GptOssConfig",
    "GptOssForCausalLM",
    "KVCache",
    "YarnRope",
    "dequantize_model",
    "init_random",
    "load_pretrained",
    "route",
    "save_pretrained",
    "shard_model",
]
