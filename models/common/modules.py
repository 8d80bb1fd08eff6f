"""The layers every model family shares, in Flax NNX: float and WNA16 quantized linears (on
`wna16_jax.linear`), linears fused into one GEMM, RMSNorm, the embedding, the gated MLP and the
routed experts (on `wna16_jax.fused_moe`, float ones on jax.lax.ragged_dot).

Modules take a family's frozen config `cfg` and read only what every family's config holds:
`dtype` (activations, float weights, quantization scales), `quant` (a QuantSpec or None),
`quantizes(target)`, `hidden_size`, `vocab_size`, `n_routed_experts` and
`moe_intermediate_size` (routed experts). Layouts and kernels are chosen by the backend
registry (`wna16_jax.linear.preferred_layout`, `wna16_jax.preferred_layout`), never by name.
Letters in shapes: T tokens, k top-k, E experts, H hidden, I intermediate, N/K a GEMM's
output/input.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

import wna16_jax as wj
from models.common.config import QuantSpec

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


class QuantParam(nnx.Variable):
    """Packed quantized weight data (qweight / scales / zeros / perm): not trained, kept apart
    from float `nnx.Param`s so filters (dtype casts, sharding rules) can tell them apart."""


class ModelSharding(Protocol):
    """What the modules ask of a sharded model's plan: `sharding.ModelSharding` implements it
    (that module builds on this one, which never imports it)."""

    mesh: Mesh

    @property
    def expert_axis(self) -> str | None: ...

    @property
    def tensor_axis(self) -> str | None: ...

    @property
    def tensor_shards(self) -> int: ...

    def constrain(self, x, field: str): ...

    def quantized_moe(
        self, x, w13, w2, topk_weights, topk_ids, *, implementation=None, activation_quant=None
    ): ...

    def float_moe(self, local_fn, x, w13, w2, topk_weights, topk_ids): ...

    def linear(self, path: tuple, weight: QuantizedTensor) -> LinearSharding: ...


@dataclasses.dataclass(frozen=True)
class LinearSharding:
    """How a QuantizedLinear's weight [1, N, K] is split over a mesh and its kernel run there.

    Static (hashable), held by the linear (`sharding.ModelSharding.linear` makes it from the
    ShardingSpecs field of the linear's weight): N over `n_axis` (column parallel: each device
    computes its slice of the output features), K over `k_axis` (row parallel: x's features
    split the same way, the partial sums added in f32), x's leading dim (the batch) over
    `row_axis`. A kernel runs per device through `wj.sharding.quantized_matmul_sharded`; the
    float dot ("xla") stays a GSPMD einsum on the placed weight.
    """

    mesh: Mesh
    row_axis: str | None = None
    n_axis: str | None = None
    k_axis: str | None = None

    def specs(self, w: wj.QuantizedExperts) -> wj.QuantizedExperts:
        """The PartitionSpec of each array of `w` in its layout (`wj.sharding.linear_specs`)."""
        return wj.sharding.linear_specs(w, n_axis=self.n_axis, k_axis=self.k_axis)

    def shardings(self, w: wj.QuantizedExperts) -> wj.QuantizedExperts:
        """`specs` as NamedShardings (jit out_shardings of a conversion)."""
        return wj.sharding.named_shardings(self.mesh, self.specs(w))

    def shard_shapes(self, w: wj.QuantizedExperts) -> wj.QuantizedExperts:
        """The arrays one device holds of `w`, as jax.ShapeDtypeStructs (nothing is moved)."""
        return jax.tree.map(
            lambda a, spec: jax.ShapeDtypeStruct(
                NamedSharding(self.mesh, spec).shard_shape(a.shape), a.dtype
            ),
            w,
            self.specs(w),
        )

    def describe(self) -> str:
        """E.g. "N over 'tensor'", "K over 'tensor'", "replicated"."""
        split = [f"{dim} over {a!r}" for dim, a in (("N", self.n_axis), ("K", self.k_axis)) if a]
        return ", ".join(split) or "replicated"

    def matmul(self, x, w, *, activation, out_dtype, implementation):
        """x [B, ..., K] @ dequant(w).T per device (`wj.sharding.quantized_matmul_sharded`)."""
        return wj.sharding.quantized_matmul_sharded(
            x,
            w,
            mesh=self.mesh,
            row_axis=self.row_axis,
            n_axis=self.n_axis,
            k_axis=self.k_axis,
            activation=activation,
            out_dtype=out_dtype,
            implementation=implementation,
        )


def constrain(ms: ModelSharding | None, x, field: str):
    """`x` pinned to the ShardingSpecs field `field` on a sharded model; unchanged without."""
    return x if ms is None else ms.constrain(x, field)


# ---- random init ----------------------------------------------------------------------------
# Modules draw their random initial weights through these helpers. `rngs` is an nnx.Rngs (jax
# random, usable under jit: weights generated on device) or a numpy Generator (host init:
# milliseconds for a small model, where XLA would compile every random op separately).

Rng = nnx.Rngs | np.random.Generator


def normal(rngs: Rng, shape, std: float = 1.0):
    if isinstance(rngs, np.random.Generator):
        return rngs.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return jax.random.normal(rngs.params(), shape, _F32) * std


# ---- weights --------------------------------------------------------------------------------


class QuantizedTensor(nnx.Module):
    """The leaves of one `wj.QuantizedExperts` [E, N, K] held as NNX variables.

    `get()` rebuilds the QuantizedExperts (bits, group_size, layout and codes are static
    attributes), which keeps nnx.split / merge / jit working on plain arrays.
    """

    def __init__(self, qe: wj.QuantizedExperts):
        self.qweight = QuantParam(qe.qweight)
        self.scales = QuantParam(qe.scales)
        self.zeros = QuantParam(qe.zeros) if qe.zeros is not None else None
        self.perm = QuantParam(qe.perm) if qe.perm is not None else None  # act-order
        self.bits = int(qe.bits)
        self.group_size = int(qe.group_size)
        self.layout = str(qe.layout)
        self.codes = str(qe.codes)  # "int", or "e2m1" (MXFP4)

    def get(self) -> wj.QuantizedExperts:
        return wj.QuantizedExperts(
            qweight=self.qweight.get_value(),
            scales=self.scales.get_value(),
            zeros=None if self.zeros is None else self.zeros.get_value(),
            bits=self.bits,
            group_size=self.group_size,
            layout=self.layout,
            perm=None if self.perm is None else self.perm.get_value(),
            codes=self.codes,
        )

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.get().shape


def random_quantized(rngs: Rng, shape, spec: QuantSpec, *, dtype) -> wj.QuantizedExperts:
    """Random weights [E, N, K] in the format `spec` says, drawn in the quantized domain by
    `wna16_jax.random_quantized_experts` (weights ~ 1/sqrt(K); scales exact in float16, so
    saving and reloading a random model is exact), its scales in spec.scale_dtype or `dtype`
    (MXFP4: E2M1 codes with uint8 E8M0 scales)."""
    key = rngs if isinstance(rngs, np.random.Generator) else rngs.params()
    if spec.scheme is not None:
        return wj.random_quantized_experts(key, shape, scheme=spec.scheme)
    return wj.random_quantized_experts(
        key,
        shape,
        bits=spec.bits,
        group_size=spec.group_for(shape[2]),
        has_zeros=spec.has_zp,
        dtype=spec.scale_dtype or dtype,
    )


# ---- batch invariance -----------------------------------------------------------------------
# A module whose float math has a batch-invariant form declares `batch_invariant = False` as a
# class attribute; `CausalLM.set_batch_invariant` sets it on the instances (a static attribute:
# each value compiles its own program). Under it every computation that reduces over a row
# runs on blocks of ROW_BLOCK rows of one shape (`in_row_blocks`), so a row's bits depend on
# neither the number of rows in the call nor the row's position among them.

ROW_BLOCK = wj.linear.BATCH_INVARIANT_ROWS


def in_row_blocks(fn, *xs, batch_dims: int = 1, rows: int = ROW_BLOCK):
    """fn applied to blocks of `rows` rows of xs, one block at a time (jax.lax.map: XLA does
    not merge the blocks into one larger op), the last block padded with zero rows.

    Args:
        fn: (*blocks [rows, ...]) -> a pytree of arrays [rows, ...]; each output row may read
            only its own input rows.
        xs: arrays [*lead, ...] of one lead (their first batch_dims dims): the rows.

    Returns:
        fn's pytree with each leaf [*lead, ...].
    """
    lead = xs[0].shape[:batch_dims]
    m = int(np.prod(lead))
    blocks = -(-m // rows)

    def split(x):  # [*lead, ...] -> [blocks, rows, ...]
        flat = x.reshape(m, *x.shape[batch_dims:])
        flat = jnp.pad(flat, [(0, blocks * rows - m)] + [(0, 0)] * (flat.ndim - 1))
        return flat.reshape(blocks, rows, *flat.shape[1:])

    out = jax.lax.map(lambda b: fn(*b), tuple(split(x) for x in xs))

    def join(y):  # [blocks, rows, ...] -> [*lead, ...]
        return y.reshape(blocks * rows, *y.shape[2:])[:m].reshape(*lead, *y.shape[2:])

    return jax.tree.map(join, out)


def matmul_nk(x, w, out_dtype=None, *, batch_invariant: bool = False):
    """x [..., K] @ w[N, K].T in out_dtype (default x.dtype), accumulated and rounded once in
    f32: when K is split over devices (o_proj under tensor parallelism) the partial sums are
    added in f32 too, so a bf16 model rounds once, as on one device. `batch_invariant`: one
    dot of [ROW_BLOCK, K] per block of rows (`wj.linear.dot_in_row_blocks`)."""
    w = w.astype(x.dtype)
    if batch_invariant:
        y = wj.linear.dot_in_row_blocks(x.reshape(-1, x.shape[-1]), w, ROW_BLOCK)
        y = y.reshape(*x.shape[:-1], w.shape[0])
    else:
        y = jnp.einsum("...k,nk->...n", x, w, preferred_element_type=_F32)
    return y.astype(out_dtype or x.dtype)


class Linear(nnx.Module):
    """y = x @ weight.T with weight float [N, K] (HF layout)."""

    batch_invariant = False

    def __init__(self, cfg, k: int, n: int, *, rngs: Rng, weight=None):
        if weight is None:
            weight = normal(rngs, (n, k), k**-0.5)
        self.weight = nnx.Param(jnp.asarray(weight, cfg.dtype))

    def dense_weight(self, dtype) -> jax.Array:
        """float [N, K]."""
        return self.weight.get_value().astype(dtype)

    def __call__(self, x, *, out_dtype=None):
        return matmul_nk(
            x, self.weight.get_value(), out_dtype, batch_invariant=self.batch_invariant
        )


class QuantizedLinear(nnx.Module):
    """y = x @ dequant(weight).T for a WNA16 weight [1, N, K].

    `implementation` (DeepseekV3ForCausalLM.set_linear_implementation): "xla" (default)
    dequantizes on the fly inside jit and runs one float dot (on a mesh, a GSPMD dot of the
    placed weight); None (automatic) or a backend with a grouped GEMM ("mgpu", "pallas", their
    "_interpret" twins, ...) runs the dequant-fused GEMM with one expert
    (`wna16_jax.linear.quantized_matmul`) where it takes the weight in its layout
    (`set_layout`). On a mesh (`sharding` set: a LinearSharding) the kernel runs per device
    on its shard of the weight (`wna16_jax.sharding.quantized_matmul_sharded`: a kernel call
    cannot be partitioned by GSPMD), and the layout and kernel are chosen for that shard.
    `batch_invariant`: the kernel's `batch_invariant=True`, the float dot in row blocks.
    """

    batch_invariant = False

    def __init__(
        self,
        cfg,
        k: int,
        n: int,
        *,
        rngs: Rng,
        qe: wj.QuantizedExperts | None = None,
    ):
        if qe is None:
            qe = random_quantized(rngs, (1, n, k), cfg.quant, dtype=cfg.dtype)
        self.weight = QuantizedTensor(qe)
        self.implementation: str | None = wj.REFERENCE_BACKEND
        self.sharding: LinearSharding | None = None  # set by set_sharding on a mesh

    def canonical_weight(self) -> wj.QuantizedExperts:
        """The weight in the canonical layout, whatever the kernel layout it is held in."""
        return wj.layouts.to_canonical_layout(self.weight.get())

    def shard_shapes(self, w: wj.QuantizedExperts | None = None) -> wj.QuantizedExperts:
        """The arrays of `w` (default: the weight) one device holds, as jax.ShapeDtypeStructs:
        the whole weight unsharded, its shard on a mesh. Kernels and layouts are chosen on it."""
        w = self.weight.get() if w is None else w
        if self.sharding is None:
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), w)
        return self.sharding.shard_shapes(w)

    def set_layout(self, layout: str) -> None:
        """Converts the weight to `layout` (wna16_jax.layouts), replacing it. On a mesh each
        device converts its own shard: the converted arrays are placed by
        `wj.sharding.linear_specs` of the converted weight (the layouts are tile-local, so a
        shard of the converted weight is the converted shard).

        Raises:
            ValueError: on a mesh, a shard of the weight cannot hold `layout` (e.g. N or K per
                device not a multiple of the mgpu layouts' 64-row tiles).
        """
        if layout == self.weight.layout:
            return
        convert = functools.partial(wj.layouts.to_kernel_layout, layout=layout)
        w = self.weight.get()
        if self.sharding is None:
            self.weight = QuantizedTensor(convert(w))
            return
        shard = self.shard_shapes(w)
        try:
            jax.eval_shape(convert, shard)
        except ValueError as err:
            raise ValueError(
                f"a shard {shard.shape} of the linear weight {w.shape} ({self.sharding.describe()})"
                f" cannot take the {layout} layout: {err}"
            ) from None
        out = self.sharding.shardings(jax.eval_shape(convert, w))
        self.weight = QuantizedTensor(jax.jit(convert, out_shardings=out)(w))

    def dense_weight(self, dtype) -> jax.Array:
        """float [N, K], dequantized."""
        return wj.dequantize_experts(self.canonical_weight(), dtype=dtype)[0]

    def kernel(self, dtype) -> str | None:
        """The backend that runs this layer for activations of `dtype`, None for the float dot:
        "xla", or a weight (on a mesh: a shard) no requested kernel takes here (e.g. N not a
        multiple of 16)."""
        if self.implementation == wj.REFERENCE_BACKEND:
            return None
        names = None if self.implementation is None else (self.implementation, wj.REFERENCE_BACKEND)
        name = wj.linear.select_implementation(
            self.shard_shapes(),
            dtype=dtype,
            implementation=names,
            batch_invariant=self.batch_invariant,
        )
        return None if name == wj.REFERENCE_BACKEND else name

    def kernel_reason(self, dtype) -> str | None:
        """Why this layer's named `implementation` does not run it (it runs on the float dot
        instead); None when it does, on "xla", and for the automatic choice."""
        if self.implementation in (None, wj.REFERENCE_BACKEND) or self.kernel(dtype) is not None:
            return None
        shard, whole = self.shard_shapes(), self.weight.get().shape
        where = f"its weight {whole}"
        if shard.shape != whole:
            where = f"its shard {shard.shape} of {whole} ({self.sharding.describe()})"
        # The layout the implementation reads for the whole weight, which the shard may not
        # hold (a shard not in whole tiles).
        canonical = jax.eval_shape(self.canonical_weight)
        want = wj.linear.preferred_layout(
            canonical,
            dtype=dtype,
            implementation=self.implementation,
            batch_invariant=self.batch_invariant,
        )
        if want != self.weight.layout:
            convert = functools.partial(wj.layouts.to_kernel_layout, layout=want)
            try:
                jax.eval_shape(convert, self.shard_shapes(canonical))
            except ValueError as err:
                return f"{where} cannot take the {want} layout: {err}"
        try:
            wj.linear.select_implementation(
                shard,
                dtype=dtype,
                implementation=self.implementation,
                batch_invariant=self.batch_invariant,
            )
        except NotImplementedError as err:
            return f"{where}: {err}"
        return None

    def set_implementation(self, implementation: str | None, *, dtype) -> None:
        """Runs this layer on `implementation` ("xla", None: automatic, or a backend name) for
        activations of `dtype`, its weight converted to the layout that reads
        (`wna16_jax.linear.preferred_layout`; on a mesh, of one device's shard)."""
        self.implementation = implementation
        shard = self.shard_shapes(jax.eval_shape(self.canonical_weight))  # shapes suffice
        self.set_layout(
            wj.linear.preferred_layout(
                shard,
                dtype=dtype,
                implementation=implementation,
                batch_invariant=self.batch_invariant,
            )
        )

    def __call__(self, x, *, activation: str | None = None, out_dtype=None):
        """x [..., K] -> [..., N] in out_dtype (default x.dtype), from f32 sums.

        activation: None, or "silu" for a gated MLP's weight with rows [gate; up] (N = 2F):
        -> silu(gate) * up [..., F]. A kernel computes it from the f32 sums (in its epilogue);
        the float dot ("xla", or a weight no kernel takes) as the unfused MLP does, from gate
        and up rounded to x.dtype, so that a FusedLinear on it is its parts' model exactly.
        On a mesh x's leading dim is the batch (split over the LinearSharding's row_axis).
        """
        kernel = self.kernel(x.dtype)
        if kernel is None:
            matmul = functools.partial(matmul_nk, batch_invariant=self.batch_invariant)
            if activation is None:
                return matmul(x, self.dense_weight(x.dtype), out_dtype)
            if activation != "silu":
                raise ValueError(f"activation={activation!r} is not None or 'silu'")
            gate, up = jnp.split(matmul(x, self.dense_weight(x.dtype)), 2, axis=-1)
            return (jax.nn.silu(gate) * up).astype(out_dtype or x.dtype)  # MLP.__call__'s
        if self.sharding is not None:
            return self.sharding.matmul(
                x,
                self.weight.get(),
                activation=activation,
                out_dtype=out_dtype,
                implementation=kernel,
            )
        return wj.linear.quantized_matmul(
            x,
            self.weight.get(),
            activation=activation,
            out_dtype=out_dtype,
            implementation=kernel,
            batch_invariant=self.batch_invariant,
        )


# ---- fused linears (a serving form) ---------------------------------------------------------


class FusedLinear(QuantizedLinear):
    """Quantized linears that read the same input, run as one: their weights' rows stacked
    [W_0; W_1; ...] into one WNA16 weight [1, N_0 + N_1 + ..., K].

    A serving form (`DeepseekV3ForCausalLM.set_linear_implementation` makes it for a kernel):
    at decode a GEMM launch's ramp and drain cost more than the bytes it reads, so two linears
    of one x are one launch instead of two, and a gated MLP's silu(gate) * up runs in that
    GEMM's epilogue (`__call__(x, activation="silu")`). Exact: the packed words, scales and
    zero points are the parts' own, joined along N in the canonical layout
    (`wj.QuantizedExperts.concatenate`); `split` gives each part back bit-identically.

    Attributes:
        parts: static ((HF name, rows N_i), ...) of the parts, in row order.
    """

    def __init__(self, cfg, parts: Mapping[str, QuantizedLinear]):
        weights = [p.canonical_weight() for p in parts.values()]
        qe = wj.QuantizedExperts.concatenate(weights, axis=1)  # [1, sum N_i, K] canonical
        super().__init__(cfg, qe.k, qe.n, rngs=None, qe=qe)
        self.cfg = cfg
        self.parts = tuple((name, w.n) for name, w in zip(parts, weights, strict=True))

    def split(self) -> dict[str, QuantizedLinear]:
        """{HF name: the part}, each a QuantizedLinear in the canonical layout on this
        layer's implementation, its weight bit-identical to the one fused."""
        w = self.canonical_weight()
        out, start = {}, 0
        for name, n in self.parts:
            part = w.slice(start, start + n, axis=1)  # rows [start, start + n)
            out[name] = QuantizedLinear(self.cfg, w.k, n, rngs=None, qe=part)
            out[name].implementation = self.implementation
            if self.batch_invariant:  # else the class's False: the tree of a never-fused model
                out[name].batch_invariant = True
            start += n
        return out


def fusion_reason(parts: Mapping[str, Linear | QuantizedLinear]) -> str | None:
    """Why the linears `parts` (HF name -> layer, one input) cannot be one FusedLinear, or
    None: all must be QuantizedLinears with the same bits, group size, zero points (int4 ones
    on an even N: two rows per byte), scales dtype, K and input order (act-order perm)."""
    for name, m in parts.items():
        if not isinstance(m, QuantizedLinear):
            return f"{name} is a {type(m).__name__}, not a QuantizedLinear"
        w = m.weight
        if w.bits == 4 and w.zeros is not None and w.shape[1] % 2:
            return f"{name} has N={w.shape[1]}: int4 zero points pack two rows per byte"

    def facts(w: wj.QuantizedExperts) -> dict:
        return {
            "bits": w.bits,
            "group_size": w.group_size,
            "zero points": w.has_zeros,
            "scales dtype": jnp.dtype(w.scales.dtype).name,
            "K": w.k,
        }

    (first, a), *rest = ((name, m.weight.get()) for name, m in parts.items())
    want = facts(a)
    for name, b in rest:
        for key, value in facts(b).items():
            if value != want[key]:
                return f"{name} has {key} {value}, {first} {want[key]}"
        same_order = (a.perm is None and b.perm is None) or (
            a.perm is not None
            and b.perm is not None
            and np.array_equal(np.asarray(a.perm), np.asarray(b.perm))
        )
        if not same_order:
            return f"{name} orders its inputs (act-order perm) unlike {first}"
    return None


@dataclasses.dataclass(frozen=True)
class Fusion:
    """Linears of one module that read the same input and may run as one FusedLinear.

    `fused` names the module's FusedLinear attribute (None while unfused), `parts` the HF
    linears it stacks, in row order (each None while fused). The HF module tree is the
    unfused one: loading, saving and sharding see `parts`.
    """

    fused: str
    parts: tuple[str, ...]

    def unfused(self, owner) -> dict[str, Linear | QuantizedLinear] | None:
        """{name: part} of `owner` while it holds every part (unfused); None when fused or
        when the module has no such parts (MLA without q LoRA)."""
        parts = {name: getattr(owner, name, None) for name in self.parts}
        return None if any(m is None for m in parts.values()) else parts

    def fuse(self, owner, implementation: str | None, *, cfg) -> str | None:
        """Replaces the parts of `owner` by one FusedLinear on `implementation`, its weight in
        the layout that reads for cfg.dtype activations, where the parts fuse and a kernel
        runs the fused weight; else returns why they stay apart, leaving them as they are."""
        parts = self.unfused(owner)
        if parts is None:
            raise ValueError(f"{type(owner).__name__} holds no unfused {self.parts}")
        why = fusion_reason(parts)
        if why is None:
            fused = FusedLinear(cfg, parts)
            if any(m.batch_invariant for m in parts.values()):
                fused.batch_invariant = True
            fused.set_implementation(implementation, dtype=cfg.dtype)
            if fused.kernel(cfg.dtype) is None:
                name = implementation or "auto"
                why = f"no {name!r} kernel runs the fused weight {fused.weight.shape}"
        if why is not None:
            return f"{' and '.join(self.parts)} stay two GEMMs: {why}"
        setattr(owner, self.fused, fused)
        for name in self.parts:
            setattr(owner, name, None)
        return None

    def unfuse(self, owner) -> None:
        """Puts the parts of `owner`'s FusedLinear back in their places (canonical layout)."""
        fused = getattr(owner, self.fused)
        if fused is None:
            return
        for name, part in fused.split().items():
            setattr(owner, name, part)
        setattr(owner, self.fused, None)

    def part(self, owner, name: str):
        """The HF linear `name` of `owner`: itself, or split off the FusedLinear holding it."""
        linear = getattr(owner, name)
        fused = getattr(owner, self.fused)
        if linear is None and fused is not None:
            return fused.split()[name]
        return linear


def make_linear(cfg, k: int, n: int, *, target: str | None, rngs: Rng):
    """A QuantizedLinear when `cfg.quant` targets `target`, else a float Linear."""
    if target is not None and cfg.quantizes(target):
        return QuantizedLinear(cfg, k, n, rngs=rngs)
    return Linear(cfg, k, n, rngs=rngs)


class RMSNorm(nnx.Module):
    """HF DeepseekV3RMSNorm: normalize in f32, cast back, then scale by weight."""

    def __init__(self, cfg, dim: int, *, eps: float, rngs: Rng):
        # Random models perturb the weight so that tests notice a norm loaded into the wrong slot.
        w = 1.0 + normal(rngs, (dim,), 0.1)
        self.weight = nnx.Param(jnp.asarray(w, cfg.dtype))
        self.eps = eps

    batch_invariant = False  # `in_row_blocks`: the mean of squares over blocks of rows

    def _normalize(self, x):
        x32 = x.astype(_F32)
        return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)

    def __call__(self, x):
        if self.batch_invariant:
            y = in_row_blocks(self._normalize, x, batch_dims=x.ndim - 1)
        else:
            y = self._normalize(x)
        return self.weight.get_value().astype(x.dtype) * y.astype(x.dtype)


