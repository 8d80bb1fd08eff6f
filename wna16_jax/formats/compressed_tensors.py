"""compressed-tensors "pack-quantized" and "int-quantized" checkpoints <-> QuantizedExperts."""

from __future__ import annotations

from typing import Any

import numpy as np

from wna16_jax._quant import implicit_zero, pack, unpack, zero_points
from wna16_jax._types import QuantizedExperts
from wna16_jax.formats._common import (
    CT_INT_STRATEGIES,
    CT_STRATEGIES,
    as_int,
    build,
    check_bits,
    check_single,
    checked_scales,
    expect_shape,
    maybe_drop_zeros,
    num_groups,
    packed_words,
)


def _ct_group_size(
    strategy: str, group_size: Any, what: str, supported: tuple[str, ...] = CT_STRATEGIES
) -> int:
    if strategy not in supported:
        raise ValueError(
            f"{what}: strategy={strategy!r} is not supported (supported: "
            f"{', '.join(map(repr, supported))})"
        )
    if strategy in ("channel", "tensor"):
        if group_size not in (None, -1):
            raise ValueError(
                f"{what}: strategy={strategy!r} takes group_size=None or -1, got {group_size!r}"
            )
        return -1
    group_size = as_int(group_size, "group_size", what)
    if group_size <= 0:
        raise ValueError(f"{what}: strategy='group' needs group_size > 0, got {group_size}")
    return group_size


