"""Block-aligned token sort (moe_align_block_size) as Pallas Triton kernels, without atomics."""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from wna16_jax import backend_api
from wna16_jax.backend_api import AlignedRouting

logger = logging.getLogger(__name__)

# E is padded to a power of two EP and held as [rows, EP] one-hot tiles in registers.
MAX_EXPERTS = 1024
# Elements of one [rows, EP] tile: sets the rows per step (slots or blocks) from EP.
_TILE_ELEMENTS = 8192
# Rows of the [num_chunks, EP] count matrix read per step by the scatter kernel.
_COUNT_ROWS = 16


@dataclasses.dataclass(frozen=True)
class AlignConfig:
    """How the align kernels split the work (frozen, hashable: a static argument).

    fused: one launch whose every program counts all T*k slots itself (small T*k), else a
        histogram launch over chunks first and a scatter launch reading its counts.
    chunk_slots: slots each program scatters (two launches: also the slots each histogram
        program counts); a power of two.
    blocks_per_program: the most blocks (expert_ids entries) one program fills; more programs
        are launched when the blocks need them.
    unroll: loop steps whose loads are issued together before their arithmetic.
    num_warps: Triton warps per program.
    """

    fused: bool = True
    chunk_slots: int = 64
    blocks_per_program: int = 64
    unroll: int = 4
    num_warps: int = 4

    def __post_init__(self):
        for f in ("chunk_slots", "blocks_per_program", "unroll", "num_warps"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"AlignConfig.{f}={v!r} must be a power of two")


# Up to this many slots (T*k) the fused single launch is the default, its programs filling
# FUSED_BLOCKS_PER_PROGRAM blocks each; from more slots two launches (a histogram, then the
# scatter) are faster. Figures: docs/performance.md, 'Backend order, rows gather, alignment'.
FUSED_MAX_SLOTS = 512
FUSED_BLOCKS_PER_PROGRAM = 32
# Two-launch chunk sizes by T*k: the fastest of 128..2048 on the H200 (E=256, top-8).
_CHUNK_SLOTS_BY_SIZE = ((8192, 128), (65536, 256), (262144, 512))


def default_config(num_slots: int) -> AlignConfig:
    """The AlignConfig used for T*k = num_slots when none is given."""
    if num_slots <= FUSED_MAX_SLOTS:
        return AlignConfig(fused=True, chunk_slots=64, blocks_per_program=FUSED_BLOCKS_PER_PROGRAM)
    chunk = next((c for s, c in _CHUNK_SLOTS_BY_SIZE if num_slots <= s), 1024)
    return AlignConfig(fused=False, chunk_slots=chunk)


