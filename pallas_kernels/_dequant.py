"""In-kernel int4/int8 -> float conversion without integer-to-float instructions.

A packed uint32 word holds 32 // bits values; value i of word j is input feature
k = (32 // bits) * j + i. Kernels load a [bn, W] tile of words once and take value slice i of
every word at a time ([bn, W], features k0 + per_word * j + i), so no reshape is needed.

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
