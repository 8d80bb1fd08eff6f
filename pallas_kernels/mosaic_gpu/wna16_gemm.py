"""The int4 / int8 grouped expert GEMM on Hopper tensor cores through Pallas' Mosaic GPU backend
(the 'mgpu' backend's GEMM; the layer is pallas_kernels/mosaic_gpu/fused_moe.py).

Swap-AB: each program computes out[rows of one block, block_n features] as the transpose of
W[e][features, :] @ x[rows, :]^T. The dequantized weight tile is the wgmma's A operand, taken
from registers: int4 or int8 is loaded from shared memory, converted to bf16 and shifted by the
zero point in registers, never written back to shared memory. The layouts store each 64x64
tile in the order of the A operand's registers, so a thread loads its 32 weights with 16-byte
shared-memory loads (one for int4, two for int8) and converts them without shuffles or
permutes (`_converted_tile`): int4 makes each bf16 pair with one shift and one lop3 (128 + q)
and one subtraction of 128 + z; int8 with two lop3 (128 plus the pair's low 7 bits; 128 or 256
by their sign bits) and one subtraction (q - 128, signed), after a shift for every other pair,
and one subtraction of z - 128 with zero points. (q - z) is a small integer (|q - z| <= 255),
exact in bf16, so the products of a group's k-tiles are exact in their f32 sum; that sum is
then scaled by the group's scale (block_k divides the group, or a k-step spans whole groups,
each scaled on its own). bf16_weights (warp-specialized GEMMs): the converted tile is scaled
in registers instead, (q - z) * s rounded to bf16 once, and multiplied straight into the
accumulators: no f32 sum per group, so 128-row blocks fit in registers (the layer's default
from config.ROWS_FOR_128 rows per expert). The block's token rows are the B operand (shared
memory, K-major), so a block needs 8..256 rows rather than a 64-row tile: the path for decode
(one row per expert) and prefill alike. TMA copies of the weight, scale and row tiles run
`max_concurrent_steps` k-steps ahead.

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
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from wna16_jax import layouts
from wna16_jax._types import MGPU_TILE, QuantizedExperts

# The mgpu layouts' weight tiles are TILE x TILE; TILE features are one wgmma's M.
TILE = MGPU_TILE


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


# What a converted weight holds beyond the stored value (`_converted_tile`), per bits: int4's
# 128 + q = (q - 8) + 136; int8's q - 128, the stored value itself. The kernel subtracts this bias
# less the layout's zeros (q - z), or for symmetric weights the bias alone.
CONVERTED_BIAS = {4: 136, 8: 0}
# Symmetric int4 weights subtract 136 (128 + 8) from each converted weight, computed from a loaded
# row of scales as a zero point's offset is (136 - 0 * scale): taken as a constant (folded into
# the subtraction, or made by inline PTX) the symmetric layer ran slower than the same weights
# with zero points of 8, for a reason not found (docs/performance.md, 'Mosaic GPU GEMM').
# Symmetric int8 weights subtract nothing.
SYMMETRIC_OFFSET = CONVERTED_BIAS[4]


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


# bf16 bits of 128 + u for a nibble u in the low bits of a 16-bit half (the exponent of 128:
# the mantissa counts units); the xor also flips the stored nibble's bit 3: (q - 8) ^ 8 = q.
_BF16_128_XOR_8 = 0x43084308
# lop3's truth tables for (a & b) ^ c and (a & b) | c.
_AND_XOR = (0xF0 & 0xCC) ^ 0xAA
_AND_OR = (0xF0 & 0xCC) | 0xAA
# int8: a bf16 pair of the signed bytes b = q - 128 in the low bytes of a word's 16-bit halves
# (bytes 0 and 2). bf16 holds 7 mantissa bits, so the byte is split: its low 7 bits set into the
# bits of 128 (the mantissa counts units: 128 + (b & 127)), its sign bit into those of 128 as the
# exponent's lowest bit (128, or 256 for a negative b), and the difference is b, exact. Two lop3
# and one subtraction per pair (the other pair of the word shifted down by 8 bits first: 3.5
# instructions per pair), against upstream Mosaic GPU's prmt, two and and a subtraction.
_INT8_PAIR = f"""{{
.reg .b32 s<2>;
lop3.b32 s0, $1, 0x007F007F, 0x43004300, {_AND_OR:#x};  // 128 + (b & 127)
lop3.b32 s1, $1, 0x00800080, 0x43004300, {_AND_OR:#x};  // 128, or 256 for b < 0
sub.bf16x2 $0, s0, s1;
}}"""


def _thread_words(ref, first: int):
    """Inside inline Mosaic GPU: the 4 words (i32) at byte first + 16 t of the shared-memory
    tile `ref`, t this thread's index in its warpgroup (one 16-byte load)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
    thread = arith.remui(mgpu_utils.thread_idx(), mgpu_utils.c(128, i32))
    byte = arith.muli(thread, mgpu_utils.c(16, i32))
    if first:
        byte = arith.addi(byte, mgpu_utils.c(first, i32))
    offset = arith.extui(ir.IntegerType.get_signless(64), byte)
    ptr = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(ref), [offset], i8)
    loaded = llvm.load(ir.VectorType.get((4,), i32), ptr, alignment=16)
    return [
        vector.extract(loaded, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))
        for i in range(4)
    ]


