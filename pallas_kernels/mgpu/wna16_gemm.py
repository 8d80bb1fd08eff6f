"""The int4 / int8 grouped expert GEMM on Hopper tensor cores through Pallas' Mosaic GPU backend
(the 'mgpu' backend's GEMM; the layer is pallas_kernels/mgpu/fused_moe.py).

Swap-AB: each program computes out[rows of one block, block_n features] as the transpose of
W[e][features, :] @ x[rows, :]^T. The dequantized weight tile is the wgmma's A operand, taken
from registers: int4 or int8 is loaded from shared memory, converted to bf16 and shifted by the
zero point in registers, never written back to shared memory. The layouts store each 64x64 tile
in the order of the A operand's registers, so a thread loads its 32 weights with 16-byte
shared-memory loads (one for int4, two for int8) and converts them without shuffles or permutes
(`convert.converted_tile`): int4 makes each bf16 pair with one shift and one lop3 (128 + q) and
one subtraction of 128 + z; int8 with two lop3 (128 plus the pair's low 7 bits; 128 or 256 by
their sign bits) and one subtraction (q - 128, signed), after a shift for every other pair, and
one subtraction of z - 128 with zero points. (q - z) is a small integer (|q - z| <= 255), exact
in bf16, so the products of a group's k-tiles are exact in their f32 sum; that sum is then
scaled by the group's scale (block_k divides the group, or a k-step spans whole groups, each
scaled on its own). Groups of fewer than 64 inputs (Kimi-K2's 32) split each tile into k-parts
of one group, each its own wgmma of that many inputs with its own scale and zero point. Scales
are read in their stored dtype (bfloat16, float16, float32) and widened to f32. bf16_weights
(warp-specialized GEMMs): the converted tile is scaled in registers instead, (q - z) * s rounded
to bf16 once, and multiplied straight into the accumulators: no f32 sum per group, so 128-row
blocks fit in registers (the layer's default from config.ROWS_FOR_128 rows per expert). The
block's token rows are the B operand (shared memory, K-major), so a block needs 8..256 rows
rather than a 64-row tile: the path for decode (one row per expert) and prefill alike. TMA
copies of the weight, scale and row tiles run `max_concurrent_steps` k-steps ahead.

Two ways to run a program (docs/performance.md, 'Mosaic GPU GEMM'):
- consumers=0: one warpgroup issues the copies and does the math on block_n features
  (`plgpu.emit_pipeline`); fastest for blocks of 8-16 rows (decode, M <= 256).
- consumers=1 or 2: warp specialization (`plgpu.emit_pipeline_warp_specialized`): a producer
  warpgroup issues the copies, and each consumer warpgroup does the math on its own block_n
  features of the program's block_n*consumers, sharing the rows' tile. While one consumer waits
  for its wgmma the other converts its next tile; fastest for blocks of 64 rows and more.
block_n (64..256): a warpgroup's features in sub-tiles of 64 (one wgmma M each, its own
accumulator): a rows' tile serves more weights. splits > 1 gives each program one of `splits`
runs of k-steps and writes partial products [splits, P, N] (summed by the caller): programs for
GEMMs with few N tiles and blocks (the TP=8 slice at M=1). gated: W is a gated MLP's [gate; up]
and the program stores silu(gate) * up: each sub-tile's gate and up sums sit in the same
registers of two accumulators, so the activation costs no data movement, and the f32 [P, N]
output and the activation's pass over it disappear.

It reads QuantizedExperts in the "mgpu_int4" or "mgpu_int8" layout (wna16_jax/layouts.py, made
once): qweight int4 [E, N/64, K/64, 64, 64] holding q - 8 (int8: q - 128) in 64x64 tiles (their
values in register order, layouts.tile_order), k-tiles of a row of tiles consecutive, so that
each k-step's block_n x block_k weights are one contiguous run of memory, copied in TMA rows of
TMA_ROW_BYTES bytes (faster than rows [E, N, K], and than a tile's own 32-byte int4 rows:
docs/performance.md, 'Mosaic GPU GEMM');
scales [E, K//G, N] (one TMA row of block_n scales per group) and zeros None or 8 - z (int8:
128 - z) as [E, K//G, N], so that w = (qweight + zeros) * scales.

Inputs are rows in block order: x_rows[P, K] (P = blocks * block_m, the block of row p is
p // block_m), one expert id per block (-1 or an id past the experts: the block's output
rows are zeros).

The code, in the order a call runs it: `make_plan` checks the arguments and gathers them with
the operands' shapes into a GemmPlan (the kernel's one static argument); `gemm_program` is one
program (a Program: its place in the grid, its refs, the rows it computes); `copies`, the
producer's TMA copies of each k-step; `dequantized` (the converter, in convert.py) and
`group_offset`; the consumers' wgmma loop, `exact_products` (a sum per group, scaled) or
`rounded_products` (bf16_weights and carried sums), run by `pipeline_step` in `run`'s
pipeline; the epilogue, `epilogue` (silu * up), `scaled_sums` and `store`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mgpu.convert import (
    CONVERTED_BIAS,
    SYMMETRIC_OFFSET,
    TILE,
    converted_tile,
    int8_operand_tile,
)
from wna16_jax.backend_api import ClampedSwiGLU, QuantizedExperts, normalize_activation


def _plgpu():
    """jax.experimental.pallas.mosaic_gpu, imported when a kernel is built: the import takes
    ~0.9 s, which registering the backend (importing this module) need not pay."""
    from jax.experimental.pallas import mosaic_gpu

    return mosaic_gpu


# The weight tiles are copied in TMA rows of this many bytes (256 int4 or 128 int8 values: a free
# reshape of the contiguous tiles); the TMA unit streams a tile's own 32-byte int4 rows slower
# (docs/performance.md, 'Mosaic GPU GEMM'). A TMA box holds at most 256 rows, so a k-step takes
# at most 256 * TMA_ROW_BYTES / TILE / (bits / 8) = 1024 int4 or 512 int8 inputs.
TMA_ROW_BYTES = 128


def row_values(bits: int) -> int:
    """The weights of one TMA row of `bits`-bit values."""
    return TMA_ROW_BYTES * 8 // bits


def rows_per_tile(bits: int) -> int:
    """A 64x64 tile's TMA rows."""
    return TILE * TILE // row_values(bits)


def takes_bf16_weights(consumers: int, tiles_per_program: int) -> bool:
    """Whether a GEMM of this shape can run bf16_weights: warp specialization (consumers 1 or 2)
    and one output tile per program (a wgmma cannot restart its accumulator; the interpreter
    cannot store one)."""
    return consumers > 0 and tiles_per_program == 1


# The scales' dtypes the GEMM reads (the mgpu layouts keep a checkpoint's: bfloat16, float16 as
# GPTQ stores them, or float32): each group's row is loaded as it is and widened to f32.
SCALE_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# Groups smaller than a 64-wide k-tile split it into k-parts of one group each (a wgmma of that
# many inputs): at least a bf16 wgmma's 16.
MIN_GROUP = 16


