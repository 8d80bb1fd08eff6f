"""The model families, behind one entry point that reads a checkpoint's config.json:

    model = models.load_pretrained("Qwen/Qwen3-30B-A3B-GPTQ-Int4")   # or a local directory
    tokenizer = models.load_tokenizer(path)
    tokens = models.generate(model, tokenizer.encode("Hello"), max_new_tokens=32)
    logits = model(ids)                                               # f32 [B, S, vocab]

Each family keeps its own entry points (models.deepseek_v3, models.qwen_moe).
"""

from __future__ import annotations

import os

from models import deepseek_v3, gpt_oss, qwen_moe
from models.common.checkpoint import CONFIG_FILE, read_json, resolve_checkpoint
from models.common.generate import generate
from models.common.tokenizer import load_tokenizer as _load_tokenizer

# config.json model_type -> the family (a models.<family> package) that runs it.
MODEL_TYPES = {
    "deepseek_v3": "deepseek_v3",
    "deepseek_v2": "deepseek_v3",
    "kimi_k2": "deepseek_v3",  # Kimi-K2: the DeepSeek-V3 architecture
    "qwen2_moe": "qwen_moe",
    "qwen3_moe": "qwen_moe",
    "gpt_oss": "gpt_oss",
}
# config.json architectures -> the family, where model_type names none of MODEL_TYPES.
ARCHITECTURES = {
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV2ForCausalLM": "deepseek_v3",
    "Qwen2MoeForCausalLM": "qwen_moe",
    "Qwen3MoeForCausalLM": "qwen_moe",
    "GptOssForCausalLM": "gpt_oss",
}
_LOADERS = {
    "deepseek_v3": deepseek_v3.load_pretrained,
    "qwen_moe": qwen_moe.load_pretrained,
    "gpt_oss": gpt_oss.load_pretrained,
}


def family_of(config: dict) -> str:
    """The family of a config.json dict: by its model_type, else its architectures.

    Raises:
        ValueError: neither is supported; the supported ones listed.
    """
    model_type = config.get("model_type")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    for arch in config.get("architectures") or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(
        f"model_type={model_type!r} (architectures {config.get('architectures')}) is not "
        f"supported; supported model types: {sorted(MODEL_TYPES)}, architectures: "
        f"{sorted(ARCHITECTURES)}"
    )


def load_pretrained(
    path_or_hub_id: str | os.PathLike,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    **kwargs,
):
    """Loads a checkpoint (a local directory or a Hugging Face Hub id) with its family's
    loader, chosen by config.json (`family_of`); `kwargs` go to that loader (dtype,
    implementation, quantize, progress; the DeepSeek family also mesh, specs, moe_mode).

    Raises:
        FileNotFoundError: no such directory or Hub repository, or no config.json.
        ValueError: an unsupported model type (the supported ones listed), or what the
            family's loader refuses.
    """
    path = resolve_checkpoint(path_or_hub_id, revision=revision, cache_dir=cache_dir)
    family = family_of(read_json(os.path.join(path, CONFIG_FILE)))
    return _LOADERS[family](path, **kwargs)


def load_tokenizer(path_or_hub_id: str | os.PathLike | None = None, **kwargs):
    """The tokenizer of a checkpoint (a local directory or a Hub id: tokenizer.json, or
    Kimi-K2's tiktoken.model; models.common.tokenizer); None: the byte-level tokenizer of a
    random model."""
    if path_or_hub_id is not None:
        path_or_hub_id = resolve_checkpoint(path_or_hub_id)
    return _load_tokenizer(path_or_hub_id, **kwargs)


__all__ = [
    "ARCHITECTURES",
    "MODEL_TYPES",
    "family_of",
    "generate",
    "load_pretrained",
    "load_tokenizer",
]
