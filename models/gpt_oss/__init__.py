"""gpt-oss (openai/gpt-oss-20b, -120b) in Flax NNX with MXFP4 routed experts."""

from models.gpt_oss.config import PRESETS, GptOssConfig, YarnRope
from models.gpt_oss.modeling import GptOssForCausalLM, KVCache, route

__all__ = ["PRESETS", "GptOssConfig", "GptOssForCausalLM", "KVCache", "YarnRope", "route"]