class Embed(nnx.Module):
    """Token embedding, weight float [V, H]."""

    def __init__(self, cfg, *, rngs: Rng):
        w = normal(rngs, (cfg.vocab_size, cfg.hidden_size), 0.02)
        self.weight = nnx.Param(jnp.asarray(w, cfg.dtype))

    def __call__(self, ids):
        return jnp.take(self.weight.get_value(), ids, axis=0)


class MLP(nnx.Module):
    """down(silu(gate(x)) * up(x)); dense layers and shared experts."""

    # gate_proj and up_proj both read x: one GEMM when served on a kernel, silu(gate) * up in
    # its epilogue.
    FUSION = Fusion("gate_up_proj", ("gate_proj", "up_proj"))

    def __init__(self, cfg, intermediate: int, *, target: str, rngs: Rng):
        lin = lambda k, n: make_linear(cfg, k, n, target=target, rngs=rngs)
        self.gate_proj = lin(cfg.hidden_size, intermediate)
        self.up_proj = lin(cfg.hidden_size, intermediate)
        self.down_proj = lin(intermediate, cfg.hidden_size)
        self.gate_up_proj: FusedLinear | None = nnx.data(None)  # [gate; up] [2F, H] (FUSION)

    def __call__(self, x):
        if self.gate_up_proj is not None:
            return self.down_proj(self.gate_up_proj(x, activation="silu"))
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def _check_w13_layout(module, ms: ModelSharding | None) -> None:
    want = 1 if ms is None else ms.tensor_shards
    if module.w13_tp_shards != want:
        raise ValueError(
            f"w13 rows are interleaved for {module.w13_tp_shards} tensor shards but the model "
            f"runs with {want}; move models between meshes with sharding.shard_model"
        )


