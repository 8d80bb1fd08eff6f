"""The MoE layer on the Mosaic GPU GEMM (the 'mgpu' backend): align -> gather rows -> GEMM1 ->
silu*up -> GEMM2 -> weighted sum over top-k.

Unlike the Triton-lowered pipeline, the GEMMs take rows already in block order (x gathered
once by XLA), write rows in block order, and the top-k sum gathers each slot's row back.
Weights are QuantizedExperts in the "mgpu_int4" layout (wna16_jax.layouts).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.common import gather_rows
from pallas_kernels.mosaic_gpu.config import (
    MgpuConfig,
    default_config,
    from_block_config,
    gemm_plan,
    one_group_block_k,
)
from pallas_kernels.mosaic_gpu.wna16_gemm import mgpu_wna16_gemm
from pallas_kernels.triton.fused_moe import DEFAULT_CHUNK_TOKENS, align
from wna16_jax import _reference
from wna16_jax._types import BlockConfig, QuantizedExperts

BLOCK_COST = {8: 1.0, 16: 1.35, 32: 2.6}
# Chunks of fewer tokens keep the default config even under ByRouting: at M=16 one prompt's
# 8-row blocks were already the faster (206.6 vs 221.1 us with the choice, session 7).
MIN_ROUTED_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class ByRouting:
    """config=ByRouting() (opt-in): the block size picked per chunk at run time from the routing
    (`routed_configs`, `pick_config`): larger blocks where a chunk's tokens share experts (a
    batch decoding one prompt: at DeepSeek-V3 M=64 460.3 vs 537.9 us, M=256 930.4 vs 1127.8,
    H200 session 7). The choice is an XLA conditional: the host waits for the routing once per
    layer and chunk, and under spread routing it costs the layer 15-30 us (H200, session 18,
    one process: M=64 1626.1 vs 1596.5 us, M=256 1981.2 vs 1962.4; back to back 1623.1 vs
    1593.0 and 1982.7 vs 1968.0), so the default (config None) picks by the token count
    alone, as vLLM's fused_moe does."""


def routed_configs(
    num_tokens: int, top_k: int, num_experts: int, group: int, down_k: int | None = None
):
    """The configs the layer picks from at run time by the routing (`ByRouting`): the default
    (block_m by the mean rows per expert, `default_config`) and, for chunks of
    MIN_ROUTED_TOKENS tokens or more, larger non-specialized blocks (up to 32 rows:
    BLOCK_COST). A batch decoding one prompt routes every token to the same k experts: at M=64
    and 256 the default blocks read each expert's weights 8 and 16 times; 32-row blocks took
    460.3 vs 537.9 us and 930.4 vs 1127.8 us (H200, session 7); on the flat grid of session 8
    447.4 vs 518.5 and 924.6 vs 1119.9 us. down_k: GEMM2's K, as default_config takes it."""
    base = default_config(num_tokens * top_k, num_experts, group, down_k)
    if num_tokens < MIN_ROUTED_TOKENS or base.block_m not in BLOCK_COST:
        return (base,)
    block_k = one_group_block_k(group)
    larger = [
        MgpuConfig(block_m=bm, block_k=block_k, narrow_blocks=1)
        for bm in BLOCK_COST
        if bm > base.block_m
    ]
    return (base, *larger)


