"""Checkpoint formats (AWQ, GPTQ, compressed-tensors) to and from QuantizedExperts."""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from wna16_jax._quant import implicit_zero, zero_points
from wna16_jax._types import SUPPORTED_BITS, ActivationQuant, QuantizedExperts

__all__ = [
    "AWQ_ORDER",
    "activation_quant_from_config",
    "from_awq",
    "from_compressed_tensors",
    "from_compressed_tensors_int",
    "from_gptq",
    "from_gptq_act_order",
    "from_quantization_config",
    "gptq_act_order_permutation",
    "stack",
    "static_input_scale",
    "to_awq",
    "to_compressed_tensors",
    "to_compressed_tensors_int",
    "to_gptq",
]

# Nibble i of an AWQ GEMM word c holds output feature 8c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The nibble that holds feature 8c + j (the inverse permutation): (0, 4, 1, 5, 2, 6, 3, 7).
_AWQ_NIBBLE_OF_FEATURE = tuple(int(i) for i in np.argsort(AWQ_ORDER))

_SCALE_DTYPES = (np.dtype(np.float16), np.dtype(jnp.bfloat16), np.dtype(np.float32))
_GPTQ_FORMATS = ("gptq", "gptq_v2")
_CT_STRATEGIES = ("group", "channel")
# int-quantized weights may also carry one scale for the whole tensor.
_CT_INT_STRATEGIES = (*_CT_STRATEGIES, "tensor")


# --- argument checks ---------------------------------------------------------------------


def _check_bits(bits: Any, what: str) -> int:
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ValueError(f"{what}: bits={bits!r} is not supported (supported: 4, 8)")
    return int(bits)


def _as_int(value: Any, name: str, what: str) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what}: {name}={value!r} must be an int") from None


def _num_groups(k: int, group_size: int, what: str) -> int:
    """Groups along K; group_size = -1 means one group spanning K."""
    if group_size == -1:
        return 1
    if group_size <= 0 or k % group_size:
        raise ValueError(f"{what}: K={k} is not a multiple of group_size={group_size}")
    return k // group_size


def _packed(x: Any, name: str, what: str) -> np.ndarray:
    """A 2-D int32 (or uint32) checkpoint tensor of packed words, viewed as uint32."""
    a = np.asarray(x)
    if a.ndim != 2:
        raise ValueError(f"{what}: {name} must be 2-D, got shape {a.shape}")
    if a.dtype not in (np.int32, np.uint32):
        raise ValueError(f"{what}: {name} must be int32 packed words, got dtype {a.dtype}")
    return a.view(np.uint32)


