"""Typed containers: QuantizedExperts (packed weights), AlignedRouting, BlockConfig."""

from __future__ import annotations

import dataclasses
import json
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_BITS = (4, 8)
# QuantizedExperts.codes values: "int" (unsigned integer codes q with a zero point, w = (q - z) *
# scale) and "e2m1" (MXFP4: OCP Microscaling FP4 codes, w = e2m1(q) * 2^(scale - 127)).
CODES = ("int", "e2m1")
# The one MXFP4 scheme: 4-bit E2M1 codes, one E8M0 scale per 32 inputs, no zero points.
MXFP4_GROUP = 32
# E8M0 scale bytes: 2^(byte - E8M0_BIAS); the byte 0xFF is NaN.
E8M0_BIAS = 127


def kernel_layout(layout: str):
    """The registered LayoutConversion of kernel layout `layout` (its shape and checks), from
    the backend registry, which installs itself here on import (wna16_jax._dispatch: the
    registry imports this module, not the other way).

    Raises:
        ValueError: `layout` is not a registered kernel layout.
    """
    return _registry_layout(layout)


def _no_registry(layout: str):
    raise ValueError(f"layout={layout!r}: no backend registry is loaded (import wna16_jax)")


# Replaced by wna16_jax._dispatch.layout_conversion when the registry is imported.
_registry_layout = _no_registry
# docs/design.md's 2^31 rule: Pallas' Triton lowering indexes in int32.
MAX_ARRAY_ELEMENTS = 2**31 - 1
# BlockConfig.unpack values.
UNPACK_MODES = ("slices", "tile", "join")
# BlockConfig.dot values.
DOT_MODES = ("mma", "fma")


