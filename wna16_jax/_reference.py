"""Pure-jnp block alignment and fused MoE: the 'xla' backend and the oracle for the kernels."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from wna16_jax import _pipeline
from wna16_jax._activations import Int8Rows, activation_fn
from wna16_jax._quant import E2M1_VALUES, dequantize_mxfp4_codes, e8m0_to_f32, unpack_k, zero_points
from wna16_jax._routing import local_expert_of, max_padded_len, slot_experts
from wna16_jax._types import AlignedRouting, QuantizedExperts


def moe_align_block_size(
    topk_ids, *, num_experts: int, block_m: int, expert_map=None
) -> AlignedRouting:
    """Groups the T*k (token, slot) pairs by expert, each expert's run padded to block_m.

    Args:
        topk_ids: int32 [T, k] global expert ids; ids outside [0, num_experts) are dropped.
        num_experts: E, the global number of experts (len(expert_map) when given).
        block_m: the padding multiple (rows per GEMM block).
        expert_map: optional int32 [E] global -> local id, -1 for experts on other shards.

    Returns:
        AlignedRouting; see docs/design.md for the exact layout.
    """
    t, k = topk_ids.shape
    num_slots = t * k
    max_padded = max_padded_len(num_slots, num_experts, block_m)
    num_blocks = max_padded // block_m
    _, gid = local_expert_of(topk_ids, num_experts=num_experts, expert_map=None)
    # Bucket E holds the dropped slots; it gets no run.
    bucket = jnp.where(gid >= 0, gid, num_experts)
    counts = jnp.zeros(num_experts + 1, jnp.int32).at[bucket].add(1)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    run_end = jnp.cumsum(padded)  # [E]
    run_start = run_end - padded
    total = run_end[-1] if num_experts else jnp.int32(0)
    # Rank of each slot inside its expert: position in a stable sort by bucket.
    order = jnp.argsort(bucket, stable=True)  # [T*k]
    sorted_bucket = bucket[order]
    first_of_bucket = jnp.searchsorted(sorted_bucket, sorted_bucket, side="left")
    rank_sorted = jnp.arange(num_slots, dtype=jnp.int32) - first_of_bucket.astype(jnp.int32)
    start_sorted = jnp.where(
        sorted_bucket < num_experts,
        run_start[jnp.clip(sorted_bucket, 0, num_experts - 1)],
        max_padded,  # dropped: scattered out of bounds, hence not written
    )
    dest = start_sorted + rank_sorted
    sorted_token_ids = (
        jnp.full((max_padded,), num_slots, jnp.int32)
        .at[dest]
        .set(order.astype(jnp.int32), mode="drop")
    )
    block_start = jnp.arange(num_blocks, dtype=jnp.int32) * block_m
    block_expert = jnp.searchsorted(run_end, block_start, side="right").astype(jnp.int32)
    in_use = block_start < total
    block_expert = jnp.where(in_use, block_expert, -1)
    if expert_map is not None:
        block_expert = jnp.where(in_use, expert_map[jnp.clip(block_expert, 0, num_experts - 1)], -1)
    return AlignedRouting(
        sorted_token_ids=sorted_token_ids,
        expert_ids=block_expert.astype(jnp.int32),
        num_tokens_post_padded=jnp.asarray(total, jnp.int32),
        block_m=block_m,
    )


def _dequantize_one(qw: QuantizedExperts, e):
    """Dequantizes expert `e` (traced index) to f32 [N, K]."""
    q = unpack_k(jax.lax.dynamic_index_in_dim(qw.qweight, e, keepdims=False), qw.bits)
    if qw.is_mxfp4:
        return dequantize_mxfp4_codes(q, jax.lax.dynamic_index_in_dim(qw.scales, e, keepdims=False))
    s = jax.lax.dynamic_index_in_dim(qw.scales, e, keepdims=False).astype(jnp.float32)
    z = jax.lax.dynamic_index_in_dim(zero_points(qw), e, keepdims=False).astype(jnp.float32)
    n, k = q.shape
    g = qw.group
    w = (q.reshape(n, k // g, g).astype(jnp.float32) - z[..., None]) * s[..., None]
    return w.reshape(n, k)


def grouped_matmul(
    a, qw: QuantizedExperts, routing: AlignedRouting, *, top_k: int, routed_weights=None,
    bias=None,
):  # fmt: skip
    """Block-sorted grouped matmul: rows of `a` times dequant(qw[e]).T, in f32.

    Args:
        a: [R, K] rows; slot s of the routing reads row s // top_k.
        qw: QuantizedExperts [E_local, N, K].
        routing: AlignedRouting over R * top_k slots (sentinel = R * top_k).
        top_k: slots per row of `a` (1 when `a` already holds one row per slot).
        routed_weights: optional f32 [num_slots] multiplied into each slot's output row.
        bias: optional [E_local, N] float, expert e's added to its rows (before the routed
            weights), in f32.

    Returns:
        f32 [num_slots, N]: output row per slot (rows of blocks of expert -1 are zero).
    """
    bm = routing.block_m
    num_slots = a.shape[0] * top_k
    n = qw.n
    ids = routing.sorted_token_ids
    num_used_blocks = routing.num_tokens_post_padded // bm
    a32 = a.astype(jnp.float32)

    def body(b, out):
        slot = jax.lax.dynamic_slice_in_dim(ids, b * bm, bm)  # [bm]
        valid = slot < num_slots
        rows = a32[jnp.where(valid, slot // top_k, 0)]  # [bm, K]
        e = routing.expert_ids[b]
        w = _dequantize_one(qw, jnp.maximum(e, 0))  # [N, K]
        y = jnp.dot(rows, w.T, precision=jax.lax.Precision.HIGHEST)  # [bm, N]
        if bias is not None:
            y = y + bias[jnp.maximum(e, 0)].astype(jnp.float32)
        if routed_weights is not None:
            y = y * routed_weights[jnp.where(valid, slot, 0)][:, None]
        y = jnp.where((e >= 0) & valid[:, None], y, 0.0)
        # Padding slots go to the spare row num_slots, dropped below.
        return out.at[jnp.where(valid, slot, num_slots)].set(y)

    out = jnp.zeros((num_slots + 1, n), jnp.float32)
    out = jax.lax.fori_loop(0, num_used_blocks, body, out)
    return out[:num_slots]


# ---- int8 activations (W8A8): the exact integer products -----------------------------------


def _signed_weights_one(qw: QuantizedExperts, e):
    """Expert `e` (traced) as integer q - z [N, K] (int8 when it fits, else int32) and f32
    scales [N, G]. MXFP4: 2 * e2m1(q) (integers in [-12, 12]) and 2^(X - 127) / 2."""
    q = unpack_k(jax.lax.dynamic_index_in_dim(qw.qweight, e, keepdims=False), qw.bits)
    if qw.is_mxfp4:
        twice = jnp.asarray([2 * v for v in E2M1_VALUES], jnp.int8)[q]  # [N, K]
        x = jax.lax.dynamic_index_in_dim(qw.scales, e, keepdims=False)
        return twice, e8m0_to_f32(x) * jnp.float32(0.5)
    s = jax.lax.dynamic_index_in_dim(qw.scales, e, keepdims=False).astype(jnp.float32)
    z = jax.lax.dynamic_index_in_dim(zero_points(qw), e, keepdims=False).astype(jnp.int32)
    n, k = q.shape
    g = qw.group
    w = q.reshape(n, k // g, g).astype(jnp.int32) - z[..., None]  # [N, G, g]
    # Symmetric weights and int4 fit int8 (q - z in [-128, 127] / [-15, 15]); int8 with zero
    # points spans [-255, 255].
    fits_int8 = qw.bits == 4 or not qw.has_zeros
    return w.reshape(n, k).astype(jnp.int8 if fits_int8 else jnp.int32), s


def grouped_matmul_int8(
    a_q,
    a_scale,
    qw: QuantizedExperts,
    routing: AlignedRouting,
    *,
    top_k: int,
    routed_weights=None,
):
    """Block-sorted grouped matmul of int8 activation rows with quantized weights, exactly.

    out[s] = sum_g (a_q[r] . (q - z)[e, :, group g]) * scales[e, :, g] * a_scale[r], r = s //
    top_k: each group's integer dot is exact (int32), the scales are applied in f32 in the
    order ((acc * w_scale) * a_scale) * routed_weight, which is the kernels' epilogue order for
    per-channel weights. Any canonical weights work (the 'xla' oracle of W8A8 and W4A8).

    Args:
        a_q: int8 [R, K] quantized rows; slot s reads row s // top_k.
        a_scale: f32 [R] the rows' scales.
        qw: QuantizedExperts [E_local, N, K].
        routing: AlignedRouting over R * top_k slots (sentinel = R * top_k).
        top_k: slots per row of `a_q`.
        routed_weights: optional f32 [num_slots] multiplied into each slot's output row.

    Returns:
        f32 [num_slots, N] (rows of blocks of expert -1 are zero).
    """
    bm = routing.block_m
    num_slots = a_q.shape[0] * top_k
    n, k = qw.n, qw.k
    g = qw.group
    ids = routing.sorted_token_ids
    num_used_blocks = routing.num_tokens_post_padded // bm

    def body(b, out):
        slot = jax.lax.dynamic_slice_in_dim(ids, b * bm, bm)  # [bm]
        valid = slot < num_slots
        row = jnp.where(valid, slot // top_k, 0)
        e = routing.expert_ids[b]
        w, s = _signed_weights_one(qw, jnp.maximum(e, 0))  # [N, K] int, [N, G] f32
        rows = a_q[row].astype(w.dtype).reshape(bm, k // g, g)  # [bm, G, g]
        acc = jax.lax.dot_general(
            rows,
            w.reshape(n, k // g, g),
            dimension_numbers=(((2,), (2,)), ((1,), (1,))),
            preferred_element_type=jnp.int32,
        )  # [G, bm, N] exact
        y = jnp.sum(acc.astype(jnp.float32) * s.T[:, None, :], axis=0)  # [bm, N]
        y = y * a_scale[row][:, None]
        if routed_weights is not None:
            y = y * routed_weights[jnp.where(valid, slot, 0)][:, None]
        y = jnp.where((e >= 0) & valid[:, None], y, 0.0)
        return out.at[jnp.where(valid, slot, num_slots)].set(y)

    out = jnp.zeros((num_slots + 1, n), jnp.float32)
    out = jax.lax.fori_loop(0, num_used_blocks, body, out)
    return out[:num_slots]


# ---- the layer: the 'xla' backend's MoeStages ---------------------------------------------


def _gemm(a, w, routed: _pipeline.Routed, *, top_k: int, routed_weights=None, bias=None):
    """A GEMM of the layer in f32; on Int8Rows exact in int32 with the scales applied in f32
    (a bias, [E, N], added in f32 before the routed weights)."""
    if isinstance(a, Int8Rows) and bias is None:
        return grouped_matmul_int8(
            a.q, a.scale, w, routed.blocks, top_k=top_k, routed_weights=routed_weights
        )
    if isinstance(a, Int8Rows):
        y = grouped_matmul_int8(a.q, a.scale, w, routed.blocks, top_k=top_k)
        experts = slot_experts(routed.blocks, y.shape[0])  # each slot's expert's bias
        b = bias[jnp.maximum(experts, 0)].astype(jnp.float32)
        y = y + jnp.where(experts[:, None] >= 0, b, 0.0)
        return y if routed_weights is None else y * routed_weights[:, None]
    return grouped_matmul(
        a, w, routed.blocks, top_k=top_k, routed_weights=routed_weights, bias=bias
    )


def _plan(num_slots, num_experts, w13, w2, *, block_m: int) -> int:
    return block_m


def _route(a, topk_ids, block_m: int, *, num_experts: int, expert_map, distinct_experts):
    return _pipeline.slots_in_blocks(
        moe_align_block_size,
        a,
        topk_ids,
        block_m=block_m,
        num_experts=num_experts,
        expert_map=expert_map,
        distinct_experts=distinct_experts,
    )


def _gemm1(a, w13, routed, block_m, *, activation, bias=None):
    h = _gemm(a, w13, routed, top_k=routed.top_k, bias=bias)  # [T*k, 2I] f32
    return activation_fn(activation)(h)  # [T*k, I] f32: unrounded (the kernels round to x.dtype)


def _gemm2(act, w2, routed, block_m, routed_weights, bias=None):
    return _gemm(act, w2, routed, top_k=1, routed_weights=routed_weights, bias=bias)  # [T*k, H]


def stages(*, block_m: int = 16, activation="silu", activation_quant=None):
    """The reference's MoeStages: `moe_align_block_size`, then `grouped_matmul` (or
    `grouped_matmul_int8` on int8 rows) for both GEMMs, the activation in f32 between them."""
    return _pipeline.MoeStages(
        plan=functools.partial(_plan, block_m=block_m),
        route=_route,
        gemm1=functools.partial(_gemm1, activation=activation),
        gemm2=_gemm2,
        activation_quant=activation_quant,
    )


@functools.partial(
    jax.jit,
    static_argnames=("activation", "activation_quant", "block_m", "chunk_tokens", "out_dtype"),
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
    activation_quant=None,
    block_m: int = 16,
    chunk_tokens: int = _pipeline.DEFAULT_CHUNK_TOKENS,
    out_dtype=None,
    w13_bias=None,
    w2_bias=None,
):
    """Reference MoE layer (docs/design.md steps 1-5) in f32, processed in token chunks.

    With activation_quant (int8 activations: the oracle of the W8A8 kernels), x is quantized
    per `activation_quant` (GEMM1's input), GEMM1 is exact in int32 with the scales applied in
    f32, silu(gate) * up in f32 is quantized again (GEMM2's input), GEMM2 is exact with the
    routed weights, then the k slots are summed in f32. The kernels apply the same
    quantization to the same values, so only f32 rounding order separates them.

    Args:
        x: [T, H] activations.  w13: [E, 2I, H].  w2: [E, H, I] (any canonical weights).
        topk_weights: [T, k] float.  topk_ids: [T, k] int32 global ids.
        expert_map: optional int32 [E_global] global -> local (-1 off-shard).
        activation: "silu" or a ClampedSwiGLU.  activation_quant: None (16-bit activations) or
        an ActivationQuant with its scales known.  block_m: alignment block.  chunk_tokens:
        tokens per chunk.  out_dtype: the output dtype (default x.dtype).
        w13_bias: optional [E, 2I], added to GEMM1's sums before the activation.
        w2_bias: optional [E, H], added to GEMM2's rows before the routed weights.

    Returns:
        [T, H] in out_dtype.
    """
    return _pipeline.fused_moe(
        stages(block_m=block_m, activation=activation, activation_quant=activation_quant),
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        expert_map=expert_map,
        chunk_tokens=chunk_tokens,
        out_dtype=out_dtype,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
    )
