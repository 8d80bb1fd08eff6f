"""The Mosaic GPU layer's configs: the MgpuConfig of a layer (the caller's, the tuned table's or
`default_config`'s) and each GEMM's plan at a config (k-step, features per program, K splits,
output tiles per program, fused activation)."""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp

from pallas_kernels.mosaic_gpu.wna16_gemm import SMEM_BYTES, TILE, stage_bytes, takes_bf16_weights
from wna16_jax import _configs
from wna16_jax._types import BlockConfig, MgpuConfig, QuantizedExperts

logger = logging.getLogger("wna16_jax")

# The name of the layer's table in the tuned files (wna16_jax/data/tuned/<device>.json).
TUNED_TABLE = "mgpu"


def tile_n(cfg: MgpuConfig) -> int:
    """Output features per program: block_n per math warpgroup."""
    return cfg.block_n * max(cfg.consumers, 1)


def halvings(cfg: MgpuConfig) -> int:
    """The halvings of a block the GEMMs run: up to cfg.block_halvings, while the width stays
    a multiple of 8 (a wgmma's least rows); 0: the GEMMs take no rows in use."""
    steps = 0
    while steps < cfg.block_halvings and cfg.block_m % (16 << steps) == 0:
        steps += 1
    return steps


def gemm_rows_in_use(cfg: MgpuConfig, in_use):
    """What the GEMMs take as each block's rows in use (mgpu_wna16_gemm's rows_in_use): in_use
    where they halve blocks, else None."""
    return in_use if halvings(cfg) else None


def one_group_block_k(group: int) -> int:
    """The k-step of one group: 128 where it divides the group (64-wide steps lost to 128 at
    every M measured), else 64."""
    return 128 if group % 128 == 0 else 64


# From this many rows per expert the default takes 128-row blocks on bf16 weights (below: 64-row
# blocks with exact group sums); docs/performance.md, 'Mosaic GPU configs'.
ROWS_FOR_128 = 64

# GEMM2 of 8-row blocks takes 128 features per program (down_block_n) from DOWN_128_SLOTS slots
# where a tile has at least DOWN_128_MIN_STEPS k-steps: a tile of rows then serves twice the
# weights; docs/performance.md, 'Mosaic GPU configs'.
DOWN_128_SLOTS = 64
DOWN_128_MIN_STEPS = 8

# GEMM1 of 8-row blocks runs 2 stages (GEMM2 3) where the experts are wide (GEMM2's K, the
# intermediate size, at least TWO_STAGES_MIN_DOWN_K) or the slots few (at most
# TWO_STAGES_MAX_SLOTS); narrow experts keep 3 stages from more slots; docs/performance.md,
# 'Mosaic GPU configs'.
TWO_STAGES_MIN_DOWN_K = 2048
TWO_STAGES_MAX_SLOTS = 128


def default_config(
    num_slots: int, num_experts: int, group: int, down_k: int | None = None, bits: int = 4,
    int8_rows: bool = False, per_channel: bool = False,
) -> MgpuConfig:  # fmt: skip
    """The heuristic config for num_slots (T*k) slots over num_experts experts: the layer's
    config where the tuned table has no entry for the problem.

    block_m follows the mean rows per expert r = num_slots / num_experts: 8 rows up to r = 4,
    16 up to r = 32, 64 below ROWS_FOR_128. 64-row blocks run two consumer warpgroups (warp
    specialization), smaller ones none; 16-row blocks take 128 features per warpgroup; GEMM2
    of 64-row blocks 128 features per consumer at 2 stages; otherwise 3 stages. k-steps of two
    groups of 128 (block_k 256) with 8- and 64-row blocks, else of one group
    (`one_group_block_k`). Blocks halve where a half is a whole wgmma (16 and 64 rows; 64 also
    to a quarter). From ROWS_FOR_128: 128-row blocks on bf16 weights (the exact group sums of
    128 rows do not fit in registers), k-steps of one group, halved down to 16 rows, GEMM2 at
    128 features per consumer and 3 stages. down_k, GEMM2's K (the experts' intermediate size;
    None: unknown), decides the rules of 8-row blocks (DOWN_128_*, TWO_STAGES_*). int8 weights
    (bits=8) take int4's rules, with k-steps of 256 also inside larger groups (per-channel
    scales: the layer's group is gcd(H, I)), and each GEMM's stages cut to those that fit in
    shared memory (`fitted_stages`: an int8 k-step takes twice int4's weight bytes; 64-row
    blocks run GEMM1 at 2 stages): guesses from int4's rules, not measured. int8 rows (W8A8)
    take int8's rules; from ROWS_FOR_128 the 128-row blocks carry exact int32 sums instead of
    bf16 weights where both weights are per channel (per_channel), else 64-row blocks. The
    figures behind each rule: docs/performance.md, 'Mosaic GPU configs'."""
    rows = num_slots / num_experts
    if rows >= ROWS_FOR_128 and (per_channel or not int8_rows):
        cfg = MgpuConfig(
            128, one_group_block_k(group), stages=3, consumers=2, block_n=64, down_block_n=128,
            down_stages=3, block_halvings=3, bf16_weights=not int8_rows,
        )  # fmt: skip
        return fitted_stages(cfg, group, bits)
    block_m = 8 if rows <= 4 else 16 if rows <= 32 else 64
    block_k = one_group_block_k(group)
    if block_m in (8, 64) and (group == 128 or (bits == 8 and group % 256 == 0)):
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
    cfg = MgpuConfig(
        block_m, block_k, stages=stages, consumers=consumers, block_n=block_n, **down,
        block_halvings=2 if block_m == 64 else 1,
    )  # fmt: skip
    return fitted_stages(cfg, group, bits)


