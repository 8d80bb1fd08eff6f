"""DeepSeek-V3's generation: the shared decode loop and sampling (models.common.generate)."""

from models.common.generate import (
    GENERATION_CONFIG_FILE,
    MIN_BUCKET,
    MIN_TEMPERATURE,
    SPECULATIVE_DECODERS,
    GenerateStats,
    GenerationDefaults,
    _decode,
    _prefill,
    bucket,
    generate,
    load_generation_config,
    row_keys,
    sample,
    sample_rows,
    sampling_kind,
    scaled_logits,
)

__all__ = [
    "GENERATION_CONFIG_FILE",
    "MIN_BUCKET",
    "MIN_TEMPERATURE",
    "SPECULATIVE_DECODERS",
    "GenerateStats",
    "GenerationDefaults",
    "_decode",
    "_prefill",
    "bucket",
    "generate",
    "load_generation_config",
    "row_keys",
    "sample",
    "sample_rows",
    "sampling_kind",
    "scaled_logits",
]
