"""The MoE layer from the Triton kernels: the pipeline's stages on the Triton align kernel and
WNA16 GEMM, whose GEMM2 applies the routed weights and writes a row per slot."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from pallas_kernels.common.block_configs import block_configs
from pallas_kernels.triton.align import moe_align_block_size
from pallas_kernels.triton.config import RULES
from pallas_kernels.triton.wna16_gemm import wna16_gemm
from wna16_jax import backend_api
from wna16_jax.backend_api import BlockConfig, activate


def _plan(
    num_slots, num_experts, w13, w2, *, config, batch_invariant
) -> tuple[BlockConfig, BlockConfig]:
    return block_configs(num_slots, w13, w2, config, rules=RULES, batch_invariant=batch_invariant)


def _route(a, topk_ids, plan, *, num_experts, expert_map, distinct_experts, interpret):
    return backend_api.slots_in_blocks(
        functools.partial(moe_align_block_size, interpret=interpret),
        a,
        topk_ids,
        block_m=plan[0].block_m,
        num_experts=num_experts,
        expert_map=expert_map,
        distinct_experts=distinct_experts,
    )


def _gemm1(x, w13, routed, plan, *, activation, interpret, bias=None):
    """[T, H] -> the activation per slot [T*k, I]: GEMM1's f32 sums plus the expert's bias
    ([E, 2I] or None) rounded to x.dtype (as the Pallas pipeline's unfused GEMM1 and vLLM do),
    then the activation."""
    h = wna16_gemm(  # [T*k, 2I]
        x, w13, routed.blocks, top_k=routed.top_k, config=plan[0], interpret=interpret, bias=bias
    )
    return activate(h, activation, x.dtype)


def _gemm2(act, w2, routed, plan, routed_weights, *, interpret, bias=None):
    """[T*k, I] -> f32 [T*k, H], each slot's row plus its expert's bias ([E, H] or None)
    times its routed weight."""
    return wna16_gemm(
        act,
        w2,
        routed.blocks,
        routed_weights,
        top_k=1,
        config=plan[1],
        out_dtype=jnp.float32,
        interpret=interpret,
        bias=bias,
    )


def stages(
    *, activation: str = "silu", config: BlockConfig | None = None, activation_quant=None,
    batch_invariant: bool = False, interpret: bool = False,
):  # fmt: skip
    """This backend's MoeStages (Backend.stages; the library's pipeline runs them): the Triton
    align kernel and WNA16 GEMMs. GEMM1's output and the activation are rounded to x.dtype (as
    the Pallas pipeline and vLLM do); GEMM2 writes f32 with the routed weights applied. The
    per-expert biases (w13_bias, w2_bias) are added in the GEMMs' epilogues to the f32 sums:
    GEMM1's before the activation, GEMM2's before the routed weight.

    Args:
        activation: a key of ACTIVATIONS.
        config: BlockConfig for both GEMMs or None (tuned table, then heuristic, per GEMM:
            `block_configs` under RULES: tensor-core configs only).
        activation_quant: None (this backend runs 16-bit activations only).
        batch_invariant: both GEMMs' configs chosen for the weights' shape alone (a fixed M),
            without a K split.
        interpret: run the kernels in Triton's interpreter on the host (slow; for tests).

    Raises:
        NotImplementedError: an activation_quant.
    """
    if activation_quant is not None:
        raise NotImplementedError(
            f"the triton backend runs no activation_quant, got {activation_quant!r}"
        )
    return backend_api.MoeStages(
        plan=functools.partial(_plan, config=config, batch_invariant=batch_invariant),
        route=functools.partial(_route, interpret=interpret),
        gemm1=functools.partial(_gemm1, activation=activation, interpret=interpret),
        gemm2=functools.partial(_gemm2, interpret=interpret),
    )
