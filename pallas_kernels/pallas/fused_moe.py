"""The MoE layer from the Pallas-Triton kernels: the pipeline's stages on the align kernel and the
WNA16 (or W8A8) grouped GEMM, whose GEMM2 applies the routed weights and writes a row per slot."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax.numpy as jnp

from pallas_kernels.common.align import moe_align_block_size
from pallas_kernels.common.block_configs import block_config_rules, block_configs
from pallas_kernels.pallas import w8a8_gemm as w8a8
from pallas_kernels.pallas.wna16_gemm import wna16_gemm
from wna16_jax import backend_api
from wna16_jax.backend_api import (
    ActivationQuant,
    BlockConfig,
    Int8Rows,
    QuantizedExperts,
    activate,
    activation_fn,
    normalize_activation,
)

# The Pallas-Triton grouped GEMM's ConfigRules: its BlockConfig validity rules and heuristic,
# and the "pallas" tuned table (measured on this GEMM).
RULES = block_config_rules(table="pallas")


def gemm_configs(
    num_slots: int,
    w13: QuantizedExperts,
    w2: QuantizedExperts,
    config: BlockConfig | None,
    *,
    activation_quant: ActivationQuant | None = None,
    batch_invariant: bool = False,
) -> tuple[BlockConfig, BlockConfig]:
    """This backend's configs of GEMM1 and GEMM2 (`block_configs`): the WNA16 GEMM's RULES, or
    the W8A8 GEMM's (`w8a8_gemm.RULES`) with activation_quant; batch_invariant: at a fixed M
    without a K split."""
    if activation_quant is None:
        return block_configs(
            num_slots, w13, w2, config, rules=RULES, batch_invariant=batch_invariant
        )
    return block_configs(
        num_slots, w13, w2, config, rules=w8a8.RULES, name=f"W8A8 ({activation_quant.scheme})",
        shape_of=w8a8.gemm_shape, batch_invariant=batch_invariant,
    )  # fmt: skip


def fuses_activation(c1: BlockConfig, w13: QuantizedExperts, activation) -> bool:
    """Whether GEMM1 computes the activation ("silu" or a ClampedSwiGLU) in its epilogue (not
    with split-K partials)."""
    known = normalize_activation(activation) is not None
    return c1.split_k == 1 and known and (w13.n // 2) % c1.block_n == 0


def act_in_slice_major(c1: BlockConfig, c2: BlockConfig, w13, activation: str) -> bool:
    """Whether GEMM1's fused epilogue writes the activation in GEMM2's slice_major order."""
    return fuses_activation(c1, w13, activation) and c2.unpack == "slices"


def align(topk_ids, *, num_experts, block_m, expert_map, interpret):
    """This backend's moe_align_block_size (the Pallas align kernel)."""
    return moe_align_block_size(
        topk_ids,
        num_experts=num_experts,
        block_m=block_m,
        expert_map=expert_map,
        interpret=interpret,
    )


def gemm1_and_activation(
    x, w13, w2, routing, *, top_k, c1, c2, activation, interpret, bias=None
):  # fmt: skip
    """[T, H] -> activation(x @ w13.T) per slot [T*k, I] in x.dtype, and whether its columns
    are in GEMM2's slice_major order (written so by GEMM1's fused epilogue)."""
    to_slices = act_in_slice_major(c1, c2, w13, activation)
    out_slice_major = (c2.block_k, w2.bits) if to_slices else None
    act = _activation_rows(
        x, w13, routing, top_k=top_k, c1=c1, activation=activation,
        out_slice_major=out_slice_major, interpret=interpret, bias=bias,
    )  # fmt: skip
    return act, to_slices


def _activation_rows(
    x, w13, routing, *, top_k, c1, activation, out_slice_major, interpret, bias=None
):  # fmt: skip
    """GEMM1 and the activation (bias: [E, 2I], added in GEMM1's epilogue, or None)."""
    extra = {} if bias is None else {"bias": bias}
    if fuses_activation(c1, w13, activation):
        return wna16_gemm(
            x,
            w13,
            routing,
            top_k=top_k,
            config=c1,
            interpret=interpret,
            activation=activation,
            out_slice_major=out_slice_major,
            **extra,
        )
    # split-K partial sums: the activation runs after the whole sum.
    h = wna16_gemm(x, w13, routing, top_k=top_k, config=c1, interpret=interpret, **extra)
    return activate(h, activation, x.dtype)  # [T*k, 2I] -> [T*k, I]


def gemm2_routed(act, w2, routing, topk_weights, *, c2, act_slice_major, interpret, bias=None):
    """[T*k, I] -> f32 [T*k, H], each slot's row (plus its expert's bias: [E, H] or None)
    times its routed weight."""
    extra = {} if bias is None else {"bias": bias}
    return wna16_gemm(
        act,
        w2,
        routing,
        topk_weights.reshape(-1).astype(jnp.float32),
        top_k=1,
        config=c2,
        out_dtype=jnp.float32,
        interpret=interpret,
        a_slice_major=act_slice_major,
        **extra,
    )


