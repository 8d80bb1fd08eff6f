"""Routing helpers shared by the alignment kernels, the pipeline and the reference."""

from __future__ import annotations

import jax.numpy as jnp

from wna16_jax._types import AlignedRouting


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


def placed_slots(topk_ids, num_experts: int):
    """bool [T*k]: the slots the alignment places in a block (ids in [0, num_experts))."""
    flat = topk_ids.reshape(-1)
    return (flat >= 0) & (flat < num_experts)


def slot_experts(routing: AlignedRouting, num_slots: int):
    """int32 [num_slots]: the expert of the block holding each slot; -1 for the slots in no
    block (dropped) and those in blocks of expert -1."""
    bm = routing.block_m
    block_of_position = jnp.repeat(routing.expert_ids, bm)  # [max_padded]
    # Padding positions hold the sentinel num_slots: dropped.
    return (
        jnp.full((num_slots,), -1, jnp.int32)
        .at[routing.sorted_token_ids]
        .set(block_of_position, mode="drop")
    )


def sum_slots(rows, *, in_order: bool = False):
    """f32 [T, k, H] -> [T, H], the sum over k; in_order: ((r0 + r1) + r2) + ..., an order that
    no compiler choice for the shape can change (batch_invariant)."""
    if not in_order:
        return rows.sum(axis=1)
    total = rows[:, 0]
    for j in range(1, rows.shape[1]):
        total = total + rows[:, j]
    return total