@dataclasses.dataclass(frozen=True)
class QuantizedExperts:
    """Weight-only quantized expert weights, in the canonical layout (docs/design.md) unless
    `layout` names a kernel's private one.

    Logical weight shape [E, N, K] (N output features, K input features).

    Attributes (layout "canonical"):
        qweight: uint32 [E, N, K//8] for int4 (k = 8j+i in bits 4i..4i+3 of word j) or
            uint32 [E, N, K//4] for int8 (k = 4j+i in byte i of word j).
        scales: [E, N, K//G] float (the activation dtype), G = group size; uint8 E8M0 for
            codes "e2m1".
        zeros: uint8 [E, N//2, K//G] for int4 (even n in the low nibble), uint8 [E, N, K//G]
            for int8, or None for symmetric weights (implicit zero 8 or 128).
        bits: 4 or 8 (static).
        group_size: G, or -1 for one group spanning K (static).
        layout: "canonical" (static).
        codes: what a stored value means (static). "int" (default): an unsigned integer q,
            w = (q - z) * scale. "e2m1": MXFP4 (OCP Microscaling FP4): bits=4, group_size=32,
            zeros=None, qweight packed as for int4 with each nibble an E2M1 code (bit 3 the
            sign, bits 2..1 the exponent, bit 0 the mantissa: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and
            their negatives, code 8 being -0), scales uint8 [E, N, K//32] E8M0 bytes X
            meaning 2^(X - 127) (X = 255 is NaN); w = e2m1(q) * 2^(X - 127).
        perm: int32 [E, K], or None: each expert's input order (GPTQ act-order). The packed
            arrays hold expert e's weight with its inputs in the order perm[e] (each group's
            inputs contiguous), so that its product is x[..., perm[e]] @ W_stored[e].T, and
            its weight in x's order W[e, :, perm[e, j]] = W_stored[e, :, j]. None: K in x's
            order. Any layout (it orders the inputs, not the packed words).
    A kernel layout (another `layout`: wna16_jax.layouts.LAYOUTS) is its backend's; the
    backend registers its shapes, checks and conversions (`Backend.layout_conversion`) and
    describes its arrays beside them (MXFP4 takes 'mgpu_int4': pallas_kernels/mgpu/layout.py).
    """

    qweight: Any
    scales: Any
    zeros: Any
    bits: int = 4
    group_size: int = 128
    layout: str = "canonical"
    perm: Any = None
    codes: str = "int"

    # --- static shape facts -------------------------------------------------------------
    @property
    def pack_factor(self) -> int:
        """Quantized values per uint32 word."""
        return 32 // self.bits

    @property
    def shape(self) -> tuple[int, int, int]:
        """Logical [E, N, K]."""
        if self.layout != "canonical":  # the kernel layout's backend knows its arrays
            return kernel_layout(self.layout).shape(self)
        e, n, kw = self.qweight.shape
        return (e, n, kw * self.pack_factor)

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    @property
    def n(self) -> int:
        return self.shape[1]

    @property
    def k(self) -> int:
        return self.shape[2]

    @property
    def group(self) -> int:
        """The effective group size (K when group_size == -1)."""
        return self.k if self.group_size == -1 else self.group_size

    @property
    def num_groups(self) -> int:
        return self.k // self.group

    @property
    def has_zeros(self) -> bool:
        return self.zeros is not None

    @property
    def has_perm(self) -> bool:
        return self.perm is not None

    @property
    def is_mxfp4(self) -> bool:
        """E2M1 codes with E8M0 scales (codes "e2m1")."""
        return self.codes == "e2m1"

    @property
    def dtype(self):
        """The scales' (activation) dtype; uint8 for MXFP4 (E8M0 bytes)."""
        return self.scales.dtype

    def validate(self, name: str = "weights") -> None:
        """Raises ValueError naming the offending values if the arrays do not have the layout's
        shapes and dtypes."""
        if self.codes not in CODES:
            raise ValueError(f"{name}: codes={self.codes!r} is not one of {CODES}")
        if self.is_mxfp4:
            self._validate_mxfp4_scheme(name)
        if self.layout != "canonical":
            try:
                layout = kernel_layout(self.layout)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
            layout.validate(self, name)
        else:
            self._validate_canonical(name)
        self._validate_perm(name)

    def _validate_canonical(self, name: str) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"{name}: bits={self.bits} is not supported (supported: 4, 8)")
        if self.qweight.ndim != 3:
            raise ValueError(
                f"{name}: qweight must be [E, N, K//{self.pack_factor}], got shape "
                f"{tuple(self.qweight.shape)}"
            )
        if self.qweight.dtype != jnp.uint32:
            raise ValueError(f"{name}: qweight dtype must be uint32, got {self.qweight.dtype}")
        e, n, k = self.shape
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"{name}: group_size={self.group_size} must be positive or -1")
        if self.group_size != -1 and k % self.group_size:
            raise ValueError(f"{name}: K={k} is not a multiple of group_size={self.group_size}")
        g = self.num_groups
        if tuple(self.scales.shape) != (e, n, g):
            raise ValueError(
                f"{name}: scales shape {tuple(self.scales.shape)} != expected {(e, n, g)} "
                f"(E={e}, N={n}, K={k}, group_size={self.group_size})"
            )
        if self.is_mxfp4 and self.scales.dtype != jnp.uint8:
            raise ValueError(f"{name}: MXFP4 scales must be uint8 E8M0, got {self.scales.dtype}")
        if not self.is_mxfp4 and not jnp.issubdtype(self.scales.dtype, jnp.floating):
            raise ValueError(f"{name}: scales must be floating point, got {self.scales.dtype}")
        if self.zeros is not None:
            if self.bits == 4 and n % 2:
                raise ValueError(f"{name}: int4 zero points need an even N, got N={n}")
            want = (e, n // 2, g) if self.bits == 4 else (e, n, g)
            if tuple(self.zeros.shape) != want:
                raise ValueError(
                    f"{name}: zeros shape {tuple(self.zeros.shape)} != expected {want} "
                    f"for bits={self.bits}"
                )
            if self.zeros.dtype != jnp.uint8:
                raise ValueError(f"{name}: zeros dtype must be uint8, got {self.zeros.dtype}")
        for field in ("qweight", "scales", "zeros"):
            arr = getattr(self, field)
            if arr is not None and int(np.prod(arr.shape)) > MAX_ARRAY_ELEMENTS:
                raise ValueError(
                    f"{name}: {field} has {int(np.prod(arr.shape))} elements, over the 2^31 "
                    f"limit of int32 kernel indexing; shard the experts (expert parallelism) "
                    f"so each device holds fewer"
                )

    def _validate_mxfp4_scheme(self, name: str) -> None:
        """codes "e2m1" is MXFP4 only: 4 bits, groups of 32, no zero points (a kernel layout
        that holds it checks its own arrays)."""
        want = dict(bits=4, group_size=MXFP4_GROUP, zeros=None)
        have = dict(
            bits=self.bits,
            group_size=self.group_size,
            zeros=None if self.zeros is None else "an array",
        )
        for field, value in want.items():
            if have[field] != value:
                raise ValueError(
                    f"{name}: codes='e2m1' (MXFP4) needs {field}={value!r}, got "
                    f"{have[field]!r} (MXFP4 is E2M1 codes with one E8M0 scale per 32 inputs)"
                )

    def _validate_perm(self, name: str) -> None:
        """perm is int32 [E, K]; held on the host (numpy), each row is a permutation of
        range(K) (device arrays are not read back: no host sync)."""
        p = self.perm
        if p is None:
            return
        e, _, k = self.shape
        if tuple(p.shape) != (e, k) or p.dtype != jnp.int32:
            raise ValueError(
                f"{name}: perm must be int32 [E, K] = {(e, k)}, got {p.dtype} {tuple(p.shape)}"
            )
        if isinstance(p, np.ndarray):
            bad = np.flatnonzero(~(np.sort(p, axis=1) == np.arange(k)).all(axis=1))
            if bad.size:
                raise ValueError(
                    f"{name}: perm[{bad[0]}] is not a permutation of range(K={k}) "
                    f"({bad.size} of {e} rows are not; perm[{bad[0]}][:8]={p[bad[0], :8].tolist()})"
                )

    # --- whole-array operations (no caller repacks by hand) ------------------------------
    @classmethod
    def concatenate(cls, parts, *, axis: int) -> QuantizedExperts:
        """Joins canonical QuantizedExperts along the experts E (axis=0) or the output
        features N (axis=1), e.g. per-expert layers into one [E, N, K], or gate rows then up
        rows into w13.

        Args:
            parts: a non-empty sequence of QuantizedExperts in the canonical layout with equal
                bits, group_size, zero-point presence and scales dtype, and equal sizes along
                the other two logical dims. Input permutations (perm; None is the identity)
                join along E; joined along N they must be equal (an expert's rows share its
                input order), compared on the host (outside jit; device arrays are read back).
            axis: 0 (E) or 1 (N). K cannot be joined: its words and groups are packed.

        Returns:
            QuantizedExperts [sum of E, N, K] or [E, sum of N, K], canonical.

        Raises:
            ValueError: naming the first part that does not fit and the values that differ.
        """
        what = "concatenate"
        if axis not in (0, 1):
            raise ValueError(f"{what}: axis={axis!r} must be 0 (E) or 1 (N); K is packed")
        parts = list(parts)
        if not parts:
            raise ValueError(f"{what}: needs at least one part")
        for i, part in enumerate(parts):
            if not isinstance(part, QuantizedExperts):
                raise ValueError(
                    f"{what}: parts[{i}] is a {type(part).__name__}, not a QuantizedExperts"
                )
            part._require_canonical(f"{what}: parts[{i}]")
            part.validate(f"{what}: parts[{i}]")
        kept = "(N, K)" if axis == 0 else "(E, K)"
        want = parts[0]._facts(axis)
        for i, part in enumerate(parts[1:], start=1):
            for key, value in part._facts(axis).items():
                if value != want[key]:
                    raise ValueError(
                        f"{what} along {'EN'[axis]}: parts[{i}] has {key}={value}, parts[0] has "
                        f"{key}={want[key]} (all parts need equal bits, group_size, zero points, "
                        f"scales dtype and {kept})"
                    )
        # Every part has a whole number of zero-point bytes along N (validate: int4 needs an
        # even N), so the packed arrays join as they are.
        host = all(isinstance(a, np.ndarray) for p in parts for a in jax.tree.leaves(p))
        xp = np if host else jnp  # host (numpy) weights stay on the host
        join = lambda field: xp.concatenate([getattr(p, field) for p in parts], axis=axis)
        ref = parts[0]
        perm = None
        if any(p.has_perm for p in parts):
            identity = xp.arange(ref.k, dtype=np.int32)
            orders = [
                p.perm if p.has_perm else xp.broadcast_to(identity, (p.num_experts, ref.k))
                for p in parts
            ]  # [E_i, K]
            perm = xp.concatenate(orders, axis=0) if axis == 0 else orders[0]
            for i, order in enumerate(orders[1:] if axis == 1 else (), start=1):
                if not _same_values(order, perm, f"{what} along N: parts[{i}].perm"):
                    raise ValueError(
                        f"{what} along N: parts[{i}] has another input permutation (perm) than "
                        f"parts[0]: rows joined along N share their expert's input order"
                    )
        out = cls(
            qweight=join("qweight"),
            scales=join("scales"),
            zeros=join("zeros") if ref.has_zeros else None,
            bits=ref.bits,
            group_size=ref.group_size,
            perm=perm,
            codes=ref.codes,
        )
        out.validate(what)
        return out

    def slice(self, start: int, stop: int, *, axis: int) -> QuantizedExperts:
        """Experts [start, stop) (axis=0) or output features [start, stop) (axis=1).

        Canonical layout only. int4 zero points hold two rows of N per byte, so with them an N
        slice must start and stop on even rows. An input permutation follows its experts.

        Raises:
            ValueError: a kernel layout, an axis other than 0 or 1, bounds outside the dim, or
                odd N bounds with int4 zero points (the values quoted).
        """
        what = "slice"
        self._require_canonical(what)
        if axis not in (0, 1):
            raise ValueError(f"{what}: axis={axis!r} must be 0 (E) or 1 (N); K is packed")
        size, letter = self.shape[axis], "EN"[axis]
        try:
            start, stop = operator.index(start), operator.index(stop)
        except TypeError:
            raise ValueError(f"{what}: start={start!r} and stop={stop!r} must be ints") from None
        if not 0 <= start < stop <= size:
            raise ValueError(
                f"{what}: [{start}, {stop}) is not a non-empty range inside {letter}={size}"
            )
        lead = (slice(None),) * axis
        zeros = self.zeros
        if zeros is not None and axis == 1 and self.bits == 4:
            if start % 2 or stop % 2:
                raise ValueError(
                    f"{what}: rows [{start}, {stop}) of N={size} cut a byte of int4 zero points "
                    f"(two rows per byte): start and stop must be even"
                )
            zeros = zeros[:, start // 2 : stop // 2]  # [E, N//2, G]
        elif zeros is not None:
            zeros = zeros[lead + (slice(start, stop),)]
        perm = self.perm
        if perm is not None and axis == 0:
            perm = perm[start:stop]  # [E, K]
        return dataclasses.replace(
            self,
            qweight=self.qweight[lead + (slice(start, stop),)],
            scales=self.scales[lead + (slice(start, stop),)],
            zeros=zeros,
            perm=perm,
        )

    def astype(self, dtype) -> QuantizedExperts:
        """The same weights with the scales (the activation dtype) cast to `dtype`.

        Canonical zero points are integers and stay as they are; the mgpu layouts' (8 - z or
        128 - z in the scales' dtype) are small integers, exact in every float dtype, and follow
        the scales. MXFP4 weights (E8M0 scale bytes, no activation dtype) are returned as they
        are.

        Raises:
            ValueError: `dtype` is not a floating point dtype.
        """
        dtype = jnp.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"astype: scales must be floating point, got dtype {dtype}")
        if self.scales.dtype == dtype or self.is_mxfp4:
            return self
        zeros = self.zeros
        if zeros is not None and self.layout != "canonical":
            zeros = zeros.astype(dtype)
        return dataclasses.replace(self, scales=self.scales.astype(dtype), zeros=zeros)

    def _require_canonical(self, what: str) -> None:
        if self.layout != "canonical":
            raise ValueError(
                f"{what}: the weights are in the {self.layout!r} layout; concatenating and "
                f"slicing take the canonical one (wna16_jax.layouts.to_canonical_layout)"
            )

    def _facts(self, axis: int) -> dict[str, Any]:
        """What must match for a concatenation along `axis`."""
        e, n, k = self.shape
        return {
            "codes": self.codes,
            "bits": self.bits,
            "group_size": self.group_size,
            "has_zeros": self.has_zeros,
            "scales dtype": jnp.dtype(self.scales.dtype),
            "(N, K)" if axis == 0 else "(E, K)": (n, k) if axis == 0 else (e, k),
        }


def _same_values(a, b, what: str) -> bool:
    """Whether two concrete arrays hold the same values (compared on the host)."""
    if a is b:
        return True
    if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
        raise ValueError(f"{what}: traced values cannot be compared; call this outside jit")
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


jax.tree_util.register_dataclass(
    QuantizedExperts,
    data_fields=["qweight", "scales", "zeros", "perm"],
    meta_fields=["bits", "group_size", "layout", "codes"],
)

# The meta fields' values of QuantizedExperts exported before the field existed.
_META_DEFAULTS = ("canonical", "int")  # layout, codes


def _deserialize_auxdata(data: bytes) -> tuple:
    aux = tuple(json.loads(data))
    return (*aux, *_META_DEFAULTS[len(aux) - 2 :])  # (bits, group_size, ...) of older exports


# So that jax.export can serialize functions taking or returning QuantizedExperts.
jax.export.register_pytree_node_serialization(
    QuantizedExperts,
    serialized_name="wna16_jax.QuantizedExperts",
    serialize_auxdata=lambda aux: json.dumps(list(aux)).encode(),
    deserialize_auxdata=_deserialize_auxdata,
)


@dataclasses.dataclass(frozen=True)
class AlignedRouting:
    """Block-aligned token order produced by `moe_align_block_size` (docs/design.md).

    Attributes:
        sorted_token_ids: int32 [max_padded]; flat indices t*k + j into topk_ids, grouped into
            one run per expert padded to a multiple of block_m; padding holds T*k.
        expert_ids: int32 [max_padded // block_m]; the local expert of each block, -1 for
            blocks of off-shard experts and for blocks past the end.
        num_tokens_post_padded: int32 [] ; the used length of sorted_token_ids.
        block_m: rows per block (static).
    """

    sorted_token_ids: Any
    expert_ids: Any
    num_tokens_post_padded: Any
    block_m: int


jax.tree_util.register_dataclass(
    AlignedRouting,
    data_fields=["sorted_token_ids", "expert_ids", "num_tokens_post_padded"],
    meta_fields=["block_m"],
)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Tile sizes of the grouped GEMM kernels (frozen, hashable: usable as a static arg).

    block_m: rows (token slots) per block; also the align padding.
    block_n: output features per program.  block_k: input features per k-step.
    split_k: programs sharing one output tile along K (atomic f32 accumulation when > 1).
    group_m: row-block grouping for L2 reuse.  num_warps / num_stages: Triton settings.
    unpack: how a k-tile of packed weights meets the tensor cores: "slices" (each word loaded
        once; one dot per value position, contracting block_k // values-per-word features),
        "tile" (words loaded once per value and shifted in place; one dot contracting block_k)
        or "join" (each word loaded and converted once, the value slices joined back into
        feature order; one dot per group in the tile, on the exact 16-bit path; elsewhere it
        runs as "tile").
    dot: how a k-tile's products are summed: "mma" (tensor-core dots; block_m, block_n >= 16)
        or "fma" (dequantize-multiply-reduce in f32 on the CUDA cores, for very few rows per
        expert: block_m may be 1, 2, 4 or 8 where a 16-row tensor-core tile would waste most of
        its work).
    """

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 2
    unpack: str = "slices"
    dot: str = "mma"

    def __post_init__(self):
        if self.unpack not in UNPACK_MODES:
            raise ValueError(f"BlockConfig.unpack={self.unpack!r} is not one of {UNPACK_MODES}")
        if self.dot not in DOT_MODES:
            raise ValueError(f"BlockConfig.dot={self.dot!r} is not one of {DOT_MODES}")
        for f in dataclasses.fields(self):
            if f.name in ("unpack", "dot"):
                continue
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"BlockConfig.{f.name}={v!r} must be a positive int")
        for f in ("block_m", "block_n", "block_k"):
            v = getattr(self, f)
            if v & (v - 1):
                raise ValueError(f"BlockConfig.{f}={v} must be a power of two")


# ActivationQuant.scheme values.
ACTIVATION_QUANT_SCHEMES = ("int8_per_token", "int8_static")


@dataclasses.dataclass(frozen=True)
class ActivationQuant:
    """How fused_moe quantizes the activations entering its two GEMMs (W8A8); frozen, hashable.

    A static argument: each distinct value (e.g. another static scale) compiles anew.

    Both GEMM inputs (x before GEMM1, silu(gate) * up before GEMM2) become symmetric int8 with
    one f32 scale per row; the GEMMs multiply int8 x int8 into int32 and apply the activation
    and weight scales in their epilogue.

    Attributes:
        scheme: "int8_per_token" (dynamic: scale_t = max|x_t| * (1/127) per token, computed on
            the fly) or "int8_static" (the given per-tensor scales below). Either way
            q = clip(round(x * (1/scale)), -127, 127) in f32, round half to even.
        gemm1_scale: the static scale of GEMM1's input x ("int8_static" only).
        gemm2_scale: the static scale of GEMM2's input ("int8_static" only).
            `formats.activation_quant_from_config` returns "int8_static" without scales; fill
            them (e.g. from the checkpoint's input_scale tensors) before calling fused_moe.
    """

    scheme: str = "int8_per_token"
    gemm1_scale: float | None = None
    gemm2_scale: float | None = None

    def __post_init__(self):
        if self.scheme not in ACTIVATION_QUANT_SCHEMES:
            raise ValueError(
                f"ActivationQuant.scheme={self.scheme!r} is not one of {ACTIVATION_QUANT_SCHEMES}"
            )
        for f in ("gemm1_scale", "gemm2_scale"):
            v = getattr(self, f)
            if v is None:
                continue
            if self.scheme != "int8_static":
                raise ValueError(
                    f"ActivationQuant.{f}={v!r}: static scales belong to scheme='int8_static', "
                    f"not {self.scheme!r}"
                )
            try:
                fv = float(v)  # numpy / 0-d array scalars become hashable Python floats
            except (TypeError, ValueError):
                raise ValueError(f"ActivationQuant.{f}={v!r} must be a positive float") from None
            if not (np.isfinite(fv) and fv > 0):
                raise ValueError(f"ActivationQuant.{f}={v!r} must be a positive finite float")
            object.__setattr__(self, f, fv)

    @property
    def has_scales(self) -> bool:
        """Whether every scale the scheme needs is known."""
        if self.scheme == "int8_static":
            return self.gemm1_scale is not None and self.gemm2_scale is not None
        return True