def _rows_per_tile(ep: int) -> int:
    return max(16, min(128, _TILE_ELEMENTS // ep))


def _pipelined_loop(num_steps: int, load, compute, carry, *, unroll: int):
    """carry = compute(step, load(step), carry) for step in range(num_steps).

    Each loop iteration issues the loads of `unroll` steps before any of their arithmetic, so
    their memory latencies overlap (the Triton lowering takes no `unroll` on fori_loop).
    """

    def steps(first, count, carry):
        loaded = [load(first + u) for u in range(count)]
        for u in range(count):
            carry = compute(first + u, loaded[u], carry)
        return carry

    full, rest = divmod(num_steps, unroll)
    if full == 1:
        carry = steps(0, unroll, carry)
    elif full > 1:
        carry = jax.lax.fori_loop(0, full, lambda it, c: steps(it * unroll, unroll, c), carry)
    if rest:
        carry = steps(full * unroll, rest, carry)
    return carry


def _load_ids(ids_ref, start, *, rows: int, stop, num_experts: int):
    """[rows] int32 expert ids of slots start..start+rows-1; -1 where dropped or >= stop."""
    slot = start + jnp.arange(rows, dtype=jnp.int32)
    # A gather, not pl.ds: a static start past the end would fail pl.ds's bounds check.
    raw = plgpu.load(ids_ref.at[jnp.where(slot < stop, slot, 0)], mask=slot < stop, other=-1)
    return jnp.where((raw >= 0) & (raw < num_experts), raw, -1)


def _count_slots(
    ids_ref,
    start,
    stop,
    *,
    num_steps: int,
    split=None,
    rows: int,
    ep: int,
    num_experts: int,
    unroll: int,
):
    """[EP] int32 slots per expert among slots [start, stop), by one-hot sums.

    With `split`, also returns the [EP] counts among slots [start, split).
    """
    expert = jnp.arange(ep, dtype=jnp.int32)

    def load(step):
        return _load_ids(
            ids_ref, start + step * rows, rows=rows, stop=stop, num_experts=num_experts
        )

    def compute(step, ids, carry):
        onehot = (ids[:, None] == expert[None, :]).astype(jnp.int32)  # [rows, EP]
        if split is None:
            return carry + onehot.sum(axis=0)
        total, before = carry
        slot = start + step * rows + jnp.arange(rows, dtype=jnp.int32)
        return (
            total + onehot.sum(axis=0),
            before + jnp.where(slot[:, None] < split, onehot, 0).sum(axis=0),
        )

    zeros = jnp.zeros(ep, jnp.int32)
    return _pipelined_loop(
        num_steps, load, compute, zeros if split is None else (zeros, zeros), unroll=unroll
    )


def _histogram_kernel(
    ids_ref, counts_ref, *, num_slots: int, chunk_slots: int, ep: int, num_experts: int, unroll: int
):
    """Program c writes counts_ref[c, :] ([num_chunks, EP] int32): its chunk's slots per expert."""
    c = pl.program_id(0)
    rows = _rows_per_tile(ep)
    start = c * chunk_slots
    counts = _count_slots(
        ids_ref,
        start,
        jnp.minimum(start + chunk_slots, num_slots),
        num_steps=pl.cdiv(chunk_slots, rows),
        rows=rows,
        ep=ep,
        num_experts=num_experts,
        unroll=unroll,
    )
    counts_ref[pl.ds(c, 1), :] = counts[None, :]


def _pick(onehot, values):
    """[rows] values[e] at the single True column e of each onehot row (0 when none)."""
    return jnp.where(onehot, values[None, :], 0).sum(axis=1)


def _align_kernel(
    *refs,
    num_slots: int,
    num_experts: int,
    block_m: int,
    chunk_slots: int,
    blocks_per_program: int,
    has_map: bool,
    has_counts: bool,
    ep: int,
    unroll: int,
):
    """Program i scatters slot chunk i and fills blocks [i*bpp, (i+1)*bpp) of the outputs.

    refs: ids [S] int32, (expert_map [E] int32), (counts [num_chunks, EP] int32 from the
    histogram kernel, else each program counts all S slots itself); outputs
    sorted_token_ids [P] int32, expert_ids [P // block_m] int32, num_tokens_post_padded [1].
    Every output element is written exactly once, by one program: no ordering is needed.
    """
    refs = list(refs)
    ids_ref = refs.pop(0)
    map_ref = refs.pop(0) if has_map else None
    counts_ref = refs.pop(0) if has_counts else None
    sorted_ref, expert_ids_ref, ntp_ref = refs

    i = pl.program_id(0)
    rows = _rows_per_tile(ep)
    max_padded = sorted_ref.shape[0]  # P
    num_blocks = expert_ids_ref.shape[0]  # P // block_m
    expert = jnp.arange(ep, dtype=jnp.int32)  # [EP]
    chunk_start = i * chunk_slots
    chunk_end = jnp.minimum(chunk_start + chunk_slots, num_slots)

    # --- per expert: all slots (total) and the slots of the chunks before this one (before).
    if counts_ref is None:
        total, before = _count_slots(
            ids_ref,
            0,
            num_slots,
            num_steps=pl.cdiv(num_slots, rows),
            split=chunk_start,
            rows=rows,
            ep=ep,
            num_experts=num_experts,
            unroll=unroll,
        )
    else:

        def load(step):
            return counts_ref[pl.ds(step * _COUNT_ROWS, _COUNT_ROWS), :]  # [COUNT_ROWS, EP]

        def compute(step, tile, carry):
            total, before = carry
            c = step * _COUNT_ROWS + jnp.arange(_COUNT_ROWS, dtype=jnp.int32)  # chunk index
            return (
                total + tile.sum(axis=0),
                before + jnp.where(c[:, None] < i, tile, 0).sum(axis=0),
            )

        zeros = jnp.zeros(ep, jnp.int32)
        total, before = _pipelined_loop(
            counts_ref.shape[0] // _COUNT_ROWS, load, compute, (zeros, zeros), unroll=unroll
        )

    # --- runs: expert e owns sorted positions [run_start[e], run_end[e]), a multiple of block_m.
    padded = jax.lax.div(total + (block_m - 1), block_m) * block_m  # [EP]
    run_end = jnp.cumsum(padded)  # [EP]; EP-E trailing zeros keep run_end = used length
    run_start = run_end - padded
    fill_end = run_start + total  # positions >= fill_end inside a run are padding
    used = padded.sum()  # num_tokens_post_padded

    @pl.when(i == 0)
    def _():
        ntp_ref[0] = used

    # --- scatter: slot s of expert e goes to run_start[e] + (slots of e before s), so each run
    # holds its slots in ascending order.
    earlier = jnp.arange(rows)[None, :] < jnp.arange(rows)[:, None]  # [rows, rows]: j < r

    def load_chunk(step):
        return _load_ids(
            ids_ref, chunk_start + step * rows, rows=rows, stop=chunk_end, num_experts=num_experts
        )

    def scatter(step, ids, next_free):
        slot = chunk_start + step * rows + jnp.arange(rows, dtype=jnp.int32)  # [rows]
        onehot = ids[:, None] == expert[None, :]  # [rows, EP]
        rank = ((ids[:, None] == ids[None, :]) & earlier).astype(jnp.int32).sum(axis=1)
        dest = _pick(onehot, next_free) + rank  # [rows] position in sorted_token_ids
        valid = ids >= 0
        # Masked lanes point past the end: never touched on GPU, dropped by the interpreter.
        plgpu.store(sorted_ref.at[jnp.where(valid, dest, max_padded)], slot, mask=valid)
        return next_free + onehot.astype(jnp.int32).sum(axis=0)

    _pipelined_loop(
        pl.cdiv(chunk_slots, rows), load_chunk, scatter, run_start + before, unroll=unroll
    )

    # --- blocks: expert_ids and the padding entries (sentinel num_slots) of this program's blocks.
    bmp = pl.next_power_of_2(block_m)
    col = jnp.arange(bmp, dtype=jnp.int32)  # [BMP]
    expert_map = (
        plgpu.load(map_ref.at[pl.ds(0, ep)])  # padded to EP with -1 by the wrapper
        if has_map
        else expert
    )  # [EP] local id of each global expert

    # [block_rows, BMP] sentinel tiles stay within _TILE_ELEMENTS for block_m up to 512.
    block_rows = max(16, min(rows, _TILE_ELEMENTS // bmp))

    def blocks(step, _, carry):
        b0 = i * blocks_per_program + step * block_rows
        b = b0 + jnp.arange(block_rows, dtype=jnp.int32)  # [block_rows] block indices
        block_start = b * block_m
        in_use = block_start < used
        # Expert of a block: how many runs end at or before its start (searchsorted, right).
        e = (run_end[None, :] <= block_start[:, None]).astype(jnp.int32).sum(axis=1)
        onehot = e[:, None] == expert[None, :]  # [block_rows, EP]
        local = _pick(onehot, expert_map)
        plgpu.store(
            expert_ids_ref.at[pl.ds(b0, block_rows)],
            jnp.where(in_use, local, -1),
            mask=b < num_blocks,
        )
        first_pad = jnp.where(in_use, _pick(onehot, fill_end), 0)  # [block_rows]
        pos = block_start[:, None] + col[None, :]  # [block_rows, BMP]
        is_pad = (pos >= first_pad[:, None]) & (col[None, :] < block_m) & (b[:, None] < num_blocks)
        plgpu.store(
            sorted_ref.at[jnp.where(is_pad, pos, max_padded)],
            jnp.full((block_rows, bmp), num_slots, jnp.int32),
            mask=is_pad,
        )
        return carry

    _pipelined_loop(blocks_per_program // block_rows, lambda step: None, blocks, 0, unroll=unroll)


@functools.partial(jax.jit, static_argnames=("num_experts", "block_m", "config", "interpret"))
def moe_align_block_size(
    topk_ids: jax.Array,
    *,
    num_experts: int,
    block_m: int,
    expert_map: jax.Array | None = None,
    config: AlignConfig | None = None,
    interpret: bool = False,
) -> AlignedRouting:
    """Groups the T*k (token, slot) pairs by expert, each expert's run padded to block_m.

    Same contract as `wna16_jax._reference.moe_align_block_size` (docs/design.md). Each run holds
    its slots in ascending order, so the result equals the reference's exactly and does not
    vary between runs.

    Args:
        topk_ids: int32 [T, k] global expert ids; ids outside [0, num_experts) are dropped.
        num_experts: E, the global number of experts (len(expert_map) when given), <= 1024.
        block_m: the padding multiple (rows per GEMM block).
        expert_map: optional int32 [E] global -> local id, -1 for experts on other shards.
        config: how to split the work; None picks `default_config(T*k)`.
        interpret: run the kernels with the Pallas interpreter (any platform).

    Returns:
        AlignedRouting: sorted_token_ids int32 [P], expert_ids int32 [P // block_m],
        num_tokens_post_padded int32 [], with P = max_padded_len(T*k, E, block_m).

    Raises:
        ValueError: on a topk_ids that is not int32 [T, k], E outside [1, 1024], block_m < 1,
            an expert_map that is not int32 [E], or 2^31 or more sorted positions.
    """
    max_padded = backend_api.check_align_kernel_args(  # P
        topk_ids,
        num_experts=num_experts,
        block_m=block_m,
        expert_map=expert_map,
        max_experts=MAX_EXPERTS,
    )
    t, k = topk_ids.shape
    num_slots = t * k  # S, also the sentinel
    num_blocks = max_padded // block_m
    if num_slots == 0:  # nothing to launch over: every position is padding
        return backend_api.all_padding_routing(max_padded, block_m)

    if config is None:
        config = default_config(num_slots)
        if interpret:  # the interpreter runs programs one after another: use one, no unrolling
            config = AlignConfig(
                chunk_slots=pl.next_power_of_2(num_slots),
                blocks_per_program=pl.next_power_of_2(num_blocks),
                unroll=1,
            )
    logger.debug(
        "wna16_jax: moe_align_block_size T*k=%d E=%d block_m=%d uses %s",
        num_slots,
        num_experts,
        block_m,
        config,
    )
    ep = pl.next_power_of_2(num_experts)
    rows = _rows_per_tile(ep)
    chunk_slots = max(config.chunk_slots, rows)
    num_chunks = pl.cdiv(num_slots, chunk_slots)
    if not config.fused:  # the scatter kernel reads the count matrix _COUNT_ROWS rows at a time
        num_chunks = pl.cdiv(num_chunks, _COUNT_ROWS) * _COUNT_ROWS
    blocks_per_program = max(config.blocks_per_program, rows)
    num_programs = max(num_chunks, pl.cdiv(num_blocks, blocks_per_program))
    blocks_per_program = pl.cdiv(pl.cdiv(num_blocks, num_programs), rows) * rows
    flat_ids = topk_ids.reshape(num_slots)  # [S]
    params = plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1)

    inputs = [flat_ids]
    if expert_map is not None:
        # Padded to EP entries so the kernel's [EP] load stays in bounds (jax 0.12 checks).
        inputs.append(jnp.pad(expert_map, (0, ep - num_experts), constant_values=-1))
    if not config.fused:
        histogram = pl.pallas_call(
            functools.partial(
                _histogram_kernel,
                num_slots=num_slots,
                chunk_slots=chunk_slots,
                ep=ep,
                num_experts=num_experts,
                unroll=config.unroll,
            ),
            out_shape=jax.ShapeDtypeStruct((num_chunks, ep), jnp.int32),
            grid=(num_chunks,),
            compiler_params=params,
            interpret=interpret,
            name="moe_align_histogram",
        )
        inputs.append(histogram(flat_ids))  # [num_chunks, EP]
    sorted_token_ids, expert_ids, ntp = pl.pallas_call(
        functools.partial(
            _align_kernel,
            num_slots=num_slots,
            num_experts=num_experts,
            block_m=block_m,
            chunk_slots=chunk_slots,
            blocks_per_program=blocks_per_program,
            has_map=expert_map is not None,
            has_counts=not config.fused,
            ep=ep,
            unroll=config.unroll,
        ),
        out_shape=(
            jax.ShapeDtypeStruct((max_padded,), jnp.int32),
            jax.ShapeDtypeStruct((num_blocks,), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32),
        ),
        grid=(num_programs,),
        compiler_params=params,
        interpret=interpret,
        name="moe_align_scatter",
    )(*inputs)
    return AlignedRouting(
        sorted_token_ids=sorted_token_ids,
        expert_ids=expert_ids,
        num_tokens_post_padded=ntp.reshape(()),
        block_m=block_m,
    )
