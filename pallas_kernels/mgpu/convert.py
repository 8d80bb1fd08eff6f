"""The Mosaic GPU GEMM's dequantizing converter: a stored 64x64 weight tile of the mgpu_int4 /
mgpu_int8 layouts (shared memory, values in wgmma register order: layout.tile_order) to the
wgmma's A operand in registers, by inline PTX on each thread's own 16-byte loads (no shuffles,
no permutes), and for W8A8 the int8 operand tile; MXFP4's E2M1 codes to their bf16 values; in
the interpreter the same values as arrays.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.mgpu import layout
from wna16_jax.backend_api import e2m1_to_f32

# The mgpu layouts' weight tiles are TILE x TILE; TILE features are one wgmma's M.
TILE = layout.MGPU_TILE


# What a converted weight holds beyond the stored value (`converted_tile`), per bits: int4's
# 128 + q = (q - 8) + 136; int8's q - 128, the stored value itself. The kernel subtracts this bias
# less the layout's zeros (q - z), or for symmetric weights the bias alone.
CONVERTED_BIAS = {4: 136, 8: 0}
# Symmetric int4 weights subtract 136 (128 + 8) from each converted weight, computed from a loaded
# row of scales as a zero point's offset is (136 - 0 * scale): taken as a constant (folded into
# the subtraction, or made by inline PTX) the symmetric layer ran slower than the same weights
# with zero points of 8, for a reason not found (docs/performance.md, 'Mosaic GPU GEMM').
# Symmetric int8 weights subtract nothing.
SYMMETRIC_OFFSET = CONVERTED_BIAS[4]


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


# MXFP4: a bf16 pair of the E2M1 codes in the low nibbles of a word's 16-bit halves. Two prmt
# look the magnitudes (code & 7) up in byte tables, the low and the high bytes of the bf16
# values of 0, 0.5, 1, 1.5, 2, 3, 4, 6 (0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080,
# 0x40C0), each magnitude selecting bytes 0 and 1 (2 and 3) of its half; a lop3 keeps each
# half's low byte from the first and high byte from the second, and one more ors in the code's
# sign bit (bit 3 -> bit 15). Exact for every code: the values are normal bf16 (or +-0).
E2M1_BF16_LOW_BYTES = (0xC0800000, 0xC0804000)  # table bytes 0-3, 4-7 (magnitudes 0-7)
E2M1_BF16_HIGH_BYTES = (0x3F3F3F00, 0x40404040)
_SELECT_OR_KEEP = (0xF0 & 0xAA) | (0xCC & ~0xAA & 0xFF)  # (a & c) | (b & ~c)
_E2M1_PAIR = f"""{{
.reg .b32 s<3>, t<4>;
and.b32 s0, $1, 0x7;                     // the low half's magnitude: selector nibble 0
shr.u32 s1, $1, 8;
and.b32 s1, s1, 0x700;                   // the high half's: selector nibble 2
or.b32 s0, s0, s1;
shl.b32 s1, s0, 4;
or.b32 s0, s0, s1;                       // and again in nibbles 1 and 3
mov.b32 t0, {E2M1_BF16_LOW_BYTES[0]:#x};
mov.b32 t1, {E2M1_BF16_LOW_BYTES[1]:#x};
mov.b32 t2, {E2M1_BF16_HIGH_BYTES[0]:#x};
mov.b32 t3, {E2M1_BF16_HIGH_BYTES[1]:#x};
prmt.b32 s1, t0, t1, s0;                 // each byte: the low byte of its half's value
prmt.b32 s2, t2, t3, s0;                 // each byte: the high byte
lop3.b32 s1, s1, s2, 0x00FF00FF, {_SELECT_OR_KEEP:#x};
shl.b32 s2, $1, 12;                      // the signs, bits 3 and 19, to 15 and 31
lop3.b32 $0, s2, 0x80008000, s1, {_AND_OR:#x};
}}"""


def e2m1_bf16_pair_reference(word: int) -> int:
    """What _E2M1_PAIR computes, in Python: the two bf16 (bits, a 32-bit int) of the E2M1
    codes in bits 0-3 and 16-19 of `word` (for the converter's test)."""

    def prmt(a: int, b: int, sel: int) -> int:
        pool = (a | (b << 32)).to_bytes(8, "little")
        return sum(pool[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))

    sel = (word & 0x7) | ((word >> 8) & 0x700)
    sel |= sel << 4
    low = prmt(*E2M1_BF16_LOW_BYTES, sel)
    high = prmt(*E2M1_BF16_HIGH_BYTES, sel)
    pair = (low & 0x00FF00FF) | (high & 0xFF00FF00)
    return pair | ((word << 12) & 0x80008000)


def e2m1_values(q):
    """int32 arrays whose low 4 bits are E2M1 codes -> their f32 values (exact)."""
    return e2m1_to_f32(q.astype(jnp.uint32) & jnp.uint32(15))


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


def converted_tile(
    q_tile, bits: int, dtype, interpret: bool, part: int = 0, parts: int = 1, *, codes="int"
):
    """The stored 64x64 tile q_tile (shared memory, in register order: layout.tile_order(bits))
    in bf16 plus CONVERTED_BIAS[bits], exact: 128 + q for int4, q - 128 for int8 (q the
    canonical value); codes "e2m1" (MXFP4 in the mgpu_int4 layout): the E2M1 values of the
    stored codes, exact, by _E2M1_PAIR for each register's pair of nibbles; with parts > 1
    only its columns (inputs) of k-part `part` of `parts`
    equal ones, [64, 64 / parts] (a group of 64 / parts inputs). Compiled: in the wgmma A
    operand's register layout (Mosaic GPU's WGMMA_LAYOUT) through inline Mosaic GPU: thread t
    of the warpgroup loads its int4 16 bytes at 16 t, and nibbles s and s + 4 of its word i
    become the bf16 pair of register 4 i + s; or its int8 16 bytes at 16 t and 16 at
    2048 + 16 t (words 0-3 and 4-7), and bytes s and s + 2 of its word i the pair of register
    2 i + s. Register r holds columns of column tile r // 2 (8 inputs each): a k-part takes
    the registers of its column tiles. interpret: the same values as a jnp array (the
    interpreter's wgmma takes A from shared memory only)."""
    width = TILE // parts
    e2m1 = codes == "e2m1"
    if interpret:
        q = q_tile[...].astype(jnp.int32).reshape(TILE, TILE)
        q = layout.from_tile_order(q, bits)[:, part * width : (part + 1) * width]
        if e2m1:
            return e2m1_values(q).astype(dtype)
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
            if e2m1:
                asm = _E2M1_PAIR
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


def int8_operand_tile(q_tile, interpret: bool):
    """W8A8: the stored mgpu_int8 tile q_tile (symmetric: the stored byte is the signed weight)
    as the int8 wgmma's A operand, its k in `w8a8_input_order`. Compiled: registers of
    WGMMA_LAYOUT_8BIT, each one prmt of two words a thread loads (_INT8_ROW_HALF); interpret:
    the same values as a jnp array."""
    if interpret:
        q = layout.from_tile_order(q_tile[...].reshape(TILE, TILE), 8)
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
