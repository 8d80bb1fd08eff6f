"""The MoE layer from the Triton kernels: the pipeline's stages on the Triton align kernel and
WNA16 GEMM, whose GEMM2 applies the routed weights and writes a row per slot."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common.block_configs import block_configs
from pallas_kernels.triton.align import moe_align_block_size
from pallas_kernels.triton.config import RULES
from pallas_kernels.triton.wna16_gemm import wna16_gemm
from wna16_jax import _pipeline
from wna16_jax._activations import activate
from wna16_jax._types import BlockConfig, QuantizedExperts


def _plan(num_slots, num_experts, w13, w2, *, config) -> tuple[BlockConfig, BlockConfig]:
    return block_configs(num_slots, w13, w2, config, rules=RULES)


def _route(a, topk_ids, plan, *, num_experts, expert_map, distinct_experts, interpret):
    return _pipeline.slots_in_blocks(
        functools.partial(moe_align_block_size, interpret=interpret),
        a,
        topk_ids,
        block_m=plan[0].block_m,
        num_experts=num_experts,
        expert_map=expert_map,
        distinct_experts=distinct_experts,
    )


def _gemm1(x, w13, routed, plan, *, activation, interpret):
    """[T, H] -> the activation per slot [T*k, I], rounded to x.dtype (as the Pallas pipeline
    and vLLM do)."""
    h = wna16_gemm(  # [T*k, 2I]
        x, w13, routed.blocks, top_k=routed.top_k, config=plan[0], interpret=interpret
    )
    return activate(h, activation, x.dtype)


def _gemm2(act, w2, routed, plan, routed_weights, *, interpret):
    """[T*k, I] -> f32 [T*k, H], each slot's row times its routed weight."""
    return wna16_gemm(
        act,
        w2,
        routed.blocks,
        routed_weights,
        top_k=1,
        config=plan[1],
        out_dtype=jnp.float32,
        interpret=interpret,
    )


def stages(*, activation: str = "silu", config=None, interpret: bool = False):
    """This backend's MoeStages: the Triton align kernel and WNA16 GEMMs."""
    return _pipeline.MoeStages(
        plan=functools.partial(_plan, config=config),
        route=functools.partial(_route, interpret=interpret),
        gemm1=functools.partial(_gemm1, activation=activation, interpret=interpret),
        gemm2=functools.partial(_gemm2, interpret=interpret),
    )


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
    chunk_tokens: int = _pipeline.DEFAULT_CHUNK_TOKENS,
    interpret: bool = False,
    out_dtype=None,
):
    """fused_moe (docs/design.md steps 1-5) from the Triton kernels; inputs already validated.

    GEMM1's output and the activation are rounded to x.dtype (as the Pallas pipeline and vLLM
    do); GEMM2 writes f32 with the routed weights applied, summed over the k slots in f32.

    Args:
        x: [T, H] bf16/f16/f32.  w13: [E, 2I, H].  w2: [E, H, I].
        topk_weights: [T, k] float.  topk_ids: [T, k] int32 global ids.
        expert_map: optional int32 [E_global].  activation: a key of _activations.ACTIVATIONS.
        config: BlockConfig for both GEMMs or None (tuned table, then heuristic, per GEMM:
            `block_configs` under RULES: tensor-core configs only).
        chunk_tokens: tokens per chunk for large T.
        interpret: run the kernels in Triton's interpreter on the host (slow; for tests).
        out_dtype: the output dtype (default x.dtype), rounded once from the f32 sum.

    Returns:
        [T, H] in out_dtype.
    """
    return _pipeline.fused_moe(
        stages(activation=activation, config=config, interpret=interpret),
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        expert_map=expert_map,
        chunk_tokens=chunk_tokens,
        out_dtype=out_dtype,
    )
