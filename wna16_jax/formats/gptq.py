"""GPTQ checkpoints (v1 and v2 zero points, act-order) <-> QuantizedExperts."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from wna16_jax._quant import pack, pack_zeros, unpack, unpack_zeros, zero_points
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

    Act-order (desc_act): a g_idx other than arange(K) // G puts each group's inputs at
    scattered k. The weights are then stored with K sorted by group (perm =
    `gptq_act_order_permutation(g_idx)`, a group's inputs contiguous) and carry that order as
    their input permutation, `perm` [1, K]: x @ W.T == x[..., perm] @ W_stored.T, which
    fused_moe (w13) and the quantized linear apply to the activations, and
    dequantize_experts gives W in the checkpoint's order. The g_idx decides, not the flag: a
    desc_act checkpoint whose g_idx is trivial (e.g. GPTQModel's static_groups) loads with
    perm None.

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
        QuantizedExperts of shape [1, N, K] (perm [1, K] int32 for act-order, else None).

    Raises:
        ValueError: on unsupported bits/format, mismatched shapes or dtypes, desc_act without
            g_idx, or a g_idx whose groups do not each have G inputs.
    """
    what = "from_gptq"
    qweight, scales, z, g_idx, group_size, bits = _gptq_parts(
        qweight, qzeros, scales, g_idx, bits, group_size, sym, checkpoint_format, what
    )
    k = qweight.shape[1] * (32 // bits)
    if desc_act and g_idx is None:
        raise ValueError(f"{what}: desc_act=True needs g_idx to know each input's group")
    if trivial_g_idx(g_idx, k, group_size):
        return build(qweight, scales, z, bits, group_size, what)
    perm = _act_order_permutation(g_idx, group_size, what)
    q = unpack(qweight, bits, axis=1)[:, perm]  # [N, K], K sorted by group
    return build(pack(q, bits, axis=1), scales, z, bits, group_size, what, perm=perm)


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
    return _act_order_permutation(g_idx, group_size, "gptq_act_order_permutation")


def _act_order_permutation(g_idx: Any, group_size: Any, what: str) -> np.ndarray:
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


def fold_w2_act_order(
    w13: QuantizedExperts, w2: QuantizedExperts
) -> tuple[QuantizedExperts, QuantizedExperts]:
    """Moves w2's input permutation (act-order down projections) into w13's output rows.

    w2's inputs are silu(gate) * up, elementwise in I, so ordering expert e's gate rows and up
    rows alike by w2.perm[e] gives w2 its inputs in its own order: the layer computes the same
    function with w2.perm None, as fused_moe needs (it applies w13's permutation only). w13's
    own input permutation is kept. Done once, at load.

    Args:
        w13: canonical QuantizedExperts [E, 2I, H], rows [gate; up].
        w2: canonical QuantizedExperts [E, H, I], with or without perm.

    Returns:
        (w13 with rows [gate[perm]; up[perm]] per expert, w2 without perm); the inputs
        unchanged when w2 has none.

    Raises:
        ValueError: a kernel layout, or shapes that are not an expert pair (values quoted).
    """
    what = "fold_w2_act_order"
    if w2.perm is None:
        return w13, w2
    for name, w in (("w13", w13), ("w2", w2)):
        w.validate(f"{what}: {name}")
        if w.layout != "canonical":
            raise ValueError(
                f"{what}: {name} is in the {w.layout!r} layout; fold the canonical weights "
                f"(wna16_jax.layouts.to_canonical_layout), then convert"
            )
    e, two_i, _ = w13.shape
    if w2.shape[0] != e or w2.k * 2 != two_i:
        raise ValueError(
            f"{what}: w13 {w13.shape} and w2 {w2.shape} are not [E, 2I, H] and [E, H, I]"
        )
    host = all(isinstance(a, np.ndarray) for a in (*jax.tree.leaves(w13), w2.perm))
    xp = np if host else jnp  # host (numpy) weights stay on the host
    p = xp.asarray(w2.perm)  # [E, I]
    rows = xp.concatenate([p, p + two_i // 2], axis=1)[:, :, None]  # [E, 2I, 1]
    take = lambda a: xp.take_along_axis(a, rows, axis=1)
    zeros = w13.zeros
    if zeros is not None:  # int4 packs two rows per byte: reorder the unpacked zero points
        zeros = pack_zeros(take(unpack_zeros(zeros, w13.bits)), w13.bits)
    w13 = dataclasses.replace(w13, qweight=take(w13.qweight), scales=take(w13.scales), zeros=zeros)
    return w13, dataclasses.replace(w2, perm=None)


def to_gptq(qw: QuantizedExperts, *, checkpoint_format: str = "gptq") -> dict[str, np.ndarray]:
    """QuantizedExperts (E=1) -> GPTQ checkpoint tensors; weights with an input permutation
    (perm) are written as act-order (K in the activations' order, each input's group in g_idx).

    Symmetric weights (zeros=None) get the implicit zero points written out, as GPTQ does.

    Args:
        qw: [1, N, K], bits 4 or 8.
        checkpoint_format: "gptq" (v1: stores (zero - 1) & (2**bits - 1)) or "gptq_v2".

    Returns:
        {"qweight": int32 [K*bits/32, N], "qzeros": int32 [K/G, N*bits/32],
        "scales": [K/G, N] (qw's scale dtype), "g_idx": int32 [K]} (numpy); g_idx is
        arange(K) // G without perm, else g_idx[perm[j]] = j // G.

    Raises:
        ValueError: if E != 1, N is not a multiple of 32/bits, or the format is unknown.
    """
    what = "to_gptq"
    check_single(qw, what, act_order=True)
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
    words = np.asarray(qw.qweight[0])  # [N, K*bits/32], the stored K order
    g_idx = (np.arange(k) // qw.group).astype(np.int32)
    if qw.perm is not None:  # stored input j is input perm[j]
        perm = np.asarray(qw.perm[0])
        q = np.empty((n, k), np.uint8)
        q[:, perm] = unpack(words, bits, axis=1)
        words = pack(q, bits, axis=1)
        g_idx[perm] = g_idx.copy()
    return {
        "qweight": np.ascontiguousarray(words.T).view(np.int32),
        "qzeros": pack(z.T, bits, axis=1).view(np.int32),
        "scales": np.ascontiguousarray(np.asarray(qw.scales[0]).T),
        "g_idx": g_idx,
    }
