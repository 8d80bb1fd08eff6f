"""Block-aligned token sort (moe_align_block_size) in Triton: an atomic count, then placement."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels.triton import _launch
from pallas_kernels.triton.config import MAX_EXPERTS
from wna16_jax import backend_api
from wna16_jax.backend_api import AlignedRouting, max_padded_len

# Slots per program of both kernels.
CHUNK_SLOTS = 256
# Elements of one program's [blocks, EP] searchsorted tile: sets its blocks from EP.
_TILE_ELEMENTS = 8192


@triton.jit
def _count_kernel(
    ids_ptr,  # [S] int32 global expert id of each slot
    counts_ptr,  # [EP] int32 slots per expert; zeroed before the launch
    rank_ptr,  # [S] int32 rank of each placed slot among its expert's slots
    NUM_SLOTS: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Program c counts slots c * CHUNK.. by atomic increments; each slot keeps its ticket."""
    slot = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    inside = slot < NUM_SLOTS
    ids = tl.load(ids_ptr + slot, mask=inside, other=-1)
    placed = inside & (ids >= 0) & (ids < NUM_EXPERTS)  # out-of-range ids are dropped
    rank = tl.atomic_add(counts_ptr + tl.where(placed, ids, 0), 1, mask=placed, sem="relaxed")
    tl.store(rank_ptr + slot, rank, mask=placed)


