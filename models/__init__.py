"""The model families, behind one entry point that reads a checkpoint's config.json:

    model = models.load_pretrained("Qwen/Qwen3-30B-A3B-GPTQ-Int4")   # or a local directory
    model = models.prepare(model, linear_implementation="auto")       # kernels, layouts: once
    tokenizer = models.load_tokenizer(path)
    tokens = models.generate(model, tokenizer.encode("Hello"), max_new_tokens=32)
    logits = model(ids)                                               # f32 [B, S, vocab]

The families are found in one table (`models.registry.FAMILY_PACKAGES`); each keeps its own
entry points too (models.deepseek_v3, models.qwen_moe).
"""

from __future__ import annotations

import os

from models import registry
from models.common.checkpoint import CONFIG_FILE, read_json, resolve_checkpoint
from models.common.generate import generate
from models.common.tokenizer import load_tokenizer as _load_tokenizer
from models.registry import family_of
from models.serving import prepare


def __getattr__(name: str):
    # MODEL_TYPES / ARCHITECTURES: {config.json value: family name}, read from the registry
    # when asked for (the families are imported on first use).
    if name == "MODEL_TYPES":
        return registry.model_types()
    if name == "ARCHITECTURES":
        return registry.architectures()
    raise AttributeError(f"module 'models' has no attribute {name!r}")


def load_pretrained(
    path_or_hub_id: str | os.PathLike,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    **kwargs,
):
    """Loads a checkpoint (a local directory or a Hugging Face Hub id) with its family's
    loader (`models.common.loader` on the family's name table), the family chosen by
    config.json (`family_of`); `kwargs` go to the loader (dtype, implementation, quantize,
    progress, mesh, moe_mode; a family with a draft layer also mtp).

    Raises:
        FileNotFoundError: no such directory or Hub repository, or no config.json.
        ValueError: an unsupported model type (the supported ones listed), or what the
            family's loader refuses.
    """
    path = resolve_checkpoint(path_or_hub_id, revision=revision, cache_dir=cache_dir)
    family = family_of(read_json(os.path.join(path, CONFIG_FILE)))
    return registry.families()[family].load_pretrained(path, **kwargs)


def load_tokenizer(path_or_hub_id: str | os.PathLike | None = None, **kwargs):
    """The tokenizer of a checkpoint (a local directory or a Hub id: tokenizer.json, or
    Kimi-K2's tiktoken.model; models.common.tokenizer); None: the byte-level tokenizer of a
    random model."""
    if path_or_hub_id is not None:
        path_or_hub_id = resolve_checkpoint(path_or_hub_id)
    return _load_tokenizer(path_or_hub_id, **kwargs)


def init_random(cfg, **kwargs):
    """A random model of `cfg`'s family (`kwargs`: seed, implementation, mesh, moe_mode,
    progress, ... as the family's init_random takes them)."""
    return registry.family_of_model(cfg).init_random(cfg, **kwargs)


def save_pretrained(model, path: str | os.PathLike, **kwargs) -> None:
    """Writes `model` as a Hugging Face directory with its family's name table
    (`models.common.loader.save_pretrained`: format, max_shard_bytes)."""
    registry.family_of_model(model).save_pretrained(model, path, **kwargs)


__all__ = [
    "family_of",
    "generate",
    "init_random",
    "load_pretrained",
    "load_tokenizer",
    "prepare",
    "save_pretrained",
]
