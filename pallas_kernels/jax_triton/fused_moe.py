"""The MoE layer from the Triton kernels: align -> GEMM1 -> act -> GEMM2 -> sum over top-k."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.jax_triton.align import moe_align_block_size
from pallas_kernels.jax_triton.wna16_gemm import wna16_gemm
from pallas_kernels.triton.fused_moe import gemm_configs, sum_over_top_k
from wna16_jax import _reference
from wna16_jax._types import BlockConfig, QuantizedExperts

# Tokens per chunk: bounds the [T*k, max(2I, H)] intermediates.
DEFAULT_CHUNK_TOKENS = 8192


def _fused_moe_chunk(
    x, w13, w2, topk_weights, topk_ids, *, expert_map, activation, config, interpret
):
    t, k = topk_ids.shape
    num_experts = expert_map.shape[0] if expert_map is not None else w13.num_experts
    # Both with GEMM1's block_m; tensor-core configs only (the Triton GEMM has no "fma").
    c1, c2 = gemm_configs(t * k, w13, w2, config, allow_fma=False)
    routing = moe_align_block_size(
        topk_ids,
        num_experts=num_experts,
        block_m=c1.block_m,
        expert_map=expert_map,
        interpret=interpret,
    )
    h = wna16_gemm(x, w13, routing, top_k=k, config=c1, interpret=interpret)  # [T*k, 2I]
    act = _reference.ACTIVATIONS[activation](h.astype(jnp.float32)).astype(x.dtype)  # [T*k, I]
    y = wna16_gemm(
        act,
        w2,
        routing,
        topk_weights.reshape(-1).astype(jnp.float32),
        top_k=1,
        config=c2,
        out_dtype=jnp.float32,
        interpret=interpret,
    )  # [T*k, H] f32, routed weights applied
    return sum_over_top_k(y, topk_ids, num_experts)


@functools.partial(
    jax.jit, static_argnames=("activation", "config", "chunk_tokens", "interpret", "out_dtype")
)
def fused_moe(
    x,
    w13: QuantizedExperts,
    w2: QuantizedExperts,
    topk_weights,
    topk_ids,
    *,
    expert_map=None,
    activation: str = "silu",
    config: BlockConfig | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    interpret: bool = False,
    out_dtype=None,
):
    """fused_moe (DESIGN.md steps 1-5) from the Triton kernels; inputs already validated.

    GEMM1's output and the activation are rounded to x.dtype (as the Pallas pipeline and vLLM
    do); GEMM2 writes f32 with the routed weights applied, summed over the k slots in f32.

    Args:
        x: [T, H] bf16/f16/f32.  w13: [E, 2I, H].  w2: [E, H, I].
        topk_weights: [T, k] float.  topk_ids: [T, k] int32 global ids.
        expert_map: optional int32 [E_global].  activation: a key of _reference.ACTIVATIONS.
        config: BlockConfig for both GEMMs or None (tuned table, then heuristic, per GEMM:
            `pallas_kernels.triton.fused_moe.gemm_configs` with allow_fma=False).
        chunk_tokens: tokens per chunk for large T.
        interpret: run the kernels in Triton's interpreter on the host (slow; for tests).

        out_dtype: the output dtype (default x.dtype), rounded once from the f32 sum.

    Returns:
        [T, H] in out_dtype.
    """
    run = functools.partial(
        _fused_moe_chunk,
        w13=w13,
        w2=w2,
        expert_map=expert_map,
        activation=activation,
        config=config,
        interpret=interpret,
    )
    return _reference.map_token_chunks(
        run, x, topk_weights, topk_ids, chunk_tokens=chunk_tokens, out_dtype=out_dtype
    )
