"""In-kernel int4/int8 and E2M1 (MXFP4) -> float conversion without integer-to-float instructions.

A packed uint32 word holds 32 // bits values; value i of word j is input feature
k = (32 // bits) * j + i. Kernels load a [bn, W] tile of words once and take value slice i of
every word at a time ([bn, W], features k0 + per_word * j + i), so no reshape is needed.

Compiled kernels convert two values per 32-bit instruction with PTX (`half_value_slices`,
asm=True): `prmt` gathers byte q of two words into one register, (`shr` moves the high nibble
down,) `lop3` masks a value out of each half and ors the exponent pattern in, so one register
holds two 16-bit floats (the trick of Marlin-class kernels). The interpreter runs the same
arithmetic in jnp (asm=False).

E2M1 codes (MXFP4: bit 3 the sign, bits 2..1 the exponent, bit 0 the mantissa) become f32
by building the value's bits (`e2m1_to_f32`); their E8M0 scales, 2^(X - 127), are X placed in
an f32's exponent field (`e8m0_to_f32`).

Conversion uses the exponent trick: or-ing v into the mantissa of a power of two 2^p gives the
float 2^p + v exactly (when v < 2^p's unit in the last place allows), so an int -> float
conversion (a quarter-rate instruction) becomes one logical op:
- bf16: 0x4300 | v = 128 + v, exact for v < 128 (int4).
- fp16: 0x6400 | v = 1024 + v, exact for v < 1024 (int4 and int8).
- f32: 0x4B000000 | v = 2^23 + v, exact for any 8-bit v.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from wna16_jax.backend_api import e2m1_to_f32

_F32_MAGIC = 0x4B000000  # 2^23
_HALF_MAGIC = {
    # dtype name: (bit pattern of 2^p, 2^p, largest exact v + 1)
    "bfloat16": (0x4300, 128.0, 128),
    "float16": (0x6400, 1024.0, 1024),
}


def value_slice(words, i: int, *, bits: int):
    """Value i of each packed word: [..] uint32 -> [..] uint32 in [0, 2**bits)."""
    mask = jnp.uint32((1 << bits) - 1)
    if i == 0:
        return words & mask
    return (words >> jnp.uint32(i * bits)) & mask


def half_magic_offset(bits: int, dtype) -> float | None:
    """The offset 2^p when values of `bits` convert exactly into `dtype` by the trick, else None."""
    spec = _HALF_MAGIC.get(jnp.dtype(dtype).name)
    if spec is None or (1 << bits) > spec[2]:
        return None
    return spec[1]


def to_half_plus_offset(v, dtype):
    """uint32 v -> `dtype` holding offset + v exactly (see half_magic_offset)."""
    pattern = _HALF_MAGIC[jnp.dtype(dtype).name][0]
    return jax.lax.bitcast_convert_type((v | jnp.uint32(pattern)).astype(jnp.uint16), dtype)


def to_f32_minus_zero(v, z):
    """uint32 v, zero point z (int32 array or int, broadcastable) -> f32 (v - z), exact."""
    f = jax.lax.bitcast_convert_type(v | jnp.uint32(_F32_MAGIC), jnp.float32)  # 2^23 + v
    return f - (jnp.float32(2.0**23) + jnp.asarray(z).astype(jnp.float32))


def e8m0_to_f32(x):
    """E8M0 scale bytes x (uint8) -> f32 2^(x - 127): x in the exponent field. x = 0 (2^-127,
    an f32 subnormal) gives 0 and x = 255 (NaN) gives inf."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.uint32) << 23, jnp.float32)


def e2m1_value_slices(words, dtype):
    """Every value slice of a uint32 word tile of E2M1 codes as `dtype` arrays of their values
    (exact in bf16, f16 and f32): 8 arrays shaped like `words`, array i holding value i."""
    return [e2m1_to_f32(value_slice(words, i, bits=4)).astype(dtype) for i in range(8)]


def _prmt_both_halves(q: int) -> int:
    """prmt selector: bytes 0, 1 of the result <- byte q of word a, bytes 2, 3 <- byte q of b."""
    return q | (q << 4) | ((4 + q) << 8) | ((4 + q) << 12)


def _slice_asm(i: int, bits: int, pattern: int) -> str:
    """PTX: two words ($1, $2) -> one register $0 holding two 16-bit floats offset + v: value i
    of word a in the low half, value i of word b in the high half."""
    per_byte = 8 // bits
    q, shift = divmod(i, per_byte)
    mask = (1 << bits) - 1
    lines = ["{", ".reg .b32 t;", f"prmt.b32 t, $1, $2, 0x{_prmt_both_halves(q):04x};"]
    if shift:
        lines.append(f"shr.u32 t, t, {shift * bits};")
    # lop3 0xEA = (t & mask) | magic
    lines.append(
        f"lop3.b32 $0, t, 0x{mask | (mask << 16):08x}, 0x{pattern | (pattern << 16):08x}, 0xEA;"
    )
    lines.append("}")
    return "\n".join(lines)


def half_value_slices(words, *, bits: int, dtype, asm: bool):
    """Every value slice of a uint32 word tile as `dtype` arrays holding offset + v, exactly.

    Returns 32 // bits arrays shaped like `words`; array i holds value i of each word plus
    half_magic_offset(bits, dtype) (which must not be None). asm=True converts with PTX (two
    values per instruction; compiled Triton kernels only), asm=False with jnp (any platform).
    Both give the same bits.
    """
    per_word = 32 // bits
    if half_magic_offset(bits, dtype) is None:
        raise ValueError(f"int{bits} does not convert exactly into {jnp.dtype(dtype).name}")
    if not asm:
        values = [value_slice(words, i, bits=bits) for i in range(per_word)]
        return [to_half_plus_offset(v, dtype) for v in values]
    pattern = _HALF_MAGIC[jnp.dtype(dtype).name][0]
    out = jax.ShapeDtypeStruct(words.shape, jnp.dtype(dtype))
    # One asm per slice: Pallas' Triton lowering (jax 0.11.2) rejects multi-result inline asm.
    return [
        plgpu.elementwise_inline_asm(
            _slice_asm(i, bits, pattern),
            args=[words],
            constraints="=r,r,r",
            pack=2,
            result_shape_dtypes=[out],
        )[0]
        for i in range(per_word)
    ]


def join_value_slices(slices):
    """Value slices back in natural feature order: per_word arrays [bn, W] -> [bn, W * per_word].

    slices[i][n, j] (value i of word j, feature per_word * j + i) lands at column
    per_word * j + i. Built from pairwise joins (Triton's `join`, which appends a minor axis of
    size 2): the first level pairs slices whose index differs in its highest bit, the last in
    its lowest, so the joined axes read (high bit, ..., low bit) = i.
    """
    level = list(slices)
    count = len(level)
    if count & (count - 1):
        raise ValueError(f"{count} value slices is not a power of two")
    while len(level) > 1:
        half = len(level) // 2
        level = [jnp.stack([level[i], level[i + half]], axis=-1) for i in range(half)]
    (joined,) = level
    return joined.reshape(joined.shape[0], -1)
