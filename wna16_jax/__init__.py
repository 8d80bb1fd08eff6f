"""wna16_jax: int4/int8/MXFP4 weight-only quantized Mixture-of-Experts for JAX."""

from wna16_jax import backend_api, formats, layouts, linear, sharding
from wna16_jax._activations import ClampedSwiGLU
from wna16_jax._api import (
    fused_moe,
    gemm_config,
    grouped_matmul,
    moe_align_block_size,
    preferred_layout,
    select_implementation,
)
from wna16_jax._dispatch import (
    REFERENCE_BACKEND,
    Backend,
    backend_layout,
    batch_invariant_reason,
    register_backend,
    registered_backends,
)
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
    QuantizedExperts,
)

__all__ = [
    "ActivationQuant",
    "AlignedRouting",
    "Backend",
    "BlockConfig",
    "ClampedSwiGLU",
    "MgpuConfig",
    "QuantizedExperts",
    "REFERENCE_BACKEND",
    "backend_api",
    "backend_layout",
    "batch_invariant_reason",
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
    "register_backend",
    "registered_backends",
    "select_implementation",
    "sharding",
]


def __getattr__(name: str):
    """A registered backend's config class by its name (wj.MgpuConfig: the 'mgpu' backend's,
    defined in its folder, pallas_kernels/mgpu/), looked up when first used so that
    importing wna16_jax imports no kernels."""
    from wna16_jax import _dispatch

    # A class name only: `from wna16_jax import <submodule>` asks here first, before the
    # submodule is imported, and must not load the backends (they import the library).
    found = _dispatch.config_class(name) if name[:1].isupper() else None
    if found is None:
        raise AttributeError(f"module 'wna16_jax' has no attribute {name!r}")
    return found
