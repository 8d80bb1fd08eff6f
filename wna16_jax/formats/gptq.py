"""GPTQ checkpoints (v1 and v2 zero points, act-order) <-> QuantizedExperts."""

from __future__ import annotations

from typing import Any

import numpy as np

from wna16_jax._quant import pack, unpack, zero_points
from wna16_jax._types import QuantizedExperts
from wna16_jax.formats._common import (
    GPTQ_FORMATS,
    as_int,
    build,
    check_bits,
    check_single,
    checked_scales,
    expect_shape,
    maybe_drop_zeros,
    num_groups,
    packed_words,
    trivial_g_idx,
)


def _gptq_parts(qweight, qzeros, scales, g_idx, bits, group_size, sym, checkpoint_format, what):
    """Checks GPTQ tensors and decodes the zero points.

    Returns (qweight uint32 [N, K*b/32] canonical, scales [N, G], zeros uint8 [N, G] or None,
    g_idx [K] or None, group_size, bits).
    """
    bits = check_bits(bits, what)
    group_size = as_int(group_size, "group_size", what)
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(
            f"{what}: checkpoint_format={checkpoint_format!r} is not supported "
            f"(supported: 'gptq' (v1, zero - 1 stored), 'gptq_v2')"
        )
    per_word = 32 // bits
    qweight = packed_words(qweight, "qweight", what)
    qzeros = packed_words(qzeros, "qzeros", what)
    scales = checked_scales(scales, "scales", what)
    k, n = qweight.shape[0] * per_word, qweight.shape[1]
    if n % per_word:
        raise ValueError(f"{what}: N={n} is not a multiple of {per_word} (bits={bits})")
    g = num_groups(k, group_size, what)
    why = f"K={k}, N={n}, bits={bits}, group_size={group_size}"
    expect_shape(qzeros, (g, n // per_word), "qzeros", what, why)
    expect_shape(scales, (g, n), "scales", what, why)
    if g_idx is not None:
        g_idx = np.asarray(g_idx)
        if g_idx.shape != (k,) or not np.issubdtype(g_idx.dtype, np.integer):
            raise ValueError(
                f"{what}: g_idx must be an integer [K] = ({k},) array, got shape "
                f"{g_idx.shape} dtype {g_idx.dtype}"
            )
    stored = unpack(qzeros, bits, axis=1).astype(np.uint16)  # [G, N]
    z = (stored + 1) & ((1 << bits) - 1) if checkpoint_format == "gptq" else stored
    z = maybe_drop_zeros(z.T.astype(np.uint8), bits, bool(sym))
    # GPTQ packs 32/b values of K per word, low bits first: the transpose is the canonical words.
    return np.ascontiguousarray(qweight.T), scales.T, z, g_idx, group_size, bits


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
    if not trivial_g_idx(g_idx, k, group_size):
        raise ValueError(
            f"{what}: act-order (desc_act) GPTQ with a non-trivial g_idx is not supported: the "
            f"canonical layout needs each group's {group_size} input features to be contiguous "
            f"in K (g_idx[:8]={g_idx[:8].tolist()}, expected arange(K) // {group_size}). Use "
            f"from_gptq_act_order, which loads the weights on a permuted K and returns the "
            f"permutation to apply to the activations"
        )
    return build(qweight, scales, z, bits, group_size, what)


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
    group_size = as_int(group_size, "group_size", what)
    g = num_groups(k, group_size, what)
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
    q = unpack(qweight, bits, axis=1)[:, perm]  # [N, K], permuted K
    return build(pack(q, bits, axis=1), scales, z, bits, group_size, what), perm


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
    check_single(qw, what)
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(
            f"{what}: checkpoint_format={checkpoint_format!r} is not supported "
            f"(supported: {GPTQ_FORMATS})"
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
        "qzeros": pack(z.T, bits, axis=1).view(np.int32),
        "scales": np.ascontiguousarray(np.asarray(qw.scales[0]).T),
        "g_idx": (np.arange(k) // qw.group).astype(np.int32),
    }
