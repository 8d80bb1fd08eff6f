"""A quantized linear layer: y = x @ dequant(w).T for one WNA16 weight [1, N, K].

The non-expert linears of a quantized checkpoint (attention projections, dense MLPs, shared
experts) are the grouped GEMM with one expert: every row of x goes to expert 0, so the routing
is the identity padded to block_m and needs no alignment kernel (a backend whose GEMM runs one
expert without a routing, `GroupedMatmul.linear`, takes x's rows as they are: 'mgpu'). The
implementation is chosen
as fused_moe's is (a backend name, names tried in order, or None: the platform's priority),
among the backends with a grouped GEMM (`Backend.grouped_matmul`) that read the weight's
layout:
- "xla": dequantize to x.dtype and one dot with f32 accumulation (any platform, any layout;
  what a float model of x's dtype computes);
- "pallas" / "pallas_interpret", "triton": that backend's dequant-fused grouped GEMM, compiled
  on an NVIDIA GPU (or in the interpreter), weights in the canonical layout;
- "mgpu" / "mgpu_interpret": the Mosaic GPU GEMM (Hopper), weights in the mgpu_int4 or
  mgpu_int8 layout (`preferred_layout` says which layout to convert a weight to once, at load).

Under GSPMD sharding (jit with sharded weights, no shard_map) a kernel call cannot be
partitioned: XLA would gather the whole weight to every device. Use "xla" there, or run the
kernel per device on its shard: `wna16_jax.sharding.quantized_matmul_sharded`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from wna16_jax import _dispatch, layouts
from wna16_jax._activations import ACTIVATIONS, activate
from wna16_jax._checks import check_array, check_out_dtype
from wna16_jax._configs import GemmShape, batch_invariant_config
from wna16_jax._inference_only import inference_only
from wna16_jax._quant import dequantize_experts
from wna16_jax._types import AlignedRouting, BlockConfig, QuantizedExperts


def identity_routing(num_rows: int, block_m: int) -> AlignedRouting:
    """Every row to expert 0: sorted ids 0..R-1 then the sentinel R, one expert-0 block each."""
    padded = -(-max(num_rows, 1) // block_m) * block_m
    ids = jnp.arange(padded, dtype=jnp.int32)
    return AlignedRouting(
        sorted_token_ids=jnp.where(ids < num_rows, ids, num_rows),
        expert_ids=jnp.zeros((padded // block_m,), jnp.int32),
        num_tokens_post_padded=jnp.asarray(padded if num_rows else 0, jnp.int32),
        block_m=block_m,
    )


def _check(x, w: QuantizedExperts, activation=None) -> None:
    check_array("x", x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"x must be floating point (bfloat16, float16 or float32), got {x.dtype}: the "
            f"weights are dequantized to x's dtype"
        )
    if not isinstance(w, QuantizedExperts):
        raise ValueError(f"w must be a QuantizedExperts, got {type(w).__name__}")
    e, n, k = w.shape
    if e != 1:
        raise ValueError(f"a quantized linear weight is [1, N, K], got {w.shape}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight K={k}")
    if activation is not None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not one of {sorted(ACTIVATIONS)}")
        if n % 2:
            raise ValueError(f"a gated weight's rows are [gate; up]: N={n} is not even")


# Rows per dot of the batch-invariant 'xla' linear: every call runs dots of this one shape
# (XLA picks a dot's algorithm, its blocking of K included, by shape), the last block padded.
BATCH_INVARIANT_ROWS = 16


def _problem(
    w: QuantizedExperts, rows: int, dtype, batch_invariant: bool = False
) -> _dispatch.GemmProblem:
    return _dispatch.GemmProblem(
        platform=_dispatch.current_platform(),
        shape=GemmShape.of_weights(w, m=max(rows, 1)),
        dtype=jnp.dtype(dtype).name,
        has_zeros=w.has_zeros,
        layout=w.layout,
        batch_invariant=batch_invariant,
    )


def _dot_f32(x, w):
    """f32 [M, N] = x [M, K] @ w [N, K].T, f32 accumulation. HIGHEST: f32 operands would
    otherwise run as TF32 on a GPU (measured rel err 2.7e-4 on the H200); 16-bit operands are
    exact products either way."""
    return jnp.einsum(
        "mk,nk->mn", x, w, preferred_element_type=jnp.float32,
        precision=jax.lax.Precision.HIGHEST,
    )  # fmt: skip


def dot_in_row_blocks(x, w, rows: int = BATCH_INVARIANT_ROWS):
    """`_dot_f32` as one dot of shape [rows, K] x [K, N] per block of x's rows (the last
    padded with zero rows), in a loop XLA cannot merge into a larger dot: a row's sums do not
    depend on M or on where the row sits (batch_invariant).

    Args:
        x: [M, K].  w: [N, K].  rows: the rows per dot.

    Returns:
        f32 [M, N].
    """
    m, k = x.shape
    blocks = -(-m // rows)
    xb = jnp.pad(x, ((0, blocks * rows - m), (0, 0))).reshape(blocks, rows, k)
    y = jax.lax.map(lambda block: _dot_f32(block, w), xb)  # [blocks, rows, N]
    return y.reshape(blocks * rows, -1)[:m]


def _names(implementation):
    """A hashable implementation argument (lists become tuples)."""
    if implementation is None or isinstance(implementation, str):
        return implementation
    return tuple(implementation)


def select_implementation(
    w: QuantizedExperts,
    *,
    dtype=jnp.bfloat16,
    implementation: str | Sequence[str] | None = None,
    batch_invariant: bool = False,
) -> str:
    """The backend `quantized_matmul` uses for `w` and activations of `dtype` (nothing runs),
    with `batch_invariant` as quantized_matmul takes it (a backend that cannot is skipped, or
    refused with its reason when named).

    Raises:
        ValueError: an unknown backend name.
        NotImplementedError: no requested backend can run it (reasons listed).
    """
    problem = _problem(w, 1, dtype, batch_invariant)
    return _dispatch.select_backend(problem, _names(implementation)).name


def preferred_layout(
    w: QuantizedExperts,
    *,
    dtype=jnp.bfloat16,
    implementation: str | None = None,
    batch_invariant: bool = False,
) -> str:
    """The layout to convert the linear weight `w` to once (at load) so that `implementation`
    runs it here: for None (the automatic choice) the first of _dispatch.preferred_layouts()
    whose backend's grouped GEMM takes it (mgpu_int4 / mgpu_int8 for the 'mgpu' GEMM: an sm_90
    GPU, int4 / int8, bfloat16 activations, N and K multiples of 64, groups of 16, 32 or
    multiples of 64), for a backend
    name the first of
    its layouts in which it takes it; else "canonical" (where 'pallas' or 'xla' run it).
    `batch_invariant`: only backends that run quantized_matmul(..., batch_invariant=True).

    Raises:
        ValueError: `w` is not a linear weight [1, N, K], or an unknown backend name.
    """
    _check(jax.ShapeDtypeStruct((1, w.k), dtype), w)
    if implementation is None:
        candidates = _dispatch.preferred_layouts()
    else:
        candidates = [
            (lay, implementation)
            for lay in _dispatch.read_layouts(_dispatch.get_backend(implementation))
        ]
    for layout, name in candidates:
        if layout == "canonical":
            return layout
        try:
            converted = jax.eval_shape(
                functools.partial(layouts.to_kernel_layout, layout=layout), w
            )
        except ValueError:  # the layout cannot hold this weight (its bits, N or K not in tiles)
            continue
        problem = _problem(converted, 1, dtype, batch_invariant)
        if _dispatch.backend_reason(_dispatch.get_backend(name), problem):
            continue
        return layout
    return "canonical"


def quantized_matmul(
    x,
    w: QuantizedExperts,
    *,
    activation: str | None = None,
    out_dtype=None,
    implementation: str | Sequence[str] | None = None,
    config: BlockConfig | object | None = None,
    batch_invariant: bool = False,
):
    """y [..., N] = x [..., K] @ dequant(w[0]).T, accumulated in f32, rounded once to out_dtype.

    Args:
        x: [..., K] bf16 / f16 / f32 (an integer x is refused: the weights would be
            dequantized to integers).
        w: QuantizedExperts [1, N, K].
        activation: None, or "silu" for a gated MLP's [gate; up] weight (N = 2I): y [..., I] =
            silu(gate) * up, computed from the f32 sums (in the GEMM's epilogue where the
            kernel fuses it, as fused_moe's GEMM1).
        out_dtype: y's dtype (default x.dtype).
        implementation: None (the platform's priority among the backends that read w's
            layout: on an NVIDIA GPU the Pallas GEMM for the canonical layout, the Mosaic GPU
            GEMM for mgpu_int4 / mgpu_int8, where it runs this weight; else "xla"), a backend
            name with a
            grouped GEMM, or names tried in order (e.g. ("pallas", "xla"): the kernel where it
            tiles the weight).
        config: the kernel's config, a BlockConfig (or the 'mgpu' GEMM's MgpuConfig); None:
            the tuned table, then the heuristic.
        batch_invariant: static; True computes each row of x in an order that does not
            depend on the other rows (their number or its position): "xla" runs one dot shape
            per block of BATCH_INVARIANT_ROWS rows (`dot_in_row_blocks`), a kernel its config
            for w's shape alone without a K split (`batch_invariant_config`); backends that
            cannot are refused with their reason.

    Raises:
        TypeError: x is not an array (a Python list: convert it first).
        ValueError: malformed inputs, an unknown backend name, a config that cannot run.
        NotImplementedError: no requested backend can run it (reasons listed).
    """
    _check(x, w, activation)
    check_out_dtype(out_dtype)
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant must be True or False, got {batch_invariant!r}")
    return _quantized_matmul(
        x,
        w,
        activation=activation,
        out_dtype=jnp.dtype(out_dtype or x.dtype),
        implementation=_names(implementation),
        config=config,
        batch_invariant=batch_invariant,
    )


@functools.partial(
    jax.jit,
    static_argnames=("activation", "out_dtype", "implementation", "config", "batch_invariant"),
)
def _quantized_matmul(
    x, w: QuantizedExperts, *, activation, out_dtype, implementation, config, batch_invariant
):
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.n // 2 if activation else w.n
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    problem = _problem(w, rows, x.dtype, batch_invariant)
    backend = _dispatch.select_backend(problem, implementation)
    if rows == 0:  # no rows: nothing to launch
        return jnp.zeros((*lead, n), out_dtype)
    if backend.name == "xla":
        # [N, K], K in x's order (an input permutation, act-order, applied to the weight)
        wd = dequantize_experts(layouts.to_canonical_layout(w), dtype=x.dtype)[0]
        y = dot_in_row_blocks(x2, wd) if batch_invariant else _dot_f32(x2, wd)
        if activation is not None:
            y = activate(y, activation)
    else:
        gemm = backend.grouped_matmul
        if batch_invariant:
            cfg, _ = batch_invariant_config(gemm.config, problem.shape, config)
        else:
            cfg, _ = gemm.config(problem.shape, config)
        x2 = inference_only(x2)  # a kernel: no gradients (the "xla" path has them)
        if w.perm is not None:  # act-order: x's features in the weight's input order
            x2, w = jnp.take(x2, w.perm[0], axis=1), dataclasses.replace(w, perm=None)
        if gemm.linear is not None:  # the backend's own path for one expert
            y = gemm.linear(x2, w, config=cfg, out_dtype=out_dtype, activation=activation)
            return y.reshape(*lead, n)
        y = gemm.run(
            x2,
            w,
            identity_routing(rows, cfg.block_m),
            top_k=1,
            config=cfg,
            out_dtype=jnp.float32,
            activation=activation,
        )
    return y.astype(out_dtype).reshape(*lead, n)
