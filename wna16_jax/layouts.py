"""Kernel-private weight layouts behind QuantizedExperts, made once (e.g. at load) and lossless.

    mgpu = wj.layouts.to_kernel_layout(qw, "mgpu_int4")    # for implementation="mgpu"
    qw_again = wj.layouts.to_canonical_layout(mgpu)        # bit-identical to qw

Which layout runs fastest here: wj.preferred_layout(w13, w2, dtype=jnp.bfloat16).

A kernel layout belongs to the backend whose kernels read it: the backend registers what it
holds, its checks, its shard granularity and its conversions with the registry
(wna16_jax.backend_api.LayoutConversion), and the functions here find them there. LAYOUTS is
"canonical" and every registered kernel layout (e.g. "mgpu_int4" and "mgpu_int8", the Mosaic
GPU GEMM's, described beside their conversions in pallas_kernels/mgpu/layout.py).
"""

from __future__ import annotations

from wna16_jax._dispatch import (
    kernel_layout_reason,
    layout_bits,
    shard_granularity,
    to_canonical_layout,
    to_kernel_layout,
)

__all__ = [  # noqa: F822 (LAYOUTS comes from the module's __getattr__)
    "LAYOUTS", "kernel_layout_reason", "layout_bits", "shard_granularity",
    "to_canonical_layout", "to_kernel_layout",
]  # fmt: skip


def __getattr__(name: str):
    """LAYOUTS: "canonical", then the registered backends' kernel layouts (looked up when first
    read, so that importing wna16_jax imports no kernels)."""
    if name == "LAYOUTS":
        from wna16_jax import _dispatch

        return _dispatch.layouts()
    raise AttributeError(f"module 'wna16_jax.layouts' has no attribute {name!r}")
