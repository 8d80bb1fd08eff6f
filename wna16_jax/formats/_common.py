"""Argument checks and the QuantizedExperts builder shared by the checkpoint formats."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from wna16_jax._quant import implicit_zero, pack_zeros
from wna16_jax._types import SUPPORTED_BITS, QuantizedExperts

SCALE_DTYPES = (np.dtype(np.float16), np.dtype(jnp.bfloat16), np.dtype(np.float32))
GPTQ_FORMATS = ("gptq", "gptq_v2")
CT_STRATEGIES = ("group", "channel")
# int-quantized weights may also carry one scale for the whole tensor.
CT_INT_STRATEGIES = (*CT_STRATEGIES, "tensor")


# --- argument checks ---------------------------------------------------------------------


def check_bits(bits: Any, what: str) -> int:
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ValueError(f"{what}: bits={bits!r} is not supported (supported: 4, 8)")
    return int(bits)


def as_int(value: Any, name: str, what: str) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what}: {name}={value!r} must be an int") from None


def num_groups(k: int, group_size: int, what: str) -> int:
    """Groups along K; group_size = -1 means one group spanning K."""
    if group_size == -1:
        return 1
    if group_size <= 0 or k % group_size:
        raise ValueError(f"{what}: K={k} is not a multiple of group_size={group_size}")
    return k // group_size


def packed_words(x: Any, name: str, what: str) -> np.ndarray:
    """A 2-D int32 (or uint32) checkpoint tensor of packed words, viewed as uint32."""
    a = np.asarray(x)
    if a.ndim != 2:
        raise ValueError(f"{what}: {name} must be 2-D, got shape {a.shape}")
    if a.dtype not in (np.int32, np.uint32):
        raise ValueError(f"{what}: {name} must be int32 packed words, got dtype {a.dtype}")
    return a.view(np.uint32)


def checked_scales(x: Any, name: str, what: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 2:
        raise ValueError(f"{what}: {name} must be 2-D, got shape {a.shape}")
    if a.dtype not in SCALE_DTYPES:
        raise ValueError(
            f"{what}: {name} dtype must be float16, bfloat16 or float32, got {a.dtype}"
        )
    return a


def expect_shape(a: np.ndarray, want: tuple[int, ...], name: str, what: str, why: str) -> None:
    if tuple(a.shape) != want:
        raise ValueError(f"{what}: {name} shape {tuple(a.shape)} != expected {want} ({why})")


def trivial_g_idx(g_idx: np.ndarray | None, k: int, group_size: int) -> bool:
    if g_idx is None:
        return True
    g = k if group_size == -1 else group_size
    return bool(np.array_equal(g_idx, np.arange(k) // g))


def check_single(qw: QuantizedExperts, what: str, *, act_order: bool = False) -> None:
    """qw is one linear layer [1, N, K]; with an input permutation only where the format
    stores act-order (act_order: GPTQ)."""
    if not isinstance(qw, QuantizedExperts):
        raise ValueError(f"{what}: expected a QuantizedExperts, got {type(qw).__name__}")
    qw.validate(what)
    if qw.num_experts != 1:
        raise ValueError(
            f"{what}: a checkpoint holds one linear layer; got E={qw.num_experts} "
            f"(take one expert with qw.slice(e, e + 1, axis=0))"
        )
    if qw.has_perm and not act_order:
        raise ValueError(
            f"{what}: the weights have an input permutation (GPTQ act-order), which this "
            f"format cannot store; write them as GPTQ (to_gptq)"
        )


# --- building QuantizedExperts -----------------------------------------------------------


def maybe_drop_zeros(z: np.ndarray, bits: int, sym: bool) -> np.ndarray | None:
    """Symmetric checkpoints may still store zero points: drop them only when all are implicit."""
    if sym and np.all(z == implicit_zero(bits)):
        return None
    return z


def build(
    qweight: np.ndarray,
    scales: np.ndarray,
    zeros: np.ndarray | None,
    bits: int,
    group_size: int,
    what: str,
    *,
    perm: np.ndarray | None = None,
) -> QuantizedExperts:
    """Canonical QuantizedExperts (E=1) from qweight uint32 [N, K*b/32], scales/zeros [N, G]
    and the input permutation perm int32 [K] or None."""
    if zeros is not None:
        if bits == 4 and zeros.shape[0] % 2:
            raise ValueError(f"{what}: int4 zero points need an even N, got N={zeros.shape[0]}")
        zeros = jnp.asarray(pack_zeros(zeros[None].astype(np.uint8), bits))  # [1, N//2 or N, G]
    qw = QuantizedExperts(
        qweight=jnp.asarray(np.ascontiguousarray(qweight)[None]),
        scales=jnp.asarray(np.ascontiguousarray(scales)[None]),
        zeros=zeros,
        bits=bits,
        group_size=group_size,
        perm=None if perm is None else jnp.asarray(perm[None].astype(np.int32)),
    )
    qw.validate(what)
    return qw


def stack(layers: Sequence[QuantizedExperts]) -> QuantizedExperts:
    """Concatenates per-expert layers along E (E = len(layers) for E=1 layers):
    `QuantizedExperts.concatenate(layers, axis=0)`.

    Args:
        layers: QuantizedExperts with equal bits, group_size, N, K, scale dtype and zeros
            presence.

    Returns:
        QuantizedExperts of shape [sum of E, N, K].

    Raises:
        ValueError: if layers is empty, or naming the first part (parts[i]) that differs.
    """
    return QuantizedExperts.concatenate(layers, axis=0)
