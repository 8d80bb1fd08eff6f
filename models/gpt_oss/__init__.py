"""gpt-oss (openai/gpt-oss-20b, -120b) in Flax NNX with MXFP4 routed experts."""

from models.gpt_oss.config import PRESETS, GptOssConfig, YarnRope
from models.gpt_oss.modeling import (
    GptOssForCausalLM,
    KVCache,
    dequantize_model,
    init_random,
    route,
)
from models.gpt_oss.params import load_pretrained, save_pretrained

__all__ = [
    "PRESETS",
    "GptOssConfig",
    "GptOssForCausalLM",
    "KVCache",
    "dequantize_model",
    "init_random",
    "YarnRope",
    "load_pretrained",
    "route",
    "save_pretrained",
]