def _scales(x: Any, name: str, what: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 2:
        raise ValueError(f"{what}: {name} must be 2-D, got shape {a.shape}")
    if a.dtype not in _SCALE_DTYPES:
        raise ValueError(
            f"{what}: {name} dtype must be float16, bfloat16 or float32, got {a.dtype}"
        )
    return a


def _expect_shape(a: np.ndarray, want: tuple[int, ...], name: str, what: str, why: str) -> None:
    if tuple(a.shape) != want:
        raise ValueError(f"{what}: {name} shape {tuple(a.shape)} != expected {want} ({why})")


# --- bit fields (host side, numpy) -------------------------------------------------------


def _unpack(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """uint32 words -> uint8 fields, `axis` grown by 32 // bits; field i = bits [b*i, b*i+b)."""
    per_word = 32 // bits
    w = np.moveaxis(words, axis, -1)
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    f = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    f = f.reshape(*w.shape[:-1], w.shape[-1] * per_word).astype(np.uint8)
    return np.moveaxis(f, -1, axis)


def _pack(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Inverse of `_unpack`: fields (< 2**bits) -> uint32 words, low bits first along `axis`."""
    per_word = 32 // bits
    v = np.moveaxis(np.asarray(values), axis, -1).astype(np.uint32)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per_word, per_word)
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    words = np.bitwise_or.reduce(v << shifts, axis=-1)
    return np.ascontiguousarray(np.moveaxis(words, -1, axis))


def _awq_unpack(words: np.ndarray) -> np.ndarray:
    """AWQ words [R, C] -> uint8 [R, 8C] in feature order."""
    r, c = words.shape
    nibbles = _unpack(words, 4, axis=1).reshape(r, c, 8)  # nibble i of word c
    return nibbles[:, :, _AWQ_NIBBLE_OF_FEATURE].reshape(r, 8 * c)


def _awq_pack(values: np.ndarray) -> np.ndarray:
    """uint8 [R, 8C] in feature order -> AWQ words uint32 [R, C]."""
    r, n = values.shape
    nibbles = values.reshape(r, n // 8, 8)[:, :, AWQ_ORDER]  # nibble i = feature AWQ_ORDER[i]
    return _pack(nibbles.reshape(r, n), 4, axis=1)


def _maybe_drop_zeros(z: np.ndarray, bits: int, sym: bool) -> np.ndarray | None:
    """Symmetric checkpoints may still store zero points: drop them only when all are implicit."""
    if sym and np.all(z == implicit_zero(bits)):
        return None
    return z


def _build(
    qweight: np.ndarray,
    scales: np.ndarray,
    zeros: np.ndarray | None,
    bits: int,
    group_size: int,
    what: str,
) -> QuantizedExperts:
    """Canonical QuantizedExperts (E=1) from qweight uint32 [N, K*b/32], scales/zeros [N, G]."""
    if zeros is not None:
        zeros = zeros.astype(np.uint8)
        if bits == 4:  # [N, G] -> [N//2, G], even n in the low nibble
            zeros = zeros[0::2] | (zeros[1::2] << 4)
        zeros = jnp.asarray(zeros[None])
    qw = QuantizedExperts(
        qweight=jnp.asarray(np.ascontiguousarray(qweight)[None]),
        scales=jnp.asarray(np.ascontiguousarray(scales)[None]),
        zeros=zeros,
        bits=bits,
        group_size=group_size,
    )
    qw.validate(what)
    return qw


# --- AWQ ---------------------------------------------------------------------------------


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
    group_size = _as_int(group_size, "group_size", what)
    qweight = _packed(qweight, "qweight", what)
    qzeros = _packed(qzeros, "qzeros", what)
    scales = _scales(scales, "scales", what)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if k % 8:
        raise ValueError(f"{what}: K={k} (qweight rows) is not a multiple of 8")
    g = _num_groups(k, group_size, what)
    why = f"K={k}, N={n}, group_size={group_size}"
    _expect_shape(qzeros, (g, n // 8), "qzeros", what, why)
    _expect_shape(scales, (g, n), "scales", what, why)
    q = _awq_unpack(qweight)  # [K, N]
    z = _awq_unpack(qzeros)  # [G, N]
    return _build(_pack(q.T, 4, axis=1), scales.T, z.T, 4, group_size, what)


def _single(qw: QuantizedExperts, what: str) -> None:
    if not isinstance(qw, QuantizedExperts):
        raise ValueError(f"{what}: expected a QuantizedExperts, got {type(qw).__name__}")
    qw.validate(what)
    if qw.num_experts != 1:
        raise ValueError(
            f"{what}: a checkpoint holds one linear layer; got E={qw.num_experts} "
            f"(slice it, e.g. jax.tree.map(lambda a: a[e:e + 1], qw))"
        )


def to_awq(qw: QuantizedExperts) -> dict[str, np.ndarray]:
    """QuantizedExperts (E=1, int4, with zeros) -> AWQ GEMM checkpoint tensors.

    Args:
        qw: [1, N, K], bits=4, zeros present (AWQ is always asymmetric).

    Returns:
        {"qweight": int32 [K, N/8], "qzeros": int32 [K/G, N/8], "scales": [K/G, N]} as numpy
        arrays, scales in qw's scale dtype.

    Raises:
        ValueError: if qw is not int4, has zeros=None, or E != 1.
    """
    what = "to_awq"
    _single(qw, what)
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
    q = _unpack(np.asarray(qw.qweight[0]), 4, axis=1)  # [N, K]
    z = np.asarray(zero_points(qw)[0])  # [N, G]
    return {
        "qweight": _awq_pack(q.T).view(np.int32),
        "qzeros": _awq_pack(z.T).view(np.int32),
        "scales": np.ascontiguousarray(np.asarray(qw.scales[0]).T),
    }


# --- GPTQ --------------------------------------------------------------------------------


def _gptq_parts(qweight, qzeros, scales, g_idx, bits, group_size, sym, checkpoint_format, what):
    """Checks GPTQ tensors and decodes the zero points.

    Returns (qweight uint32 [N, K*b/32] canonical, scales [N, G], zeros uint8 [N, G] or None,
    g_idx [K] or None, group_size, bits).
    """
    bits = _check_bits(bits, what)
    group_size = _as_int(group_size, "group_size", what)
    if checkpoint_format not in _GPTQ_FORMATS:
        raise ValueError(
            f"{what}: checkpoint_format={checkpoint_format!r} is not supported "
            f"(supported: 'gptq' (v1, zero - 1 stored), 'gptq_v2')"
        )
    per_word = 32 // bits
    qweight = _packed(qweight, "qweight", what)
    qzeros = _packed(qzeros, "qzeros", what)
    scales = _scales(scales, "scales", what)
    k, n = qweight.shape[0] * per_word, qweight.shape[1]
    if n % per_word:
        raise ValueError(f"{what}: N={n} is not a multiple of {per_word} (bits={bits})")
    g = _num_groups(k, group_size, what)
    why = f"K={k}, N={n}, bits={bits}, group_size={group_size}"
    _expect_shape(qzeros, (g, n // per_word), "qzeros", what, why)
    _expect_shape(scales, (g, n), "scales", what, why)
    if g_idx is not None:
        g_idx = np.asarray(g_idx)
        if g_idx.shape != (k,) or not np.issubdtype(g_idx.dtype, np.integer):
            raise ValueError(
                f"{what}: g_idx must be an integer [K] = ({k},) array, got shape "
                f"{g_idx.shape} dtype {g_idx.dtype}"
            )
    stored = _unpack(qzeros, bits, axis=1).astype(np.uint16)  # [G, N]
    z = (stored + 1) & ((1 << bits) - 1) if checkpoint_format == "gptq" else stored
    z = _maybe_drop_zeros(z.T.astype(np.uint8), bits, bool(sym))
    # GPTQ packs 32/b values of K per word, low bits first: the transpose is the canonical words.
    return np.ascontiguousarray(qweight.T), scales.T, z, g_idx, group_size, bits


def _trivial_g_idx(g_idx: np.ndarray | None, k: int, group_size: int) -> bool:
    if g_idx is None:
        return True
    g = k if group_size == -1 else group_size
    return bool(np.array_equal(g_idx, np.arange(k) // g))


def from_gptq(
    qweight: Any,
    qzeros: Any,
    scales: Any,
    g_idx: Any = None,
    *,
    bits: int,
    group_size: int,
    sym: bool,
    desc_act: bool = False,
    checkpoint_format: str = "gptq",
) -> QuantizedExperts:
    """GPTQ checkpoint tensors (one linear layer) -> QuantizedExperts with E=1.

    w[k, n] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n]. qweight packs 32/bits values of
    K per word, low bits first (k = 1..8 holding 1..8 pack to 0x87654321); qzeros packs N the
    same way.

    Zero points: "gptq" (v1) stores zero - 1, decoded as (stored + 1) & (2**bits - 1). The mask
    matters only for stored 2**bits - 1, which a v1 writer produces only from a true zero of 0
    (AutoGPTQ wraps -1); it decodes back to 0. (Kernels that add 1 without the mask, such as
    vLLM's gptq_gemm, use 2**bits there instead, a value the canonical layout cannot hold.)
    "gptq_v2" stores the true zero. With sym=True the checkpoint still carries qzeros (2**(b-1),
    stored as 2**(b-1) - 1 in v1): they become zeros=None when every one equals the implicit
    zero, and are kept otherwise, so the weights always dequantize as the checkpoint says.

    Act-order (desc_act): a g_idx other than arange(K) // G puts each group's input features at
    scattered k, which the canonical layout cannot express without permuting the activations.
    Such a g_idx is refused; `from_gptq_act_order` loads it on a permuted K instead. A desc_act
    checkpoint whose g_idx is trivial (e.g. GPTQModel's static_groups) loads here.

    Args:
        qweight: int32 [K*bits/32, N].
        qzeros: int32 [K/G, N*bits/32].
        scales: [K/G, N] float16, bfloat16 or float32.
        g_idx: int [K] group of each input feature, or None (= arange(K) // G).
        bits: 4 or 8.
        group_size: G, or -1 for one group spanning K.
        sym: the config's `sym`.
        desc_act: the config's `desc_act`; needs g_idx when True.
        checkpoint_format: "gptq" (v1, stores zero - 1) or "gptq_v2" (stores the true zero).

    Returns:
        QuantizedExperts of shape [1, N, K].

    Raises:
        ValueError: on unsupported bits/format, mismatched shapes or dtypes, or a non-trivial
            g_idx (act-order).
    """
    what = "from_gptq"
    qweight, scales, z, g_idx, group_size, bits = _gptq_parts(
        qweight, qzeros, scales, g_idx, bits, group_size, sym, checkpoint_format, what
    )
    k = qweight.shape[1] * (32 // bits)
    if desc_act and g_idx is None:
        raise ValueError(f"{what}: desc_act=True needs g_idx to know each input's group")
    if not _trivial_g_idx(g_idx, k, group_size):
        raise ValueError(
            f"{what}: act-order (desc_act) GPTQ with a non-trivial g_idx is not supported: the "
            f"canonical layout needs each group's {group_size} input features to be contiguous "
            f"in K (g_idx[:8]={g_idx[:8].tolist()}, expected arange(K) // {group_size}). Use "
            f"from_gptq_act_order, which loads the weights on a permuted K and returns the "
            f"permutation to apply to the activations"
        )
    return _build(qweight, scales, z, bits, group_size, what)


def gptq_act_order_permutation(g_idx: Any, *, group_size: int) -> np.ndarray:
    """The permutation of K that makes each act-order group contiguous.

    Args:
        g_idx: int [K], the group of each input feature; every group must have exactly
            group_size members.
        group_size: G (or -1: a single group, the identity permutation).

    Returns:
        perm: int32 [K] (a stable sort of g_idx), so that g_idx[perm] == arange(K) // G.

    Raises:
        ValueError: if g_idx is not [K] integers or its groups do not each have G members.
    """
    what = "gptq_act_order_permutation"
    g_idx = np.asarray(g_idx)
    if g_idx.ndim != 1 or not np.issubdtype(g_idx.dtype, np.integer):
        raise ValueError(
            f"{what}: g_idx must be an integer [K] array, got {g_idx.shape} dtype {g_idx.dtype}"
        )
    k = g_idx.shape[0]
    group_size = _as_int(group_size, "group_size", what)
    g = _num_groups(k, group_size, what)
    counts = np.bincount(np.clip(g_idx, 0, g), minlength=g + 1)
    if g_idx.min(initial=0) < 0 or g_idx.max(initial=0) >= g or np.any(counts[:g] != k // g):
        raise ValueError(
            f"{what}: g_idx must assign exactly {k // g} features to each of {g} groups "
            f"(K={k}, group_size={group_size}); got values in [{g_idx.min()}, {g_idx.max()}] "
            f"with group sizes {counts[:g].tolist()[:8]}..."
        )
    return np.argsort(g_idx, kind="stable").astype(np.int32)


def from_gptq_act_order(
    qweight: Any,
    qzeros: Any,
    scales: Any,
    g_idx: Any,
    *,
    bits: int,
    group_size: int,
    sym: bool,
    checkpoint_format: str = "gptq",
) -> tuple[QuantizedExperts, np.ndarray]:
    """Act-order GPTQ -> QuantizedExperts on a permuted K, plus the permutation.

    With W the checkpoint's dequantized [N, K] weight and perm =
    gptq_act_order_permutation(g_idx): dequantize_experts(qw)[0] == W[:, perm], so
    x @ W.T == x[..., perm] @ dequantize_experts(qw)[0].T. The caller must permute the
    activations. In an MoE this is exact for w2 (permute the rows of the same expert's w13,
    gate and up alike, by w2's perm); w13's input is shared by all experts, so its g_idx must be
    trivial (load it with `from_gptq`).

    Args:
        qweight, qzeros, scales, bits, group_size, sym, checkpoint_format: as in `from_gptq`.
        g_idx: int [K], the group of each input feature (any order, G members per group).

    Returns:
        (qw [1, N, K] on the permuted K, perm int32 [K] numpy).

    Raises:
        ValueError: as `from_gptq`, or if g_idx's groups do not each have G members.
    """
    what = "from_gptq_act_order"
    qweight, scales, z, g_idx, group_size, bits = _gptq_parts(
        qweight, qzeros, scales, g_idx, bits, group_size, sym, checkpoint_format, what
    )
    if g_idx is None:
        raise ValueError(f"{what}: g_idx is required")
    perm = gptq_act_order_permutation(g_idx, group_size=group_size)
    q = _unpack(qweight, bits, axis=1)[:, perm]  # [N, K], permuted K
    return _build(_pack(q, bits, axis=1), scales, z, bits, group_size, what), perm


def to_gptq(qw: QuantizedExperts, *, checkpoint_format: str = "gptq") -> dict[str, np.ndarray]:
    """QuantizedExperts (E=1) -> GPTQ checkpoint tensors (no act-order).

    Symmetric weights (zeros=None) get the implicit zero points written out, as GPTQ does.

    Args:
        qw: [1, N, K], bits 4 or 8.
        checkpoint_format: "gptq" (v1: stores (zero - 1) & (2**bits - 1)) or "gptq_v2".

    Returns:
        {"qweight": int32 [K*bits/32, N], "qzeros": int32 [K/G, N*bits/32],
        "scales": [K/G, N] (qw's scale dtype), "g_idx": int32 [K] = arange(K) // G} (numpy).

    Raises:
        ValueError: if E != 1, N is not a multiple of 32/bits, or the format is unknown.
    """
    what = "to_gptq"
    _single(qw, what)
    if checkpoint_format not in _GPTQ_FORMATS:
        raise ValueError(
            f"{what}: checkpoint_format={checkpoint_format!r} is not supported "
            f"(supported: {_GPTQ_FORMATS})"
        )
    bits = qw.bits
    _, n, k = qw.shape
    if n % (32 // bits):
        raise ValueError(f"{what}: N={n} is not a multiple of {32 // bits} (bits={bits})")
    z = np.asarray(zero_points(qw)[0]).astype(np.int16)  # [N, G]
    if checkpoint_format == "gptq":
        z = (z - 1) & ((1 << bits) - 1)
    return {
        "qweight": np.ascontiguousarray(np.asarray(qw.qweight[0]).T).view(np.int32),
        "qzeros": _pack(z.T, bits, axis=1).view(np.int32),
        "scales": np.ascontiguousarray(np.asarray(qw.scales[0]).T),
        "g_idx": (np.arange(k) // qw.group).astype(np.int32),
    }


# --- compressed-tensors ------------------------------------------------------------------


def _ct_group_size(
    strategy: str, group_size: Any, what: str, supported: tuple[str, ...] = _CT_STRATEGIES
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
    group_size = _as_int(group_size, "group_size", what)
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
    bits = _check_bits(num_bits, what)
    group_size = _ct_group_size(strategy, group_size, what)
    per_word = 32 // bits
    packed = _packed(weight_packed, "weight_packed", what)
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
    g = _num_groups(k, group_size, what)
    why = f"N={n}, K={k}, num_bits={bits}, group_size={group_size}"
    scale = _scales(weight_scale, "weight_scale", what)
    _expect_shape(scale, (n, g), "weight_scale", what, why)
    z = None
    if weight_zero_point is None:
        if not symmetric:
            raise ValueError(f"{what}: symmetric=False needs weight_zero_point")
    else:
        zp = _packed(weight_zero_point, "weight_zero_point", what)
        if n % per_word:
            raise ValueError(f"{what}: N={n} is not a multiple of {per_word} (num_bits={bits})")
        _expect_shape(zp, (n // per_word, g), "weight_zero_point", what, why)
        z = _maybe_drop_zeros(_unpack(zp, bits, axis=0), bits, bool(symmetric))  # [N, G]
    return _build(packed, scale, z, bits, group_size, what)


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
    bits = _check_bits(num_bits, what)
    group_size = _ct_group_size(strategy, group_size, what, _CT_INT_STRATEGIES)
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
    g = _num_groups(k, group_size, what)
    why = f"N={n}, K={k}, group_size={group_size}"
    if strategy == "tensor":
        weight_scale = _per_tensor(weight_scale, "weight_scale", n, what)
        if weight_zero_point is not None:
            weight_zero_point = _per_tensor(weight_zero_point, "weight_zero_point", n, what)
    scale = _scales(weight_scale, "weight_scale", what)
    _expect_shape(scale, (n, g), "weight_scale", what, why)
    z = None
    if weight_zero_point is None:
        if not symmetric:
            raise ValueError(f"{what}: symmetric=False needs weight_zero_point")
    else:
        zp = np.asarray(weight_zero_point)
        if not np.issubdtype(zp.dtype, np.integer):
            raise ValueError(f"{what}: weight_zero_point must be integer, got {zp.dtype}")
        _expect_shape(zp, (n, g), "weight_zero_point", what, why)
        zp = zp.astype(np.int32)
        if zp.min(initial=0) < -offset or zp.max(initial=0) >= offset:
            raise ValueError(
                f"{what}: weight_zero_point values span [{zp.min()}, {zp.max()}], outside the "
                f"int{bits} range [{-offset}, {offset - 1}]"
            )
        z = _maybe_drop_zeros((zp + offset).astype(np.uint8), bits, bool(symmetric))
    q = (w.astype(np.int16) + offset).astype(np.uint8)  # [N, K]
    return _build(_pack(q, bits, axis=1), scale, z, bits, group_size, what)


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
        ValueError: if E != 1, or qw has zeros and N is not a multiple of 32/bits.
    """
    what = "to_compressed_tensors"
    _single(qw, what)
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
        out["weight_zero_point"] = _pack(z, qw.bits, axis=0).view(np.int32)
    return out


def to_compressed_tensors_int(qw: QuantizedExperts) -> dict[str, np.ndarray]:
    """QuantizedExperts (E=1) -> compressed-tensors "int-quantized" tensors.

    Args:
        qw: [1, N, K], bits 4 or 8.

    Returns:
        {"weight": int8 [N, K] (signed), "weight_scale": [N, K/G]} plus
        "weight_zero_point": int8 [N, K/G] (signed) when qw has zeros. numpy arrays.

    Raises:
        ValueError: if E != 1.
    """
    what = "to_compressed_tensors_int"
    _single(qw, what)
    offset = implicit_zero(qw.bits)
    q = _unpack(np.asarray(qw.qweight[0]), qw.bits, axis=1).astype(np.int16)  # [N, K]
    out = {
        "weight": (q - offset).astype(np.int8),
        "weight_scale": np.asarray(qw.scales[0]),
    }
    if qw.zeros is not None:
        z = np.asarray(zero_points(qw)[0]).astype(np.int16)
        out["weight_zero_point"] = (z - offset).astype(np.int8)
    return out


# --- config dispatch ---------------------------------------------------------------------


def _take(tensors: Mapping[str, Any], prefix: str, required, optional, what: str):
    names = {s: f"{prefix}.{s}" for s in (*required, *optional)}
    missing = [names[s] for s in required if names[s] not in tensors]
    if missing:
        have = sorted(name for name in tensors if name.startswith(prefix + "."))
        raise ValueError(f"{what}: missing tensors {missing} (tensors under {prefix!r}: {have})")
    return {s: tensors[names[s]] for s in names if names[s] in tensors}


def _require(cfg: Mapping[str, Any], keys: Sequence[str], what: str) -> Any:
    for key in keys:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    raise ValueError(f"{what}: quantization_config has no {' / '.join(map(repr, keys))}")


def _load_awq(tensors, cfg, prefix) -> QuantizedExperts:
    what = f"awq layer {prefix!r}"
    version = str(cfg.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(
            f"{what}: AWQ version={cfg.get('version')!r} is not supported (supported: 'gemm')"
        )
    bits = _require(cfg, ("bits", "w_bit"), what)
    if bits != 4:
        raise ValueError(f"{what}: AWQ bits={bits!r} is not supported (supported: 4)")
    if cfg.get("zero_point", True) is not True:
        raise ValueError(
            f"{what}: AWQ zero_point={cfg.get('zero_point')!r} is not supported (AWQ GEMM "
            f"checkpoints need zero_point=true)"
        )
    skipped = [m for m in cfg.get("modules_to_not_convert") or () if m in prefix]
    if skipped:
        raise ValueError(
            f"{what}: the layer matches modules_to_not_convert {skipped}; it is not quantized"
        )
    group_size = _require(cfg, ("group_size", "q_group_size"), what)
    t = _take(tensors, prefix, ("qweight", "qzeros", "scales"), (), what)
    return from_awq(t["qweight"], t["qzeros"], t["scales"], group_size=group_size)


def _gptq_dynamic(cfg: Mapping[str, Any], prefix: str, what: str) -> dict[str, Any]:
    """GPTQModel's per-module overrides: {"-:regex": {}} skips, {"+:regex"|"regex": {...}}."""
    for pattern, override in (cfg.get("dynamic") or {}).items():
        if pattern.startswith("-:"):
            if re.match(pattern[2:], prefix):
                raise ValueError(
                    f"{what}: the layer matches dynamic exclusion {pattern!r}; it is not quantized"
                )
            continue
        if re.match(pattern.removeprefix("+:"), prefix):
            return {**cfg, **override}
    return dict(cfg)


def _load_gptq(tensors, cfg, prefix) -> QuantizedExperts:
    what = f"gptq layer {prefix!r}"
    cfg = _gptq_dynamic(cfg, prefix, what)
    bits = _require(cfg, ("bits",), what)
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{what}: GPTQ bits={bits!r} is not supported (supported: 4, 8)")
    group_size = _require(cfg, ("group_size",), what)
    fmt = cfg.get("checkpoint_format") or cfg.get("format") or "gptq"
    if fmt not in _GPTQ_FORMATS:
        raise ValueError(
            f"{what}: GPTQ checkpoint_format={fmt!r} is not supported (supported: "
            f"{', '.join(_GPTQ_FORMATS)})"
        )
    t = _take(tensors, prefix, ("qweight", "qzeros", "scales"), ("g_idx",), what)
    return from_gptq(
        t["qweight"],
        t["qzeros"],
        t["scales"],
        t.get("g_idx"),
        bits=bits,
        group_size=group_size,
        sym=bool(cfg.get("sym", True)),
        desc_act=bool(cfg.get("desc_act", False)),
        checkpoint_format=fmt,
    )


def _ct_scheme(cfg: Mapping[str, Any], prefix: str, what: str) -> Mapping[str, Any]:
    """The config group whose targets cover `prefix` (regex targets first, then class names)."""
    groups = {
        name: grp
        for name, grp in (cfg.get("config_groups") or {}).items()
        if grp and grp.get("weights")
    }
    if not groups:
        raise ValueError(f"{what}: quantization_config has no config_groups with weights")
    if len(groups) == 1:
        return next(iter(groups.values()))
    by_regex = [
        name
        for name, grp in groups.items()
        if any(t.startswith("re:") and re.match(t[3:], prefix) for t in grp.get("targets", ()))
    ]
    by_class = [
        name
        for name, grp in groups.items()
        if any(not t.startswith("re:") for t in grp.get("targets", ()))
    ]
    for matches in (by_regex, by_class):
        if len(matches) == 1:
            return groups[matches[0]]
        if len(matches) > 1:
            break
    raise ValueError(
        f"{what}: cannot tell which of config_groups {sorted(groups)} applies "
        f"(regex matches: {by_regex}, class-name targets: {by_class})"
    )


def _load_compressed_tensors(tensors, cfg, prefix) -> QuantizedExperts:
    what = f"compressed-tensors layer {prefix!r}"
    scheme = _ct_scheme(cfg, prefix, what)
    weights = scheme["weights"]
    fmt = scheme.get("format") or cfg.get("format")
    if weights.get("type", "int") != "int":
        raise ValueError(
            f"{what}: weights type={weights.get('type')!r} is not supported (supported: 'int')"
        )
    bits = weights.get("num_bits")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{what}: weights num_bits={bits!r} is not supported (supported: 4, 8)")
    strategy = weights.get("strategy", "group")
    supported = (
        _CT_INT_STRATEGIES if fmt in ("int-quantized", "naive-quantized") else _CT_STRATEGIES
    )
    if strategy not in supported:
        raise ValueError(
            f"{what}: weights strategy={strategy!r} is not supported for format={fmt!r} "
            f"(supported: {', '.join(map(repr, supported))})"
        )
    kwargs = dict(
        num_bits=bits,
        group_size=weights.get("group_size"),
        symmetric=bool(weights.get("symmetric", True)),
        strategy=strategy,
    )
    if fmt == "pack-quantized":
        required, optional = ("weight_packed", "weight_scale"), ("weight_zero_point",)
        optional += ("weight_shape", "weight_g_idx")
    elif fmt in ("int-quantized", "naive-quantized"):
        required, optional = ("weight", "weight_scale"), ("weight_zero_point", "weight_g_idx")
    else:
        raise ValueError(
            f"{what}: format={fmt!r} is not supported (supported: 'pack-quantized', "
            f"'int-quantized', 'naive-quantized')"
        )
    t = _take(tensors, prefix, required, optional, what)
    if "weight_g_idx" in t:
        g_idx = np.asarray(t["weight_g_idx"])
        k = g_idx.shape[0] if g_idx.ndim == 1 else -1
        group = kwargs["group_size"] if strategy == "group" else -1  # channel, tensor
        if k < 0 or not _trivial_g_idx(g_idx, k, _as_int(group, "group_size", what)):
            raise ValueError(
                f"{what}: activation ordering with a non-trivial {prefix}.weight_g_idx is not "
                f"supported (actorder={weights.get('actorder')!r}); the canonical layout needs "
                f"contiguous groups"
            )
    if fmt == "pack-quantized":
        return from_compressed_tensors(
            t["weight_packed"],
            t["weight_scale"],
            t.get("weight_zero_point"),
            t.get("weight_shape"),
            **kwargs,
        )
    return from_compressed_tensors_int(
        t["weight"], t["weight_scale"], t.get("weight_zero_point"), **kwargs
    )


_LOADERS = {
    "awq": _load_awq,
    "gptq": _load_gptq,
    "compressed-tensors": _load_compressed_tensors,
}


def from_quantization_config(
    tensors: Mapping[str, Any], quantization_config: Mapping[str, Any], prefix: str
) -> QuantizedExperts:
    """Loads one quantized linear layer as described by an HF `quantization_config`.

    Recognized (`quant_method`):
      - "awq": version "gemm" only; keys bits (or w_bit) = 4, group_size (or q_group_size),
        zero_point (must be true), modules_to_not_convert (a matching prefix is refused).
        Tensors {prefix}.qweight, .qzeros, .scales.
      - "gptq": keys bits (4, 8), group_size, sym, desc_act, checkpoint_format (or format;
        "gptq" or "gptq_v2"), dynamic (GPTQModel per-module overrides: "-:" excludes refuse,
        other matches override keys). Tensors .qweight, .qzeros, .scales, optional .g_idx
        (a non-trivial g_idx is refused, see `from_gptq`).
      - "compressed-tensors": the config group whose targets match (regex "re:..." targets
        first; otherwise the single group with class-name targets); weights type "int",
        num_bits 4/8, strategy group/channel (and tensor for int-quantized), group_size,
        symmetric; format (per group or
        top-level) "pack-quantized" (.weight_packed, .weight_scale, optional
        .weight_zero_point, .weight_shape) or "int-quantized" / "naive-quantized" (.weight,
        .weight_scale, optional .weight_zero_point). A non-trivial .weight_g_idx is refused.
        The "ignore" list is not consulted: an ignored layer is a float layer, which the
        caller must not pass here (it fails for lack of the quantized tensors). Only weights
        are read here: `activation_quant_from_config` reads input_activations (W8A8 schemes),
        which fused_moe takes as its activation_quant.

    Args:
        tensors: mapping name -> numpy or jax array (e.g. one safetensors file's contents).
        quantization_config: the "quantization_config" dict of the model's config.json.
        prefix: the linear layer's name, e.g. "model.layers.3.mlp.experts.7.up_proj".

    Returns:
        QuantizedExperts of shape [1, N, K].

    Raises:
        ValueError: naming the missing tensors or the unsupported key and value.
    """
    method = quantization_config.get("quant_method")
    if method not in _LOADERS:
        raise ValueError(
            f"layer {prefix!r}: quant_method={method!r} is not supported (supported: "
            f"{', '.join(map(repr, _LOADERS))})"
        )
    return _LOADERS[method](tensors, quantization_config, prefix)


def activation_quant_from_config(
    quantization_config: Mapping[str, Any], prefix: str
) -> ActivationQuant | None:
    """The activation quantization (W8A8) a checkpoint's config asks for at one layer.

    compressed-tensors' input_activations of the config group covering `prefix`:
      - absent / null: None (weight-only: 16-bit activations).
      - int, 8 bits, symmetric, strategy "token", dynamic true: ActivationQuant("int8_per_token").
      - int, 8 bits, symmetric, strategy "tensor", dynamic false: ActivationQuant("int8_static")
        without scales: the scales are tensors ({prefix}.input_scale); set them with
        `static_input_scale`, e.g. dataclasses.replace(aq, gemm1_scale=static_input_scale(
        tensors, gate_and_up_prefixes), gemm2_scale=static_input_scale(tensors, down_prefixes)).
    AWQ and GPTQ are weight-only: None.

    Args:
        quantization_config: the "quantization_config" dict of the model's config.json.
        prefix: a linear layer's name, e.g. "model.layers.3.mlp.experts.7.up_proj".

    Returns:
        None or an ActivationQuant for fused_moe's activation_quant.

    Raises:
        ValueError: an unknown quant_method, or input_activations that fused_moe cannot run
            (naming the key and value: e.g. asymmetric, float, 4-bit, dynamic per-tensor).
    """
    method = quantization_config.get("quant_method")
    if method in ("awq", "gptq"):
        return None
    if method != "compressed-tensors":
        raise ValueError(
            f"layer {prefix!r}: quant_method={method!r} is not supported (supported: "
            f"{', '.join(map(repr, _LOADERS))})"
        )
    what = f"compressed-tensors layer {prefix!r}"
    acts = _ct_scheme(quantization_config, prefix, what).get("input_activations")
    if not acts:
        return None
    facts = {
        "type": acts.get("type", "int"),
        "num_bits": acts.get("num_bits"),
        "symmetric": acts.get("symmetric", True),
    }
    want = {"type": "int", "num_bits": 8, "symmetric": True}
    for key, value in facts.items():
        if value != want[key]:
            raise ValueError(
                f"{what}: input_activations {key}={value!r} is not supported (int8 activations "
                f"need type='int', num_bits=8, symmetric=true)"
            )
    strategy, dynamic = acts.get("strategy", "tensor"), acts.get("dynamic", False)
    if strategy == "token" and dynamic is True:
        return ActivationQuant(scheme="int8_per_token")
    if strategy == "tensor" and dynamic is False:
        return ActivationQuant(scheme="int8_static")
    raise ValueError(
        f"{what}: input_activations strategy={strategy!r} with dynamic={dynamic!r} is not "
        f"supported (supported: strategy='token' with dynamic=true, strategy='tensor' with "
        f"dynamic=false)"
    )


def static_input_scale(tensors: Mapping[str, Any], prefixes: Sequence[str]) -> float:
    """The static activation scale shared by several layers: max of their input_scale tensors.

    One GEMM of fused_moe reads one scale for every expert, so the largest of the experts'
    (and, for GEMM1, gate's and up's) scales is used, as vLLM does: no activation clips.

    Args:
        tensors: mapping name -> array holding {prefix}.input_scale for each prefix.
        prefixes: the layers, e.g. every expert's gate_proj and up_proj for gemm1_scale.

    Returns:
        A positive float.

    Raises:
        ValueError: naming missing tensors, or a scale that is not one positive finite value.
    """
    what = "static_input_scale"
    if not prefixes:
        raise ValueError(f"{what}: needs at least one layer prefix")
    names = [f"{p}.input_scale" for p in prefixes]
    missing = [name for name in names if name not in tensors]
    if missing:
        raise ValueError(f"{what}: missing tensors {missing[:8]} ({len(missing)} in all)")
    values = []
    for name in names:
        a = np.asarray(tensors[name], dtype=np.float32)
        if a.size != 1 or not np.isfinite(a).all() or float(a.reshape(())) <= 0:
            raise ValueError(
                f"{what}: {name} must be one positive finite value (per-tensor), got shape "
                f"{a.shape} values {a.ravel()[:4].tolist()}"
            )
        values.append(float(a.reshape(())))
    return max(values)


# --- stacking ----------------------------------------------------------------------------


def stack(layers: Sequence[QuantizedExperts]) -> QuantizedExperts:
    """Concatenates per-expert layers along E (E = len(layers) for E=1 layers).

    Args:
        layers: QuantizedExperts with equal bits, group_size, N, K, scale dtype and zeros
            presence.

    Returns:
        QuantizedExperts of shape [sum of E, N, K].

    Raises:
        ValueError: if layers is empty, or naming the first index whose settings differ.
    """
    if len(layers) == 0:
        raise ValueError("stack: needs at least one layer")
    for i, layer in enumerate(layers):
        if not isinstance(layer, QuantizedExperts):
            raise ValueError(
                f"stack: layers[{i}] is a {type(layer).__name__}, not a QuantizedExperts"
            )
        layer.validate(f"stack: layers[{i}]")
    ref = layers[0]

    def facts(qw):
        return {
            "bits": qw.bits,
            "group_size": qw.group_size,
            "(N, K)": qw.shape[1:],
            "has_zeros": qw.has_zeros,
            "scales dtype": qw.scales.dtype,
        }

    want = facts(ref)
    for i, layer in enumerate(layers[1:], start=1):
        for key, value in facts(layer).items():
            if value != want[key]:
                raise ValueError(
                    f"stack: layers[{i}] has {key}={value}, layers[0] has {key}={want[key]}"
                )
    zeros = None
    if ref.has_zeros:
        zeros = jnp.concatenate([layer.zeros for layer in layers], axis=0)
    out = QuantizedExperts(
        qweight=jnp.concatenate([layer.qweight for layer in layers], axis=0),
        scales=jnp.concatenate([layer.scales for layer in layers], axis=0),
        zeros=zeros,
        bits=ref.bits,
        group_size=ref.group_size,
    )
    out.validate("stack")
    return out