def stages_that_fit(cfg: MgpuConfig, group: int, bits: int, *, gated: bool) -> int:
    """The most pipeline stages of a GEMM at cfg on `bits`-bit weights with groups of `group`
    (gated: GEMM1's two halves) that fit in a program's shared memory beside its output
    buffers at their least (8 f32 rows per warpgroup; `output_buffer_rows` takes the rows the
    stages leave), for the most bytes a group's row takes (zero points and f32 scales) and
    bf16 rows (int8 rows, W8A8, take fewer)."""
    one = stage_bytes(
        block_m=cfg.block_m, block_k=cfg.block_k, tile_n=tile_n(cfg), halves=2 if gated else 1,
        groups_per_step=max(cfg.block_k // group, 1), has_offset=True, scale_bytes=4, bits=bits,
    )  # fmt: skip
    return (SMEM_BYTES - max(cfg.consumers, 1) * 8 * TILE * 4) // one


def fitted_stages(cfg: MgpuConfig, group: int, bits: int) -> MgpuConfig:
    """cfg with GEMM1's stages (gated) and GEMM2's (`down_config`) cut to `stages_that_fit`
    (int4's defaults fit as they are; int8's k-steps take twice the weight bytes)."""
    down = down_config(cfg)
    stages = min(cfg.stages, stages_that_fit(cfg, group, bits, gated=True))
    down_stages = min(down.stages, stages_that_fit(down, group, bits, gated=False))
    if (stages, down_stages) == (cfg.stages, down.stages):
        return cfg
    return dataclasses.replace(cfg, stages=stages, down_stages=down_stages)


def from_block_config(config: BlockConfig) -> MgpuConfig:
    """A BlockConfig's block_m, block_k and num_stages (its other fields do not apply)."""
    return MgpuConfig(config.block_m, config.block_k, config.num_stages)


def layer_group(w13: QuantizedExperts, w2: QuantizedExperts) -> int:
    """The group both GEMMs' k-steps fit: the gcd of the two weights' effective groups."""
    return math.gcd(w13.group, w2.group)


# problem["activations"] of the tuned table's entries for int8 rows (W8A8); an entry without
# the key is for 16-bit activations.
INT8_ROWS_KEY = "int8"


def table_problem(
    num_experts: int, w13: QuantizedExperts, w2: QuantizedExperts, *, int8_rows: bool = False
) -> dict:
    """The problem keys of a layer's entries in the tuned table: E (the routing's experts),
    H, I, bits and the group of `layer_group`; with int8 rows (W8A8) also
    activations=INT8_ROWS_KEY, so that W8A8 and W8A16 entries of the same weights stay apart.
    Both W8A8 schemes (per token, static) give the GEMMs the same int8 rows with an f32 scale
    per row, so one entry serves both."""
    problem = dict(E=num_experts, H=w13.k, I=w2.k, bits=w13.bits, group=layer_group(w13, w2))
    if int8_rows:
        problem["activations"] = INT8_ROWS_KEY
    return problem


_logged: set = set()


def layer_config(
    config: MgpuConfig | BlockConfig | None,
    num_slots: int,
    num_experts: int,
    w13: QuantizedExperts,
    w2: QuantizedExperts,
    *,
    int8_rows: bool = False,
) -> MgpuConfig:
    """The layer's config for a chunk of num_slots (T*k) slots over num_experts (the routing's)
    experts: the caller's (a BlockConfig: `from_block_config`), else the device's tuned table's
    (the nearest M of exactly this problem, `table_problem`: int8 rows, W8A8, have entries of
    their own), else `default_config`. Logs each new choice once at INFO with where it came
    from."""
    if isinstance(config, MgpuConfig):
        return config
    if isinstance(config, BlockConfig):
        return from_block_config(config)
    if config is not None:
        raise ValueError(f"config must be an MgpuConfig, a BlockConfig or None, got {config!r}")
    kind = _configs.device_kind()
    problem = table_problem(num_experts, w13, w2, int8_rows=int8_rows)
    cfg = _configs.lookup_tuned(TUNED_TABLE, problem, num_slots, kind)
    source = f"tuned:{kind}"
    if cfg is None:
        per_channel = w13.group == w13.k and w2.group == w2.k
        cfg = default_config(
            num_slots, num_experts, problem["group"], w2.k, w13.bits, int8_rows=int8_rows,
            per_channel=per_channel,
        )  # fmt: skip
        source = "heuristic"
    key = (num_slots, tuple(problem.items()), cfg)
    if key not in _logged:
        _logged.add(key)
        logger.info("wna16_jax: fused_moe mgpu M=%d %s %s [%s]", num_slots, problem, cfg, source)
    return cfg


PROGRAMS_PER_SM = 2
MAX_AUTO_SPLITS = 8


def auto_splits(programs: int, num_sms: int, per_sm: int = PROGRAMS_PER_SM) -> int:
    """Most K splits for a GEMM of `programs` (N tiles x blocks) programs: enough to give each
    SM `per_sm` programs, at most MAX_AUTO_SPLITS. On 132 SMs DeepSeek-V3's TP=8 GEMM1 at M=1
    (8 N tiles x 8 blocks) gets 4; at TP=1 (512 programs) none, where a split measured slower
    (docs/performance.md, 'Mosaic GPU configs')."""
    return max(1, min(MAX_AUTO_SPLITS, -(-per_sm * num_sms // programs)))


def _num_sms() -> int:
    return getattr(jax.devices()[0], "core_count", None) or 132


def down_config(cfg: MgpuConfig) -> MgpuConfig:
    """cfg as GEMM2 takes it: its own block_n and stages where set."""
    return dataclasses.replace(
        cfg,
        block_n=cfg.down_block_n or cfg.block_n,
        stages=cfg.down_stages or cfg.stages,
        down_block_n=None,
        down_stages=None,
    )


def fitted_config(cfg: MgpuConfig, w: QuantizedExperts) -> MgpuConfig:
    """cfg for a GEMM on `w`: a k-step of several groups (block_k > G) that does not tile the
    GEMM's K becomes one group (e.g. DeepSeek-V2-Lite's GEMM2, K = I = 1408: 11 groups of 128
    but no whole steps of 256; a group under 64 inputs: one 64-wide k-tile), and features per
    warpgroup that do not tile N become 64."""
    n, k, group = w.shape[1], w.shape[2], w.group
    if cfg.block_k > group and k % cfg.block_k:
        cfg = dataclasses.replace(cfg, block_k=group if group % TILE == 0 else TILE)
    if n % tile_n(cfg):
        cfg = dataclasses.replace(cfg, block_n=64)
    return cfg


def largest_divisor(n: int, most: int, least_quotient: int = 1) -> int:
    """The largest divisor d of n up to `most` whose quotient n // d is at least
    `least_quotient` (1 where none is)."""
    fits = [d for d in range(1, min(most, n) + 1) if n % d == 0 and n // d >= least_quotient]
    return max(fits, default=1)


# k-steps a program's pipeline runs at least where a tile has fewer: a program then computes
# several output tiles of its block, one after the other in one pipeline (DeepSeek-V3's TP=8
# GEMM2, one k-step of 256 per tile: runs of 4 tiles); docs/performance.md, 'Mosaic GPU configs'.
MIN_STEPS_PER_PROGRAM = 4


def tiles_per_program(n_tiles: int, steps: int) -> int:
    """The output tiles of a program's run for a GEMM of n_tiles output tiles per block and
    `steps` k-steps per tile (per split): the largest divisor of n_tiles up to
    ceil(MIN_STEPS_PER_PROGRAM / steps)."""
    return largest_divisor(n_tiles, -(-MIN_STEPS_PER_PROGRAM // steps))


# A linear's GEMM of one 8-row block (decode of up to 4 rows) splits K for this many programs
# per SM, counting the programs it runs unsplit (a gated weight's: one per pair of gate and up
# tiles), each split keeping MIN_STEPS_PER_PROGRAM k-steps: one H200, M=1, the dense MLP's gate
# and up (288 gated programs) 59.1 -> 43.3 us at 2 splits, o_proj 24.3 -> 22.1 at 4
# (docs/performance.md, 'Quantized linears').
LINEAR_PROGRAMS_PER_SM = 4


def linear_splits(cfg: MgpuConfig, w: QuantizedExperts, gated: bool) -> int | None:
    """The K splits of a linear's GEMM on `w` ([1, N, K]; gated: [gate; up]) at cfg: for 8-row
    blocks the largest divisor of its k-steps up to `auto_splits` at LINEAR_PROGRAMS_PER_SM
    that leaves each split MIN_STEPS_PER_PROGRAM k-steps (or 1); None (`gemm_splits`) for
    larger blocks."""
    if cfg.block_m != 8:
        return None
    cfg = fitted_config(cfg, w)
    steps = w.shape[2] // cfg.block_k
    programs = w.shape[1] // (2 if gated else 1) // tile_n(cfg)
    most = auto_splits(programs, _num_sms(), LINEAR_PROGRAMS_PER_SM)
    return largest_divisor(steps, most, least_quotient=MIN_STEPS_PER_PROGRAM)


def gemm_splits(cfg: MgpuConfig, w: QuantizedExperts, num_blocks: int) -> int:
    """The K splits a GEMM of `num_blocks` blocks on `w` takes at cfg: cfg.splits where set
    (mgpu_wna16_gemm checks that it divides the k-steps), else the largest divisor of its
    k-step count up to `auto_splits` for its programs."""
    if w.shape[2] % cfg.block_k:
        raise ValueError(f"block_k={cfg.block_k} must divide the GEMM's K={w.shape[2]}")
    if cfg.splits is not None:
        return cfg.splits
    steps = w.shape[2] // cfg.block_k
    return largest_divisor(steps, auto_splits(w.shape[1] // tile_n(cfg) * num_blocks, _num_sms()))


def gemm_options(
    cfg: MgpuConfig, splits: int, *, n_tiles: int, steps: int, gated: bool = False,
    out_dtype=None,
) -> dict:  # fmt: skip
    """mgpu_wna16_gemm's keyword arguments at cfg with `splits` for a GEMM of n_tiles output
    tiles per block and `steps` k-steps, its output in out_dtype (default f32; K-split partial
    products always f32, rounded after their sum)."""
    tiles = tiles_per_program(n_tiles, steps // splits)
    return dict(
        tiles_per_program=tiles,
        bf16_weights=cfg.bf16_weights and takes_bf16_weights(cfg.consumers, tiles),
        block_halvings=halvings(cfg) or 1,  # with the rows in use (`gemm_rows_in_use`)
        block_m=cfg.block_m,
        block_k=cfg.block_k,
        block_n=cfg.block_n,
        max_concurrent_steps=cfg.stages,
        consumers=cfg.consumers,
        splits=splits,
        gated=gated,
        out_dtype=out_dtype if out_dtype is not None and splits == 1 else jnp.float32,
    )


def fuses_activation(cfg: MgpuConfig, w13: QuantizedExperts, splits: int) -> bool:
    """Whether GEMM1 at cfg (after `fitted_config`) with `splits` applies silu * up itself: not
    K-split (silu of a partial sum is not a part), and each half of w13 whole output tiles."""
    return splits == 1 and (w13.shape[1] // 2) % tile_n(cfg) == 0


def gemm_plan(
    cfg: MgpuConfig, w: QuantizedExperts, num_blocks: int, activation_dtype=None, out_dtype=None
):
    """(config, splits, gated, mgpu_wna16_gemm's options) of the layer's GEMM on `w` over
    `num_blocks` blocks: GEMM1 with activation_dtype (gated where `fuses_activation`; else f32
    sums), else GEMM2 (`down_config`) with its rows in out_dtype (default f32)."""
    this = fitted_config(cfg if activation_dtype is not None else down_config(cfg), w)
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
    return w.shape[1] // (2 if gated else 1) // tile_n(cfg)