def from_compressed_tensors(
    weight_packed: Any,
    weight_scale: Any,
    weight_zero_point: Any = None,
    weight_shape: Any = None,
    *,
    num_bits: int,
    group_size: int | None,
    symmetric: bool,
    strategy: str = "group",
) -> QuantizedExperts:
    """compressed-tensors "pack-quantized" tensors (one linear layer) -> QuantizedExperts, E=1.

    compressed-tensors dequantizes w = (q_s - zp_s) * scale with signed q_s, zp_s and packs
    the unsigned q_s + 2**(b-1) low bits first (signed [-8,-3,0,1,7,-1,2,-5] packs to
    0x3A7F9850). Those stored fields are exactly the canonical q and z (the offsets cancel), so
    weight_packed is the canonical qweight and weight_zero_point (packed along N, dim 0) holds
    the canonical zeros.

    Args:
        weight_packed: int32 [N, K*b/32].
        weight_scale: [N, K/G] float16, bfloat16 or float32 ([N, 1] for strategy "channel").
        weight_zero_point: int32 [N*b/32, K/G] when asymmetric, else None. Given with
            symmetric=True it is dropped if every zero is 0 (signed), kept otherwise.
        weight_shape: int [2] = (N, K), checked when present.
        num_bits: 4 or 8.
        group_size: G for strategy "group"; None or -1 for "channel".
        symmetric: the scheme's `symmetric`.
        strategy: "group" or "channel".

    Returns:
        QuantizedExperts of shape [1, N, K].

    Raises:
        ValueError: on unsupported settings, mismatched shapes or dtypes, a weight_shape that
            disagrees (e.g. a K padded up to a whole word), or symmetric=False without zeros.
    """
    what = "from_compressed_tensors"
    bits = check_bits(num_bits, what)
    group_size = _ct_group_size(strategy, group_size, what)
    per_word = 32 // bits
    packed = packed_words(weight_packed, "weight_packed", what)
    n, k = packed.shape[0], packed.shape[1] * per_word
    if weight_shape is not None:
        ws = np.asarray(weight_shape)
        if ws.shape != (2,) or not np.issubdtype(ws.dtype, np.integer):
            raise ValueError(f"{what}: weight_shape must be int [2], got {ws.shape} {ws.dtype}")
        if (int(ws[0]), int(ws[1])) != (n, k):
            raise ValueError(
                f"{what}: weight_shape {tuple(int(v) for v in ws)} != (N, K) = {(n, k)} "
                f"implied by weight_packed shape {packed.shape} (K must be a multiple of "
                f"{per_word}; padded packing is not supported)"
            )
    g = num_groups(k, group_size, what)
    why = f"N={n}, K={k}, num_bits={bits}, group_size={group_size}"
    scale = checked_scales(weight_scale, "weight_scale", what)
    expect_shape(scale, (n, g), "weight_scale", what, why)
    z = None
    if weight_zero_point is None:
        if not symmetric:
            raise ValueError(f"{what}: symmetric=False needs weight_zero_point")
    else:
        zp = packed_words(weight_zero_point, "weight_zero_point", what)
        if n % per_word:
            raise ValueError(f"{what}: N={n} is not a multiple of {per_word} (num_bits={bits})")
        expect_shape(zp, (n // per_word, g), "weight_zero_point", what, why)
        z = maybe_drop_zeros(unpack(zp, bits, axis=0), bits, bool(symmetric))  # [N, G]
    return build(packed, scale, z, bits, group_size, what)


def from_compressed_tensors_int(
    weight: Any,
    weight_scale: Any,
    weight_zero_point: Any = None,
    *,
    num_bits: int,
    group_size: int | None,
    symmetric: bool,
    strategy: str = "group",
) -> QuantizedExperts:
    """compressed-tensors "int-quantized" (or "naive-quantized") tensors -> QuantizedExperts.

    The weight is stored unpacked as signed integers; canonical q = q_s + 2**(b-1) and
    z = zp_s + 2**(b-1), so symmetric weights (no zero point) get the implicit zero. An int8
    symmetric "channel" or "tensor" checkpoint (W8A8 models) loads as bits=8, group_size=-1,
    zeros=None: the weights the W8A8 kernels take.

    Args:
        weight: int8 [N, K], values in [-2**(b-1), 2**(b-1)).
        weight_scale: [N, K/G] float16, bfloat16 or float32 ([N, 1] for strategy "channel";
            one value, shape (), (1,) or (1, 1), for "tensor", repeated for every channel).
        weight_zero_point: signed integer [N, K/G] when asymmetric, else None (given with
            symmetric=True it is dropped if all zero, kept otherwise); one value for "tensor".
        num_bits: 8 (int-quantized) or 4 (int4 values held in int8).
        group_size: G for strategy "group"; None or -1 for "channel" and "tensor".
        symmetric: the scheme's `symmetric`.
        strategy: "group", "channel" or "tensor".

    Returns:
        QuantizedExperts of shape [1, N, K].

    Raises:
        ValueError: on unsupported settings, mismatched shapes or dtypes, or out-of-range
            values.
    """
    what = "from_compressed_tensors_int"
    bits = check_bits(num_bits, what)
    group_size = _ct_group_size(strategy, group_size, what, CT_INT_STRATEGIES)
    per_word = 32 // bits
    offset = implicit_zero(bits)
    w = np.asarray(weight)
    if w.ndim != 2 or w.dtype != np.int8:
        raise ValueError(f"{what}: weight must be int8 [N, K], got shape {w.shape} {w.dtype}")
    n, k = w.shape
    if k % per_word:
        raise ValueError(f"{what}: K={k} is not a multiple of {per_word} (num_bits={bits})")
    if bits < 8 and (w.min(initial=0) < -offset or w.max(initial=0) >= offset):
        raise ValueError(
            f"{what}: weight values span [{w.min()}, {w.max()}], outside the int{bits} range "
            f"[{-offset}, {offset - 1}]"
        )
    g = num_groups(k, group_size, what)
    why = f"N={n}, K={k}, group_size={group_size}"
    if strategy == "tensor":
        weight_scale = _per_tensor(weight_scale, "weight_scale", n, what)
        if weight_zero_point is not None:
            weight_zero_point = _per_tensor(weight_zero_point, "weight_zero_point", n, what)
    scale = checked_scales(weight_scale, "weight_scale", what)
    expect_shape(scale, (n, g), "weight_scale", what, why)
    z = None
    if weight_zero_point is None:
        if not symmetric:
            raise ValueError(f"{what}: symmetric=False needs weight_zero_point")
    else:
        zp = np.asarray(weight_zero_point)
        if not np.issubdtype(zp.dtype, np.integer):
            raise ValueError(f"{what}: weight_zero_point must be integer, got {zp.dtype}")
        expect_shape(zp, (n, g), "weight_zero_point", what, why)
        zp = zp.astype(np.int32)
        if zp.min(initial=0) < -offset or zp.max(initial=0) >= offset:
            raise ValueError(
                f"{what}: weight_zero_point values span [{zp.min()}, {zp.max()}], outside the "
                f"int{bits} range [{-offset}, {offset - 1}]"
            )
        z = maybe_drop_zeros((zp + offset).astype(np.uint8), bits, bool(symmetric))
    q = (w.astype(np.int16) + offset).astype(np.uint8)  # [N, K]
    return build(pack(q, bits, axis=1), scale, z, bits, group_size, what)


def _per_tensor(x: Any, name: str, n: int, what: str) -> np.ndarray:
    """A per-tensor value (shape (), (1,) or (1, 1)) repeated as one per channel: [N, 1]."""
    a = np.asarray(x)
    if a.size != 1 or a.ndim > 2:
        raise ValueError(
            f"{what}: strategy='tensor' needs one {name} value (shape (), (1,) or (1, 1)), got "
            f"shape {a.shape}"
        )
    return np.full((n, 1), a.reshape(()), dtype=a.dtype)


def to_compressed_tensors(qw: QuantizedExperts) -> dict[str, np.ndarray]:
    """QuantizedExperts (E=1) -> compressed-tensors "pack-quantized" tensors.

    Args:
        qw: [1, N, K], bits 4 or 8.

    Returns:
        {"weight_packed": int32 [N, K*b/32], "weight_scale": [N, K/G] (qw's scale dtype),
        "weight_shape": int64 [2] = (N, K)} plus "weight_zero_point": int32 [N*b/32, K/G]
        when qw has zeros (write the scheme as symmetric=False then; strategy "channel" when
        group_size == -1). numpy arrays.

    Raises:
        ValueError: if E != 1, qw has an input permutation (act-order), or qw has zeros and N
            is not a multiple of 32/bits.
    """
    what = "to_compressed_tensors"
    check_single(qw, what)
    _, n, k = qw.shape
    out = {
        "weight_packed": np.asarray(qw.qweight[0]).view(np.int32),
        "weight_scale": np.asarray(qw.scales[0]),
        "weight_shape": np.array([n, k], dtype=np.int64),
    }
    if qw.zeros is not None:
        if n % (32 // qw.bits):
            raise ValueError(f"{what}: N={n} is not a multiple of {32 // qw.bits}")
        z = np.asarray(zero_points(qw)[0])  # [N, G]
        out["weight_zero_point"] = pack(z, qw.bits, axis=0).view(np.int32)
    return out


def to_compressed_tensors_int(qw: QuantizedExperts) -> dict[str, np.ndarray]:
    """QuantizedExperts (E=1) -> compressed-tensors "int-quantized" tensors.

    Args:
        qw: [1, N, K], bits 4 or 8.

    Returns:
        {"weight": int8 [N, K] (signed), "weight_scale": [N, K/G]} plus
        "weight_zero_point": int8 [N, K/G] (signed) when qw has zeros. numpy arrays.

    Raises:
        ValueError: if E != 1 or qw has an input permutation (act-order).
    """
    what = "to_compressed_tensors_int"
    check_single(qw, what)
    offset = implicit_zero(qw.bits)
    q = unpack(np.asarray(qw.qweight[0]), qw.bits, axis=1).astype(np.int16)  # [N, K]
    out = {
        "weight": (q - offset).astype(np.int8),
        "weight_scale": np.asarray(qw.scales[0]),
    }
    if qw.zeros is not None:
        z = np.asarray(zero_points(qw)[0]).astype(np.int16)
        out["weight_zero_point"] = (z - offset).astype(np.int8)
    return out