def activation_quant_of(value) -> wj.ActivationQuant | None:
    """None (16-bit activations), "int8_per_token" or a wj.ActivationQuant -> the
    ActivationQuant the routed experts hold (None stays None).

    Raises:
        ValueError: another value, or "int8_static" without both scales (a static scheme's
            scales are part of the model: the checkpoint's input_scale tensors).
    """
    if value is None or isinstance(value, wj.ActivationQuant):
        aq = value
    elif isinstance(value, str):
        aq = wj.ActivationQuant(value)  # an unknown scheme raises, naming the known ones
    else:
        raise ValueError(
            f"activation_quant={value!r} is not None, 'int8_per_token' or a wj.ActivationQuant"
        )
    if aq is not None and not aq.has_scales:
        raise ValueError(
            f"activation_quant={aq} needs both static scales (gemm1_scale, gemm2_scale): "
            f"wj.ActivationQuant('int8_static', gemm1_scale=..., gemm2_scale=...)"
        )
    return aq


class RoutedExperts(nnx.Module):
    """WNA16 routed experts through wna16_jax.fused_moe: w13 [E, 2I, H] (gate rows then up
    rows), w2 [E, H, I].

    `activation_quant` (a static attribute, not an array: each value compiles its own
    program) is fused_moe's: None runs 16-bit activations (WNA16), a wj.ActivationQuant int8
    activations (W8A8: per token, or the layer's static scales), as a compressed-tensors W8A8
    checkpoint says (`params.load_pretrained`) or `DeepseekV3ForCausalLM.set_activation_quant`
    sets it.

    On a mesh (`sharding` set) the experts are split over the expert axis and I over the
    tensor axis, w13's rows interleaved for `w13_tp_shards` tensor shards
    (wna16_jax.sharding.tp_interleave_w13); `canonical_w13()` undoes that.
    """

    def __init__(
        self,
        cfg,
        *,
        rngs: Rng,
        w13=None,
        w2=None,
        implementation=None,
        activation_quant: str | wj.ActivationQuant | None = None,
    ):
        e, i, hdim = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        if w13 is None:
            w13 = random_quantized(rngs, (e, 2 * i, hdim), cfg.quant, dtype=cfg.dtype)
        if w2 is None:
            w2 = random_quantized(rngs, (e, hdim, i), cfg.quant, dtype=cfg.dtype)
        self.w13 = QuantizedTensor(w13)
        self.w2 = QuantizedTensor(w2)
        self.implementation = implementation
        self.activation_quant = activation_quant_of(activation_quant)
        self.sharding: ModelSharding | None = None
        self.w13_tp_shards = 1

    batch_invariant = False  # fused_moe's

    def canonical_w13(self) -> wj.QuantizedExperts:
        """w13 [E, 2I, H] with rows [gate; up], in the canonical layout, whatever the
        tensor-parallel row order or kernel layout."""
        w13 = wj.layouts.to_canonical_layout(self.w13.get())
        if self.w13_tp_shards == 1:
            return w13
        return wj.sharding.tp_deinterleave_w13(w13, self.w13_tp_shards)

    @property
    def layout(self) -> str:
        return self.w13.layout

    def set_layout(self, layout: str) -> None:
        """Converts w13 and w2 to `layout` (wna16_jax.layouts; "mgpu_int4" for the 'mgpu'
        backend), replacing them: no second copy is kept. On a mesh each device converts its
        own shard (the shardings follow the layout's specs: experts over the expert axis, w13's
        rows and w2's K over the tensor axis; the conversion is row by row, so w13's
        tensor-parallel row order is kept)."""
        if layout == self.layout:
            return
        convert = functools.partial(wj.layouts.to_kernel_layout, layout=layout)
        w13, w2 = self.w13.get(), self.w2.get()
        if self.sharding is not None:
            ea, ta, mesh = self.sharding.expert_axis, self.sharding.tensor_axis, self.sharding.mesh

            def shard(qw, **tensor):
                specs = wj.sharding.expert_specs(
                    jax.eval_shape(convert, qw), expert_axis=ea, **tensor
                )
                return wj.sharding.named_shardings(mesh, specs)

            w13 = jax.jit(convert, out_shardings=shard(w13, n_axis=ta))(w13)
            w2 = jax.jit(convert, out_shardings=shard(w2, k_axis=ta))(w2)
        else:
            w13, w2 = convert(w13), convert(w2)
        self.w13 = QuantizedTensor(w13)
        self.w2 = QuantizedTensor(w2)

    def __call__(self, x, topk_weights, topk_ids):
        """x [T, H] -> [T, H] (x.dtype)."""
        _check_w13_layout(self, self.sharding)
        if self.sharding is not None:
            return self.sharding.quantized_moe(
                x,
                self.w13.get(),
                self.w2.get(),
                topk_weights,
                topk_ids,
                implementation=self.implementation,
                activation_quant=self.activation_quant,
            )
        return wj.fused_moe(
            x,
            self.w13.get(),
            self.w2.get(),
            topk_weights,
            topk_ids,
            implementation=self.implementation,
            activation_quant=self.activation_quant,
            batch_invariant=self.batch_invariant,
        )


