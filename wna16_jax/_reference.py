"""Pure-jnp block alignment and fused MoE: the 'xla' backend and the oracle for the kernels."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from wna16_jax._quant import unpack_k, zero_points
from wna16_jax._types import AlignedRouting, QuantizedExperts

# Tokens per chunk of the reference fused_moe: bounds the [T*k, 2I] intermediates.
DEFAULT_CHUNK_TOKENS = 4096


def max_padded_len(num_slots: int, num_experts: int, block_m: int) -> int:
    """Static length of sorted_token_ids: T*k + E*(block_m - 1), rounded up to block_m."""
    n = num_slots + num_experts * (block_m - 1)
    return -(-n // block_m) * block_m


def check_align_kernel_args(
    topk_ids, *, num_experts: int, block_m: int, expert_map, max_experts: int
) -> int:
    """Validates the arguments of an align kernel (GPU kernels index in int32); returns the
    static sorted length max_padded_len(T*k, E, block_m).

    Raises:
        ValueError: a topk_ids that is not int32 [T, k], E outside [1, max_experts],
            block_m < 1, an expert_map that is not int32 [E], or 2^31 or more sorted positions.
    """
    if topk_ids.ndim != 2 or topk_ids.dtype != jnp.int32:
        raise ValueError(
            f"topk_ids must be int32 [T, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}"
        )
    if not 1 <= num_experts <= max_experts:
        raise ValueError(f"num_experts={num_experts} must be in [1, {max_experts}]")
    if block_m < 1:
        raise ValueError(f"block_m={block_m} must be positive")
    if expert_map is not None and (
        expert_map.shape != (num_experts,) or expert_map.dtype != jnp.int32
    ):
        raise ValueError(
            f"expert_map must be int32 [num_experts={num_experts}], got {expert_map.dtype} "
            f"{tuple(expert_map.shape)}"
        )
    num_slots = topk_ids.shape[0] * topk_ids.shape[1]
    max_padded = max_padded_len(num_slots, num_experts, block_m)
    if max_padded >= 2**31:
        raise ValueError(
            f"T*k={num_slots} with E={num_experts}, block_m={block_m} gives {max_padded} sorted "
            f"positions, over the 2^31 - 1 of int32 kernel indexing; route fewer tokens per call"
        )
    return max_padded


def all_padding_routing(max_padded: int, block_m: int) -> AlignedRouting:
    """The routing of zero slots: every position padding, every block expert -1."""
    return AlignedRouting(
        sorted_token_ids=jnp.zeros((max_padded,), jnp.int32),
        expert_ids=jnp.full((max_padded // block_m,), -1, jnp.int32),
        num_tokens_post_padded=jnp.zeros((), jnp.int32),
        block_m=block_m,
    )


def local_expert_of(topk_ids, *, num_experts: int, expert_map=None):
    """Flat [T*k] int32 local expert per slot; -1 for out-of-range ids and off-shard experts.

    Also returns the flat [T*k] int32 *global* expert with invalid ids replaced by -1.
    """
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    valid = (ids >= 0) & (ids < num_experts)
    gid = jnp.where(valid, ids, -1)
    if expert_map is None:
        return gid, gid
    lid = jnp.where(valid, expert_map[jnp.clip(gid, 0, num_experts - 1)], -1)
    return lid, gid


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
        AlignedRouting; see DESIGN.md for the exact layout.
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


def silu_and_mul(h):
    """[.., 2I] -> [.., I]: silu(gate) * up with gate = first half."""
    i = h.shape[-1] // 2
    return jax.nn.silu(h[..., :i]) * h[..., i:]


ACTIVATIONS = {"silu": silu_and_mul}


def _fused_moe_chunk(
    x, w13, w2, topk_weights, topk_ids, *, expert_map, activation, activation_quant, block_m
):
    t, k = topk_ids.shape
    num_experts = expert_map.shape[0] if expert_map is not None else w13.num_experts
    routing = moe_align_block_size(
        topk_ids, num_experts=num_experts, block_m=block_m, expert_map=expert_map
    )

    def gemm(a, w, which: int, **kwargs):
        """GEMM `which` (1 or 2) of the layer, in f32; with int8 activations, `a` quantized
        first and the product exact in int32 with the scales applied in f32."""
        if activation_quant is None:
            return grouped_matmul(a, w, routing, **kwargs)
        q, scale = quantize_activations(a, activation_quant, which)
        return grouped_matmul_int8(q, scale, w, routing, **kwargs)

    h = gemm(x, w13, 1, top_k=k)  # [T*k, 2I] f32
    act = ACTIVATIONS[activation](h)  # [T*k, I] f32
    y = gemm(
        act, w2, 2, top_k=1, routed_weights=topk_weights.reshape(-1).astype(jnp.float32)
    )  # [T*k, H]
    return y.reshape(t, k, -1).sum(axis=1)


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
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    out_dtype=None,
):
    """Reference MoE layer (DESIGN.md steps 1-5) in f32, processed in token chunks.

    With activation_quant (int8 activations: the oracle of the W8A8 kernels), x is quantized
    per `activation_quant` (GEMM1's input), GEMM1 is exact in int32 with the scales applied in
    f32, silu(gate) * up in f32 is quantized again (GEMM2's input), GEMM2 is exact with the
    routed weights, then the k slots are summed in f32. The kernels apply the same
    quantization to the same values, so only f32 rounding order separates them.

    Args:
        x: [T, H] activations.  w13: [E, 2I, H].  w2: [E, H, I] (any canonical weights).
        topk_weights: [T, k] float.  topk_ids: [T, k] int32 global ids.
        expert_map: optional int32 [E_global] global -> local (-1 off-shard).
        activation: "silu".  activation_quant: None (16-bit activations) or an ActivationQuant
        with its scales known.  block_m: alignment block.  chunk_tokens: tokens per chunk.
        out_dtype: the output dtype (default x.dtype).

    Returns:
        [T, H] in out_dtype.
    """
    run = functools.partial(
        _fused_moe_chunk,
        w13=w13,
        w2=w2,
        expert_map=expert_map,
        activation=activation,
        activation_quant=activation_quant,
        block_m=block_m,
    )
    return map_token_chunks(
        run, x, topk_weights, topk_ids, chunk_tokens=chunk_tokens, out_dtype=out_dtype
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


# ---- int8 activations (W8A8): quantization and the exact integer products --------------------

# Symmetric int8 activations use [-127, 127] (the grid is symmetric around 0).
INT8_ACTIVATION_MAX = 127


def quantize_activations_per_token(x):
    """Dynamic symmetric int8 quantization of each row (token).

    scale_t = max|x_t| * (1/127) and q = clip(round(x * (1 / scale_t)), -127, 127), round half
    to even, all in f32 (0 scale and q for an all-zero row). The divisions are written as
    products with reciprocals because that is what XLA compiles them to (it rewrites a / b by
    a broadcast or constant b as a * (1/b)): so written, numpy reproduces the result bitwise.

    Args:
        x: [T, K] float.

    Returns:
        (q int8 [T, K], scale f32 [T]); x ~= q * scale[:, None].
    """
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1) * jnp.float32(1.0 / INT8_ACTIVATION_MAX)  # [T]
    inv = jnp.float32(1.0) / jnp.where(scale > 0, scale, jnp.float32(1.0))  # [T]
    q = jnp.clip(jnp.round(xf * inv[:, None]), -INT8_ACTIVATION_MAX, INT8_ACTIVATION_MAX)
    return q.astype(jnp.int8), scale


def quantize_activations_static(x, scale: float):
    """Static symmetric int8 quantization with one given scale for the whole tensor.

    Args:
        x: [T, K] float.
        scale: positive float (a static Python float).

    Returns:
        (q int8 [T, K] = clip(round(x * (1 / scale)), -127, 127) in f32, scale f32 [T] filled
        with `scale`).
    """
    s = np.float32(scale)
    inv = np.float32(1.0) / s  # on the host, IEEE f32
    q = jnp.clip(jnp.round(x.astype(jnp.float32) * inv), -INT8_ACTIVATION_MAX, INT8_ACTIVATION_MAX)
    return q.astype(jnp.int8), jnp.full((x.shape[0],), s, jnp.float32)


def quantize_activations(x, activation_quant, gemm: int):
    """The int8 input of GEMM `gemm` (1 or 2) under an ActivationQuant: (q int8, scale f32 [T])."""
    if activation_quant.scheme == "int8_per_token":
        return quantize_activations_per_token(x)
    scale = activation_quant.gemm1_scale if gemm == 1 else activation_quant.gemm2_scale
    return quantize_activations_static(x, scale)


def _signed_weights_one(qw: QuantizedExperts, e):
    """Expert `e` (traced) as integer q - z [N, K] (int8 when it fits, else int32) and f32
    scales [N, G]."""
    q = unpack_k(jax.lax.dynamic_index_in_dim(qw.qweight, e, keepdims=False), qw.bits)
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