def group_reason(group: int, *, int8_rows: bool = False) -> str | None:
    """Why the GEMM cannot take weights in groups of `group` inputs along K (None when it can):
    a multiple of the 64-wide k-tile, or (bf16 rows) a divisor of it of at least MIN_GROUP."""
    if group % TILE == 0:
        return None
    if int8_rows:
        return f"group size {group} is not a multiple of {TILE}, as int8 rows (W8A8) need"
    if TILE % group or group < MIN_GROUP:
        return (
            f"group size {group} neither is a multiple of {TILE} (the k-tile) nor divides it "
            f"with at least {MIN_GROUP} inputs (a bf16 wgmma's)"
        )
    return None


# Rows that may fill part of a block (one block: P < this): Mosaic GPU tiles the rows' copies
# by the block's least width (8 rows, a wgmma's least) and takes a dimension shorter than its
# tile or a multiple of it; more rows come in whole blocks.
PARTIAL_BLOCK_ROWS = 8


def takes_rows(rows: int, block_m: int, int8_rows: bool = False) -> bool:
    """Whether the GEMM takes `rows` rows as they are in blocks of block_m: whole blocks, or
    fewer than PARTIAL_BLOCK_ROWS bf16 rows (part of one block)."""
    return rows % block_m == 0 or (rows < PARTIAL_BLOCK_ROWS and not int8_rows)


