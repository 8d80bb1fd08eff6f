"""The Mosaic GPU backend's configs: MgpuConfig, the layer's config rules (the caller's config,
the tuned table's or `default_config`'s, through `backend_api.resolve`) and each GEMM's plan at a
config (k-step, features per program, K splits, output tiles per program, fused activation)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kernels.mgpu.layout import MGPU_TILE
from pallas_kernels.mgpu.wna16_gemm import SMEM_BYTES, TILE, stage_bytes, takes_bf16_weights
from wna16_jax import backend_api
from wna16_jax.backend_api import BlockConfig, QuantizedExperts


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """The 'mgpu' backend's layer config: both grouped GEMMs of its MoE layer (frozen, hashable).

    block_m: rows per block (the wgmma's N: a multiple of 8 in [8, 256]); also the align padding.
    block_k: input features per k-step (a multiple of 64 that divides the group or spans whole
        groups).
    stages: k-steps in flight in GEMM1's pipeline.
    consumers: math warpgroups per program: 0 (one warpgroup issues the copies and does the
        math) or 1, 2 (warp specialization: a producer warpgroup issues the copies).
    block_n: output features per math warpgroup (64, one wgmma M, up to 256 in sub-tiles of 64;
        a GEMM whose N it does not tile takes 64).
    down_block_n, down_stages: GEMM2's (the down projection's) own block_n and stages (None:
        GEMM1's).
    block_halvings: how many times the GEMMs may halve a block whose rows in use fit in half of
        it (0: never; 1: halves; 2: also quarters; each width stays a multiple of 8).
    bf16_weights: the warp-specialized GEMMs multiply the weights rounded to bf16 once,
        (q - z) * s, straight into their sums, instead of exact integer products summed per
        group in f32 and then scaled (room in registers for 128-row blocks; one more rounding;
        per-channel weights are not rounded: their exact (q - z) go into the sums, each
        feature's scale multiplies its sum at the end).
    splits: each GEMM's K splits (a divisor of its k-steps; each program sums one run of
        k-steps and the f32 partial products are summed after; a split GEMM1 applies the
        activation after that sum); None: chosen per GEMM from the shapes.
    Output tiles per program and whether GEMM1 applies the activation in its epilogue are
    chosen per GEMM from the shapes (`gemm_plan`).
    """

    block_m: int
    block_k: int = 128
    stages: int = 4
    consumers: int = 0
    block_n: int = 64
    down_block_n: int | None = None
    down_stages: int | None = None
    block_halvings: int = 0
    bf16_weights: bool = False
    splits: int | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "bf16_weights":
                if not isinstance(v, bool):
                    raise ValueError(f"MgpuConfig.bf16_weights={v!r} must be a bool")
            elif not (v is None and f.default is None):  # the fields that default to None
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise ValueError(f"MgpuConfig.{f.name}={v!r} must be a non-negative int")
        if self.block_m % 8 or not 8 <= self.block_m <= 256:
            raise ValueError(
                f"MgpuConfig.block_m={self.block_m} must be a multiple of 8 in [8, 256]"
            )
        if self.block_k % MGPU_TILE or not self.block_k:
            raise ValueError(f"MgpuConfig.block_k={self.block_k} must be a multiple of {MGPU_TILE}")
        for name in ("stages", "down_stages", "splits"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"MgpuConfig.{name}={v} must be at least 1")
        if self.consumers not in (0, 1, 2):
            raise ValueError(f"MgpuConfig.consumers={self.consumers} must be 0, 1 or 2")
        for name in ("block_n", "down_block_n"):
            v = getattr(self, name)
            if v is not None and (v % MGPU_TILE or not MGPU_TILE <= v <= 4 * MGPU_TILE):
                raise ValueError(
                    f"MgpuConfig.{name}={v} must be a multiple of {MGPU_TILE} in "
                    f"[{MGPU_TILE}, {4 * MGPU_TILE}]"
                )


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
    int8_rows: bool = False, per_channel: bool = False, bf16_scales: bool = True,
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
    bf16 weights where both weights are per channel (per_channel), else 64-row blocks; so do
    grouped weights whose scales are not all bfloat16 (bf16_scales False: float16 / float32
    scales multiply each bf16 weight in f32, slower than exact group sums in 64-row blocks).
    Groups under 64 inputs (Kimi-K2's 32): 8-row blocks take k-steps of 256 inputs as g128's
    do (a sum per group in registers: 64-row blocks keep one 64-wide tile). The figures
    behind each rule: docs/performance.md, 'Mosaic GPU configs'."""
    rows = num_slots / num_experts
    if rows >= ROWS_FOR_128 and (per_channel or (not int8_rows and bf16_scales)):
        cfg = MgpuConfig(
            128, one_group_block_k(group), stages=3, consumers=2, block_n=64, down_block_n=128,
            down_stages=3, block_halvings=3, bf16_weights=not int8_rows,
        )  # fmt: skip
        return fitted_stages(cfg, group, bits)
    block_m = 8 if rows <= 4 else 16 if rows <= 32 else 64
    block_k = one_group_block_k(group)
    if block_m in (8, 64) and (group == 128 or (bits == 8 and group % 256 == 0)):
        block_k = 256
    if block_m == 8 and group < TILE:
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
    """A caller's BlockConfig as the Mosaic GPU GEMM takes it: its block_m, block_k and
    num_stages (its other fields do not apply)."""
    return MgpuConfig(config.block_m, config.block_k, config.num_stages)


def layer_group(w13: QuantizedExperts, w2: QuantizedExperts) -> int:
    """The group both GEMMs' k-steps fit: the gcd of the two weights' effective groups."""
    return math.gcd(w13.group, w2.group)


# problem["activations"] of the tuned table's entries for int8 rows (W8A8); an entry without
# the key is for 16-bit activations.
INT8_ROWS_KEY = "int8"


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """The static facts of a MoE layer's chunk that its config follows: num_slots (T*k) slots
    over num_experts (the routing's) experts, w13 [E, 2I, H] and w2 [E, H, I] of `bits` bits,
    the group both GEMMs' k-steps fit (`layer_group`), whether both weights are per channel,
    and int8 rows (W8A8)."""

    num_slots: int
    num_experts: int
    hidden: int  # H
    intermediate: int  # I: GEMM2's K
    bits: int
    group: int
    per_channel: bool = False
    int8_rows: bool = False
    bf16_scales: bool = True  # both weights' scales bfloat16

    @classmethod
    def of_layer(
        cls, num_slots: int, num_experts: int, w13: QuantizedExperts, w2: QuantizedExperts, *,
        int8_rows: bool = False,
    ) -> LayerShape:  # fmt: skip
        return cls(
            num_slots, num_experts, w13.k, w2.k, w13.bits, layer_group(w13, w2),
            per_channel=w13.group == w13.k and w2.group == w2.k, int8_rows=int8_rows,
            bf16_scales=all(w.scales.dtype == jnp.bfloat16 for w in (w13, w2)),
        )  # fmt: skip

    def table_problem(self) -> dict:
        """The problem keys of the layer's entries in the tuned table: E (the routing's
        experts), H, I, bits and the group of `layer_group`; with int8 rows (W8A8) also
        activations=INT8_ROWS_KEY, so that W8A8 and W8A16 entries of the same weights stay
        apart. Both W8A8 schemes (per token, static) give the GEMMs the same int8 rows with an
        f32 scale per row, so one entry serves both."""
        problem = dict(
            E=self.num_experts, H=self.hidden, I=self.intermediate, bits=self.bits,
            group=self.group,
        )  # fmt: skip
        if self.int8_rows:
            problem["activations"] = INT8_ROWS_KEY
        return problem

    @classmethod
    def of_entry(cls, problem: dict, m: int) -> LayerShape:
        """The layer of a tuned entry (`table_problem`'s keys) at M=m slots; both weights per
        channel where the group is gcd(H, I)."""
        h, i, group = problem["H"], problem["I"], problem["group"]
        return cls(
            m, problem["E"], h, i, problem["bits"], group, per_channel=group == math.gcd(h, i),
            int8_rows=problem.get("activations") == INT8_ROWS_KEY,
        )  # fmt: skip


def layer_default_config(shape: LayerShape) -> MgpuConfig:
    """`default_config` of a layer."""
    return default_config(
        shape.num_slots, shape.num_experts, shape.group, shape.intermediate, shape.bits,
        int8_rows=shape.int8_rows, per_channel=shape.per_channel, bf16_scales=shape.bf16_scales,
    )  # fmt: skip


# The layer's ConfigRules: a caller's MgpuConfig (or BlockConfig: `from_block_config`), else the
# device's tuned table's (the nearest M of exactly this problem: int8 rows, W8A8, have entries of
# their own), else `default_config`. The GEMMs check a config against the shapes when they run
# (mgpu_wna16_gemm's check_config).
LAYER_RULES = backend_api.ConfigRules(
    config_type=MgpuConfig,
    heuristic=layer_default_config,
    table=TUNED_TABLE,
    table_key=lambda shape: (shape.table_problem(), shape.num_slots),
    converters={BlockConfig: from_block_config},
    entry_problem=LayerShape.of_entry,
)


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
    experts under LAYER_RULES. Logs each new choice once at INFO with where it came from."""
    shape = LayerShape.of_layer(num_slots, num_experts, w13, w2, int8_rows=int8_rows)
    cfg, source = backend_api.resolve(LAYER_RULES, shape, config)
    problem = shape.table_problem()
    backend_api.log_once(
        ("mgpu", num_slots, tuple(problem.items()), cfg),
        "wna16_jax: fused_moe mgpu M=%d %s %s [%s]", num_slots, problem, cfg, source,
    )  # fmt: skip
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
    but no whole steps of 256; a group under 64 inputs: one 64-wide k-tile), features per
    warpgroup that do not tile N become 64, and two consumer warpgroups whose 128 features
    still do not tile it one (gpt-oss's GEMM2, N = H = 2880: 45 tiles of 64)."""
    n, k, group = w.shape[1], w.shape[2], w.group
    if cfg.block_k > group and k % cfg.block_k:
        cfg = dataclasses.replace(cfg, block_k=group if group % TILE == 0 else TILE)
    if n % tile_n(cfg):
        cfg = dataclasses.replace(cfg, block_n=64)
    if n % tile_n(cfg) and cfg.consumers > 1:
        cfg = dataclasses.replace(cfg, consumers=1)
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
