"""The Mosaic GPU layer's configs: MgpuConfig, the default by the routing's rows per expert, and
each GEMM's plan at a config (k-step, features per program, K splits, fused activation)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.mosaic_gpu.wna16_gemm import takes_bf16_weights
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
def from_block_config(config: BlockConfig) -> MgpuConfig:
    """A BlockConfig's block_m, block_k, num_stages and split_k (its other fields do not
    apply)."""
    return MgpuConfig(config.block_m, config.block_k, config.num_stages, splits=config.split_k)


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