# ---- the pipeline's stages --------------------------------------------------------------------


class Plan(NamedTuple):
    """A chunk's GEMM configs, and GEMM1's output column order where its fused epilogue writes
    GEMM2's slice_major order: (GEMM2's block_k, w2's bits), else None."""

    c1: BlockConfig
    c2: BlockConfig
    out_slice_major: tuple[int, int] | None = None


def _plan(
    num_slots, num_experts, w13, w2, *, config, activation, activation_quant, batch_invariant
) -> Plan:
    c1, c2 = gemm_configs(
        num_slots, w13, w2, config, activation_quant=activation_quant,
        batch_invariant=batch_invariant,
    )  # fmt: skip
    if activation_quant is None and act_in_slice_major(c1, c2, w13, activation):
        return Plan(c1, c2, (c2.block_k, w2.bits))
    return Plan(c1, c2)


def _route(a, topk_ids, plan: Plan, *, num_experts, expert_map, distinct_experts, interpret):
    return backend_api.slots_in_blocks(
        functools.partial(align, interpret=interpret),
        a,
        topk_ids,
        block_m=plan.c1.block_m,
        num_experts=num_experts,
        expert_map=expert_map,
        distinct_experts=distinct_experts,
    )


def _gemm1(a, w13, routed, plan: Plan, *, activation, interpret, bias=None):
    """[T, H] -> the activation per slot [T*k, I]: in x.dtype (`gemm1_and_activation`), or in
    f32 from the W8A8 GEMM's f32 output (not rounded before its second quantization)."""
    routing, k = routed.blocks, routed.top_k
    if isinstance(a, Int8Rows):
        h = w8a8.w8a8_gemm(a.q, a.scale, w13, routing, top_k=k, config=plan.c1, interpret=interpret)
        return activation_fn(activation)(h)  # [T*k, I] f32
    return _activation_rows(
        a, w13, routing, top_k=k, c1=plan.c1, activation=activation,
        out_slice_major=plan.out_slice_major, interpret=interpret, bias=bias,
    )  # fmt: skip


def _gemm2(act, w2, routed, plan: Plan, routed_weights, *, interpret, bias=None):
    """[T*k, I] -> f32 [T*k, H], each slot's row times its routed weight."""
    if isinstance(act, Int8Rows):
        return w8a8.w8a8_gemm(
            act.q,
            act.scale,
            w2,
            routed.blocks,
            routed_weights,
            top_k=1,
            config=plan.c2,
            interpret=interpret,
        )
    return gemm2_routed(
        act,
        w2,
        routed.blocks,
        routed_weights,
        c2=plan.c2,
        act_slice_major=plan.out_slice_major is not None,
        interpret=interpret,
        bias=bias,
    )


def stages(
    *,
    activation: str = "silu",
    config: BlockConfig | None = None,
    activation_quant: ActivationQuant | None = None,
    batch_invariant: bool = False,
    interpret: bool = False,
) -> backend_api.MoeStages:
    """This backend's MoeStages (Backend.stages; the library's pipeline runs them): the Pallas
    align kernel, the WNA16 GEMMs (the W8A8 GEMMs with activation_quant), the routed weights
    applied by GEMM2.

    GEMM1's activation is rounded to x.dtype (as vLLM does); GEMM2 writes f32 with the routed
    weights applied, summed over the k slots in f32 by the pipeline. With activation_quant (W8A8;
    w13 and w2 int8 per-channel symmetric): x is quantized to int8 rows, GEMM1 runs int8 x int8
    -> int32 with the scales in its epilogue (f32 out), silu(gate) * up in f32 is quantized
    again, and GEMM2 runs the same way with the routed weights.

    Args:
        activation: "silu".
        config: BlockConfig for both GEMMs or None (tuned table, then heuristic, per GEMM).
        activation_quant: None (16-bit activations) or an ActivationQuant with its scales.
        batch_invariant: both GEMMs' configs chosen for the weights' shape alone (a fixed M),
            without a K split, so a row's sums do not depend on the rows beside it.
        interpret: run the kernels under the Pallas interpreter.
    """
    return backend_api.MoeStages(
        plan=functools.partial(
            _plan,
            config=config,
            activation=activation,
            activation_quant=activation_quant,
            batch_invariant=batch_invariant,
        ),  # fmt: skip
        route=functools.partial(_route, interpret=interpret),
        gemm1=functools.partial(_gemm1, activation=activation, interpret=interpret),
        gemm2=functools.partial(_gemm2, interpret=interpret),
        activation_quant=activation_quant,
    )
