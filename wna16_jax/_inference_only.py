"""The library computes no gradients: a marker that says so where a derivative is asked for."""

from __future__ import annotations

import jax


@jax.custom_jvp
def inference_only(a):
    """a, unchanged; differentiating through it raises TypeError: the kernels (and the
    reference's loops) have no derivative rules, and the library computes no gradients."""
    return a


@inference_only.defjvp
def _inference_only_jvp(primals, tangents):
    raise TypeError(
        "wna16_jax is inference-only: fused_moe and the quantized GEMMs have no gradients. To "
        "differentiate a layer, dequantize its weights (wj.dequantize_experts) and compute it "
        "in plain JAX."
    )
