"""Pure-jnp block alignment, grouped GEMM and fused MoE: the 'xla' backend and the oracle for the
kernels; its layer is computed on its own (no _pipeline), so a kernel's test compares two
independent computations."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from wna16_jax._activations import Int8Rows, activation_fn, quantize_activations
from wna16_jax._quant import (
    E2M1_VALUES,
    dequantize_mxfp4_codes,
    e8m0_to_f32,
    unpack_k,
    zero_points,
)
from wna16_jax._routing import local_expert_of, max_padded_len, sum_slots
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
    a, qw: QuantizedExperts, routing: AlignedRouting, *, top_k: int, routed_weights=None
):
    """Block-sorted grouped matmul: rows of `a` times dequant(qw[e]).T, in f32.

    Args:
        a: [R, K] rows; slot s of the routing reads row s // top_k.
        qw: QuantizedExperts [E_local, N, K].
        routing: AlignedRouting over R * top_k slots (sentinel = R * top_k).
        top_k: slots per row of `a` (1 when `a` already holds one row per slot).
        routed_weights: optional f32 [num_slots] multiplied into each slot's output row.

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
    ids = routing.sorted_token_ids
    num_used_blocks = routing.num_tokens_post_padded // bm

    def body(b, out):
        slot = jax.lax.dynamic_slice_in_dim(ids, b * bm, bm)  # [bm]
        valid = slot < num_slots
        row = jnp.where(valid, slot // top_k, 0)
        e = routing.expert_ids[b]
        y = _int8_rows_times(a_q[row], a_scale[row], qw, jnp.maximum(e, 0))  # [bm, N]
        if routed_weights is not None:
            y = y * routed_weights[jnp.where(valid, slot, 0)][:, None]
        y = jnp.where((e >= 0) & valid[:, None], y, 0.0)
        return out.at[jnp.where(valid, slot, num_slots)].set(y)

    out = jnp.zeros((num_slots + 1, qw.n), jnp.float32)
    out = jax.lax.fori_loop(0, num_used_blocks, body, out)
    return out[:num_slots]


def _int8_rows_times(q, scale, qw: QuantizedExperts, e):
    """f32 [R, N] = int8 rows q [R, K] (scales f32 [R]) times expert `e` (traced) of `qw`,
    transposed: each group's integer dot exact in int32, then the weight scales and the row
    scales in f32 (the W8A8 kernels' epilogue order)."""
    w, s = _signed_weights_one(qw, e)  # [N, K] int, [N, G] f32
    r, k = q.shape
    g = qw.group
    acc = jax.lax.dot_general(
        q.astype(w.dtype).reshape(r, k // g, g),  # [R, G, g]
        w.reshape(qw.n, k // g, g),
        dimension_numbers=(((2,), (2,)), ((1,), (1,))),
        preferred_element_type=jnp.int32,
    )  # [G, R, N] exact
    y = jnp.sum(acc.astype(jnp.float32) * s.T[:, None, :], axis=0)  # [R, N]
    return y * scale[:, None]


# ---- the layer: computed on its own, not through _pipeline -----------------------------------

# Tokens per block of the layer: every GEMM of the reference has this many rows, whatever T,
# so a token's result does not depend on the other tokens of its call.
TOKEN_BLOCK = 16


def _gemm_rows(a, qw: QuantizedExperts, e):
    """f32 [R, N] = rows a [R, K] times expert `e` (traced) of `qw`, transposed: in f32 on the
    dequantized weight for float rows; exact for Int8Rows (`_int8_rows_times`)."""
    if isinstance(a, Int8Rows):
        return _int8_rows_times(a.q, a.scale, qw, e)
    w = _dequantize_one(qw, e)  # [N, K] f32
    return jnp.dot(a.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST)


def _expert_layer(x, w13, w2, e, *, activation, activation_quant, biases=(None, None)):
    """One expert's MLP on rows x [R, H]: f32 [R, H] = w2[e] @ act(w13[e] @ x + b13[e]) +
    b2[e], the activation in f32 (unrounded), each GEMM's input quantized first under
    activation_quant; x's columns in the expert's input order first where w13 has one (perm,
    act-order). biases: (w13_bias [E, 2I], w2_bias [E, H]), each None or added in f32."""
    b13, b2 = biases
    if w13.perm is not None:  # act-order: the rows in the expert's input order
        x = x[:, jax.lax.dynamic_index_in_dim(w13.perm, e, keepdims=False)]
    a = x if activation_quant is None else quantize_activations(x, activation_quant, 1)
    h = _gemm_rows(a, w13, e)  # [R, 2I] f32
    if b13 is not None:
        h = h + b13[e].astype(jnp.float32)
    h = activation_fn(activation)(h)  # [R, I] f32
    if activation_quant is not None:
        h = quantize_activations(h, activation_quant, 2)  # a scale per row
    y = _gemm_rows(h, w2, e)  # [R, H] f32
    return y if b2 is None else y + b2[e].astype(jnp.float32)


def _slot_experts(topk_ids, num_experts: int, expert_map):
    """int32 [T, k]: each slot's local expert; -1 for an id outside [0, num_experts) and for an
    expert off this shard (expert_map -1)."""
    ids = topk_ids.astype(jnp.int32)
    valid = (ids >= 0) & (ids < num_experts)
    safe = jnp.where(valid, ids, 0)
    local = safe if expert_map is None else expert_map.astype(jnp.int32)[safe]
    return jnp.where(valid, local, -1)


@functools.partial(
    jax.jit, static_argnames=("activation", "activation_quant", "out_dtype", "batch_invariant")
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
    out_dtype=None,
    batch_invariant: bool = False,
    w13_bias=None,
    w2_bias=None,
):
    """Reference MoE layer (docs/design.md steps 1-5) in f32, computed on its own: no alignment,
    no _pipeline. For each block of TOKEN_BLOCK tokens, each local expert's MLP on the block's
    rows (`_expert_layer`; or, where the block holds fewer slots than there are experts, each
    slot's expert's); slot (t, j) takes its expert's row t
    times topk_weights[t, j]; each token's k slots are summed in f32 (j in order).

    With activation_quant (int8 activations: the oracle of the W8A8 kernels), x is quantized
    per `activation_quant` (GEMM1's input), GEMM1 is exact in int32 with the scales applied in
    f32, silu(gate) * up in f32 is quantized again (GEMM2's input), GEMM2 is exact, the routed
    weight multiplies each slot's row, then the k slots are summed in f32. The kernels apply the
    same quantization to the same values, so only f32 rounding order separates them.

    Args:
        x: [T, H] activations.  w13: [E, 2I, H].  w2: [E, H, I] (any canonical weights).
        topk_weights: [T, k] float.  topk_ids: [T, k] int32 global ids (ids outside
            [0, E_global) are dropped).
        expert_map: optional int32 [E_global] global -> local (-1 off-shard: dropped).
        activation: "silu" or a ClampedSwiGLU.  activation_quant: None (16-bit activations) or
        an ActivationQuant with its scales known.  out_dtype: the output dtype (default
        x.dtype).
        w13_bias: optional [E, 2I], added to GEMM1's sums before the activation.
        w2_bias: optional [E, H], added to GEMM2's rows before the routed weights.
        batch_invariant: the k slots summed left to right (`sum_slots`); the token blocks'
            GEMMs already have one shape for every T.

    Returns:
        [T, H] in out_dtype.
    """
    t, hdim = x.shape
    k = topk_ids.shape[1]
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if t == 0:
        return jnp.zeros((0, hdim), out_dtype)
    num_experts = w13.num_experts if expert_map is None else expert_map.shape[0]
    experts = _slot_experts(topk_ids, num_experts, expert_map)  # [T, k]
    blocks = -(-t // TOKEN_BLOCK)
    pad = blocks * TOKEN_BLOCK - t
    xb = jnp.pad(x, ((0, pad), (0, 0))).reshape(blocks, TOKEN_BLOCK, hdim)
    eb = jnp.pad(experts, ((0, pad), (0, 0)), constant_values=-1).reshape(blocks, TOKEN_BLOCK, k)
    wb = jnp.pad(topk_weights.astype(jnp.float32), ((0, pad), (0, 0)))
    wb = wb.reshape(blocks, TOKEN_BLOCK, k)
    layer = functools.partial(
        _expert_layer, activation=activation, activation_quant=activation_quant,
        biases=(w13_bias, w2_bias),
    )  # fmt: skip

    # Two loops give the same bits (each slot's row is its expert's MLP on the whole block, one
    # GEMM shape for every T); the shorter one is taken, and neither branches on data (no
    # conditional in a program that runs the reference, e.g. a model's decode loop).
    slots_per_block = min(t, TOKEN_BLOCK) * k  # the slots a block can hold (T < TB: one block)

    def by_expert(rows, ids, weights):  # every local expert once: [TB, k, H]
        def expert(e, block_slots):
            y = layer(rows, w13, w2, e)  # [TB, H] f32
            mine = (ids == e)[..., None]  # [TB, k, 1]
            return jnp.where(mine, y[:, None, :] * weights[..., None], block_slots)

        zero = jnp.zeros((TOKEN_BLOCK, k, hdim), jnp.float32)
        return jax.lax.fori_loop(0, w13.num_experts, expert, zero)

    def by_slot(rows, ids, weights):  # each slot's expert in turn: [TB, k, H]
        def slot(s, block_slots):
            row, j = s // k, s % k
            e = ids[row, j]
            y = layer(rows, w13, w2, jnp.maximum(e, 0))[row]  # [H] f32
            value = jnp.where(e >= 0, y * weights[row, j], 0.0)
            return block_slots.at[row, j].set(value)

        zero = jnp.zeros((TOKEN_BLOCK, k, hdim), jnp.float32)
        return jax.lax.fori_loop(0, slots_per_block, slot, zero)

    per_block = by_slot if slots_per_block < w13.num_experts else by_expert

    def block(b, slots):  # slots: f32 [T_pad, k, H], each slot's weighted row
        block_slots = per_block(xb[b], eb[b], wb[b])  # [TB, H], [TB, k], [TB, k] in
        return jax.lax.dynamic_update_slice_in_dim(slots, block_slots, b * TOKEN_BLOCK, axis=0)

    slots = jnp.zeros((blocks * TOKEN_BLOCK, k, hdim), jnp.float32)
    slots = jax.lax.fori_loop(0, blocks, block, slots)
    # [T, H]: the sum over each token's k slots
    return sum_slots(slots[:t], in_order=batch_invariant).astype(out_dtype)