def _register_tile(q_tile, dtype, fill, *, eight_bit: bool, is_signed, columns: int = TILE):
    """Inside inline Mosaic GPU: a TILE x columns array of `dtype` in the wgmma A operand's
    register layout (WGMMA_LAYOUT, or WGMMA_LAYOUT_8BIT for eight_bit), built from the
    shared-memory tile q_tile by fill(ref, registers): it sets every entry of `registers` (the
    layout's array of register values) from ref."""
    import numpy as np
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.pallas import mosaic_gpu as plgpu

    layout = mgpu.WGMMA_LAYOUT_8BIT if eight_bit else mgpu.WGMMA_LAYOUT
    pallas_layout = plgpu.Layout.WGMMA_8BIT if eight_bit else plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),),
        return_type=plgpu.ShapeDtypeStruct((TILE, columns), dtype, layout=pallas_layout),
    )
    def tile(_, ref):
        registers = np.empty(layout.registers_shape((TILE, columns)), dtype=object)
        fill(ref, registers)
        return mgpu.FragmentedArray(_registers=registers, _layout=layout, _is_signed=is_signed)

    return tile(q_tile)


def _converted_tile(q_tile, bits: int, dtype, interpret: bool, part: int = 0, parts: int = 1):
    """The stored 64x64 tile q_tile (shared memory, in register order: layouts.tile_order(bits))
    in bf16 plus CONVERTED_BIAS[bits], exact: 128 + q for int4, q - 128 for int8 (q the
    canonical value); with parts > 1 only its columns (inputs) of k-part `part` of `parts`
    equal ones, [64, 64 / parts] (a group of 64 / parts inputs). Compiled: in the wgmma A
    operand's register layout (Mosaic GPU's WGMMA_LAYOUT) through inline Mosaic GPU: thread t
    of the warpgroup loads its int4 16 bytes at 16 t, and nibbles s and s + 4 of its word i
    become the bf16 pair of register 4 i + s; or its int8 16 bytes at 16 t and 16 at
    2048 + 16 t (words 0-3 and 4-7), and bytes s and s + 2 of its word i the pair of register
    2 i + s. Register r holds columns of column tile r // 2 (8 inputs each): a k-part takes
    the registers of its column tiles. interpret: the same values as a jnp array (the
    interpreter's wgmma takes A from shared memory only)."""
    width = TILE // parts
    if interpret:
        q = q_tile[...].astype(jnp.int32).reshape(TILE, TILE)
        q = layouts.from_tile_order(q, bits)[:, part * width : (part + 1) * width]
        return q.astype(dtype) + CONVERTED_BIAS[bits]

    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    part_tiles = TILE // 8 // parts  # column tiles of 8 inputs per k-part

    def fill(ref, registers):
        i32 = ir.IntegerType.get_signless(32)
        pair = ir.VectorType.get((2,), ir.BF16Type.get())

        def ours(register: int) -> bool:
            return register // 2 // part_tiles == part

        def place(register: int, value):
            ct, rh = divmod(register, 2)  # register (column tile, row half)
            ct -= part * part_tiles
            registers[0, ct, 0, 0, rh, 0, 0, 0, 0] = mgpu_utils.bitcast(value, pair)

        def shifted(word, by: int):
            return arith.shrui(word, mgpu_utils.c(by, i32)) if by else word

        if bits == 4:  # nibbles s and s + 4 of word i: register 4 i + s, by a shift and a lop3
            asm = f"lop3.b32 $0, $1, 0x000F000F, {_BF16_128_XOR_8:#x}, {_AND_XOR:#x};"
            for i, word in enumerate(_thread_words(ref, 0)):
                for s in range(4):
                    if ours(4 * i + s):
                        value = llvm.inline_asm(i32, [shifted(word, 4 * s)], asm, "=r,r")
                        place(4 * i + s, value)
        else:  # bytes s and s + 2 of word i (0-3 at 16 t, 4-7 at 2048 + 16 t): register 2 i + s
            halves = {h for h in range(2) if any(ours(2 * (4 * h + i)) for i in range(4))}
            words = {h: _thread_words(ref, h * TILE * TILE // 2) for h in sorted(halves)}
            for h, half_words in words.items():
                for i, word in enumerate(half_words, start=4 * h):
                    for s in range(2):
                        if ours(2 * i + s):
                            value = llvm.inline_asm(i32, [shifted(word, 8 * s)], _INT8_PAIR, "=r,r")
                            place(2 * i + s, value)

    return _register_tile(
        q_tile, jnp.bfloat16, fill, eight_bit=False, is_signed=None, columns=TILE // parts
    )


# W8A8: the int8 wgmma's A operand (WGMMA_LAYOUT_8BIT) holds, in register (16-column tile c16,
# row half rh), 4 consecutive k-positions 16 c16 + 4 lc + q of one row; a thread of the
# mgpu_int8 layout holds, in its word i of half h, the columns 8 (4 h + i) + 2 lc + v of both
# row halves (byte rh + 2 v). One prmt of words 2 j and 2 j + 1 of half h makes register
# (2 h + j, rh) from the row half's 4 bytes: k-position 16 c16 + 4 lc + q then holds column
# 16 c16 + 8 (q // 2) + 2 lc + q % 2. The products are a sum over k, so the rows (the B operand)
# take the same order (`w8a8_input_order`) and the weights keep their one layout.
_INT8_ROW_HALF = {0: 0x6420, 1: 0x7531}  # prmt selectors: bytes rh and rh + 2 of each word


def w8a8_input_order(q):
    """int8 rows [..., K] (K a multiple of 16) in the W8A8 GEMM's k-order: position
    16 b + 4 lc + 2 hi + v holds column 16 b + 8 hi + 2 lc + v (the order in which a thread's
    register of the mgpu_int8 layout's weights holds them: see _INT8_ROW_HALF)."""
    *lead, k = q.shape
    t = q.reshape(*lead, k // 16, 2, 4, 2)  # (b, hi, lc, v)
    return jnp.swapaxes(t, -3, -2).reshape(*lead, k)


def _int8_operand_tile(q_tile, interpret: bool):
    """W8A8: the stored mgpu_int8 tile q_tile (symmetric: the stored byte is the signed weight)
    as the int8 wgmma's A operand, its k in `w8a8_input_order`. Compiled: registers of
    WGMMA_LAYOUT_8BIT, each one prmt of two words a thread loads (_INT8_ROW_HALF); interpret:
    the same values as a jnp array."""
    if interpret:
        q = layouts.from_tile_order(q_tile[...].reshape(TILE, TILE), 8)
        return w8a8_input_order(q)

    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    def fill(ref, registers):
        i32 = ir.IntegerType.get_signless(32)
        quad = ir.VectorType.get((4,), ir.IntegerType.get_signless(8))
        for h in range(2):
            words = _thread_words(ref, h * TILE * TILE // 2)
            for j in range(2):
                for rh, selector in _INT8_ROW_HALF.items():
                    asm = f"prmt.b32 $0, $1, $2, {selector:#x};"
                    value = llvm.inline_asm(i32, [words[2 * j], words[2 * j + 1]], asm, "=r,r,r")
                    registers[0, 2 * h + j, 0, 0, rh, 0, 0, 0, 0] = mgpu_utils.bitcast(value, quad)

    return _register_tile(q_tile, jnp.int8, fill, eight_bit=True, is_signed=True)


def _swizzled(shape, dtype, what: str):
    """Tiling + swizzle transforms for an SMEM tile whose minor dimension is shape[-1]."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bits = jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo(dtype).bits
    swizzle = plgpu.find_swizzle(shape[-1] * bits, what)
    return (plgpu.TilingTransform((8, 8 * swizzle // bits)), plgpu.SwizzleTransform(swizzle))


@functools.partial(
    jax.jit,
    static_argnames=(
        "block_m",
        "block_k",
        "block_n",
        "max_concurrent_steps",
        "consumers",
        "splits",
        "gated",
        "tiles_per_program",
        "block_halvings",
        "buffer_rows",
        "bf16_weights",
        "out_dtype",
        "interpret",
        "profile_dir",
        "profile_regions",
    ),  # fmt: skip
)
def mgpu_wna16_gemm(
    x_rows: jax.Array,
    w: QuantizedExperts,
    block_experts: jax.Array,
    rows_in_use: jax.Array | None = None,
    *,
    x_scales: jax.Array | None = None,
    block_m: int,
    block_k: int = 128,
    block_n: int = 64,
    max_concurrent_steps: int = 4,
    consumers: int = 0,
    splits: int = 1,
    gated: bool = False,
    tiles_per_program: int = 1,
    block_halvings: int = 1,
    buffer_rows: int | None = None,
    bf16_weights: bool = False,
    out_dtype=None,
    interpret: bool = False,
    profile_dir: str | None = None,
    profile_regions: tuple[str, ...] = PROFILE_REGIONS,
) -> jax.Array:
    """out[p] = x_rows[p] @ W[block_experts[p // block_m]].T in out_dtype (default x_rows',
    f32 for int8 rows), [P, N]; with splits > 1 the K-split partial products, [splits, P, N],
    to be summed. Fewer than PARTIAL_BLOCK_ROWS bf16 rows may fill part of one block (a decode
    step's rows as they are): TMA reads the missing rows as zeros and skips their stores.
    gated: W's rows are the [gate; up] halves of a gated MLP (DeepSeek's w13) and out[p] =
    silu(gate) * up, [P, N/2], computed on the f32 sums before the one rounding to out_dtype.

    W8A8: x_rows int8 in `w8a8_input_order` with their f32 scales x_scales [P] (x_rows[p] *
    x_scales[p] the rows), on symmetric mgpu_int8 weights: int8 x int8 products on the int8
    tensor cores, exact in an int32 sum per group (or k-step), scaled in f32 by the weight's
    scale and the row's. The weight tile goes from shared memory to the A operand's registers
    by one prmt per register, no conversion (_int8_operand_tile).

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
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if unknown := set(profile_regions) - set(REGIONS):
        raise ValueError(f"profile_regions {sorted(unknown)} are not among {REGIONS}")

    def region(name: str):
        """The named scope `name` where it is profiled, else none (a region costs registers)."""
        return jax.named_scope(name) if name in profile_regions else contextlib.nullcontext()

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
    _, n, k = w.shape
    p = x_rows.shape[0]
    dtype = x_rows.dtype
    w8a8 = dtype == jnp.int8
    out_dtype = jnp.dtype(out_dtype or (jnp.float32 if w8a8 else dtype))
    sums = jnp.int32 if w8a8 else jnp.float32  # a group's exact products
    # Per-channel weights, warp-specialized, one tile per program, W8A8 or bf16_weights: the
    # exact sums of all k-steps carried in the accumulators (int32 of int8 products; f32 of
    # the bf16 (q - z), exact), scaled once at the end by each feature's scale (W8A8: and each
    # row's): no scale per weight, nor per k-step.
    carried = (
        w.group == k and takes_bf16_weights(consumers, tiles_per_program) and (w8a8 or bf16_weights)
    )
    wgs = max(consumers, 1)  # warpgroups doing math, each on block_n features
    subs = block_n // TILE  # a warpgroup's 64-feature sub-tiles (wgmma M) per half
    halves = 2 if gated else 1  # weight halves a program reads: (gate, up) or the one
    bm, bk = block_m, block_k
    tile_n = block_n * wgs  # output features per output tile
    tiles = tiles_per_program
    out_n = n // halves
    # A k-step spans part of one group (steps_per_group of them) or several whole groups.
    steps_per_group = max(w.group // bk, 1)
    groups_per_step = max(bk // w.group, 1)
    # A k-part: the inputs of a weight tile one wgmma takes, the whole 64-wide tile or, for
    # groups of fewer inputs (32: Kimi-K2's), one group's columns of it (its own scale and zero
    # point), `parts` per tile.
    part_k = min(TILE, w.group)
    parts = TILE // part_k
    parts_per_group = min(w.group, bk) // part_k  # a group's k-parts in a k-step
    has_offset = w.zeros is not None
    bias = CONVERTED_BIAS[w.bits]
    tile_rows = rows_per_tile(w.bits)  # a weight tile's TMA rows
    steps = k // bk // splits
    n_tiles, blocks = out_n // tile_n, -(-p // bm)  # the last block may be partial
    if block_experts.shape != (blocks,):
        raise ValueError(
            f"block_experts has shape {block_experts.shape}, want ({blocks},): one expert per "
            f"block of {bm} of the {p} rows"
        )
    n_runs = n_tiles // tiles  # runs of `tiles` output tiles of a block, a program each
    xs_width = max(bm, XS_BYTES // 4)  # W8A8: f32 row scales per block, padded
    stages = min(max_concurrent_steps, tiles * steps)  # k-steps in flight in a pipeline
    if buffer_rows is None:
        buffer_rows = output_buffer_rows(
            block_m=bm, block_k=bk, tile_n=tile_n, halves=halves, groups_per_step=groups_per_step,
            has_offset=has_offset, scale_bytes=w.scales.dtype.itemsize, bits=w.bits,
            stages=stages, warpgroups=wgs, out_bytes=out_dtype.itemsize, int8_rows=w8a8,
        )  # fmt: skip
    elif buffer_rows % 8 or bm % buffer_rows:
        raise ValueError(f"buffer_rows={buffer_rows} must be a multiple of 8 dividing {bm}")
    wgmma = plgpu.Layout.WGMMA
    row = plgpu.Layout.WGMMA.reduce(1)  # a value per feature (the sums' rows)
    column = plgpu.Layout.WGMMA.reduce(0)  # a value per row of x (the sums' columns)

    def kernel(experts_gmem, *rest):
        rows_gmem, rest = (rest[0], rest[1:]) if narrow else (None, rest)
        x_gmem, q_gmem, s_gmem, *rest = rest
        z_gmem, rest = (list(rest[:1]), rest[1:]) if has_offset else ([], rest)
        xs_gmem, rest = (list(rest[:1]), rest[1:]) if w8a8 else ([], rest)
        o_gmem, o_smem, *rest = rest
        a_smem = rest[0] if interpret else None
        wg = lax.axis_index("wg") if consumers else 0
        # This program's output tiles: split, block, run of N tiles (fastest).
        flat = lax.axis_index("p")
        si, bi, n_run = flat // (blocks * n_runs), flat // n_runs % blocks, flat % n_runs
        expert = experts_gmem[bi]
        has_expert = (expert >= 0) & (expert < w.num_experts)

        def sub_tile(s):  # this warpgroup's sub-tile s among the program's 64-feature tiles
            return wg * subs + s

        def features(s):
            return pl.ds(sub_tile(s) * TILE, TILE)

        def block_products(rows):
            """(store, zero_acc, run) of this program's products on the block's first `rows`
            rows (block_m, or block_m // 2 for a block using at most that many): run() runs
            the pipeline and stores the output tiles' rows."""

            def store(values, ni):
                with region("store"):
                    store_rows(values, ni)

            def store_rows(values, ni):
                # This warpgroup's [rows, block_n] part of output tile ni, one copy per sub-tile
                # and chunk of buffer_rows rows through one [buffer_rows, 64] buffer (a buffer
                # per sub-tile where they fit measured the same). The copies are waited for at
                # the program's end (`store_all`); a copy waits only until the last has read the
                # buffer.
                out_tile = o_gmem.at[si] if splits > 1 else o_gmem
                chunk = min(rows, buffer_rows)
                buffer = o_smem.at[wg] if chunk == buffer_rows else o_smem.at[wg, pl.ds(0, chunk)]
                for s, value in enumerate(values):
                    cols = pl.ds(ni * tile_n + sub_tile(s) * TILE, TILE)
                    for first in range(0, rows, chunk):
                        with region("store_reuse"):
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        part = value if chunk == rows else value[:, first : first + chunk]
                        with region("store_smem"):
                            buffer.T[...] = plgpu.layout_cast(
                                part.astype(out_dtype), plgpu.Layout.WGMMA_TRANSPOSED
                            )
                            plgpu.commit_smem()
                        out_rows = pl.ds(bi * bm + first, chunk)
                        plgpu.copy_smem_to_gmem(buffer, out_tile.at[out_rows, cols])

            def store_all(values, ni):
                store(values, ni)
                with region("store_wait"):
                    plgpu.wait_smem_to_gmem(0)

            def epilogue(accs):
                """The output sub-tiles from the f32 sums: silu(gate) * up, or the sums."""
                if not gated:
                    return accs
                gates, ups = accs[:subs], accs[subs:]
                return tuple(g / (1.0 + jnp.exp(-g)) * u for g, u in zip(gates, ups, strict=True))

            def dequantized_tile(q_smem, offset, s, m, scale=None):
                with region("convert"):
                    return dequantized(q_smem, offset, s, m, scale)

            def dequantized(q_smem, offset, s, m, scale):
                # Sub-tile s's m-th k-part of the k-step in bf16 (of its 64x64 weight tile
                # m // parts): the converted part (the stored value plus CONVERTED_BIAS) less
                # offset, the bias less the zeros of the part's features: q - z, a small integer,
                # exact in bf16.
                j, part = divmod(m, parts)
                q_tile = q_smem.at[sub_tile(s), pl.ds(j * tile_rows, tile_rows)]
                if w8a8:  # the stored signed bytes are the weights
                    wt = _int8_operand_tile(q_tile, interpret)
                else:
                    wt = _converted_tile(q_tile, w.bits, dtype, interpret, part, parts)
                if offset is not None:
                    wt = wt - lax.broadcast_in_dim(offset, wt.shape, [0])
                elif bias:  # symmetric int4 in the interpreter: the constant
                    wt = wt - bias
                if scale is not None:  # bf16_weights: (q - z) * s, rounded once
                    wt = rounded_weights(wt, scale)
                if interpret:
                    a_smem.at[wg, s, m][...] = wt
                    return a_smem.at[wg, s, m]
                return wt

            def rounded_weights(wt, scale):
                # (q - z) * s rounded to bf16 once: bf16 scales multiply in bf16 (the exact
                # product, rounded); float16 / float32 scales in f32 (exact for float16: an
                # integer of at most 8 bits times 11 significant bits), then rounded to bf16.
                if scale.dtype == dtype:
                    return wt * lax.broadcast_in_dim(scale, wt.shape, [0])
                scale = lax.broadcast_in_dim(scale.astype(jnp.float32), wt.shape, [0])
                return (wt.astype(jnp.float32) * scale).astype(dtype)

            def x_part(x_smem, m):  # the rows' inputs of k-part m of the step, K-major
                return x_smem.at[:, pl.ds(m * part_k, part_k)].T

            def group_offset(s_refs, z_refs, g, h, s, scale=None):
                # What the conversion subtracts from sub-tile s's features in group g, once per
                # group of the step: the bias less the zeros, int4 136 - (8 - z) = 128 + z <=
                # 143, int8 0 - (128 - z) = z - 128, exact; symmetric int4: 136 - 0 * scale =
                # 136 (exact for finite scales), computed as a zero point's offset is (see
                # SYMMETRIC_OFFSET; scale: the group's row where already loaded); None where
                # the bias is subtracted as a constant (symmetric: int8's 0, int4's in the
                # interpreter). In the weights' dtype (exact: small integers), whatever the
                # scales' (and zero points') dtype.
                if z_refs:
                    z = plgpu.load(z_refs[h].at[g, features(s)], layout=row)
                    return (bias - z).astype(dtype)
                if interpret or not bias:
                    return None
                if scale is None:
                    scale = plgpu.load(s_refs[h].at[g, features(s)], layout=row)
                return (SYMMETRIC_OFFSET - 0 * scale).astype(dtype)

            def zero_acc():  # f32 [64 features, rows] accumulators: per half, per sub-tile
                return tuple(
                    plgpu.layout_cast(jnp.full((TILE, rows), 0, jnp.float32), wgmma)
                    for _ in range(halves * subs)
                )

            def products(accs, q_refs, x_smem, s_refs, z_refs, xs_ref=None):
                # The products of a group's k-tiles are exact in their f32 (W8A8: int32) sum
                # (its own accumulator); the group scale (W8A8: times each row's, xs_ref)
                # multiplies the sum. Units (group, half, sub-tile) run in order: unit u's tiles
                # are converted while unit u-1's wgmmas run, and u-1's sum is scaled while u's
                # run.
                units = [
                    (g, h, s)
                    for g in range(groups_per_step)
                    for h in range(halves)
                    for s in range(subs)
                ]

                def issue(part_ref, g, h, s):
                    k_parts = range(g * parts_per_group, (g + 1) * parts_per_group)
                    offset = group_offset(s_refs, z_refs, g, h, s)
                    wts = [dequantized_tile(q_refs[h], offset, s, m) for m in k_parts]
                    with region("wgmma"):
                        for m, wt in zip(k_parts, wts, strict=True):
                            plgpu.wgmma(part_ref, wt, x_part(x_smem, m))

                def add_scaled(accs, part_ref, g, h, s, in_flight):
                    # wait until at most in_flight wgmmas (the next unit's) are running
                    with region("wait"):
                        part = plgpu.wgmma_accumulator_load(part_ref, wait_n=in_flight)
                    with region("scale"):
                        scale = plgpu.load(s_refs[h].at[g, features(s)], layout=row)
                        scale = lax.broadcast_in_dim(scale.astype(jnp.float32), part.shape, [0])
                        if xs_ref is not None:
                            row_scale = plgpu.load(xs_ref.at[pl.ds(0, rows)], layout=column)
                            scale = scale * lax.broadcast_in_dim(row_scale, part.shape, [1])
                        a = h * subs + s
                        part = part.astype(jnp.float32) * scale
                        return accs[:a] + (accs[a] + part,) + accs[a + 1 :]

                def unit_products(*part_refs):
                    out = accs
                    for u, part_ref in enumerate(part_refs):
                        issue(part_ref, *units[u])
                        if u:
                            out = add_scaled(out, part_refs[u - 1], *units[u - 1], parts_per_group)
                    return add_scaled(out, part_refs[-1], *units[-1], 0)

                return pl.run_scoped(unit_products, *[plgpu.ACC((TILE, rows), sums) for _ in units])

            def tile_and_step(idx):
                # The pipeline's step idx: (k-step,), or (tile of the run, k-step) with
                # tiles_per_program > 1; returns (N tile, k-step within this split).
                if tiles == 1:
                    return n_run, idx[0]
                return n_run * tiles + idx[0], idx[1]

            def rounded_products(acc_refs, q_refs, x_smem, s_refs, z_refs):
                # bf16_weights: each weight's (q - z) * s rounded to bf16 once (as a bf16 model's
                # dequantized weights), multiplied straight into the sums (acc_refs): no f32 sum
                # per group to hold, wait for and scale. carried: the products of the weights
                # (q - z) straight into the sums (scaled at the end: `scaled_sums`).
                for g in range(groups_per_step):
                    for h in range(halves):
                        for s in range(subs):
                            scale = None
                            if not carried:
                                scale = plgpu.load(s_refs[h].at[g, features(s)], layout=row)
                            offset = group_offset(s_refs, z_refs, g, h, s, scale)
                            for m in range(g * parts_per_group, (g + 1) * parts_per_group):
                                wt = dequantized_tile(q_refs[h], offset, s, m, scale)
                                with region("wgmma"):
                                    plgpu.wgmma(acc_refs[h * subs + s], wt, x_part(x_smem, m))
                with region("wait"):
                    plgpu.wgmma_wait(0)
                return acc_refs

            def step(idx, *refs):
                # refs: the weight tiles of each half, the rows' tile, the scales of each half,
                # the zero points of each half (with them), the rows' scales (W8A8), the
                # carried sums
                *refs, accs = refs
                xs_ref = refs.pop() if w8a8 else None
                q_refs, x_smem = refs[:halves], refs[halves]
                s_refs, z_refs = refs[halves + 1 : 2 * halves + 1], refs[2 * halves + 1 :]
                if bf16_weights or carried:  # accs: the sums' accumulator refs
                    return rounded_products(accs, q_refs, x_smem, s_refs, z_refs)
                if tiles == 1:
                    return products(accs, q_refs, x_smem, s_refs, z_refs, xs_ref)
                # A run of tiles: a tile's first k-step starts its sums from zero, its last stores
                # them (the next tile's copies are already in flight).
                ni, kk = tile_and_step(idx)
                keep = lax.broadcast_in_dim((kk > 0).astype(jnp.float32), (TILE, rows), ())
                keep = plgpu.layout_cast(keep, wgmma)
                accs = tuple(a * keep for a in accs)
                accs = products(accs, q_refs, x_smem, s_refs, z_refs, xs_ref)

                @pl.when(kk == steps - 1)
                def _store():
                    store(epilogue(accs), ni)

                return accs

            # The inputs of pipeline step idx; half h's tiles start at N tile h * n_tiles (the up
            # half of a gated W). A block without an expert (-1, or past E) runs no pipeline.
            e = jnp.clip(expert, 0, w.num_experts - 1)

            def weight_tile(h):
                def index(*idx):
                    ni, kk = tile_and_step(idx)
                    return e, h * n_tiles + ni, si * steps + kk, 0

                return index

            def group_rows(h):
                def index(*idx):
                    ni, kk = tile_and_step(idx)
                    return e, (si * steps + kk) // steps_per_group, h * n_tiles + ni

                return index

            def row_tile(*idx):
                return bi * (bm // rows), si * steps + tile_and_step(idx)[1]

            q_spec = (None, wgs * subs, bk // TILE * tile_rows, row_values(w.bits))
            g_spec = (None, groups_per_step, tile_n)
            in_specs = [  # weight tiles [64-feature tiles, the k-step's rows of TMA_ROW_BYTES]:
                # contiguous and unswizzled: a warp's 16-byte loads read 512 consecutive bytes,
                # no bank conflicts
                *(plgpu.BlockSpec(q_spec, weight_tile(h)) for h in range(halves)),
                plgpu.BlockSpec(
                    (rows, bk),
                    row_tile,
                    # swizzled as a k-part is (the wgmma's slices): a 64-wide k-tile's 128 bytes
                    # of bf16, 64 of int8; a 32-wide group's 64 bytes of bf16
                    transforms=_swizzled((rows, part_k), dtype, "x"),
                ),
                *(plgpu.BlockSpec(g_spec, group_rows(h)) for h in range(halves)),
            ]
            if has_offset:
                in_specs += [plgpu.BlockSpec(g_spec, group_rows(h)) for h in range(halves)]
            if w8a8:  # the block's row scales, with each k-step's rows (a few bytes; the
                # warp-specialized pipeline takes only inputs that follow its steps)
                in_specs.append(
                    plgpu.BlockSpec((None, xs_width), lambda *idx: (bi + 0 * idx[-1], 0))
                )
            operands = [q_gmem] * halves + [x_gmem] + [s_gmem] * halves + z_gmem * halves
            operands += xs_gmem
            grid = (steps,) if tiles == 1 else (tiles, steps)

            def pipeline(compute_context=None):
                """Runs the k-steps: without warp specialization, returns the final f32
                accumulators; with it, compute_context(run) is the consumer warpgroups' prologue
                and epilogue around run(init_carry)."""
                if not consumers:
                    return plgpu.emit_pipeline(
                        step, grid=grid, in_specs=in_specs, max_concurrent_steps=stages,
                        init_carry=zero_acc(),
                    )(*operands)  # fmt: skip
                plgpu.emit_pipeline_warp_specialized(
                    step,
                    grid=grid,
                    memory_registers=40,
                    in_specs=in_specs,
                    max_concurrent_steps=stages,
                    wg_axis="wg",
                    num_compute_wgs=consumers,
                    compute_context=compute_context,
                )(*operands)

            def program(body):  # the math warpgroups' part of run()
                with region("program"):
                    body()

            def scaled_sums(acc_refs):
                """The carried sums in f32: `carried`'s scaled by each feature's weight scale
                (W8A8: and each row's scale; read from global memory: the pipeline's copies
                are gone; optimized=False: Mosaic GPU lowers optimized loads from shared memory
                only), bf16_weights' scaled ones as they are."""
                values = tuple(acc[...] for acc in acc_refs)
                if not carried:
                    return values
                row_scale = None
                if w8a8:
                    row_scale = plgpu.load(
                        xs_gmem[0].at[bi, pl.ds(0, rows)], layout=column, optimized=False
                    )
                out = []
                for h in range(halves):
                    for s in range(subs):
                        first = (h * n_tiles + n_run) * tile_n + sub_tile(s) * TILE
                        scale = plgpu.load(
                            s_gmem.at[e, 0, pl.ds(first, TILE)], layout=row, optimized=False
                        )
                        value = values[h * subs + s].astype(jnp.float32)
                        value = value * lax.broadcast_in_dim(
                            scale.astype(jnp.float32), value.shape, [0]
                        )
                        if row_scale is not None:
                            value = value * lax.broadcast_in_dim(row_scale, value.shape, [1])
                        out.append(value)
                return tuple(out)

            def run():
                if bf16_weights or carried:  # the sums in accumulator refs, the carry

                    def rounded(run):
                        def scope(*acc_refs):
                            run(acc_refs)
                            store_all(epilogue(scaled_sums(acc_refs)), n_run)

                        accs = [plgpu.ACC((TILE, rows), sums) for _ in range(halves * subs)]
                        program(lambda: pl.run_scoped(scope, *accs))

                    pipeline(rounded)
                elif tiles > 1:  # each tile stored at its last k-step
                    pipeline(lambda run: program(lambda: run(zero_acc())))
                    plgpu.wait_smem_to_gmem(0)
                elif not consumers:
                    program(lambda: store_all(epilogue(pipeline()), n_run))
                else:
                    pipeline(
                        lambda run: program(lambda: store_all(epilogue(run(zero_acc())), n_run))
                    )

            return store, zero_acc, run

        store, zero_acc, run = block_products(bm)
        if narrow:  # a block computes and stores the fewest rows (of the widths) it uses
            used = rows_gmem[bi]
            widths = [bm >> j for j in range(block_halvings + 1)]
            for j, width in enumerate(widths):
                narrower = widths[j + 1] if j < block_halvings else -1
                fits = (used > narrower) & ((used <= width) if j else True)
                pl.when(has_expert & fits)(run if j == 0 else block_products(width)[2])
        else:
            pl.when(has_expert)(run)

        @pl.when(~has_expert & (wg < wgs))
        def _zeros():
            for j in range(tiles):
                store(zero_acc()[:subs], n_run * tiles + j)
            plgpu.wait_smem_to_gmem(0)

    # A free reshape of [E, N/64, K/64, 64, 64]: [E, N/64, K/64 * tile_rows, row_values(bits)].
    q_rows = w.qweight.reshape(w.num_experts, n // TILE, k // TILE * tile_rows, row_values(w.bits))
    operands = [block_experts.astype(jnp.int32)]
    if narrow:
        operands.append(rows_in_use.astype(jnp.int32))
    operands += [x_rows, q_rows, w.scales]
    if has_offset:
        operands.append(w.zeros)
    if w8a8:  # [blocks, xs_width]: a block's scales, then zeros to XS_BYTES
        operands.append(jnp.pad(x_scales.reshape(blocks, bm), ((0, 0), (0, xs_width - bm))))
    out_shape = (splits, p, out_n) if splits > 1 else (p, out_n)
    scratch = [plgpu.SMEM((wgs, buffer_rows, TILE), out_dtype)]
    if interpret:
        scratch.append(plgpu.SMEM((wgs, subs, bk // part_k, TILE, part_k), dtype))
    threads = dict(num_threads=consumers + 1, thread_name="wg") if consumers else {}
    profile = {}
    if profile_dir:  # ranges per warpgroup and k-step: a convert per tile, a wgmma, a wait and
        # a scale per group (twice that, to spare); per tile the store and its parts (two per
        # copy), and the program
        regions = halves * subs * (bk // part_k + 3 * groups_per_step)
        copies = subs * (bm // buffer_rows)
        profile = dict(
            profile_space=2 * regions * steps + tiles * (2 * copies + 4) + 8,
            profile_dir=profile_dir,
        )
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        scratch_types=scratch,
        grid=(splits * blocks * n_runs,),
        grid_names=("p",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, **profile
        ),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        **threads,
    )
    return call(*operands)
