"""The one MoE pipeline every backend plugs its GEMMs into: token chunks, and per chunk the GEMM
configs, the slots aligned into blocks, GEMM1 + activation, GEMM2, the top-k sum in f32."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from wna16_jax._activations import quantize_activations
from wna16_jax._routing import local_expert_of, placed_slots, sum_slots
from wna16_jax._types import ActivationQuant, QuantizedExperts

# Tokens per chunk of every backend. The GEMM configs are chosen per chunk from its T*k slots, so
# this is also the largest M the configs see; a chunk's largest intermediate, [T*k, max(2I, H)],
# stays under 2^31 elements for k <= 8 and max(2I, H) < 32768 (DeepSeek-V3: 7168).
DEFAULT_CHUNK_TOKENS = 8192


# ---- the stages a backend plugs in ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Routed:
    """One chunk's slots in blocks, as a backend's GEMMs take them.

    blocks: the backend's own block description (an AlignedRouting for GEMMs that read rows by
        slot; the Mosaic GPU layer's block experts and rows in use).
    top_k: k, the slots per token.
    keep: bool [T*k], the slots whose GEMM2 rows enter the top-k sum.
    slot_rows: int32 [T*k], the row of GEMM2's output holding each slot; None where GEMM2
        writes a row per slot (row s is slot s).
    """

    blocks: Any
    top_k: int
    keep: jax.Array
    slot_rows: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class MoeStages:
    """A backend's part of the pipeline: the functions it plugs in, called once per chunk.

    plan(num_slots, num_experts, w13, w2) -> plan: the chunk's static choices (its GEMMs'
        configs) for its T*k slots; passed on to the other stages.
    route(a, topk_ids, plan, *, num_experts, expert_map, distinct_experts) -> (Routed, a1):
        the slots aligned into blocks, and GEMM1's input rows a1 (a itself, or its rows in
        block order). a is x [T, H], or its Int8Rows under activation_quant. distinct_experts
        (static): no two of the chunk's slots go to one expert (one token: its k experts are
        distinct), so a block per slot holds what the alignment's blocks would.
    gemm1(a1, w13, routed, plan) -> [R, I]: the activation of GEMM1's products (fused in
        GEMM1 where the backend can), one row per slot or per block row; f32 when a1 is
        Int8Rows (it is quantized again for GEMM2), else in the backend's GEMM2 input dtype.
        Called with the keyword bias ([E, 2I], added to the f32 sums before the activation)
        when the layer has w13_bias (only backends with Backend.biases get such calls).
    gemm2(act, w2, routed, plan, routed_weights) -> f32 [R', H]: GEMM2's rows; routed_weights
        (f32 [T*k]) is given where `routed_weights` is "gemm2" (None otherwise). Called with
        the keyword bias ([E, H], added to each row before its routed weight) when the layer
        has w2_bias.
    routed_weights: where each slot's routed weight is applied: "gemm2" (GEMM2 writes a row per
        slot and scales it) or "sum" (GEMM2's rows are in block order: the top-k sum scales the
        rows it gathers).
    activation_quant: None (16-bit activations) or the int8 quantization of both GEMMs'
        inputs (W8A8): x before GEMM1, the f32 activation before GEMM2.
    """

    plan: Callable[..., Any]
    route: Callable[..., tuple[Routed, Any]]
    gemm1: Callable[..., jax.Array]
    gemm2: Callable[..., jax.Array]
    routed_weights: Literal["gemm2", "sum"] = "gemm2"
    activation_quant: ActivationQuant | None = None


def slots_in_blocks(
    align, a, topk_ids, *, block_m: int, num_experts: int, expert_map, distinct_experts=False
):
    """The `route` stage of GEMMs that read x's rows by slot and write a row per slot: the
    routing of `align` (an moe_align_block_size), every placed slot kept; a unchanged. The
    alignment takes any slots (distinct_experts is not read)."""
    routing = align(topk_ids, num_experts=num_experts, block_m=block_m, expert_map=expert_map)
    return Routed(routing, topk_ids.shape[1], placed_slots(topk_ids, num_experts)), a


# ---- the pipeline ---------------------------------------------------------------------------


def sum_over_top_k(y, routed: Routed, topk_weights=None, *, in_order: bool = False):
    """GEMM2's rows y -> f32 [T, H]: each token's k slot rows summed in f32 (`sum_slots`).

    Slots not kept (dropped by the alignment: their rows were never written; off this shard
    where the backend says so) count zero. topk_weights: [T, k], multiplied into the rows
    first (backends whose GEMM2 did not apply them); None where GEMM2 did.
    """
    k = routed.top_k
    t = routed.keep.shape[0] // k
    rows = y if routed.slot_rows is None else y[routed.slot_rows]
    rows = jnp.where(routed.keep[:, None], rows.astype(jnp.float32), 0.0).reshape(t, k, -1)
    if topk_weights is not None:
        rows = rows * topk_weights[..., None].astype(jnp.float32)
    return sum_slots(rows, in_order=in_order)


def rows_in_input_order(rows, experts, perm):
    """rows [S, K], row s in the input order of its expert: rows[s, perm[experts[s]]].

    experts: int32 [S] local experts; -1 (a row no expert reads) takes expert 0's order.
    perm: int32 [E, K] (QuantizedExperts.perm)."""
    return jnp.take_along_axis(rows, perm[jnp.maximum(experts, 0)], axis=1)


def act_order_rows(x, topk_ids, perm, *, num_experts: int, expert_map=None):
    """x's row of each slot in its expert's input order: [T*k, H], row t*k + j = x[t, perm[e]]
    with e the slot's local expert.

    Args:
        x: [T, H].  topk_ids: [T, k] global ids.  perm: int32 [E_local, H] (w13.perm).
        num_experts: E_global.  expert_map: optional int32 [E_global] global -> local.
    """
    local, _ = local_expert_of(topk_ids, num_experts=num_experts, expert_map=expert_map)
    return rows_in_input_order(jnp.repeat(x, topk_ids.shape[1], axis=0), local, perm)


def moe_chunk(
    stages: MoeStages, x, *, w13, w2, topk_weights, topk_ids, expert_map=None,
    batch_invariant=False, biases=(None, None),
):  # fmt: skip
    """One chunk of tokens through `stages`: [t, H] f32, before the output's rounding.

    Experts with an input order (w13.perm, act-order) take each slot's row of x in their
    order (`act_order_rows`): the chunk's T*k slots run as tokens of one slot each (the same
    GEMM rows as before), and their rows are summed over k in f32 after. batch_invariant: the
    k slots summed in order (`sum_slots`), and a block per slot never replaces the alignment
    (a one-token call would otherwise route differently from a token inside a batch). biases:
    (w13_bias, w2_bias), each None or [E, N]."""
    t, k = topk_ids.shape
    distinct = t == 1 and not batch_invariant  # a token's k experts are distinct
    slots = functools.partial(_slots, in_order=batch_invariant, biases=biases)
    if w13.perm is None:
        return slots(stages, x, w13, w2, topk_weights, topk_ids, expert_map, distinct)
    num_experts = expert_map.shape[0] if expert_map is not None else w13.num_experts
    rows = act_order_rows(x, topk_ids, w13.perm, num_experts=num_experts, expert_map=expert_map)
    w13 = dataclasses.replace(w13, perm=None)  # applied to the rows
    ids, weights = topk_ids.reshape(-1, 1), topk_weights.reshape(-1, 1)
    y = slots(stages, rows, w13, w2, weights, ids, expert_map, distinct)  # [T*k, H] f32
    return sum_slots(y.reshape(t, k, -1), in_order=batch_invariant)


def _slots(
    stages: MoeStages, x, w13, w2, topk_weights, topk_ids, expert_map, distinct_experts, *,
    in_order=False, biases=(None, None),
):  # fmt: skip
    """The stages on x [T, H] and its slots [T, k]: f32 [T, H] (the k slots summed in order
    where in_order)."""
    b13, b2 = ({} if b is None else {"bias": b} for b in biases)
    t, k = topk_ids.shape
    num_experts = expert_map.shape[0] if expert_map is not None else w13.num_experts
    plan = stages.plan(t * k, num_experts, w13, w2)
    quant = stages.activation_quant
    a = x if quant is None else quantize_activations(x, quant, 1)  # [T, H], or int8 rows
    routed, a = stages.route(
        a, topk_ids, plan, num_experts=num_experts, expert_map=expert_map,
        distinct_experts=distinct_experts,
    )  # fmt: skip
    act = stages.gemm1(a, w13, routed, plan, **b13)  # [R, I]
    if quant is not None:
        act = quantize_activations(act, quant, 2)  # int8 rows, a scale per row (per token)
    in_gemm2 = stages.routed_weights == "gemm2"
    weights = topk_weights.reshape(-1).astype(jnp.float32) if in_gemm2 else None
    y = stages.gemm2(act, w2, routed, plan, weights, **b2)  # [R', H] f32
    return sum_over_top_k(y, routed, None if in_gemm2 else topk_weights, in_order=in_order)


def fused_moe(
    stages: MoeStages,
    x,
    w13: QuantizedExperts,
    w2: QuantizedExperts,
    topk_weights,
    topk_ids,
    *,
    expert_map=None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    out_dtype=None,
    batch_invariant: bool = False,
    w13_bias=None,
    w2_bias=None,
):
    """The MoE layer (docs/design.md steps 1-5) through a backend's stages, in token chunks.

    Args:
        stages: the backend's MoeStages.
        x: [T, H].  w13: [E, 2I, H].  w2: [E, H, I] (in the layout the stages take).
        topk_weights: [T, k] float.  topk_ids: [T, k] int32 global ids.
        expert_map: optional int32 [E_global] global -> local (-1 off-shard).
        chunk_tokens: tokens per chunk.
        out_dtype: the output dtype (default x.dtype), rounded once from the f32 sums.
        batch_invariant: each token's k slots summed in order (`moe_chunk`); the stages were
            made with batch_invariant=True (their configs fixed for the weights).
        w13_bias: optional [E, 2I] per-expert bias of GEMM1 (before the activation).
        w2_bias: optional [E, H] per-expert bias of GEMM2 (before the routed weights).

    Returns:
        [T, H] in out_dtype.
    """
    run = functools.partial(
        moe_chunk,
        stages,
        w13=w13,
        w2=w2,
        expert_map=expert_map,
        batch_invariant=batch_invariant,
        biases=(w13_bias, w2_bias),
    )
    return map_token_chunks(
        run, x, topk_weights, topk_ids, chunk_tokens=chunk_tokens, out_dtype=out_dtype
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "make_stages",
        "activation",
        "config",
        "activation_quant",
        "chunk_tokens",
        "out_dtype",
        "batch_invariant",
    ),
)
def run(
    make_stages: Callable[..., MoeStages],
    x,
    w13: QuantizedExperts,
    w2: QuantizedExperts,
    topk_weights,
    topk_ids,
    *,
    expert_map=None,
    activation: str = "silu",
    config=None,
    activation_quant: ActivationQuant | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    out_dtype=None,
    batch_invariant: bool = False,
    w13_bias=None,
    w2_bias=None,
):
    """The MoE layer of a backend: its stages (make_stages(activation=, config=,
    activation_quant=), a backend's `Backend.stages`) through `fused_moe`, jitted; inputs
    already validated (wna16_jax.fused_moe calls it).

    Args:
        make_stages: the backend's stages factory (static: hashable, e.g. a module function or
            one functools.partial kept for reuse).
        x: [T, H].  w13: [E, 2I, H].  w2: [E, H, I] (in the layout the stages take).
        topk_weights: [T, k] float.  topk_ids: [T, k] int32 global ids.
        expert_map: optional int32 [E_global] global -> local (-1 off-shard).
        activation: the activation's name.  config: the backend's config, or None.
        activation_quant: None (16-bit activations) or an ActivationQuant with its scales.
        chunk_tokens: tokens per chunk.  out_dtype: the output dtype (default x.dtype).
        batch_invariant: each row computed as it would be alone (the stages made with
            batch_invariant=True, a backend whose `batch_invariant_reason` is None).
        w13_bias, w2_bias: optional per-expert biases [E, 2I] and [E, H] (`fused_moe`), for
            backends with Backend.biases.

    Returns:
        [T, H] in out_dtype.
    """
    # Only batch-invariant calls pass the keyword: a backend that cannot honour it takes none.
    extra = {"batch_invariant": True} if batch_invariant else {}
    stages = make_stages(
        activation=activation, config=config, activation_quant=activation_quant, **extra
    )
    return fused_moe(
        stages,
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        expert_map=expert_map,
        chunk_tokens=chunk_tokens,
        out_dtype=out_dtype,
        batch_invariant=batch_invariant,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
    )


def map_token_chunks(run, x, topk_weights, topk_ids, *, chunk_tokens: int, out_dtype=None):
    """Applies run(x, topk_weights=, topk_ids=) -> [t, H] f32 to chunks of at most chunk_tokens.

    Returns [T, H] in out_dtype (default x.dtype), rounded once from the f32 sums. Padding
    tokens of the last chunk route to id -1 (dropped).
    """
    t, hdim = x.shape
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if t == 0:
        return jnp.zeros((0, hdim), out_dtype)
    if t <= chunk_tokens:
        return run(x, topk_weights=topk_weights, topk_ids=topk_ids).astype(out_dtype)
    num_chunks = -(-t // chunk_tokens)
    pad = num_chunks * chunk_tokens - t
    xp = jnp.pad(x, ((0, pad), (0, 0)))
    wp = jnp.pad(topk_weights, ((0, pad), (0, 0)))
    ip = jnp.pad(topk_ids, ((0, pad), (0, 0)), constant_values=-1)
    out = jax.lax.map(
        lambda args: run(args[0], topk_weights=args[1], topk_ids=args[2]),
        (
            xp.reshape(num_chunks, chunk_tokens, hdim),
            wp.reshape(num_chunks, chunk_tokens, -1),
            ip.reshape(num_chunks, chunk_tokens, -1),
        ),
    )
    return out.reshape(-1, hdim)[:t].astype(out_dtype)
