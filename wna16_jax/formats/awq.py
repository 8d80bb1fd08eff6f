"""AWQ GEMM checkpoints (int4, asymmetric) <-> QuantizedExperts."""

from __future__ import annotations

from typing import Any

import numpy as np

from wna16_jax._quant import pack, unpack, zero_points
from wna16_jax._types import QuantizedExperts
from wna16_jax.formats._common import (
    as_int,
    build,
    check_single,
    checked_scales,
    expect_shape,
    num_groups,
    packed_words,
)

# Nibble i of an AWQ GEMM word c holds output feature 8c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The nibble that holds feature 8c + j (the inverse permutation): (0, 4, 1, 5, 2, 6, 3, 7).
_AWQ_NIBBLE_OF_FEATURE = tuple(int(i) for i in np.argsort(AWQ_ORDER))


def _awq_unpack(words: np.ndarray) -> np.ndarray:
    """AWQ words [R, C] -> uint8 [R, 8C] in feature order."""
    r, c = words.shape
    nibbles = unpack(words, 4, axis=1).reshape(r, c, 8)  # nibble i of word c
    return nibbles[:, :, _AWQ_NIBBLE_OF_FEATURE].reshape(r, 8 * c)


def _awq_pack(values: np.ndarray) -> np.ndarray:
    """uint8 [R, 8C] in feature order -> AWQ words uint32 [R, C]."""
    r, n = values.shape
    nibbles = values.reshape(r, n // 8, 8)[:, :, AWQ_ORDER]  # nibble i = feature AWQ_ORDER[i]
    return pack(nibbles.reshape(r, n), 4, axis=1)


def from_awq(qweight: Any, qzeros: Any, scales: Any, *, group_size: int) -> QuantizedExperts:
    """AWQ GEMM checkpoint tensors (one linear layer) -> QuantizedExperts with E=1.

    AWQ is always asymmetric 4-bit: w[k, n] = (q[k, n] - z[k // G, n]) * scales[k // G, n].
    Nibble i of word c holds output feature 8c + AWQ_ORDER[i], AWQ_ORDER = (0,2,4,6,1,3,5,7)
    (features 1..8 pack to 0x86427531).

    Args:
        qweight: int32 [K, N/8], 8 output features per word in AWQ order.
        qzeros: int32 [K/G, N/8], true zero points, packed like qweight.
        scales: [K/G, N] float16, bfloat16 or float32.
        group_size: G, or -1 for one group spanning K.

    Returns:
        QuantizedExperts of shape [1, N, K], bits=4, with zeros.

    Raises:
        ValueError: on dtypes or shapes that do not fit together (the message quotes them).
    """
    what = "from_awq"
    group_size = as_int(group_size, "group_size", what)
    qweight = packed_words(qweight, "qweight", what)
    qzeros = packed_words(qzeros, "qzeros", what)
    scales = checked_scales(scales, "scales", what)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if k % 8:
        raise ValueError(f"{what}: K={k} (qweight rows) is not a multiple of 8")
    g = num_groups(k, group_size, what)
    why = f"K={k}, N={n}, group_size={group_size}"
    expect_shape(qzeros, (g, n // 8), "qzeros", what, why)
    expect_shape(scales, (g, n), "scales", what, why)
    q = _awq_unpack(qweight)  # [K, N]
    z = _awq_unpack(qzeros)  # [G, N]
    return build(pack(q.T, 4, axis=1), scales.T, z.T, 4, group_size, what)


def to_awq(qw: QuantizedExperts) -> dict[str, np.ndarray]:
    """QuantizedExperts (E=1, int4, with zeros) -> AWQ GEMM checkpoint tensors.

    Args:
        qw: [1, N, K], bits=4, zeros present (AWQ is always asymmetric).

    Returns:
        {"qweight": int32 [K, N/8], "qzeros": int32 [K/G, N/8], "scales": [K/G, N]} as numpy
        arrays, scales in qw's scale dtype.

    Raises:
        ValueError: if qw is not int4, has zeros=None or an input permutation, or E != 1.
    """
    what = "to_awq"
    check_single(qw, what)
    if qw.bits != 4:
        raise ValueError(f"{what}: AWQ is 4-bit only, got bits={qw.bits}")
    if qw.zeros is None:
        raise ValueError(
            f"{what}: AWQ checkpoints always carry zero points; qw has zeros=None (symmetric). "
            f"Write it with to_gptq or to_compressed_tensors instead"
        )
    _, n, _ = qw.shape
    if n % 8:
        raise ValueError(f"{what}: N={n} is not a multiple of 8")
    q = unpack(np.asarray(qw.qweight[0]), 4, axis=1)  # [N, K]
    z = np.asarray(zero_points(qw)[0])  # [N, G]
    return {
        "qweight": _awq_pack(q.T).view(np.int32),
        "qzeros": _awq_pack(z.T).view(np.int32),
        "scales": np.ascontiguousarray(np.asarray(qw.scales[0]).T),
    }