class FloatExperts(nnx.Module):
    """Unquantized routed experts (float checkpoints without quantize=): w13 float [E, 2I, H],
    w2 [E, H, I], computed with sorted tokens and jax.lax.ragged_dot."""

    def __init__(self, cfg, *, rngs: Rng, w13=None, w2=None):
        e, i, hdim = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        if w13 is None:
            w13 = normal(rngs, (e, 2 * i, hdim), hdim**-0.5)
        if w2 is None:
            w2 = normal(rngs, (e, hdim, i), i**-0.5)
        self.w13 = nnx.Param(jnp.asarray(w13, cfg.dtype))
        self.w2 = nnx.Param(jnp.asarray(w2, cfg.dtype))
        self.implementation = None
        self.sharding: ModelSharding | None = None
        self.w13_tp_shards = 1

    batch_invariant = False  # `float_experts` on blocks of tokens (`in_row_blocks`)

    def canonical_w13(self) -> jax.Array:
        """w13 float [E, 2I, H] with rows [gate; up] whatever the tensor-parallel layout."""
        w13 = self.w13.get_value()
        if self.w13_tp_shards == 1:
            return w13
        return wj.sharding.interleave_w13_rows(w13, self.w13_tp_shards, inverse=True)

    def __call__(self, x, topk_weights, topk_ids):
        """x [T, H] -> [T, H] (x.dtype)."""
        _check_w13_layout(self, self.sharding)
        w13, w2 = self.w13.get_value(), self.w2.get_value()
        if self.sharding is not None:
            return self.sharding.float_moe(float_experts, x, w13, w2, topk_weights, topk_ids)
        if self.batch_invariant:
            block = lambda xb, wb, ib: float_experts(xb, w13, w2, wb, ib)
            return in_row_blocks(block, x, topk_weights, topk_ids)
        return float_experts(x, w13, w2, topk_weights, topk_ids)


