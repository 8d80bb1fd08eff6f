"""Kernel-private weight layouts behind QuantizedExperts, made once (e.g. at load) and lossless.

    mgpu = wj.layouts.to_kernel_layout(qw, "mgpu_int4")    # for implementation="mgpu"
    qw_again = wj.layouts.to_canonical_layout(mgpu)        # bit-identical to qw

Which layout runs fastest here: wj.preferred_layout(w13, w2, dtype=jnp.bfloat16).

A kernel layout belongs to the backend whose kernels read it: the backend registers its
conversions with the registry (wna16_jax._dispatch, Backend.layout_conversion), and the
functions here find them there. "mgpu_int4" and "mgpu_int8", the Mosaic GPU GEMM's, are
described beside their conversions (pallas_kernels/mgpu/layout.py).
"""

from __future__ import annotations

from wna16_jax._dispatch import kernel_layout_reason, to_canonical_layout, to_kernel_layout
from wna16_jax._types import LAYOUTS, MGPU_TILE

# MGPU_TILE: the kernel layouts' tiles are MGPU_TILE x MGPU_TILE weights, so a shard of such a
# weight holds whole tiles (its N and K splits multiples of MGPU_TILE).
__all__ = [
    "LAYOUTS", "MGPU_TILE", "kernel_layout_reason", "to_canonical_layout", "to_kernel_layout",
]  # fmt: skip
