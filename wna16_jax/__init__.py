"""wna16_jax: int4/int8 weight-only quantized Mixture-of-Experts for JAX."""

from wna16_jax import formats, layouts, linear, sharding
from wna16_jax._api import (
    backend_layout,
    fused_moe,
    gemm_config,
    grouped_matmul,
    moe_align_block_size,
    preferred_layout,
    select_implementation,
)
from wna16_jax._dispatch import registered_backends
from wna16_jax._quant import (
    check_finite,
    dequantize_experts,
    quantize_experts,
    random_quantized_experts,
)
from wna16_jax._types import (
    ActivationQuant,
    AlignedRouting,
    BlockConfig,
    MgpuConfig,
    QuantizedExperts,
)

__all__ = [
    "ActivationQuant",
    "AlignedRouting",
    "BlockConfig",
    "MgpuConfig",
    "QuantizedExperts",
    "backend_layout",
    "check_finite",
    "dequantize_experts",
    "formats",
    "layouts",
    "fused_moe",
    "gemm_config",
    "grouped_matmul",
    "linear",
    "moe_align_block_size",
    "preferred_layout",
    "quantize_experts",
    "random_quantized_experts",
    "registered_backends",
    "select_implementation",
    "sharding",
]