def float_experts(x, w13, w2, topk_weights, topk_ids):
    """Float routed experts with sorted tokens and jax.lax.ragged_dot.

    Args:
        x: [T, H].  w13: float [E, 2I, H] (gate rows, then up rows).  w2: float [E, H, I].
        topk_weights: [T, k].  topk_ids: int [T, k] in [0, E); other ids (-1: an expert on
            another shard) contribute zero.

    Returns:
        [T, H] in x.dtype.
    """
    t, k = topk_ids.shape
    e, two_i, _ = w13.shape
    flat = topk_ids.reshape(-1)
    valid = (flat >= 0) & (flat < e)
    flat = jnp.where(valid, flat, e)  # absent slots sort last, outside every group
    order = jnp.argsort(flat, stable=True)  # slots grouped by expert
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[order // k]  # [T*k, H]
    h = jax.lax.ragged_dot(
        xs,
        w13.astype(x.dtype).transpose(0, 2, 1),
        sizes,
        precision=_HIGHEST,
        preferred_element_type=_F32,
    )  # [T*k, 2I]
    act = (jax.nn.silu(h[:, : two_i // 2]) * h[:, two_i // 2 :]).astype(x.dtype)
    y = jax.lax.ragged_dot(
        act,
        w2.astype(x.dtype).transpose(0, 2, 1),
        sizes,
        precision=_HIGHEST,
        preferred_element_type=_F32,
    )  # [T*k, H]
    y = y * topk_weights.reshape(-1)[order][:, None].astype(_F32)
    y = jnp.where(valid[order][:, None], y, 0.0)
    out = jnp.zeros_like(y).at[order].set(y)
    return out.reshape(t, k, -1).sum(axis=1).astype(x.dtype)


def module_at(root: nnx.Module, path: tuple):
    """The module (or variable) at `path` (attribute names and list indices) under `root`."""
    node = root
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node


def set_module(root: nnx.Module, path: tuple, value) -> None:
    """Puts `value` at `path` under `root`, replacing what was there."""
    parent = module_at(root, path[:-1])
    if isinstance(path[-1], int):
        parent[path[-1]] = value
    else:
        setattr(parent, path[-1], value)


# ---- the MoE block --------------------------------------------------------------------------


class Router(nnx.Module):
    """The MoE gate: weight [E, H] in the model dtype, logits in f32; a family's subclass
    writes `route` (its scoring and top-k) and adds what its gate holds beside the weight."""

    def __init__(self, cfg, *, rngs: Rng):
        self.cfg = cfg
        e, h = cfg.n_routed_experts, cfg.hidden_size
        self.weight = nnx.Param(jnp.asarray(normal(rngs, (e, h), h**-0.5), cfg.dtype))

    def route(self, logits):
        """f32 [T, E] -> (topk_weights f32 [T, k], topk_ids int32 [T, k])."""
        raise NotImplementedError(f"{type(self).__name__} does not define route")

    batch_invariant = False  # the logits and `route` on blocks of tokens (`in_row_blocks`)

    def __call__(self, x):
        """x [T, H] -> (topk_weights f32 [T, k], topk_ids int32 [T, k])."""
        w = self.weight.get_value().astype(_F32)
        logits = lambda xt: jnp.dot(xt.astype(_F32), w.T, precision=_HIGHEST)  # [T, E]
        if self.batch_invariant:
            return in_row_blocks(lambda xb: self.route(logits(xb)), x)
        return self.route(logits(x))


class MoEBlock(nnx.Module):
    """The family's ROUTER (`gate`), the routed experts (`experts`: RoutedExperts where the
    config quantizes them, else FloatExperts) and whatever `shared` adds (a family's shared
    experts; None: nothing). Subclasses build their shared experts after this constructor,
    the order their random weights are drawn in."""

    ROUTER: type

    def __init__(self, cfg, *, rngs: Rng):
        self.gate = self.ROUTER(cfg, rngs=rngs)
        if cfg.quantizes("experts"):
            self.experts = RoutedExperts(cfg, rngs=rngs)
        else:
            self.experts = FloatExperts(cfg, rngs=rngs)

    def shared(self, x):
        """x [B, S, H] -> what the shared experts add [B, S, H], or None."""
        return None

    def __call__(self, x):
        b, s, h = x.shape
        xt = x.reshape(b * s, h)
        topk_weights, topk_ids = self.gate(xt)
        out = self.experts(xt, topk_weights, topk_ids).reshape(b, s, h)
        extra = self.shared(x)
        return out if extra is None else out + extra


# ---- the decoder ---------------------------------------------------------------------------


class PreNormDecoderLayer(nnx.Module):
    """A pre-norm decoder layer: x + attention(norm(x)), then x + mlp(norm(x)), the MLP the
    family's MoE on its MoE layers (`cfg.is_moe_layer`), else a dense gated MLP. A family
    subclasses it, naming its ATTENTION and MOE modules (each built as cls(cfg, rngs=))."""

    ATTENTION: type
    MOE: type

    def __init__(self, cfg, layer_idx: int, *, rngs: Rng):
        self.self_attn = self.ATTENTION(cfg, rngs=rngs)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = self.MOE(cfg, rngs=rngs)
        else:
            self.mlp = MLP(cfg, cfg.intermediate_size, target="dense_mlp", rngs=rngs)
        self.input_layernorm = RMSNorm(cfg, cfg.hidden_size, eps=cfg.rms_norm_eps, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(
            cfg, cfg.hidden_size, eps=cfg.rms_norm_eps, rngs=rngs
        )

    def __call__(self, x, **attn_kw):
        h, new_cache = self.self_attn(self.input_layernorm(x), **attn_kw)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, new_cache


class DecoderStack(nnx.Module):
    """The embedding, the decoder layers (`layer`, a family's PreNormDecoderLayer subclass,
    built as layer(cfg, i, rngs=)) and the final norm, drawing their random weights in that
    order."""

    def __init__(self, cfg, layer: type, *, rngs: Rng):
        self.embed_tokens = Embed(cfg, rngs=rngs)
        self.layers = nnx.List([layer(cfg, i, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg, cfg.hidden_size, eps=cfg.rms_norm_eps, rngs=rngs)


# ---- causal masks ---------------------------------------------------------------------------


def positions_from_mask(mask):
    """Left-padded mask bool [B, S] -> int32 [B, S] positions (pads get 0)."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)


def chunk_mask(key_valid):
    """Causal mask over one chunk: bool [B, S, S]; pad keys masked; each query sees itself so
    rows of pad queries stay finite."""
    s = key_valid.shape[1]
    causal = jnp.tril(jnp.ones((s, s), bool))
    return (causal[None] & key_valid[:, None, :]) | jnp.eye(s, dtype=bool)[None]


def decode_mask(valid, index, s: int):
    """The mask of `s` tokens written at cache slots index..index+s-1: bool [B, s, L], each
    query seeing the valid slots up to its own. valid: bool [B, L] with the new slots set."""
    slots = jnp.arange(valid.shape[1], dtype=jnp.int32)
    query_slot = index + jnp.arange(s, dtype=jnp.int32)
    return valid[:, None, :] & (slots[None, None, :] <= query_slot[None, :, None])