def pick_config(topk_ids, num_experts: int, configs) -> jax.Array:
    """Index into configs (by block_m) of the least cost for this routing: each expert's rows in
    blocks of block_m, each block at BLOCK_COST (ties: the first)."""
    if len(configs) == 1:
        return jnp.int32(0)
    ids = topk_ids.reshape(-1)
    valid = (ids >= 0) & (ids < num_experts)
    rows = jnp.zeros(num_experts, jnp.int32).at[jnp.where(valid, ids, 0)].add(valid)
    costs = [
        jnp.sum(-(-rows // c.block_m)).astype(jnp.float32) * BLOCK_COST[c.block_m] for c in configs
    ]
    return jnp.argmin(jnp.stack(costs)).astype(jnp.int32)


def rows_in_block_order(x, slots, top_k: int, *, interpret: bool = False):
    """x's row of each aligned slot ([P, H]; padding slots, ids >= T*k, get zero rows): the
    gather_rows kernel where its tiles fit (XLA's gather and select took 441 us for the ~1 GB
    of DeepSeek-V3's rows at M=4096 on the H200, session 11), else `xla_rows_in_block_order`."""
    if gather_rows.tile_shape(slots.shape[0], x.shape[1]) is None:
        return xla_rows_in_block_order(x, slots, top_k)
    ids = jnp.where(slots < x.shape[0] * top_k, slots // top_k, -1)
    return gather_rows.gather_rows(x, ids, interpret=interpret)


def xla_rows_in_block_order(x, slots, top_k: int):
    """rows_in_block_order by XLA's gather and select."""
    placed = slots < x.shape[0] * top_k
    return jnp.where(placed[:, None], x[jnp.where(placed, slots // top_k, 0)], 0).astype(x.dtype)


def used_blocks(routing, num_slots: int, block_m: int):
    """The aligned slots [B*block_m] and block experts [B] of the B = min(blocks, num_slots)
    leading blocks: every block holding a slot is among them (each holds at least one slot and
    the runs are packed from the start, DESIGN.md), so the GEMMs skip the trailing empty ones
    (at T=1, top-8, E=256, block_m=8: 8 of 225 blocks)."""
    blocks = min(routing.expert_ids.shape[0], num_slots)
    return routing.sorted_token_ids[: blocks * block_m], routing.expert_ids[:blocks]


# Programs wanted per SM before K is split (two resident per SM).
def block_gemm(cfg: MgpuConfig, interpret: bool):
    """gemm(rows, w, block_experts, rows_in_use) -> [P, N] in out_dtype (default f32): the
    Mosaic GPU GEMM at cfg (rows_in_use: mgpu_wna16_gemm's block_rows, or None; GEMM2's:
    `down_config`), K-split partial products summed in f32; with activation_dtype, w's rows are
    [gate; up] and the result is silu(gate) * up in that dtype, [P, N/2] (in GEMM1's epilogue
    where `fuses_activation`)."""

    def gemm(
        rows, w, block_experts, rows_in_use=None, activation_dtype=None, out_dtype=None,
        one_row_tile=False,
    ):  # fmt: skip
        _, splits, gated, options = gemm_plan(
            cfg, w, block_experts.shape[0], activation_dtype, out_dtype
        )
        out = mgpu_wna16_gemm(
            rows, w, block_experts, rows_in_use, **options, one_row_tile=one_row_tile,
            interpret=interpret,
        )  # fmt: skip
        if gated:
            return out
        out = out.sum(axis=0) if splits > 1 else out
        if activation_dtype is None:
            return out.astype(out_dtype or jnp.float32)
        return _reference.silu_and_mul(out).astype(activation_dtype)

    return gemm


def down_rows_dtype(cfg: MgpuConfig, x_dtype, out_dtype):
    """The dtype of GEMM2's rows (one per slot, read back by the top-k sum): f32, or with
    cfg.bf16_down_rows x's (bf16) where the layer's output is 16-bit: half the bytes of the
    [P, H] rows to write and read back (as vLLM's intermediate cache), at the cost of a third
    rounding (after the activation's and the output's) that cancellation in the top-k sum can
    amplify beyond the bf16 tolerance of tests/helpers.py (an element of a 40-token test did)."""
    if cfg.bf16_down_rows and jnp.dtype(out_dtype or x_dtype).itemsize < 4:
        return jnp.dtype(x_dtype)
    return jnp.dtype(jnp.float32)


def block_rows(x, topk_ids, *, num_experts: int, block_m: int, expert_map, interpret: bool):
    """The aligned slots, block experts and x's rows in block order of the used blocks
    (align, used_blocks, rows_in_block_order): the GEMMs' inputs."""
    t, k = topk_ids.shape
    routing = align(
        topk_ids, num_experts=num_experts, block_m=block_m, expert_map=expert_map,
        interpret=interpret,
    )  # fmt: skip
    # slots: t*k + j, or the sentinel t*k for padding
    slots, block_experts = used_blocks(routing, t * k, block_m)
    return slots, block_experts, rows_in_block_order(x, slots, k, interpret=interpret)


def one_token_blocks(x, topk_ids, *, num_experts: int, block_m: int, expert_map, direct=False):
    """For one token ([1, H], topk_ids [1, k]): the block experts [k], rows [k * block_m, H]
    of one block per slot, slot j's row first in block j (the rest zero), each slot's row
    position j * block_m and the rows in use per block (ones). No alignment kernel: a token's
    k experts are distinct, so this is the blocks the alignment gives (in slot order, not
    expert order), and their rows are the same products. Slots the alignment drops (ids out of
    range, or off this shard through expert_map) get expert -1 (zero rows, masked by the
    caller). Session 11's timeline: the alignment kernel took ~7 us of the ~39 us TP=8 layer
    at M=1. direct (`MgpuConfig.direct_token`): the rows are x itself ([1, H], for GEMM1's
    one_row_tile) and, without an expert_map, the block experts are topk_ids' own (the GEMMs
    give ids out of range zero rows)."""
    k, h = topk_ids.shape[1], x.shape[1]
    if direct and expert_map is None:
        block_experts = topk_ids.reshape(k).astype(jnp.int32)
    else:
        block_experts, _ = _reference.local_expert_of(
            topk_ids, num_experts=num_experts, expert_map=expert_map
        )
    if direct:
        x_rows = x
    else:
        x_rows = jnp.zeros((k, block_m, h), x.dtype).at[:, 0].set(x[0]).reshape(k * block_m, h)
    position = jnp.arange(k, dtype=jnp.int32) * block_m
    return block_experts, x_rows, position, jnp.ones(k, jnp.int32)


def aligned_blocks(x, topk_ids, *, num_experts: int, block_m: int, expert_map, interpret):
    """The block experts [B], rows in block order [B * block_m, H] (`block_rows`), each slot's
    row position [T*k] (a slot the alignment dropped keeps position 0; the caller masks it) and
    the rows in use per block [B] (its first ones: each expert's run is padded at its end)."""
    t, k = topk_ids.shape
    slots, block_experts, x_rows = block_rows(
        x, topk_ids, num_experts=num_experts, block_m=block_m, expert_map=expert_map,
        interpret=interpret,
    )  # fmt: skip
    # Padding slots point past the end and are dropped.
    position = jnp.zeros(t * k, jnp.int32)
    position = position.at[slots].set(jnp.arange(slots.shape[0], dtype=jnp.int32), mode="drop")
    in_use = (slots < t * k).reshape(-1, block_m).sum(axis=1, dtype=jnp.int32)
    return block_experts, x_rows, position, in_use


def _chunk(
    x, *, topk_weights, topk_ids, w13, w2, expert_map, cfg: MgpuConfig, interpret, one_token=True,
    out_dtype=None,
):  # fmt: skip
    """One chunk of tokens: [t, H] f32, for a layer output in out_dtype (default x's; it decides
    `down_rows_dtype`). A chunk of one token takes `one_token_blocks` (unless one_token=False),
    else `aligned_blocks`."""
    t, k = topk_ids.shape
    num_experts = expert_map.shape[0] if expert_map is not None else w13.num_experts
    blocks = dict(num_experts=num_experts, block_m=cfg.block_m, expert_map=expert_map)
    direct = t == 1 and one_token and cfg.direct_token
    if t == 1 and one_token:
        block_experts, x_rows, position, in_use = one_token_blocks(
            x, topk_ids, **blocks, direct=direct
        )
    else:
        block_experts, x_rows, position, in_use = aligned_blocks(
            x, topk_ids, **blocks, interpret=interpret
        )
    in_use = cfg.gemm_rows_in_use(in_use)
    gemm = block_gemm(cfg, interpret)
    # The activation sees unrounded f32 sums; it is rounded to x's dtype for GEMM2's tensor
    # cores, as in the 'pallas' backend (the 'xla' reference keeps it in f32). GEMM2's rows are
    # f32 (bf16 where the config asks: `down_rows_dtype`); the top-k sum is f32.
    # With narrow blocks, a block's unused rows of `act` may be unwritten; GEMM2 reads none.
    act = gemm(  # [P, I]
        x_rows, w13, block_experts, in_use, activation_dtype=x.dtype, one_row_tile=direct
    )
    y = gemm(act, w2, block_experts, in_use, out_dtype=down_rows_dtype(cfg, x.dtype, out_dtype))
    # Only the rows of slots on this shard are read (leaving the others unwritten in the GEMMs
    # and the rows' gather measured no faster, session 12).
    local, _ = _reference.local_expert_of(topk_ids, num_experts=num_experts, expert_map=expert_map)
    rows = jnp.where(local[:, None] >= 0, y[position].astype(jnp.float32), 0.0).reshape(t, k, -1)
    return (rows * topk_weights[..., None].astype(jnp.float32)).sum(axis=1)


@functools.partial(
    jax.jit,
    static_argnames=("activation", "config", "out_dtype", "chunk_tokens", "interpret"),
)
def fused_moe(
    x: jax.Array,
    w13: QuantizedExperts,
    w2: QuantizedExperts,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    *,
    expert_map=None,
    activation: str = "silu",
    config: BlockConfig | MgpuConfig | ByRouting | None = None,
    out_dtype=None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    interpret: bool = False,
) -> jax.Array:
    """The 'mgpu' backend's fused_moe (silu only; weights in the mgpu_int4 layout), [T, H].

    config None: `default_config` for the chunk's token count (no choice at run time);
    ByRouting(): the block size picked per chunk at run time from the routing."""
    if activation != "silu":
        raise NotImplementedError(f"the mgpu backend runs silu only, not {activation!r}")
    t, k = topk_ids.shape
    num_experts = expert_map.shape[0] if expert_map is not None else w13.num_experts
    group = math.gcd(w13.group, w2.group)
    if config is None:  # by the token count
        configs = (default_config(min(t, chunk_tokens) * k, num_experts, group, w2.shape[2]),)
    elif isinstance(config, ByRouting):  # by the routing, at run time
        configs = routed_configs(min(t, chunk_tokens), k, num_experts, group, w2.shape[2])
    elif isinstance(config, BlockConfig):
        configs = (from_block_config(config),)
    else:
        configs = (config,)
    runs = [
        functools.partial(
            _chunk,
            w13=w13,
            w2=w2,
            expert_map=expert_map,
            cfg=cfg,
            interpret=interpret,
            out_dtype=out_dtype,
        )  # fmt: skip
        for cfg in configs
    ]

    def run(x, *, topk_weights, topk_ids):
        if len(runs) == 1:
            return runs[0](x, topk_weights=topk_weights, topk_ids=topk_ids)
        return jax.lax.switch(
            pick_config(topk_ids, num_experts, configs),
            [lambda a, b, c, r=r: r(a, topk_weights=b, topk_ids=c) for r in runs],
            x, topk_weights, topk_ids,
        )  # fmt: skip

    return _reference.map_token_chunks(
        run, x, topk_weights, topk_ids, chunk_tokens=chunk_tokens, out_dtype=out_dtype
    )
