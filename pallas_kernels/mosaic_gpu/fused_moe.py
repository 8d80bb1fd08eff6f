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
from pallas_kernels.mosaic_gpu.wna16_gemm import mgpu_wna16_gemm, takes_bf16_weights
from pallas_kernels.triton.fused_moe import DEFAULT_CHUNK_TOKENS, align
from wna16_jax import _reference
from wna16_jax._types import BlockConfig, QuantizedExperts


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Rows per block (wgmma N, 8..256), k-tile (divides the group), pipelined k-steps,
    consumer warpgroups (0: no warp specialization; 1 or 2 with a producer warpgroup), the
    most K splits (each GEMM takes the largest divisor of its k-step count up to it; None:
    `auto_splits` per GEMM), features per math warpgroup (block_n: 64, one wgmma M, or up to
    256 in sub-tiles of 64; `gemm_config` falls back to 64 where N does not take it) and
    whether GEMM1 applies silu * up to its sums before storing them (fuse_activation: no f32
    [P, 2I] output and no separate activation pass; where GEMM1 is not K-split). GEMM2 (the
    down projection) may take its own block_n and stages (down_block_n, down_stages; None: the
    same as GEMM1): e.g. 128 features per consumer, which leave room for only 2 stages of
    256-wide steps (the default with 64-row blocks: `default_config`), and its own k-step
    (down_block_k). tiles_per_program (down_tiles_per_program for GEMM2): the most output
    tiles of a block one program computes in one pipeline (`tiles_per_program` takes the
    largest divisor of the GEMM's tile count up to it); None: enough tiles for
    MIN_STEPS_PER_PROGRAM k-steps. narrow_blocks: how many times both GEMMs
    may halve a block that uses at most that many of its rows (mgpu_wna16_gemm's block_rows
    and narrow_steps; 1: halves, 2: also quarters; each width a multiple of 8).
    bf16_down_rows: GEMM2 rounds its rows ([P, H], one per slot) to x's dtype where the layer's
    output is 16-bit (`down_rows_dtype`; by default they are f32). direct_token: a chunk of one
    token gives GEMM1 the token's row itself (mgpu_wna16_gemm's one_row_tile: no
    [k * block_m, H] rows built) and, without an expert_map, the router's ids as the block
    experts (the GEMMs skip ids out of range): two XLA kernels fewer per decode step (H200,
    session 15, one process: TP=1 M=1 80.8 vs 79.5 us, TP=8 26.5 vs 28.4; not the default).
    bf16_weights: the warp-specialized GEMMs (consumers >= 1, one output tile per program)
    multiply weights rounded to bf16 ((q - z) * s, as a bf16 model's dequantized weights) straight
    into their sums, in place of exact integer products summed per group and scaled: no f32 sum
    per group in registers (room for 128-row blocks) and no wait per group; one more rounding.
    weight_row_nibbles: both GEMMs copy the int4 weight tiles in TMA rows of this many nibbles
    (64: a tile's row of 32 bytes; 128 or 256: rows of 64 or 128 bytes, the same bytes; 256
    by default: DeepSeek-V3 on the H200, session 21 call 2, one process: M=1 71.9 vs 81.4 us,
    M=16 664.7 vs 768.6, M=256 1724.0 vs 1887.6)."""

    block_m: int
    block_k: int = 128
    stages: int = 4
    consumers: int = 0
    splits: int | None = None
    block_n: int = 64
    fuse_activation: bool = True
    down_block_n: int | None = None
    down_stages: int | None = None
    down_block_k: int | None = None
    tiles_per_program: int | None = None
    down_tiles_per_program: int | None = None
    narrow_blocks: int = 0
    bf16_down_rows: bool = False
    direct_token: bool = False
    bf16_weights: bool = False
    weight_row_nibbles: int = 256

    def tile_n(self) -> int:
        """Output features per program."""
        return self.block_n * max(self.consumers, 1)

    def narrow_steps(self) -> int:
        """The halvings the GEMMs run: up to narrow_blocks, while the width stays a multiple
        of 8 (a wgmma's least rows); 0: the GEMMs take no rows in use."""
        steps = 0
        while steps < self.narrow_blocks and self.block_m % (16 << steps) == 0:
            steps += 1
        return steps

    def gemm_rows_in_use(self, in_use):
        """What the GEMMs take as each block's rows in use (mgpu_wna16_gemm's block_rows):
        in_use where they narrow blocks, else None."""
        return in_use if self.narrow_steps() else None


def one_group_block_k(group: int) -> int:
    """The k-step of one group: 128 where it divides the group (64 lost to 128 at every M in
    session 4), else 64."""
    return 128 if group % 128 == 0 else 64


# Rows per expert from which the default takes 128-row blocks on bf16 weights. DeepSeek-V3 on the
# H200, one process each (sessions 15-16): 64 rows (M=2048) a tie, 4279.7 vs 4291.2 us for 64-row
# blocks; 80 rows (M=2560) 4846.6 vs 5276.1; 96 rows (M=3072) 5116.6 vs 5871.8; 128 rows (M=4096)
# 6403.0 vs 7358.2.
ROWS_FOR_128 = 64


# GEMM2 of 8-row blocks at 128 features per program (down_block_n) from DOWN_128_SLOTS slots,
# where a tile has at least DOWN_128_MIN_STEPS k-steps: a rows' tile serves twice the weights.
# DeepSeek-V3 on the H200 (session 22, one process per row; the layer, 64 against 128 features):
# TP=1 (GEMM2's K = 2048, 8 k-steps of 256) M=1 70.1 / 76.0 us, M=2 144.7 / 150.6, M=4 225.6 /
# 224.8, M=8 390.4 / 383.4, M=16 695.8 / 676.6 (call 1: 666.3 / 649.8), M=32 1060.6 / 1030.3,
# M=64 1453.9 / 1416.9, M=128 1709.3 / 1667.8; TP=8 (K = 256, one k-step) M=8 85.7 / 92.1,
# M=16 149.9 / 151.2. Steps between 1 and 8 were not measured.
DOWN_128_SLOTS = 64
DOWN_128_MIN_STEPS = 8

# GEMM1 of 8-row blocks at 2 stages (GEMM2 stays at 3) where the experts are wide (GEMM2's K, the
# intermediate size, at least TWO_STAGES_MIN_DOWN_K) or the slots few (at most
# TWO_STAGES_MAX_SLOTS). DeepSeek-V3 on the H200, the layer, 3 stages -> GEMM1 at 2 (sessions
# 23-24, one process per row): TP=1 (I = 2048) M=2 142.1 -> 126.9 us, M=16 640.4 -> 628.4;
# both GEMMs at 2: M=1 71.3 -> 70.9, M=4 226.8 -> 219.5, M=8 372.2 -> 357.3, M=32 980.2 ->
# 939.6, M=64 1327.0 -> 1282.8, M=128 1573.7 -> 1510.2. TP=8 (I = 256) M=16 148.4 -> 135.9
# (GEMM1 85.9 -> 73.8), M=1, 4, 8 equal within 1 us, but M=32 196.7 -> 215.6 (GEMM1 95.3 ->
# 112.8): narrow experts keep 3 stages from 256 slots (M=64, 128 not measured).
TWO_STAGES_MIN_DOWN_K = 2048
TWO_STAGES_MAX_SLOTS = 128


def default_config(
    num_slots: int, num_experts: int, group: int, down_k: int | None = None
) -> MgpuConfig:
    """block_m near the mean rows per expert, from the H200 figures of sessions 4-6 (8 rows
    won at M=1 and 16, 16 rows at M=256, 64 rows at M=4096). Two consumer warpgroups with
    64-row blocks (M=4096: 12.4 vs 17.5 ms); no warp specialization or K split for smaller
    blocks (each lost at M=1, 16 and 256). k-steps of two groups of 128 (block_k 256) with 8-
    and 64-row blocks (M=16: 963 vs 994 us, M=4096: 11.69 vs 12.41 ms, M=1: a tie), else of
    one group (block_k 128 beat 64 everywhere in session 4; at M=256 256 was not faster).
    With GEMM1's fused activation (session 9; its k-steps carry both halves' weights): 3
    stages everywhere (M=1 92.5 vs 98.3 us with 4, M=16 777.9 vs 798.7, M=256 1940.8 vs
    2036.5; at M=4096 4 do not fit) and 128 features per warpgroup with 16-row blocks (M=256
    2036.5 vs 2041.9 at 4 stages; 128 lost at M=1 and 16, and at M=4096 with 2 consumers).
    GEMM2 with 64-row blocks: 128 features per consumer and 2 stages (session 10, M=4096:
    7685.1 vs 7929.7 us, GEMM2 2908.0 us; 2 stages alone 8026.7). Half blocks (narrow_blocks=1)
    wherever a half is a wgmma's width (block_m 16 and 64; session 12, one run each: M=4096
    7471.3 vs 7690.5 and 7663.0 us, M=256 1966.1 vs 2025.9); 64-row blocks also to a quarter
    (narrow_blocks=2; session 13, M=4096: 7420.0 vs 7486.2 and 7485.7 us in call 2, 7487.9 vs
    7576.6 and 7540.6 in call 3). From ROWS_FOR_128 rows per expert: 128-row blocks on weights
    rounded to bf16 (bf16_weights: the exact group sums of 128 rows do not fit in registers),
    k-steps of one group, narrowed down to 16 rows (session 15, M=4096, one process: 6403.0 vs
    7358.2 us; GEMM1 3782.0 vs 4412.5, GEMM2 2582.2 vs 2790.3; k-steps of 256 for GEMM2 6541.2;
    the exact sums at 128 rows spill registers: 13645.8); GEMM2 there at 3 stages (session 15
    call 6 and session 16 call 1, one process each: GEMM2 alone 2562.8 vs 2597.9 and 2529.5 vs
    2558.4 us, the layer 6410.2 vs 6445.9 and 6366.6 vs 6386.3). down_k: GEMM2's K (the
    experts' intermediate size; None: unknown): with 8-row blocks, GEMM2 takes 128 features per
    program from DOWN_128_SLOTS slots where K has DOWN_128_MIN_STEPS k-steps, and GEMM1 takes 2
    stages (GEMM2 3) where down_k >= TWO_STAGES_MIN_DOWN_K or the slots are at most
    TWO_STAGES_MAX_SLOTS (sessions 23-24)."""
    rows = num_slots / num_experts
    if rows >= ROWS_FOR_128:
        return MgpuConfig(
            128, one_group_block_k(group), stages=3, consumers=2, block_n=64, down_block_n=128,
            down_stages=3, narrow_blocks=3, bf16_weights=True,
        )  # fmt: skip
    block_m = 8 if rows <= 4 else 16 if rows <= 32 else 64
    block_k = one_group_block_k(group)
    if group == 128 and block_m in (8, 64):
        block_k = 256
    consumers = 2 if block_m == 64 else 0
    block_n = 128 if block_m == 16 else 64
    down = dict(down_block_n=128, down_stages=2) if block_m == 64 else {}
    stages = 3
    if block_m == 8 and down_k is not None:  # the rules of 8-row blocks that need GEMM2's K
        if num_slots >= DOWN_128_SLOTS and down_k // block_k >= DOWN_128_MIN_STEPS:
            down = dict(down_block_n=128)
        if down_k >= TWO_STAGES_MIN_DOWN_K or num_slots <= TWO_STAGES_MAX_SLOTS:
            stages, down = 2, dict(down, down_stages=3)
    return MgpuConfig(
        block_m, block_k, stages=stages, consumers=consumers, block_n=block_n, **down,
        narrow_blocks=2 if block_m == 64 else 1,
    )  # fmt: skip


# A block's relative cost by its rows (the layer's time per used block, less ~60 us fixed),
# measured for DeepSeek-V3 TP=1 on the H200 with every token routed like the first (M=64,
# session 6: block_m 8, 16, 32 at 667.0, 470.2, 453.7 us for 64, 32, 16 blocks). A block costs
# about its expert's weight reads until its rows make the wgmmas count.
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


def from_block_config(config: BlockConfig) -> MgpuConfig:
    """A BlockConfig's block_m, block_k, num_stages and split_k (its other fields do not
    apply)."""
    return MgpuConfig(config.block_m, config.block_k, config.num_stages, splits=config.split_k)


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
PROGRAMS_PER_SM = 2
MAX_AUTO_SPLITS = 8


def auto_splits(programs: int, num_sms: int) -> int:
    """Most K splits for a GEMM of `programs` (N tiles x blocks) programs: enough to give each
    SM PROGRAMS_PER_SM, at most MAX_AUTO_SPLITS. On the H200 (132 SMs), DeepSeek-V3 at TP=8
    and M=1 (GEMM1: 8 N tiles x 8 blocks) gets 4; at TP=1 (512 programs) none, where a split
    measured slower (121.5 vs 112.6 us for the layer)."""
    return max(1, min(MAX_AUTO_SPLITS, -(-PROGRAMS_PER_SM * num_sms // programs)))


def _num_sms() -> int:
    return getattr(jax.devices()[0], "core_count", None) or 132


def down_config(cfg: MgpuConfig) -> MgpuConfig:
    """cfg as GEMM2 takes it: its own block_n, stages and block_k where set."""
    return dataclasses.replace(
        cfg,
        block_n=cfg.down_block_n or cfg.block_n,
        stages=cfg.down_stages or cfg.stages,
        block_k=cfg.down_block_k or cfg.block_k,
        tiles_per_program=cfg.down_tiles_per_program,
        down_block_n=None,
        down_stages=None,
        down_block_k=None,
        down_tiles_per_program=None,
    )


def gemm_config(cfg: MgpuConfig, w: QuantizedExperts) -> MgpuConfig:
    """cfg for a GEMM on `w`: a k-step of several groups (block_k > G) that does not tile the
    GEMM's K becomes one group (e.g. DeepSeek-V2-Lite's GEMM2, K = I = 1408: 11 groups of 128
    but no whole steps of 256), and features per warpgroup that do not tile N become 64."""
    n, k, group = w.shape[1], w.shape[2], w.group
    if cfg.block_k > group and k % cfg.block_k and group % 64 == 0:
        cfg = dataclasses.replace(cfg, block_k=group)
    if n % cfg.tile_n():
        cfg = dataclasses.replace(cfg, block_n=64)
    return cfg


# k-steps a program's pipeline should run at least, where a tile has fewer (tiles_per_program
# None). H200, session 12, DeepSeek-V3 TP=8 (GEMM2: one k-step of 256 per tile): runs of 4
# tiles took the layer to 25.2 vs 29.4 us at M=1 and 176.1 vs 191.3 at M=16 (8 tiles: 27.5,
# 177.2). At TP=1 (GEMM2: 8 k-steps per tile) runs were slower: M=1 85.0 vs 79.4 us with 4,
# M=16 792.0 vs 777.1, M=256 2008.6 vs 1985.6.
MIN_STEPS_PER_PROGRAM = 4


def tiles_per_program(cfg: MgpuConfig, n_tiles: int, steps: int) -> int:
    """The tiles of a program's run for a GEMM of n_tiles output tiles per block and `steps`
    k-steps per tile (per split): the largest divisor of n_tiles up to cfg.tiles_per_program
    (None: ceil(MIN_STEPS_PER_PROGRAM / steps))."""
    most = cfg.tiles_per_program or -(-MIN_STEPS_PER_PROGRAM // steps)
    return max(d for d in range(1, min(most, n_tiles) + 1) if n_tiles % d == 0)


def gemm_splits(cfg: MgpuConfig, w: QuantizedExperts, num_blocks: int) -> int:
    """The K splits a GEMM of `num_blocks` blocks on `w` takes at cfg: the largest divisor of
    its k-step count up to cfg.splits (None: auto_splits for its programs)."""
    if w.shape[2] % cfg.block_k:
        raise ValueError(f"block_k={cfg.block_k} must divide the GEMM's K={w.shape[2]}")
    steps = w.shape[2] // cfg.block_k
    most = cfg.splits
    if most is None:
        tiles = w.shape[1] // cfg.tile_n()
        most = auto_splits(tiles * num_blocks, _num_sms())
    return max(d for d in range(1, min(most, steps) + 1) if steps % d == 0)


def gemm_options(
    cfg: MgpuConfig, splits: int, *, n_tiles: int, steps: int, gated: bool = False,
    out_dtype=None,
) -> dict:  # fmt: skip
    """mgpu_wna16_gemm's keyword arguments at cfg with `splits` for a GEMM of n_tiles output
    tiles per block and `steps` k-steps, its output in out_dtype (default f32; K-split partial
    products always f32, rounded after their sum)."""
    tiles = tiles_per_program(cfg, n_tiles, steps // splits)
    return dict(
        tiles_per_program=tiles,
        bf16_weights=cfg.bf16_weights and takes_bf16_weights(cfg.consumers, tiles),
        narrow_steps=cfg.narrow_steps() or 1,  # with the rows in use (`_chunk`)
        block_m=cfg.block_m,
        block_k=cfg.block_k,
        block_n=cfg.block_n,
        max_concurrent_steps=cfg.stages,
        consumers=cfg.consumers,
        splits=splits,
        gated=gated,
        weight_row_nibbles=cfg.weight_row_nibbles,
        out_dtype=out_dtype if out_dtype is not None and splits == 1 else jnp.float32,
    )


def fuses_activation(cfg: MgpuConfig, w13: QuantizedExperts, splits: int) -> bool:
    """Whether GEMM1 at cfg (after gemm_config) with `splits` applies silu * up itself: asked
    for, not K-split, and each half of w13 whole output tiles."""
    return cfg.fuse_activation and splits == 1 and (w13.shape[1] // 2) % cfg.tile_n() == 0


def gemm_plan(
    cfg: MgpuConfig, w: QuantizedExperts, num_blocks: int, activation_dtype=None, out_dtype=None
):
    """(config, splits, gated, mgpu_wna16_gemm's options) of the layer's GEMM on `w` over
    `num_blocks` blocks: GEMM1 with activation_dtype (gated where `fuses_activation`; else f32
    sums), else GEMM2 (`down_config`) with its rows in out_dtype (default f32)."""
    this = gemm_config(cfg if activation_dtype is not None else down_config(cfg), w)
    splits = gemm_splits(this, w, num_blocks)
    gated = activation_dtype is not None and fuses_activation(this, w, splits)
    if activation_dtype is not None:
        out_dtype = activation_dtype if gated else None
    steps = w.shape[2] // this.block_k
    options = gemm_options(
        this, splits, n_tiles=output_tiles(this, w, gated), steps=steps, gated=gated,
        out_dtype=out_dtype,
    )  # fmt: skip
    return this, splits, gated, options


def output_tiles(cfg: MgpuConfig, w: QuantizedExperts, gated: bool) -> int:
    """A block's output tiles in a GEMM on `w` at cfg (gated: of the activation, half w's
    rows)."""
    return w.shape[1] // (2 if gated else 1) // cfg.tile_n()


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
