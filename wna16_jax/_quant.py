"""Packing, unpacking, round-to-nearest quantization and dequantization of expert weights."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from wna16_jax._checks import as_int
from wna16_jax._types import E8M0_BIAS, MXFP4_GROUP, SUPPORTED_BITS, QuantizedExperts

# The E2M1 value of each 4-bit code (OCP MX v1.0): bit 3 the sign, bits 2..1 the exponent
# (bias 1), bit 0 the mantissa; code 8 is -0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0) + (
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
E2M1_MAX = 6.0
# The schemes `quantize_experts` names (scheme=): MXFP4 is E2M1 codes, group 32, E8M0 scales.
SCHEMES = ("mxfp4",)


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported (supported: 4, 8)")


def implicit_zero(bits: int) -> int:
    """The zero point of symmetric weights (zeros=None): 8 for int4, 128 for int8."""
    _check_bits(bits)
    return 1 << (bits - 1)


def _xp(a):
    """numpy for numpy arrays (host conversions stay on the host), jax.numpy otherwise."""
    return np if isinstance(a, np.ndarray) else jnp


def _axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis} is out of range for an array of {ndim} dims")
    return axis % ndim


def pack(values, bits: int, *, axis: int = -1, dtype=np.uint32):
    """Packs unsigned `bits`-wide fields into words of `dtype` along `axis`, low bits first:
    value j * w + i (w = fields per word) goes to bits [bits * i, bits * (i + 1)) of word j.

    The one packer of the library (with `unpack`): numpy arrays are packed with numpy (host
    conversions stay on the host), anything else with jax.numpy.

    Args:
        values: integer array with values in [0, 2**bits); its size along `axis` must be a
            multiple of w = word bits // bits.
        bits: 4 or 8.
        axis: the axis to pack.
        dtype: the unsigned word dtype, uint32 (qweight, checkpoint words) or uint8 (int4
            zero points).

    Returns:
        `dtype` array, `axis` shrunk w times.
    """
    _check_bits(bits)
    xp = _xp(values)
    v = xp.asarray(values)
    dtype = np.dtype(dtype)
    per_word = dtype.itemsize * 8 // bits
    axis = _axis(axis, v.ndim)
    size = v.shape[axis]
    if size % per_word:
        raise ValueError(
            f"{size} values along axis {axis} are not a multiple of {per_word} "
            f"(bits={bits}: {per_word} values per {dtype.name} word)"
        )
    v = v.astype(dtype).reshape(v.shape[:axis] + (size // per_word, per_word) + v.shape[axis + 1 :])
    shifts = (xp.arange(per_word, dtype=dtype) * dtype.type(bits)).reshape(
        (per_word,) + (1,) * (v.ndim - axis - 2)
    )
    # The fields are disjoint, so a sum is the bitwise or.
    return xp.sum(v << shifts, axis=axis + 1, dtype=dtype)


def unpack(words, bits: int, *, axis: int = -1):
    """Inverse of `pack`: unsigned words -> uint8 fields, `axis` grown w = word bits // bits
    times (numpy for numpy arrays, jax.numpy otherwise).

    Args:
        words: unsigned integer array (uint32 or uint8 words).
        bits: 4 or 8.
        axis: the axis to unpack.

    Returns:
        uint8 array; field i of word j along `axis` at position j * w + i.
    """
    _check_bits(bits)
    xp = _xp(words)
    w = xp.asarray(words)
    dtype = np.dtype(w.dtype)
    if dtype.kind != "u":
        raise ValueError(f"words must be unsigned integers, got dtype {dtype}")
    per_word = dtype.itemsize * 8 // bits
    axis = _axis(axis, w.ndim)
    shifts = (xp.arange(per_word, dtype=dtype) * dtype.type(bits)).reshape(
        (per_word,) + (1,) * (w.ndim - axis - 1)
    )
    fields = (xp.expand_dims(w, axis + 1) >> shifts) & dtype.type((1 << bits) - 1)
    size = w.shape[axis] * per_word
    return fields.reshape(w.shape[:axis] + (size,) + w.shape[axis + 1 :]).astype(np.uint8)


def pack_k(q, bits: int):
    """Packs quantized values along K (the last axis) into the canonical qweight words.

    Args:
        q: integer array [..., K] with values in [0, 2**bits).
        bits: 4 (8 values per word, k = 8j+i in bits 4i..4i+3) or 8 (k = 4j+i in byte i).

    Returns:
        uint32 [..., K * bits // 32] (numpy for numpy input, else jax).
    """
    _check_bits(bits)
    per_word = 32 // bits
    k = np.shape(q)[-1]
    if k % per_word:
        raise ValueError(f"K={k} is not a multiple of {per_word} (bits={bits})")
    return pack(q, bits, axis=-1)


def unpack_k(qweight, bits: int):
    """Inverse of `pack_k`: uint32 [..., W] -> uint8 [..., W * 32 // bits]."""
    xp = _xp(qweight)
    return unpack(xp.asarray(qweight, dtype=np.uint32), bits, axis=-1)


def pack_zeros(z, bits: int):
    """Packs zero points [E, N, G] (values < 2**bits) into the canonical zeros layout.

    int4: uint8 [E, N//2, G] with even n in the low nibble; int8: uint8 [E, N, G]. numpy for
    numpy input, else jax.
    """
    _check_bits(bits)
    xp = _xp(z)
    z = xp.asarray(z).astype(np.uint8)
    if bits == 8:
        return z
    n = z.shape[1]
    if n % 2:
        raise ValueError(f"int4 zero points need an even N, got N={n}")
    return pack(z, 4, axis=1, dtype=np.uint8)


def unpack_zeros(zeros, bits: int):
    """Inverse of `pack_zeros`: -> uint8 [E, N, G]."""
    _check_bits(bits)
    xp = _xp(zeros)
    zeros = xp.asarray(zeros, dtype=np.uint8)
    return zeros if bits == 8 else unpack(zeros, 4, axis=1)


def zero_points(qw: QuantizedExperts):
    """The per-group zero points of `qw` as uint8 [E, N, K//G] (implicit ones filled in)."""
    if qw.zeros is not None:
        return unpack_zeros(jnp.asarray(qw.zeros), qw.bits)
    e, n, _ = qw.shape
    return jnp.full((e, n, qw.num_groups), implicit_zero(qw.bits), jnp.uint8)


def e2m1_to_f32(v):
    """uint32 E2M1 codes v in [0, 16) -> their f32 values, exactly, from bits alone (traceable in
    any kernel): the bits of 0, 0.5, 1, 1.5, 2, 3, 4, 6 are 0, 252 << 22 and (m + 252) << 22 for
    the magnitudes m = 2..7, and bit 3 of the code is the sign (code 8 is -0)."""
    mag = v & jnp.uint32(7)
    bits = jnp.where(mag < 2, mag * jnp.uint32(252 << 22), (mag + jnp.uint32(252)) << 22)
    return jax.lax.bitcast_convert_type(bits | ((v & jnp.uint32(8)) << 28), jnp.float32)


def e8m0_to_f32(x):
    """E8M0 scale bytes -> their f32 values 2^(x - 127), exactly (x = 0: the subnormal 2^-127,
    x = 255: NaN). uint8 [...] -> f32 [...] (numpy for numpy input, else jax)."""
    xp = _xp(x)
    b = xp.asarray(x).astype(np.uint32)
    bits = xp.where(b == 0, np.uint32(0x00400000), b << np.uint32(23))  # 2^-127: subnormal
    bits = xp.where(b == 255, np.uint32(0x7FC00000), bits)  # NaN
    return _bitcast(bits, np.float32)


def _bitcast(a, dtype):
    if isinstance(a, np.ndarray):
        return a.view(dtype)
    return jax.lax.bitcast_convert_type(a, dtype)


def dequantize_mxfp4_codes(q, scale_bytes):
    """E2M1 codes times E8M0 scales, bit-exact in f32: w = e2m1(q) * 2^(X - 127).

    The f32 result is built from its bits (no multiply, so no platform's flush of subnormals
    changes it): every nonzero E2M1 value is a normal f32, and a power-of-two scale adds
    X - 127 to its exponent; results under f32's normal range become exact subnormals (every
    E2M1 value has at most two significant bits), above it inf (6 * 2^127). Signed zeros are
    kept (code 8 is -0), and X = 255 gives NaN for every code.

    Args:
        q: uint8 [..., K] codes in [0, 16).
        scale_bytes: uint8 [..., K // 32] E8M0 bytes.

    Returns:
        f32 [..., K] (numpy for numpy input, else jax).
    """
    xp = _xp(q)
    q = xp.asarray(q).astype(np.uint32)
    x = xp.repeat(xp.asarray(scale_bytes).astype(np.int32), MXFP4_GROUP, axis=-1)  # [..., K]
    values = np.asarray(E2M1_VALUES, np.float32).view(np.uint32)
    v = xp.asarray(values)[q]  # [..., K] the E2M1 value's f32 bits
    sign = v & np.uint32(0x80000000)
    exp = ((v >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int32)  # 0 for +-0
    mant = v & np.uint32(0x7FFFFF)
    e = exp + x - E8M0_BIAS  # the scaled value's biased exponent
    normal = (xp.clip(e, 0, 255).astype(np.uint32) << np.uint32(23)) | mant
    # Below the normal range: the significand (implicit bit included) shifted right 1 - e
    # places, exact down to e = -22 (two significant bits).
    shift = xp.clip(1 - e, 0, 31).astype(np.uint32)
    sub = ((mant | np.uint32(0x800000)) >> shift) & np.uint32(0x7FFFFF)
    mag = xp.where(e >= 255, np.uint32(0x7F800000), xp.where(e >= 1, normal, sub))
    mag = xp.where(exp == 0, np.uint32(0), mag)  # +-0 stays +-0
    mag = xp.where(x == 255, np.uint32(0x7FC00000), mag)  # NaN scale
    return _bitcast(sign | mag, np.float32)


def dequantize_experts(qw: QuantizedExperts, dtype=jnp.float32):
    """Dequantizes to [E, N, K]: w = (q - z) * scale[e, n, k // G], computed in f32, with K
    in the activations' order (an input permutation, `qw.perm`, undone: x @ w[e].T is expert
    e's product). MXFP4 weights (codes "e2m1"): w = e2m1(q) * 2^(X - 127), bit-exact
    (`dequantize_mxfp4_codes`).

    Args:
        qw: quantized experts in the canonical layout.
        dtype: output dtype (the arithmetic is f32 whatever it is).

    Returns:
        [E, N, K] array of `dtype`.
    """
    qw.validate()
    e, n, k = qw.shape
    if qw.is_mxfp4:
        q = unpack_k(jnp.asarray(qw.qweight), 4)  # [E, N, K] codes
        w = dequantize_mxfp4_codes(q, jnp.asarray(qw.scales))  # [E, N, K] f32
    else:
        q = unpack_k(jnp.asarray(qw.qweight), qw.bits).astype(jnp.float32)  # [E, N, K]
        z = zero_points(qw).astype(jnp.float32)  # [E, N, G]
        s = qw.scales.astype(jnp.float32)  # [E, N, G]
        g = qw.group
        w = (q.reshape(e, n, k // g, g) - z[..., None]) * s[..., None]
        w = w.reshape(e, n, k)
    if qw.perm is not None:  # stored column j is input perm[e, j]: input k is column inv[e, k]
        inv = jnp.argsort(jnp.asarray(qw.perm), axis=1)  # [E, K]
        w = jnp.take_along_axis(w, inv[:, None, :], axis=2)
    return w.astype(dtype)


def check_finite(w, name: str = "w") -> None:
    """Raises ValueError when the float array `w` holds NaN or inf, naming `name`, the count and
    the first index: quantization would make them finite values (a group with a NaN gets a
    meaningless scale) and the model would compute garbage without a sign of it. Nothing is
    checked for a traced value (inside jit): check before. A numpy array is checked on the
    host (no copy to a device)."""
    if isinstance(w, jax.core.Tracer):
        return
    xp = np if isinstance(w, np.ndarray) else jnp  # a host array is checked on the host
    finite = xp.isfinite(w)
    if bool(xp.all(finite)):
        return
    bad = int(finite.size - xp.count_nonzero(finite))
    first = tuple(int(i) for i in xp.unravel_index(xp.argmin(finite), finite.shape))
    raise ValueError(
        f"{name} holds {bad} non-finite value(s) (NaN or inf), the first at index {first}: "
        f"a quantized weight cannot represent them (fix or drop the tensor)"
    )


def quantize_experts(
    w,
    *,
    bits: int | None = None,
    group_size: int | None = None,
    has_zp: bool | None = None,
    scale_dtype=None,
    scheme: str | None = None,
) -> QuantizedExperts:
    """Round-to-nearest quantization of float expert weights.

    With zero points each group maps [min, max] onto [0, 2**bits - 1]; without them the grid is
    symmetric around the implicit zero (8 or 128) with scale = absmax / (2**(bits-1) - 0.5).
    Every value dequantizes to within half a step of its group's scale (exactly so when the
    scales are stored in f32; a 16-bit scale dtype adds its own rounding).

    scheme="mxfp4" (E2M1 codes, one E8M0 scale per 32 inputs: `quantize_mxfp4`) rounds as
    OpenAI's `downcast_to_mxfp` does with its default scale rounding (round up).

    Args:
        w: float [E, N, K].
        bits: 4 or 8 (default 4).
        group_size: G dividing K, or -1 for one group per output row (default 128).
        has_zp: asymmetric (zero points stored) or symmetric (zeros=None) (default True).
        scale_dtype: dtype of the stored scales; default w's dtype.
        scheme: None (the integer scheme the arguments above describe) or "mxfp4" (then bits,
            group_size, has_zp and scale_dtype stay unset, or name MXFP4's own: 4, 32, False,
            uint8).

    Returns:
        QuantizedExperts in the canonical layout.

    Raises:
        ValueError: a bad shape or scheme, or w holds NaN or inf (`check_finite`; not checked
            under jit).
    """
    if scheme is not None:
        if scheme not in SCHEMES:
            raise ValueError(f"scheme={scheme!r} is not one of {SCHEMES} (or None)")
        given = dict(bits=bits, group_size=group_size, has_zp=has_zp)
        mxfp4 = dict(bits=4, group_size=MXFP4_GROUP, has_zp=False)
        for name, value in given.items():
            if value is not None and value != mxfp4[name]:
                raise ValueError(
                    f"scheme='mxfp4' has {name}={mxfp4[name]!r}, got {name}={value!r} (MXFP4 is "
                    f"E2M1 codes with one E8M0 scale per 32 inputs, no zero points)"
                )
        if scale_dtype is not None and jnp.dtype(scale_dtype) != jnp.uint8:
            raise ValueError(
                f"scheme='mxfp4' stores uint8 E8M0 scales, got scale_dtype={scale_dtype!r}"
            )
        return quantize_mxfp4(w)
    bits = as_int("bits", 4 if bits is None else bits)
    group_size = as_int("group_size", 128 if group_size is None else group_size)
    has_zp = True if has_zp is None else has_zp
    _check_bits(bits)
    w = jnp.asarray(w)
    if w.ndim != 3:
        raise ValueError(f"w must be [E, N, K], got shape {tuple(w.shape)}")
    check_finite(w)
    e, n, k = w.shape
    g = k if group_size == -1 else group_size
    if g <= 0 or k % g:
        raise ValueError(f"K={k} is not a multiple of group_size={group_size}")
    if k % (32 // bits):
        raise ValueError(f"K={k} is not a multiple of {32 // bits} (bits={bits})")
    if has_zp and bits == 4 and n % 2:
        raise ValueError(f"int4 zero points need an even N, got N={n}")
    scale_dtype = scale_dtype or w.dtype
    qmax = (1 << bits) - 1
    wg = w.astype(jnp.float32).reshape(e, n, k // g, g)
    if has_zp:
        lo = jnp.minimum(wg.min(-1), 0.0)
        hi = jnp.maximum(wg.max(-1), 0.0)
        scale = (hi - lo) / qmax
        scale = jnp.where(scale > 0, scale, 1.0).astype(scale_dtype)
        sf = scale.astype(jnp.float32)
        zero = jnp.clip(jnp.round(-lo / sf), 0, qmax)
    else:
        absmax = jnp.abs(wg).max(-1)
        scale = absmax / ((1 << (bits - 1)) - 0.5)
        scale = jnp.where(scale > 0, scale, 1.0).astype(scale_dtype)
        sf = scale.astype(jnp.float32)
        zero = jnp.full(scale.shape, implicit_zero(bits), jnp.float32)
    q = jnp.clip(jnp.round(wg / sf[..., None] + zero[..., None]), 0, qmax)
    q = q.reshape(e, n, k).astype(jnp.uint8)
    zeros = pack_zeros(zero.astype(jnp.uint8), bits) if has_zp else None
    return QuantizedExperts(
        qweight=pack_k(q, bits), scales=scale, zeros=zeros, bits=bits, group_size=group_size
    )


# The midpoints between neighbouring E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def quantize_mxfp4(w) -> QuantizedExperts:
    """MXFP4 quantization of float expert weights (OCP Microscaling FP4), as OpenAI's
    `downcast_to_mxfp` does it with its default (round-up) scale rounding.

    Per block of 32 inputs: the scale is the smallest power of two >= max|w| / 6 (the f32
    quotient's exponent rounded up: E8M0 byte X = its biased exponent; an all-zero block gets
    X = 0 and zero codes); each w / 2^(X - 127) (exact) rounds to the nearest E2M1 magnitude,
    ties away from zero, saturating at 6; the sign bit is w's (a negative value that rounds
    to 0 is -0, code 8).

    Args:
        w: float [E, N, K], K a multiple of 32, finite.

    Returns:
        QuantizedExperts (codes "e2m1", bits 4, group_size 32, zeros None, uint8 scales).

    Raises:
        ValueError: a bad shape, or w holds NaN or inf (not checked under jit).
    """
    w = jnp.asarray(w)
    if w.ndim != 3:
        raise ValueError(f"w must be [E, N, K], got shape {tuple(w.shape)}")
    check_finite(w)
    e, n, k = w.shape
    if k % MXFP4_GROUP:
        raise ValueError(f"K={k} is not a multiple of the MXFP4 block of {MXFP4_GROUP} inputs")
    wg = w.astype(jnp.float32).reshape(e, n, k // MXFP4_GROUP, MXFP4_GROUP)
    amax = jnp.abs(wg).max(-1)  # [E, N, K//32]
    bits = jax.lax.bitcast_convert_type(amax / jnp.float32(E2M1_MAX), jnp.uint32)
    x = ((bits + jnp.uint32(0x7FFFFF)) >> jnp.uint32(23)).astype(jnp.uint8)  # round up
    inv = jnp.where(x == 0, 0.0, e8m0_to_f32(jnp.uint8(254) - x))  # 2^(127 - X)
    v = wg * inv[..., None]  # exact: a power of two
    mag = sum((jnp.abs(v) >= t).astype(jnp.uint8) for t in _E2M1_MIDPOINTS)  # [.., 32] 0..7
    sign = (jax.lax.bitcast_convert_type(v, jnp.uint32) >> jnp.uint32(31)).astype(jnp.uint8)
    q = (mag | (sign << 3)).reshape(e, n, k)
    return QuantizedExperts(
        qweight=pack_k(q, 4), scales=x, zeros=None, bits=4, group_size=MXFP4_GROUP, codes="e2m1"
    )


# random_quantized_experts' zero_range values.
ZERO_RANGES = ("middle", "full")


def random_quantized_experts(
    key,
    shape: tuple[int, int, int],
    *,
    bits: int = 4,
    group_size: int | None = None,
    has_zeros: bool | None = None,
    dtype=jnp.bfloat16,
    std: float | None = None,
    zero_range: str = "middle",
    scheme: str | None = None,
) -> QuantizedExperts:
    """Random canonical weights [E, N, K] drawn in the quantized domain (no float copy).

    Codes are uniform over [0, 2**bits) (every bit of qweight random). Zero points, when
    has_zeros, are uniform over [2**(bits-1) - 2, 2**(bits-1) + 2) (zero_range="middle":
    weights centred near 0, as in a trained model) or over [0, 2**bits) (zero_range="full":
    every bit random, the corner values kernels must get right). Scales are
    std / std(codes) * U(0.75, 1.25), rounded through float16 (the dtype AWQ and GPTQ store
    scales in, so saved random weights reload exactly) and then cast to `dtype`.

    scheme="mxfp4": every one of the 16 E2M1 codes equally likely, and E8M0 scale bytes
    uniform over 9 consecutive powers of two, centred so that the weights' spread is about
    std (dtype, group_size, has_zeros and zero_range are not read; bits must be 4).

    Args:
        key: a jax PRNG key (jax.random: traceable, e.g. under jit with sharded outputs so that
            each device draws only its own slice) or a numpy Generator (drawn on the host with
            numpy, in the order codes, zero points, scales: no compilation, fast for small
            weights).
        shape: the logical (E, N, K).
        bits: 4 or 8.
        group_size: G dividing K, or -1 for one group per row (default 128).
        has_zeros: store zero points (else symmetric: zeros=None, implicit 8 or 128) (default
            True).
        dtype: the scales' (activation) dtype.
        std: the codes' spread times the scale; default 1/sqrt(K), so that x @ w.T stays O(1)
            for O(1) activations.
        zero_range: "middle" or "full" (see above).
        scheme: None (integer codes) or "mxfp4".

    Returns:
        QuantizedExperts of jax arrays, canonical layout.

    Raises:
        ValueError: bits, a K that is not whole words or groups, an odd N with int4 zero
            points, or an unknown zero_range or scheme (the values quoted).
    """
    bits = as_int("bits", bits)
    _check_bits(bits)
    if len(shape) != 3:
        raise ValueError(f"shape={shape!r} must be (E, N, K)")
    e, n, k = (as_int(f"shape[{i}]", d, minimum=1) for i, d in enumerate(shape))
    if scheme is not None:
        if scheme not in SCHEMES:
            raise ValueError(f"scheme={scheme!r} is not one of {SCHEMES} (or None)")
        if bits != 4 or group_size not in (None, MXFP4_GROUP) or has_zeros:
            raise ValueError(
                f"scheme='mxfp4' is 4-bit codes in groups of {MXFP4_GROUP} without zero points, "
                f"got bits={bits}, group_size={group_size}, has_zeros={has_zeros}"
            )
        return _random_mxfp4(key, (e, n, k), std=std)
    group_size = 128 if group_size is None else group_size
    has_zeros = True if has_zeros is None else has_zeros
    per_word = 32 // bits
    if k % per_word:
        raise ValueError(f"K={k} is not a multiple of {per_word} (bits={bits})")
    if group_size != -1 and (group_size <= 0 or k % group_size):
        raise ValueError(f"K={k} is not a multiple of group_size={group_size}")
    if has_zeros and bits == 4 and n % 2:
        raise ValueError(f"int4 zero points need an even N, got N={n}")
    if zero_range not in ZERO_RANGES:
        raise ValueError(f"zero_range={zero_range!r} is not one of {ZERO_RANGES}")
    groups = 1 if group_size == -1 else k // group_size
    mid = implicit_zero(bits)
    lo, hi = (mid - 2, mid + 2) if zero_range == "middle" else (0, 1 << bits)
    if isinstance(key, np.random.Generator):
        xp = np
        qweight = key.integers(0, 2**32, (e, n, k // per_word), dtype=np.uint32)
        z = key.integers(lo, hi, (e, n, groups), dtype=np.uint8) if has_zeros else None
        jitter = key.uniform(0.75, 1.25, (e, n, groups)).astype(np.float32)
    else:
        xp = jnp
        kq, kz, ks = jax.random.split(key, 3)
        qweight = jax.random.bits(kq, (e, n, k // per_word), jnp.uint32)
        z = None
        if has_zeros:
            z = jax.random.randint(kz, (e, n, groups), lo, hi).astype(jnp.uint8)
        jitter = jax.random.uniform(ks, (e, n, groups), jnp.float32, 0.75, 1.25)
    code_std = math.sqrt(((1 << bits) ** 2 - 1) / 12.0)  # std of uniform codes
    std = k**-0.5 if std is None else std
    scales = (jitter * (std / code_std)).astype(xp.float16)
    return QuantizedExperts(
        qweight=jnp.asarray(qweight),
        scales=jnp.asarray(scales).astype(dtype),
        zeros=None if z is None else jnp.asarray(pack_zeros(z, bits)),
        bits=bits,
        group_size=group_size,
    )


# The spread of E2M1 values of uniform codes: sqrt(mean of their squares) (their mean is 0).
_E2M1_STD = math.sqrt(sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES))
# random MXFP4 scales: this many powers of two either side of the centre.
_MXFP4_SCALE_SPAN = 4
# The root mean square of 2^u over the scales' exponents u (uniform in +-_MXFP4_SCALE_SPAN): the
# centre is this much lower, so the weights' spread is std.
_MXFP4_SCALE_RMS = math.sqrt(
    sum(4.0**u for u in range(-_MXFP4_SCALE_SPAN, _MXFP4_SCALE_SPAN + 1))
    / (2 * _MXFP4_SCALE_SPAN + 1)
)


def _random_mxfp4(key, shape: tuple[int, int, int], *, std: float | None) -> QuantizedExperts:
    """`random_quantized_experts(..., scheme="mxfp4")`."""
    e, n, k = shape
    if k % MXFP4_GROUP:
        raise ValueError(f"K={k} is not a multiple of the MXFP4 block of {MXFP4_GROUP} inputs")
    std = k**-0.5 if std is None else std
    centre = E8M0_BIAS + round(math.log2(std / (_E2M1_STD * _MXFP4_SCALE_RMS)))
    lo, hi = centre - _MXFP4_SCALE_SPAN, centre + _MXFP4_SCALE_SPAN + 1
    if lo < 1 or hi > 255:
        raise ValueError(f"std={std} puts the MXFP4 scales outside the E8M0 range")
    groups = (e, n, k // MXFP4_GROUP)
    if isinstance(key, np.random.Generator):
        qweight = key.integers(0, 2**32, (e, n, k // 8), dtype=np.uint32)
        scales = key.integers(lo, hi, groups, dtype=np.uint8)
    else:
        kq, ks = jax.random.split(key)
        qweight = jax.random.bits(kq, (e, n, k // 8), jnp.uint32)
        scales = jax.random.randint(ks, groups, lo, hi).astype(jnp.uint8)
    return QuantizedExperts(
        qweight=jnp.asarray(qweight),
        scales=jnp.asarray(scales),
        zeros=None,
        bits=4,
        group_size=MXFP4_GROUP,
        codes="e2m1",
    )