def check_config(
    w: QuantizedExperts,
    x_rows,
    *,
    block_m: int,
    block_k: int,
    block_n: int = 64,
    consumers: int = 0,
    splits: int = 1,
    gated: bool = False,
    tiles_per_program: int = 1,
    bf16_weights: bool = False,
    x_scales=None,
) -> None:
    """Raises ValueError (NotImplementedError for unsupported operands) for a config or operands
    this GEMM cannot take."""
    w.validate("weights")
    if w.layout not in ("mgpu_int4", "mgpu_int8"):
        raise NotImplementedError(
            f"the Mosaic GPU GEMM reads the mgpu_int{w.bits} layout, got {w.layout!r} "
            f"(wna16_jax.layouts.to_kernel_layout converts)"
        )
    e, n, k = w.shape
    p, kx = x_rows.shape
    if kx != k:
        raise ValueError(f"x_rows has K={kx}, the weights K={k}")
    if x_rows.dtype == jnp.int8:  # W8A8
        if w.bits != 8 or w.zeros is not None:
            raise NotImplementedError(
                f"int8 rows (W8A8) take symmetric int8 weights, got int{w.bits}"
                f"{' with zero points' if w.zeros is not None else ''}"
            )
        if x_scales is None or x_scales.shape != (p,) or x_scales.dtype != jnp.float32:
            raise ValueError(
                f"int8 rows take their f32 scales [{p}], got "
                f"{None if x_scales is None else (x_scales.shape, x_scales.dtype)}"
            )
        if bf16_weights:
            raise ValueError("bf16_weights takes bf16 rows, not int8 (W8A8)")
    elif x_rows.dtype != jnp.bfloat16:
        raise NotImplementedError(f"activations must be bfloat16 or int8, got {x_rows.dtype}")
    elif x_scales is not None:
        raise ValueError("x_scales are the scales of int8 rows (W8A8); these rows are bfloat16")
    if block_m % 8 or not 8 <= block_m <= 256:
        raise ValueError(f"block_m={block_m} must be a multiple of 8 in [8, 256] (wgmma N)")
    if not takes_rows(p, block_m, x_rows.dtype == jnp.int8):
        raise ValueError(
            f"{p} rows are not whole blocks of {block_m} (a partial block: bf16 rows, fewer "
            f"than {PARTIAL_BLOCK_ROWS})"
        )
    if consumers not in (0, 1, 2):
        raise ValueError(f"consumers={consumers} must be 0 (no warp specialization), 1 or 2")
    if bf16_weights and not takes_bf16_weights(consumers, tiles_per_program):
        raise ValueError(
            "bf16_weights takes warp specialization (consumers 1 or 2) and one output tile per "
            "program (a wgmma cannot restart its accumulator; the interpreter cannot store one)"
        )
    if block_n % TILE or not TILE <= block_n <= 4 * TILE:
        raise ValueError(f"block_n={block_n} must be a multiple of {TILE} in [{TILE}, {4 * TILE}]")
    if block_n * max(consumers, 1) > 256:
        raise ValueError(
            f"block_n x consumers = {block_n * max(consumers, 1)} features per program: at most "
            f"256 (a TMA copy's row of scales)"
        )
    tile_n = block_n * max(consumers, 1) * (2 if gated else 1)
    if n % tile_n:
        raise ValueError(
            f"N={n} must be a multiple of {tile_n} (block_n x consumers, x 2 halves if gated)"
        )
    if w.scales.dtype not in SCALE_DTYPES:
        raise NotImplementedError(
            f"scales must be one of {[str(jnp.dtype(d)) for d in SCALE_DTYPES]}, got "
            f"{w.scales.dtype}"
        )
    if reason := group_reason(w.group, int8_rows=x_rows.dtype == jnp.int8):
        raise NotImplementedError(reason)
    if block_k % 64 or k % block_k:
        raise ValueError(f"block_k={block_k} must be a multiple of 64 dividing K={k}")
    if w.group % block_k and block_k % w.group:
        raise ValueError(
            f"block_k={block_k} must divide the group ({w.group}) or be a multiple of it: "
            f"one scale per group's k-tiles"
        )
    if splits < 1 or (k // block_k) % splits:
        raise ValueError(f"splits={splits} must divide the {k // block_k} k-steps")
    if gated and splits > 1:
        raise ValueError("gated needs whole sums (splits=1): silu of a partial sum is not a part")
    n_tiles = n // tile_n
    if tiles_per_program < 1 or n_tiles % tiles_per_program:
        raise ValueError(
            f"tiles_per_program={tiles_per_program} must divide the {n_tiles} output tiles of "
            f"{tile_n} features"
        )
    step_rows = block_k // TILE * rows_per_tile(w.bits)
    if step_rows > 256:
        raise ValueError(
            f"a k-step of {block_k} int{w.bits} inputs takes {step_rows} weight rows of "
            f"{TMA_ROW_BYTES} bytes: a TMA box holds at most 256"
        )


# The kernel's named regions (jax.named_scope: the in-kernel profiler's): "convert" (int4 / int8
# -> bf16 and the zero point), "wgmma" (issue a group's k-tile products), "wait" (for them), "scale"
# (group scale, accumulate), "store" (the output tile's rows, all of it), its parts "store_smem"
# (registers to the shared-memory buffer), "store_reuse" (wait until the last copy has read the
# buffer) and "store_wait" (the program's final wait for its copies' writes), and "program" (a
# warpgroup's whole block_products run: its span).
REGIONS = (
    "convert", "wgmma", "wait", "scale", "store", "store_smem", "store_reuse", "store_wait",
    "program",
)  # fmt: skip
PROFILE_REGIONS = ("convert", "wgmma", "wait", "scale", "store")


# Shared memory a block may take on sm_90 (cudaDevAttrMaxSharedMemoryPerBlockOptin of the H100 /
# H200: 227 KiB; the tests' compile checks use it too), and what a program's buffers may take:
# that less 2 KB for the pipeline's barriers and alignment.
SM90_SHARED_MEMORY_BYTES = 232448
SMEM_BYTES = SM90_SHARED_MEMORY_BYTES - 2048


# W8A8: each block's f32 row scales are copied padded to this many bytes (a TMA copy's shared
# memory destination is 128-byte aligned, and each pipeline stage's copy lands one block after
# the last).
XS_BYTES = 128


def stage_bytes(
    *, block_m: int, block_k: int, tile_n: int, halves: int, groups_per_step: int,
    has_offset: bool, scale_bytes: int, bits: int, int8_rows: bool = False,
) -> int:  # fmt: skip
    """Shared memory of one pipeline stage (a k-step's copies): the weight tiles of each half,
    the block's rows (bf16, or int8 and their f32 scales: int8_rows) and each half's scales
    (and zero offsets) of the step's groups."""
    rows = block_m * block_k + max(4 * block_m, XS_BYTES) if int8_rows else block_m * block_k * 2
    return (
        halves * tile_n * block_k * bits // 8  # int4 / int8 weights
        + rows
        + halves * groups_per_step * tile_n * scale_bytes * (2 if has_offset else 1)
    )


def output_buffer_rows(*, stages: int, warpgroups: int, out_bytes: int, **stage) -> int:
    """Rows of each warpgroup's output buffer ([rows, 64]): the block's, or half of them (then a
    quarter, ...; at least 8) where the pipeline's stages (`stage_bytes` of the keyword
    arguments `stage`) leave no room for the whole block's. E.g. int4 GEMM2 of 64-row blocks
    with 256 features per program and 3 stages of 256-wide k-steps: 198 KB of stages leave no
    room for two [64, 64] f32 buffers (32 KB), so they take 32 rows and a sub-tile is stored in
    two copies."""
    one_stage = stage_bytes(**stage)
    rows = stage["block_m"]
    while rows % 16 == 0 and stages * one_stage + warpgroups * rows * TILE * out_bytes > SMEM_BYTES:
        rows //= 2
    return rows


def _swizzled(shape, dtype, what: str):
    """Tiling + swizzle transforms for an SMEM tile whose minor dimension is shape[-1]."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bits = jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo(dtype).bits
    swizzle = plgpu.find_swizzle(shape[-1] * bits, what)
    return (plgpu.TilingTransform((8, 8 * swizzle // bits)), plgpu.SwizzleTransform(swizzle))


# ---- the plan --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """One call of the GEMM as it is traced: the operands' shapes and formats, the config, and
    the counts that follow from them (`make_plan` checks and builds it; the kernel's parts read
    it). P rows, N features (w's rows), K inputs, G the group."""

    # the operands
    num_experts: int
    n: int
    k: int
    rows: int  # P, in blocks of block_m (the last may be partial)
    bits: int
    group: int
    has_offset: bool  # zero points (stored as the offsets 8 - z / 128 - z)
    dtype: jnp.dtype  # the rows': bfloat16, or int8 (W8A8)
    out_dtype: jnp.dtype
    # the config (mgpu_wna16_gemm's arguments)
    block_m: int
    block_k: int
    block_n: int
    stages: int  # k-steps in flight
    consumers: int
    splits: int
    gated: bool
    tiles: int  # output tiles per program
    halvings: int  # times a block may halve (`narrow`)
    narrow: bool  # the rows in use per block are given: blocks run at the fewest rows they use
    buffer_rows: int
    bf16_weights: bool
    interpret: bool
    profile_regions: tuple[str, ...]
    profile_dir: str | None
    codes: str = "int"  # QuantizedExperts.codes: "e2m1" (MXFP4) converts to E2M1 values
    has_bias: bool = False  # a bias [E, N] per expert and feature, added to the f32 sums
    activation: str | ClampedSwiGLU = "silu"  # gated's: "silu" or a ClampedSwiGLU

    @property
    def w8a8(self) -> bool:
        return self.dtype == jnp.int8

    @property
    def sums(self):  # a group's exact products: int32 of int8 products, else f32
        return jnp.int32 if self.w8a8 else jnp.float32

    @property
    def carried(self) -> bool:
        """Per-channel weights, warp-specialized, one tile per program, W8A8 or bf16_weights:
        the exact sums of all k-steps carried in the accumulators (int32 of int8 products; f32
        of the bf16 (q - z), exact), scaled once at the end by each feature's scale (W8A8: and
        each row's): no scale per weight, nor per k-step."""
        one_tile = takes_bf16_weights(self.consumers, self.tiles)
        return self.group == self.k and one_tile and (self.w8a8 or self.bf16_weights)

    @property
    def wgs(self) -> int:  # warpgroups doing math, each on block_n features
        return max(self.consumers, 1)

    @property
    def subs(self) -> int:  # a warpgroup's 64-feature sub-tiles (wgmma M) per half
        return self.block_n // TILE

    @property
    def halves(self) -> int:  # weight halves a program reads: (gate, up) or the one
        return 2 if self.gated else 1

    @property
    def tile_n(self) -> int:  # output features per output tile
        return self.block_n * self.wgs

    @property
    def out_n(self) -> int:
        return self.n // self.halves

    @property
    def steps_per_group(self) -> int:  # a k-step spans part of one group ...
        return max(self.group // self.block_k, 1)

    @property
    def groups_per_step(self) -> int:  # ... or several whole groups
        return max(self.block_k // self.group, 1)

    @property
    def part_k(self) -> int:
        """A k-part: the inputs of a weight tile one wgmma takes, the whole 64-wide tile or,
        for groups of fewer inputs (32: Kimi-K2's), one group's columns of it (its own scale
        and zero point), `parts` per tile."""
        return min(TILE, self.group)

    @property
    def parts(self) -> int:
        return TILE // self.part_k

    @property
    def parts_per_group(self) -> int:  # a group's k-parts in a k-step
        return min(self.group, self.block_k) // self.part_k

    @property
    def bias(self) -> int:
        return 0 if self.codes == "e2m1" else CONVERTED_BIAS[self.bits]

    @property
    def tile_rows(self) -> int:  # a weight tile's TMA rows
        return rows_per_tile(self.bits)

    @property
    def steps(self) -> int:  # k-steps per split
        return self.k // self.block_k // self.splits

    @property
    def n_tiles(self) -> int:  # output tiles per block
        return self.out_n // self.tile_n

    @property
    def blocks(self) -> int:
        return -(-self.rows // self.block_m)

    @property
    def n_runs(self) -> int:  # runs of `tiles` output tiles of a block, a program each
        return self.n_tiles // self.tiles

    @property
    def xs_width(self) -> int:  # W8A8: f32 row scales per block, padded to XS_BYTES
        return max(self.block_m, XS_BYTES // 4)

    @property
    def grid(self) -> tuple[int, ...]:  # a program's pipeline: (k-steps,) or (tiles, k-steps)
        return (self.steps,) if self.tiles == 1 else (self.tiles, self.steps)

    def region(self, name: str):
        """The named scope `name` where it is profiled, else none (a region costs
        registers)."""
        return jax.named_scope(name) if name in self.profile_regions else contextlib.nullcontext()


def make_plan(
    x_rows, w: QuantizedExperts, block_experts, rows_in_use=None, *, x_scales=None, block_m: int,
    block_k: int = 128, block_n: int = 64, max_concurrent_steps: int = 4, consumers: int = 0,
    splits: int = 1, gated: bool = False, tiles_per_program: int = 1, block_halvings: int = 1,
    buffer_rows: int | None = None, bf16_weights: bool = False, out_dtype=None,
    interpret: bool = False, profile_dir: str | None = None,
    profile_regions: tuple[str, ...] = PROFILE_REGIONS, bias=None, activation="silu",
) -> GemmPlan:  # fmt: skip
    """The GemmPlan of mgpu_wna16_gemm's arguments (see there), checked: raises ValueError
    (NotImplementedError for unsupported operands) for what the GEMM cannot run."""
    if unknown := set(profile_regions) - set(REGIONS):
        raise ValueError(f"profile_regions {sorted(unknown)} are not among {REGIONS}")
    check_config(
        w, x_rows, block_m=block_m, block_k=block_k, block_n=block_n, consumers=consumers,
        splits=splits, gated=gated, tiles_per_program=tiles_per_program,
        bf16_weights=bf16_weights, x_scales=x_scales,
    )  # fmt: skip
    narrow = rows_in_use is not None
    if narrow and (
        block_halvings < 1
        or block_m % (8 << block_halvings)
        or rows_in_use.shape != block_experts.shape
    ):
        raise ValueError(
            f"rows_in_use needs block_halvings >= 1 halvings of block_m to a multiple of 8 (a "
            f"wgmma's least rows), got block_m={block_m}, block_halvings={block_halvings}, and "
            f"one count per block: {rows_in_use.shape} for {block_experts.shape} blocks"
        )
    e, n, k = w.shape
    if bias is not None and (
        tuple(bias.shape) != (e, n) or not jnp.issubdtype(bias.dtype, jnp.floating)
    ):
        raise ValueError(f"bias must be float [E, N] = {[e, n]}, got {bias.dtype} {bias.shape}")
    gated_activation = normalize_activation(activation)
    if gated_activation is None:
        raise ValueError(f"activation={activation!r} is not 'silu' or a ClampedSwiGLU")
    p = x_rows.shape[0]
    dtype = jnp.dtype(x_rows.dtype)
    out_dtype = jnp.dtype(out_dtype or (jnp.float32 if dtype == jnp.int8 else dtype))
    steps = k // block_k // splits
    plan = GemmPlan(
        num_experts=w.num_experts, n=n, k=k, rows=p, bits=w.bits, group=w.group,
        has_offset=w.zeros is not None, dtype=dtype, out_dtype=out_dtype, block_m=block_m,
        block_k=block_k, block_n=block_n,
        stages=min(max_concurrent_steps, tiles_per_program * steps), consumers=consumers,
        splits=splits, gated=gated, tiles=tiles_per_program, halvings=block_halvings,
        narrow=narrow, buffer_rows=0, bf16_weights=bf16_weights, interpret=interpret,
        profile_regions=tuple(profile_regions), profile_dir=profile_dir, codes=w.codes,
        has_bias=bias is not None, activation=gated_activation,
    )  # fmt: skip
    if block_experts.shape != (plan.blocks,):
        raise ValueError(
            f"block_experts has shape {block_experts.shape}, want ({plan.blocks},): one expert "
            f"per block of {block_m} of the {p} rows"
        )
    if buffer_rows is None:
        buffer_rows = output_buffer_rows(
            block_m=block_m, block_k=block_k, tile_n=plan.tile_n, halves=plan.halves,
            groups_per_step=plan.groups_per_step, has_offset=plan.has_offset,
            scale_bytes=w.scales.dtype.itemsize, bits=w.bits, stages=plan.stages,
            warpgroups=plan.wgs, out_bytes=out_dtype.itemsize, int8_rows=plan.w8a8,
        )  # fmt: skip
    elif buffer_rows % 8 or block_m % buffer_rows:
        raise ValueError(f"buffer_rows={buffer_rows} must be a multiple of 8 dividing {block_m}")
    return dataclasses.replace(plan, buffer_rows=buffer_rows)


# ---- one program ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of the kernel as it runs (traced values): its output tiles (split si, block
    bi, run n_run of N tiles), its math warpgroup wg, its block's expert, the refs it reads and
    writes, and `rows`, the width at which it computes its block (block_m, or a halving)."""

    plan: GemmPlan
    rows: int
    wg: object
    si: object
    bi: object
    n_run: object
    expert: object  # the block's expert id as given
    e: object  # clipped to [0, E): the weights a block without an expert would index
    has_expert: object
    x_gmem: object
    q_gmem: object
    s_gmem: object
    z_gmem: object | None
    xs_gmem: object | None
    b_gmem: object | None  # the biases [E, N] (has_bias)
    o_gmem: object
    o_smem: object
    a_smem: object | None  # the interpreter's dequantized tiles (its wgmma takes A from smem)

    def sub_tile(self, s):  # this warpgroup's sub-tile s among the program's 64-feature tiles
        return self.wg * self.plan.subs + s

    def features(self, s):
        return pl.ds(self.sub_tile(s) * TILE, TILE)

    def tile_and_step(self, idx):
        """The pipeline's step idx -> (N tile, k-step within this split): idx is (k-step,), or
        (tile of the run, k-step) with runs of tiles."""
        if self.plan.tiles == 1:
            return self.n_run, idx[0]
        return self.n_run * self.plan.tiles + idx[0], idx[1]


# ---- the epilogue: output tiles from the sums ---------------------------------------------------


def store(prog: Program, values, ni) -> None:
    """This warpgroup's [rows, block_n] part of output tile ni, one copy per sub-tile and chunk
    of buffer_rows rows through one [buffer_rows, 64] buffer (a buffer per sub-tile where they
    fit measured the same). The copies are waited for at the program's end (`store_all`); a
    copy waits only until the last has read the buffer."""
    plgpu = _plgpu()
    plan, rows = prog.plan, prog.rows
    with plan.region("store"):
        out_tile = prog.o_gmem.at[prog.si] if plan.splits > 1 else prog.o_gmem
        chunk = min(rows, plan.buffer_rows)
        wg = prog.wg
        buffer = (
            prog.o_smem.at[wg] if chunk == plan.buffer_rows else prog.o_smem.at[wg, pl.ds(0, chunk)]
        )
        for s, value in enumerate(values):
            cols = pl.ds(ni * plan.tile_n + prog.sub_tile(s) * TILE, TILE)
            for first in range(0, rows, chunk):
                with plan.region("store_reuse"):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                part = value if chunk == rows else value[:, first : first + chunk]
                with plan.region("store_smem"):
                    buffer.T[...] = plgpu.layout_cast(
                        part.astype(plan.out_dtype), plgpu.Layout.WGMMA_TRANSPOSED
                    )
                    plgpu.commit_smem()
                out_rows = pl.ds(prog.bi * plan.block_m + first, chunk)
                plgpu.copy_smem_to_gmem(buffer, out_tile.at[out_rows, cols])


def store_all(prog: Program, values, ni) -> None:
    """`store`, then wait for the program's copies to be written."""
    plgpu = _plgpu()
    store(prog, values, ni)
    with prog.plan.region("store_wait"):
        plgpu.wait_smem_to_gmem(0)


def gated_product(activation):
    """(gate, up) -> the output of a gated activation on f32 sub-tiles: "silu" (silu(gate) *
    up) or a ClampedSwiGLU (gpt-oss's: gate clamped above at its limit, up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate)), its limit and alpha the value's."""
    if activation == "silu":
        return lambda g, u: g / (1.0 + jnp.exp(-g)) * u
    alpha, limit = activation.alpha, activation.limit

    def clamped_swiglu(g, u):
        g = jnp.minimum(g, limit)
        return (jnp.clip(u, -limit, limit) + 1.0) * (g / (1.0 + jnp.exp(-alpha * g)))

    return clamped_swiglu


def biased(prog: Program, accs, ni):
    """accs (per half, per sub-tile) of output tile ni plus each feature's bias of the block's
    expert in f32 (W's rows: a gated W's gate and up halves each their own), read from global
    memory (optimized=False: Mosaic GPU lowers optimized loads from shared memory only); with
    K splits only the first split adds it, so that the partial products sum to one bias."""
    plgpu = _plgpu()
    plan = prog.plan
    row = plgpu.Layout.WGMMA.reduce(1)
    out = []
    for h in range(plan.halves):
        for s in range(plan.subs):
            first = h * plan.out_n + ni * plan.tile_n + prog.sub_tile(s) * TILE
            bias = plgpu.load(
                prog.b_gmem.at[prog.e, pl.ds(first, TILE)], layout=row, optimized=False
            )
            value = accs[h * plan.subs + s].astype(jnp.float32)
            bias = lax.broadcast_in_dim(bias.astype(jnp.float32), value.shape, [0])
            if plan.splits > 1:
                first_split = lax.broadcast_in_dim(
                    (prog.si == 0).astype(jnp.float32), value.shape, ()
                )
                bias = bias * plgpu.layout_cast(first_split, plgpu.Layout.WGMMA)
            out.append(value + bias)
    return tuple(out)


def epilogue(prog: Program, accs, ni):
    """Output tile ni's sub-tiles from the f32 sums: plus the biases (has_bias), then the gated
    activation (gated) or as they are."""
    plan = prog.plan
    if plan.has_bias:
        accs = biased(prog, accs, ni)
    if not plan.gated:
        return accs
    gates, ups = accs[: plan.subs], accs[plan.subs :]
    act = gated_product(plan.activation)
    return tuple(act(g, u) for g, u in zip(gates, ups, strict=True))


def scaled_sums(prog: Program, acc_refs):
    """The carried sums in f32: `carried`'s scaled by each feature's weight scale (W8A8: and
    each row's scale; read from global memory: the pipeline's copies are gone;
    optimized=False: Mosaic GPU lowers optimized loads from shared memory only),
    bf16_weights' scaled ones as they are."""
    plgpu = _plgpu()
    plan = prog.plan
    values = tuple(acc[...] for acc in acc_refs)
    if not plan.carried:
        return values
    row = plgpu.Layout.WGMMA.reduce(1)
    row_scale = None
    if plan.w8a8:
        row_scale = plgpu.load(
            prog.xs_gmem.at[prog.bi, pl.ds(0, prog.rows)],
            layout=plgpu.Layout.WGMMA.reduce(0),
            optimized=False,
        )
    out = []
    for h in range(plan.halves):
        for s in range(plan.subs):
            first = (h * plan.n_tiles + prog.n_run) * plan.tile_n + prog.sub_tile(s) * TILE
            scale = plgpu.load(
                prog.s_gmem.at[prog.e, 0, pl.ds(first, TILE)], layout=row, optimized=False
            )
            value = values[h * plan.subs + s].astype(jnp.float32)
            value = value * lax.broadcast_in_dim(scale.astype(jnp.float32), value.shape, [0])
            if row_scale is not None:
                value = value * lax.broadcast_in_dim(row_scale, value.shape, [1])
            out.append(value)
    return tuple(out)


def zero_accs(prog: Program):
    """f32 [64 features, rows] accumulators: per half, per sub-tile."""
    plgpu = _plgpu()
    wgmma = plgpu.Layout.WGMMA
    return tuple(
        plgpu.layout_cast(jnp.full((TILE, prog.rows), 0, jnp.float32), wgmma)
        for _ in range(prog.plan.halves * prog.plan.subs)
    )


# ---- the dequantizing converter -----------------------------------------------------------------


def group_offset(prog: Program, s_refs, z_refs, g, h, s, scale=None):
    """What the conversion subtracts from sub-tile s's features in group g, once per group of
    the step: the bias less the zeros, int4 136 - (8 - z) = 128 + z <= 143, int8
    0 - (128 - z) = z - 128, exact; symmetric int4: 136 - 0 * scale = 136 (exact for finite
    scales), computed as a zero point's offset is (see SYMMETRIC_OFFSET; scale: the group's
    row where already loaded); None where the bias is subtracted as a constant (symmetric:
    int8's 0, int4's in the interpreter). In the weights' dtype (exact: small integers),
    whatever the scales' (and zero points') dtype."""
    plgpu = _plgpu()
    plan = prog.plan
    row = plgpu.Layout.WGMMA.reduce(1)
    if z_refs:
        z = plgpu.load(z_refs[h].at[g, prog.features(s)], layout=row)
        return (plan.bias - z).astype(plan.dtype)
    if plan.interpret or not plan.bias:
        return None
    if scale is None:
        scale = plgpu.load(s_refs[h].at[g, prog.features(s)], layout=row)
    return (SYMMETRIC_OFFSET - 0 * scale).astype(plan.dtype)


def rounded_weights(plan: GemmPlan, wt, scale):
    """(q - z) * s rounded to bf16 once: bf16 scales multiply in bf16 (the exact product,
    rounded); float16 / float32 scales in f32 (exact for float16: an integer of at most 8 bits
    times 11 significant bits), then rounded to bf16."""
    if scale.dtype == plan.dtype:
        return wt * lax.broadcast_in_dim(scale, wt.shape, [0])
    scale = lax.broadcast_in_dim(scale.astype(jnp.float32), wt.shape, [0])
    return (wt.astype(jnp.float32) * scale).astype(plan.dtype)


def dequantized(prog: Program, q_smem, offset, s, m, scale=None):
    """Sub-tile s's m-th k-part of the k-step in bf16 (of its 64x64 weight tile m // parts):
    the converted part (the stored value plus CONVERTED_BIAS) less offset, the bias less the
    zeros of the part's features: q - z, a small integer, exact in bf16; with scale
    (bf16_weights) times the scale, rounded once. W8A8: the stored signed bytes, the weights
    themselves."""
    plan = prog.plan
    with plan.region("convert"):
        j, part = divmod(m, plan.parts)
        q_tile = q_smem.at[prog.sub_tile(s), pl.ds(j * plan.tile_rows, plan.tile_rows)]
        if plan.w8a8:
            wt = int8_operand_tile(q_tile, plan.interpret)
        else:
            wt = converted_tile(
                q_tile, plan.bits, plan.dtype, plan.interpret, part, plan.parts, codes=plan.codes
            )
        if offset is not None:
            wt = wt - lax.broadcast_in_dim(offset, wt.shape, [0])
        elif plan.bias:  # symmetric int4 in the interpreter: the constant
            wt = wt - plan.bias
        if scale is not None:
            wt = rounded_weights(plan, wt, scale)
        if plan.interpret:
            prog.a_smem.at[prog.wg, s, m][...] = wt
            return prog.a_smem.at[prog.wg, s, m]
        return wt


# ---- the consumers' wgmma loop ------------------------------------------------------------------


def x_part(plan: GemmPlan, x_smem, m):
    """The rows' inputs of k-part m of the step, K-major (the wgmma's B operand)."""
    return x_smem.at[:, pl.ds(m * plan.part_k, plan.part_k)].T


def exact_products(prog: Program, accs, q_refs, x_smem, s_refs, z_refs, xs_ref=None):
    """accs plus this k-step's products: each group's k-parts' products are exact in their f32
    (W8A8: int32) sum (its own accumulator); the group scale (W8A8: times each row's, xs_ref)
    multiplies the sum. Units (group, half, sub-tile) run in order: unit u's parts are
    converted while unit u-1's wgmmas run, and u-1's sum is scaled while u's run."""
    plgpu = _plgpu()
    plan = prog.plan
    row, column = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    units = [
        (g, h, s)
        for g in range(plan.groups_per_step)
        for h in range(plan.halves)
        for s in range(plan.subs)
    ]

    def issue(part_ref, g, h, s):
        k_parts = range(g * plan.parts_per_group, (g + 1) * plan.parts_per_group)
        offset = group_offset(prog, s_refs, z_refs, g, h, s)
        wts = [dequantized(prog, q_refs[h], offset, s, m) for m in k_parts]
        with plan.region("wgmma"):
            for m, wt in zip(k_parts, wts, strict=True):
                plgpu.wgmma(part_ref, wt, x_part(plan, x_smem, m))

    def add_scaled(accs, part_ref, g, h, s, in_flight):
        # wait until at most in_flight wgmmas (the next unit's) are running
        with plan.region("wait"):
            part = plgpu.wgmma_accumulator_load(part_ref, wait_n=in_flight)
        with plan.region("scale"):
            scale = plgpu.load(s_refs[h].at[g, prog.features(s)], layout=row)
            scale = lax.broadcast_in_dim(scale.astype(jnp.float32), part.shape, [0])
            if xs_ref is not None:
                row_scale = plgpu.load(xs_ref.at[pl.ds(0, prog.rows)], layout=column)
                scale = scale * lax.broadcast_in_dim(row_scale, part.shape, [1])
            a = h * plan.subs + s
            part = part.astype(jnp.float32) * scale
            return accs[:a] + (accs[a] + part,) + accs[a + 1 :]

    def unit_products(*part_refs):
        out = accs
        for u, part_ref in enumerate(part_refs):
            issue(part_ref, *units[u])
            if u:
                out = add_scaled(out, part_refs[u - 1], *units[u - 1], plan.parts_per_group)
        return add_scaled(out, part_refs[-1], *units[-1], 0)

    acc_types = [plgpu.ACC((TILE, prog.rows), plan.sums) for _ in units]
    return pl.run_scoped(unit_products, *acc_types)


def rounded_products(prog: Program, acc_refs, q_refs, x_smem, s_refs, z_refs):
    """bf16_weights: each weight's (q - z) * s rounded to bf16 once (as a bf16 model's
    dequantized weights), multiplied straight into the sums (acc_refs): no f32 sum per group
    to hold, wait for and scale. carried: the products of the weights (q - z) straight into
    the sums (scaled at the end: `scaled_sums`)."""
    plgpu = _plgpu()
    plan = prog.plan
    row = plgpu.Layout.WGMMA.reduce(1)
    for g in range(plan.groups_per_step):
        for h in range(plan.halves):
            for s in range(plan.subs):
                scale = None
                if not plan.carried:
                    scale = plgpu.load(s_refs[h].at[g, prog.features(s)], layout=row)
                offset = group_offset(prog, s_refs, z_refs, g, h, s, scale)
                for m in range(g * plan.parts_per_group, (g + 1) * plan.parts_per_group):
                    wt = dequantized(prog, q_refs[h], offset, s, m, scale)
                    with plan.region("wgmma"):
                        plgpu.wgmma(acc_refs[h * plan.subs + s], wt, x_part(plan, x_smem, m))
    with plan.region("wait"):
        plgpu.wgmma_wait(0)
    return acc_refs


def pipeline_step(prog: Program, idx, *refs):
    """The pipeline's body at step idx. refs: the weight tiles of each half, the rows' tile,
    the scales of each half, the zero points of each half (with them), the rows' scales
    (W8A8), the carried sums (accumulators, or with bf16_weights / carried their refs)."""
    plgpu = _plgpu()
    plan = prog.plan
    *refs, accs = refs
    xs_ref = refs.pop() if plan.w8a8 else None
    halves = plan.halves
    q_refs, x_smem = refs[:halves], refs[halves]
    s_refs, z_refs = refs[halves + 1 : 2 * halves + 1], refs[2 * halves + 1 :]
    if plan.bf16_weights or plan.carried:
        return rounded_products(prog, accs, q_refs, x_smem, s_refs, z_refs)
    if plan.tiles == 1:
        return exact_products(prog, accs, q_refs, x_smem, s_refs, z_refs, xs_ref)
    # A run of tiles: a tile's first k-step starts its sums from zero, its last stores them (the
    # next tile's copies are already in flight).
    ni, kk = prog.tile_and_step(idx)
    keep = lax.broadcast_in_dim((kk > 0).astype(jnp.float32), (TILE, prog.rows), ())
    keep = plgpu.layout_cast(keep, plgpu.Layout.WGMMA)
    accs = tuple(a * keep for a in accs)
    accs = exact_products(prog, accs, q_refs, x_smem, s_refs, z_refs, xs_ref)

    @pl.when(kk == plan.steps - 1)
    def _store():
        store(prog, epilogue(prog, accs, ni), ni)

    return accs


# ---- the producer's copies ----------------------------------------------------------------------


def copies(prog: Program):
    """(in_specs, operands) of the pipeline: what each k-step copies to shared memory, by TMA
    (half h's weight tiles start at N tile h * n_tiles: the up half of a gated W)."""
    plgpu = _plgpu()
    plan = prog.plan
    halves, bk = plan.halves, plan.block_k

    def weight_tile(h):
        def index(*idx):
            ni, kk = prog.tile_and_step(idx)
            return prog.e, h * plan.n_tiles + ni, prog.si * plan.steps + kk, 0

        return index

    def group_rows(h):
        def index(*idx):
            ni, kk = prog.tile_and_step(idx)
            return (
                prog.e,
                (prog.si * plan.steps + kk) // plan.steps_per_group,
                h * plan.n_tiles + ni,
            )

        return index

    def row_tile(*idx):
        return prog.bi * (plan.block_m // prog.rows), prog.si * plan.steps + prog.tile_and_step(
            idx
        )[1]

    q_spec = (None, plan.wgs * plan.subs, bk // TILE * plan.tile_rows, row_values(plan.bits))
    g_spec = (None, plan.groups_per_step, plan.tile_n)
    in_specs = [  # weight tiles [64-feature tiles, the k-step's rows of TMA_ROW_BYTES]:
        # contiguous and unswizzled: a warp's 16-byte loads read 512 consecutive bytes, no bank
        # conflicts
        *(plgpu.BlockSpec(q_spec, weight_tile(h)) for h in range(halves)),
        plgpu.BlockSpec(
            (prog.rows, bk),
            row_tile,
            # swizzled as a k-part is (the wgmma's slices): a 64-wide k-tile's 128 bytes of
            # bf16, 64 of int8; a 32-wide group's 64 bytes of bf16
            transforms=_swizzled((prog.rows, plan.part_k), plan.dtype, "x"),
        ),
        *(plgpu.BlockSpec(g_spec, group_rows(h)) for h in range(halves)),
    ]
    if plan.has_offset:
        in_specs += [plgpu.BlockSpec(g_spec, group_rows(h)) for h in range(halves)]
    if plan.w8a8:  # the block's row scales, with each k-step's rows (a few bytes; the
        # warp-specialized pipeline takes only inputs that follow its steps)
        in_specs.append(
            plgpu.BlockSpec((None, plan.xs_width), lambda *idx: (prog.bi + 0 * idx[-1], 0))
        )
    operands = [prog.q_gmem] * halves + [prog.x_gmem] + [prog.s_gmem] * halves
    if plan.has_offset:
        operands += [prog.z_gmem] * halves
    if plan.w8a8:
        operands.append(prog.xs_gmem)
    return in_specs, operands


# ---- a program's run -----------------------------------------------------------------------------


def run(prog: Program) -> None:
    """Runs the program's pipeline over its k-steps (and tiles) and stores its output tiles.
    Without warp specialization one warpgroup copies and computes (`plgpu.emit_pipeline`, the
    f32 sums its carry); with it, a producer warpgroup copies and each consumer runs the
    compute context around the pipeline (`plgpu.emit_pipeline_warp_specialized`)."""
    plgpu = _plgpu()
    plan = prog.plan
    in_specs, operands = copies(prog)
    step = functools.partial(pipeline_step, prog)

    def pipeline(compute_context=None):
        if not plan.consumers:
            return plgpu.emit_pipeline(
                step, grid=plan.grid, in_specs=in_specs, max_concurrent_steps=plan.stages,
                init_carry=zero_accs(prog),
            )(*operands)  # fmt: skip
        plgpu.emit_pipeline_warp_specialized(
            step,
            grid=plan.grid,
            memory_registers=40,
            in_specs=in_specs,
            max_concurrent_steps=plan.stages,
            wg_axis="wg",
            num_compute_wgs=plan.consumers,
            compute_context=compute_context,
        )(*operands)

    def program(body):  # the math warpgroups' part of the run
        with plan.region("program"):
            body()

    if plan.bf16_weights or plan.carried:  # the sums in accumulator refs, the carry

        def rounded(run_steps):
            def scope(*acc_refs):
                run_steps(acc_refs)
                store_all(prog, epilogue(prog, scaled_sums(prog, acc_refs), prog.n_run), prog.n_run)

            accs = [plgpu.ACC((TILE, prog.rows), plan.sums) for _ in range(plan.halves * plan.subs)]
            program(lambda: pl.run_scoped(scope, *accs))

        pipeline(rounded)
    elif plan.tiles > 1:  # each tile stored at its last k-step
        pipeline(lambda run_steps: program(lambda: run_steps(zero_accs(prog))))
        plgpu.wait_smem_to_gmem(0)
    elif not plan.consumers:
        program(lambda: store_all(prog, epilogue(prog, pipeline(), prog.n_run), prog.n_run))
    else:
        pipeline(
            lambda run_steps: program(
                lambda: store_all(
                    prog, epilogue(prog, run_steps(zero_accs(prog)), prog.n_run), prog.n_run
                )
            )
        )


# ---- the kernel ----------------------------------------------------------------------------------


def gemm_program(plan: GemmPlan, experts_gmem, *refs) -> None:
    """One program: its block's expert, then its run at the fewest rows its block uses (or the
    block's), or zero rows for a block without an expert (-1, or past E)."""
    plgpu = _plgpu()
    refs = list(refs)
    rows_gmem = refs.pop(0) if plan.narrow else None
    x_gmem, q_gmem, s_gmem = refs.pop(0), refs.pop(0), refs.pop(0)
    z_gmem = refs.pop(0) if plan.has_offset else None
    xs_gmem = refs.pop(0) if plan.w8a8 else None
    b_gmem = refs.pop(0) if plan.has_bias else None
    o_gmem, o_smem = refs.pop(0), refs.pop(0)
    a_smem = refs.pop(0) if plan.interpret else None
    wg = lax.axis_index("wg") if plan.consumers else 0
    # This program's output tiles: split, block, run of N tiles (fastest).
    flat = lax.axis_index("p")
    blocks, n_runs = plan.blocks, plan.n_runs
    si, bi, n_run = flat // (blocks * n_runs), flat // n_runs % blocks, flat % n_runs
    expert = experts_gmem[bi]
    has_expert = (expert >= 0) & (expert < plan.num_experts)
    prog = Program(
        plan=plan, rows=plan.block_m, wg=wg, si=si,
        bi=bi, n_run=n_run, expert=expert, e=jnp.clip(expert, 0, plan.num_experts - 1),
        has_expert=has_expert, x_gmem=x_gmem, q_gmem=q_gmem, s_gmem=s_gmem, z_gmem=z_gmem,
        xs_gmem=xs_gmem, b_gmem=b_gmem, o_gmem=o_gmem, o_smem=o_smem, a_smem=a_smem,
    )  # fmt: skip
    if plan.narrow:  # a block computes and stores the fewest rows (of the widths) it uses
        used = rows_gmem[bi]
        widths = [plan.block_m >> j for j in range(plan.halvings + 1)]
        for j, width in enumerate(widths):
            narrower = widths[j + 1] if j < plan.halvings else -1
            fits = (used > narrower) & ((used <= width) if j else True)
            pl.when(has_expert & fits)(
                functools.partial(run, dataclasses.replace(prog, rows=width))
            )
    else:
        pl.when(has_expert)(functools.partial(run, prog))

    @pl.when(~has_expert & (prog.wg < plan.wgs))
    def _zeros():
        for j in range(plan.tiles):
            store(prog, zero_accs(prog)[: plan.subs], n_run * plan.tiles + j)
        plgpu.wait_smem_to_gmem(0)


def mgpu_wna16_gemm(
    x_rows: jax.Array,
    w: QuantizedExperts,
    block_experts: jax.Array,
    rows_in_use: jax.Array | None = None,
    *,
    x_scales: jax.Array | None = None,
    bias: jax.Array | None = None,
    **config,
) -> jax.Array:
    """out[p] = x_rows[p] @ W[block_experts[p // block_m]].T in out_dtype (default x_rows',
    f32 for int8 rows), [P, N]; with splits > 1 the K-split partial products, [splits, P, N],
    to be summed. Fewer than PARTIAL_BLOCK_ROWS bf16 rows may fill part of one block (a decode
    step's rows as they are): TMA reads the missing rows as zeros and skips their stores.
    gated: W's rows are the [gate; up] halves of a gated MLP (DeepSeek's w13) and out[p] =
    activation(gate, up), [P, N/2], computed on the f32 sums before the one rounding to
    out_dtype: `activation` "silu" (silu(gate) * up) or a ClampedSwiGLU (gpt-oss's).
    bias: None, or float [E, N] (W's rows: a gated W's [gate; up]), expert e's row added to
    the f32 sums of its blocks' rows (scaled, before the activation; under K splits by the
    first split's partial products).

    config: `make_plan`'s keywords (block_m, block_k, block_n, max_concurrent_steps, consumers,
    splits, gated, activation, tiles_per_program, block_halvings, buffer_rows, bf16_weights,
    out_dtype, interpret, profile_dir, profile_regions), checked and gathered with the
    operands' shapes into one GemmPlan, the kernel's one static argument; each is described
    below.

    W8A8: x_rows int8 in `w8a8_input_order` with their f32 scales x_scales [P] (x_rows[p] *
    x_scales[p] the rows), on symmetric mgpu_int8 weights: int8 x int8 products on the int8
    tensor cores, exact in an int32 sum per group (or k-step), scaled in f32 by the weight's
    scale and the row's. The weight tile goes from shared memory to the A operand's registers
    by one prmt per register, no conversion (`convert.int8_operand_tile`).

    consumers=0: one warpgroup per program issues the copies and does the math on block_n
    features (`plgpu.emit_pipeline`). consumers=1 or 2: warp specialization
    (`plgpu.emit_pipeline_warp_specialized`), a producer warpgroup issues the copies and each
    consumer warpgroup does the math on its own block_n features of the program's tile, sharing
    the rows' tile. block_n: 64 (one wgmma M) or a multiple up to 256, a warpgroup's sub-tiles
    of 64 features, each with its own accumulator: the rows' tile, copied once per k-step,
    serves more features (fewer bytes through L2 per weight byte). splits > 1: each program
    takes one of `splits` equal runs of k-steps (more programs for few rows). block_k: inputs
    per k-step, a multiple of 64 that divides the group or spans whole groups (256 = two groups
    of 128: fewer, larger copies), at most 1024 for int4 and 512 for int8 (one TMA copy; an int8
    k-step takes twice int4's shared memory). gated: a warpgroup's block_n output features take
    a gate and an up accumulator each (the same register positions: silu * up in registers),
    their weights copied from both halves of W.

    Output tiles (a block's rows x block_n * max(consumers, 1) features x one split's k-steps)
    are numbered split-major, then block, then N tile, one program each: the programs running
    at once share a block's rows in L2 (faster than numbering the blocks fastest:
    docs/performance.md, 'Mosaic GPU GEMM').

    tiles_per_program > 1: a program computes that many consecutive output
    tiles of its block, one after the other in one pipeline (grid (tiles, k-steps)): the copies
    of the next tile's first k-steps are in flight while the last tile's sums are stored, and
    the pipeline's start and drain are paid once per program instead of once per tile (GEMM2
    of DeepSeek-V3 has 8 k-steps of 256 per tile at TP=1 and 1 at TP=8).

    rows_in_use: int32 [blocks], the rows of each block in use, its first ones (the aligned
    layout pads each expert's run at its end). A block using at most block_m // 2 rows runs
    its products on the first block_m // 2 only (wgmmas of half the width: about half the
    tensor-core work, the same weight bytes and dequantization) and leaves its other output
    rows unwritten: for the layer's prefill blocks of 64 rows, where an expert's last block
    holds 1..64 rows. block_halvings (with rows_in_use): how many times a block may be halved:
    with 2, a block using at most block_m // 4 rows runs at a quarter of the width (each width
    a multiple of 8, a wgmma's least). Each width is its own pipeline in the kernel (sibling
    scoped allocations: they share shared memory).

    buffer_rows: rows of each warpgroup's output buffer in shared memory (a multiple of 8
    dividing block_m); None: `output_buffer_rows`, the block's where they fit beside the
    pipeline's stages. A sub-tile is stored in copies of that many rows.

    bf16_weights (consumers >= 1, tiles_per_program 1): each weight (q - z) * s rounded to bf16
    once, multiplied straight into the sums (wgmma accumulator refs carried through the
    pipeline) instead of exact integer products summed per group in f32 and then scaled: no
    group sums in registers or waits for them, at the cost of one rounding. Per-channel weights
    (one group: W8A16's usual scheme) need no rounding: the exact (q - z) go into the sums and
    each feature's scale multiplies its sum once, at the end.

    Blocks whose expert is outside [0, E) (-1, or an id past the experts) give zero rows
    (leaving them unwritten measured no faster).
    Compiles for sm_90 only (or runs in the Mosaic GPU interpreter with interpret=True).
    profile_dir: record each warpgroup's named regions with Mosaic GPU's in-kernel profiler
    and write a Chrome trace there per call: those of profile_regions among REGIONS (fewer
    regions, fewer registers for the profiler: with all five of PROFILE_REGIONS ptxas spilled
    registers in GEMM2 at M=4096).
    """
    plan = make_plan(x_rows, w, block_experts, rows_in_use, x_scales=x_scales, bias=bias, **config)
    return _call(plan, x_rows, w, block_experts, rows_in_use, x_scales, bias)


@functools.partial(jax.jit, static_argnames=("plan",))
def _call(plan: GemmPlan, x_rows, w, block_experts, rows_in_use, x_scales, bias):
    """The kernel's launch: its operands in the layouts it reads, its grid, scratch and
    profile space."""
    plgpu = _plgpu()
    n, k = plan.n, plan.k
    # A free reshape of [E, N/64, K/64, 64, 64]: [E, N/64, K/64 * tile_rows, row_values(bits)].
    q_rows = w.qweight.reshape(
        plan.num_experts, n // TILE, k // TILE * plan.tile_rows, row_values(plan.bits)
    )
    operands = [block_experts.astype(jnp.int32)]
    if plan.narrow:
        operands.append(rows_in_use.astype(jnp.int32))
    operands += [x_rows, q_rows, w.scales]
    if plan.has_offset:
        operands.append(w.zeros)
    if plan.w8a8:  # [blocks, xs_width]: a block's scales, then zeros to XS_BYTES
        xs = x_scales.reshape(plan.blocks, plan.block_m)
        operands.append(jnp.pad(xs, ((0, 0), (0, plan.xs_width - plan.block_m))))
    if plan.has_bias:
        operands.append(bias)
    out_shape = (plan.splits, plan.rows, plan.out_n) if plan.splits > 1 else (plan.rows, plan.out_n)
    wgs, subs = plan.wgs, plan.subs
    scratch = [plgpu.SMEM((wgs, plan.buffer_rows, TILE), plan.out_dtype)]
    if plan.interpret:
        parts = plan.block_k // plan.part_k
        scratch.append(plgpu.SMEM((wgs, subs, parts, TILE, plan.part_k), plan.dtype))
    threads = dict(num_threads=plan.consumers + 1, thread_name="wg") if plan.consumers else {}
    profile = {}
    if plan.profile_dir:  # ranges per warpgroup and k-step: a convert per k-part, a wgmma, a
        # wait and a scale per group (twice that, to spare); per tile the store and its parts
        # (two per copy), and the program
        regions = plan.halves * subs * (plan.block_k // plan.part_k + 3 * plan.groups_per_step)
        copies_per_tile = subs * (plan.block_m // plan.buffer_rows)
        profile = dict(
            profile_space=2 * regions * plan.steps + plan.tiles * (2 * copies_per_tile + 4) + 8,
            profile_dir=plan.profile_dir,
        )

    def kernel(*refs):  # its name names the compiled kernel (kernel_mosaic_gpu in traces)
        gemm_program(plan, *refs)

    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(out_shape, plan.out_dtype),
        scratch_types=scratch,
        grid=(plan.splits * plan.blocks * plan.n_runs,),
        grid_names=("p",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, **profile
        ),
        interpret=plgpu.InterpretGPUParams() if plan.interpret else None,
        **threads,
    )
    return call(*operands)