@triton.jit
def _place_kernel(
    ids_ptr,  # [S] int32
    map_ptr,  # [E] int32 global -> local expert (a 1-element dummy without a map)
    counts_ptr,  # [EP] int32 from _count_kernel
    rank_ptr,  # [S] int32 from _count_kernel
    sorted_ptr,  # [P] int32 out: sorted_token_ids
    eids_ptr,  # [NUM_BLOCKS] int32 out: expert_ids
    ntpp_ptr,  # [1] int32 out: num_tokens_post_padded
    scratch_ptr,  # [programs, 2, EP] int32: each program's run starts and fill ends
    NUM_SLOTS: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    EP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BMP: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    HAS_MAP: tl.constexpr,
):
    """Program p places slots p * CHUNK.. and fills blocks p * BLOCKS_PER_PROGRAM.. .

    Every program derives the runs from the counts: expert e owns sorted positions
    [run_start[e], run_end[e]), a multiple of BLOCK_M; its slot of rank r goes to
    run_start[e] + r and positions from run_start[e] + count[e] on are padding. Each output
    element is written by exactly one program, so programs need no ordering.
    """
    p = tl.program_id(0)
    experts = tl.arange(0, EP)
    counts = tl.load(counts_ptr + experts)  # [EP]; entries >= NUM_EXPERTS are 0
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    run_end = tl.cumsum(padded, axis=0)
    run_start = run_end - padded
    used = tl.sum(padded, axis=0)  # num_tokens_post_padded
    if p == 0:
        tl.store(ntpp_ptr, used)
    # Register tensors cannot be indexed by a vector: gathers read this program's own copy.
    starts_ptr = scratch_ptr + p * (2 * EP)
    fill_end_ptr = starts_ptr + EP
    tl.store(starts_ptr + experts, run_start)
    tl.store(fill_end_ptr + experts, run_start + counts)
    tl.debug_barrier()

    # Slots: each placed slot to its run start plus its rank.
    slot = p * CHUNK + tl.arange(0, CHUNK)
    inside = slot < NUM_SLOTS
    ids = tl.load(ids_ptr + slot, mask=inside, other=-1)
    placed = inside & (ids >= 0) & (ids < NUM_EXPERTS)
    expert = tl.where(placed, ids, 0)
    dest = tl.load(starts_ptr + expert, mask=placed, other=0)
    dest += tl.load(rank_ptr + slot, mask=placed, other=0)
    tl.store(sorted_ptr + dest, slot, mask=placed)

    # Blocks: expert_ids, and the sentinel NUM_SLOTS at the padding positions.
    block = p * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)  # [B]
    block_start = block * BLOCK_M
    in_use = block_start < used
    # The block's expert: how many runs end at or before its start (searchsorted, right).
    owner = tl.sum((run_end[None, :] <= block_start[:, None]).to(tl.int32), axis=1)  # [B]
    owner = tl.where(in_use, owner, 0)
    if HAS_MAP:
        local = tl.load(map_ptr + owner, mask=in_use, other=-1)
    else:
        local = owner
    tl.store(eids_ptr + block, tl.where(in_use, local, -1), mask=block < NUM_BLOCKS)
    first_pad = tl.load(fill_end_ptr + owner, mask=in_use, other=0)  # [B]; 0: all padding
    col = tl.arange(0, BMP)
    pos = block_start[:, None] + col[None, :]  # [B, BMP]
    is_pad = (pos >= first_pad[:, None]) & (col[None, :] < BLOCK_M)
    is_pad = is_pad & (block[:, None] < NUM_BLOCKS)
    sentinel = tl.full([BLOCKS_PER_PROGRAM, BMP], NUM_SLOTS, tl.int32)
    tl.store(sorted_ptr + pos, sentinel, mask=is_pad)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def align_launches(
    topk_ids, *, num_experts: int, block_m: int, expert_map=None
) -> tuple[_launch.Launch, functools.partial]:
    """(count launch, place launch given the count's outputs) of `moe_align_block_size`."""
    t, k = topk_ids.shape
    num_slots = t * k
    max_padded = max_padded_len(num_slots, num_experts, block_m)
    num_blocks = max_padded // block_m
    ep = _pow2(num_experts)
    bmp = _pow2(block_m)
    blocks_per_program = max(1, min(64, _TILE_ELEMENTS // max(ep, bmp)))
    num_chunks = -(-num_slots // CHUNK_SLOTS)
    programs = max(num_chunks, -(-num_blocks // blocks_per_program))
    ids = topk_ids.reshape(-1)
    count = _launch.Launch(
        kernel=_count_kernel,
        inputs=(ids,),
        outputs=(
            jax.ShapeDtypeStruct((ep,), jnp.int32),
            jax.ShapeDtypeStruct((num_slots,), jnp.int32),
        ),
        grid=(num_chunks,),
        constexprs=dict(NUM_SLOTS=num_slots, NUM_EXPERTS=num_experts, CHUNK=CHUNK_SLOTS),
        zeroed_outputs=(0,),
        name="triton_moe_align_count",
    )
    mapping = expert_map if expert_map is not None else jnp.zeros((1,), jnp.int32)

    def place(counts, rank) -> _launch.Launch:
        return _launch.Launch(
            kernel=_place_kernel,
            inputs=(ids, mapping, counts, rank),
            outputs=(
                jax.ShapeDtypeStruct((max_padded,), jnp.int32),
                jax.ShapeDtypeStruct((num_blocks,), jnp.int32),
                jax.ShapeDtypeStruct((1,), jnp.int32),
                jax.ShapeDtypeStruct((programs * 2 * ep,), jnp.int32),
            ),
            grid=(programs,),
            constexprs=dict(
                NUM_SLOTS=num_slots,
                NUM_EXPERTS=num_experts,
                EP=ep,
                BLOCK_M=block_m,
                BMP=bmp,
                NUM_BLOCKS=num_blocks,
                CHUNK=CHUNK_SLOTS,
                BLOCKS_PER_PROGRAM=blocks_per_program,
                HAS_MAP=expert_map is not None,
            ),
            name="triton_moe_align_place",
        )

    return count, place


@functools.partial(jax.jit, static_argnames=("num_experts", "block_m", "interpret"))
def moe_align_block_size(
    topk_ids,
    *,
    num_experts: int,
    block_m: int,
    expert_map=None,
    interpret: bool = False,
) -> AlignedRouting:
    """Groups the T*k (token, slot) pairs by expert, each expert's run padded to block_m.

    Same contract as `wna16_jax._reference.moe_align_block_size` (docs/design.md), in two launches:
    one counts the slots of each expert with atomic increments (each slot keeps the count it
    saw: its rank), the next places every slot at its run start plus its rank and writes
    expert_ids and the padding. The order inside a run follows the atomics, so it may differ
    from the reference's and between runs.

    Args:
        topk_ids: int32 [T, k] global expert ids; ids outside [0, num_experts) are dropped.
        num_experts: E, the global number of experts (len(expert_map) when given), <= 1024.
        block_m: the padding multiple (rows per GEMM block).
        expert_map: optional int32 [E] global -> local id, -1 for experts on other shards.
        interpret: run in Triton's interpreter on the host (any platform; slow).

    Returns:
        AlignedRouting: sorted_token_ids int32 [P], expert_ids int32 [P // block_m],
        num_tokens_post_padded int32 [], with P = max_padded_len(T*k, E, block_m).

    Raises:
        ValueError: a topk_ids that is not int32 [T, k], E outside [1, 1024], block_m < 1, an
            expert_map that is not int32 [E], or 2^31 or more sorted positions.
    """
    max_padded = backend_api.check_align_kernel_args(
        topk_ids,
        num_experts=num_experts,
        block_m=block_m,
        expert_map=expert_map,
        max_experts=MAX_EXPERTS,
    )
    if topk_ids.size == 0:  # nothing to count: every position is padding
        return backend_api.all_padding_routing(max_padded, block_m)
    count, place = align_launches(
        topk_ids, num_experts=num_experts, block_m=block_m, expert_map=expert_map
    )
    counts, rank = _launch.run(count, interpret=interpret)
    sorted_ids, expert_ids, ntpp, _ = _launch.run(place(counts, rank), interpret=interpret)
    return AlignedRouting(
        sorted_token_ids=sorted_ids,
        expert_ids=expert_ids,
        num_tokens_post_padded=ntpp.reshape(()),
        block_m=block_m,
    )
