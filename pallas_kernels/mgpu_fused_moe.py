"""The MoE layer on the Mosaic GPU GEMM (prototype): align -> gather rows -> GEMM1 ->
silu*up -> GEMM2 -> weighted sum over top-k.

Unlike the Triton-lowered pipeline, the GEMMs take rows already in block order (x gathered
once by XLA), write rows in block order, and the top-k sum gathers each slot's row back.
Weights come in the kernel's layout (`mgpu_wna16_gemm.prepare_weights`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.fused_moe import align
from pallas_kernels.mgpu_wna16_gemm import MgpuInt4Weights, mgpu_wna16_gemm
from wna16_jax import _reference


@functools.partial(
    jax.jit,
    static_argnames=("block_m", "block_k", "max_concurrent_steps", "exact", "interpret"),
)
def mgpu_fused_moe(
    x: jax.Array,
    w13: MgpuInt4Weights,
    w2: MgpuInt4Weights,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    *,
    block_m: int,
    block_k: int = 128,
    max_concurrent_steps: int = 4,
    exact: bool = True,
    interpret: bool = False,
) -> jax.Array:
    """fused_moe(x, w13, w2, topk_weights, topk_ids) with silu, in x.dtype ([T, H])."""
    t, k = topk_ids.shape
    num_experts = w13.shape[0]
    routing = align(
        topk_ids, num_experts=num_experts, block_m=block_m, expert_map=None, interpret=interpret
    )
    slots = routing.sorted_token_ids  # [P]: t*k + j, or the sentinel t*k for padding
    placed = slots < t * k
    x_rows = jnp.where(placed[:, None], x[jnp.where(placed, slots // k, 0)], 0).astype(x.dtype)
    gemm = functools.partial(
        mgpu_wna16_gemm,
        block_m=block_m,
        block_k=block_k,
        max_concurrent_steps=max_concurrent_steps,
        exact=exact,
        interpret=interpret,
    )
    h = gemm(x_rows, w13, routing.expert_ids)  # [P, 2I]
    act = _reference.silu_and_mul(h.astype(jnp.float32)).astype(x.dtype)  # [P, I]
    y = gemm(act, w2, routing.expert_ids)  # [P, H]
    # Each slot's row in block order (padding rows point past the end and are dropped).
    p = slots.shape[0]
    position = jnp.zeros(t * k, jnp.int32)
    position = position.at[slots].set(jnp.arange(p, dtype=jnp.int32), mode="drop")
    flat = topk_ids.reshape(-1)
    kept = (flat >= 0) & (flat < num_experts)
    rows = jnp.where(kept[:, None], y[position].astype(jnp.float32), 0.0)
    out = (rows.reshape(t, k, -1) * topk_weights[..., None].astype(jnp.float32)).sum(axis=1)
    return out.astype(x.dtype)
