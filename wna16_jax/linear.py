"""A quantized linear layer: y = x @ dequant(w).T for one WNA16 weight [1, N, K].

The non-expert linears of a quantized checkpoint (attention projections, dense MLPs, shared
experts) are the grouped GEMM with one expert: every row of x goes to expert 0, so the routing
is the identity padded to block_m and needs no alignment kernel. Backends:
- "xla": dequantize to x.dtype and one dot with f32 accumulation (any platform; what a float
  model of x's dtype computes);
- "pallas" / "pallas_interpret": the dequant-fused Pallas GEMM (pallas_kernels.triton.wna16_gemm),
  compiled on an NVIDIA GPU or in the interpreter.

Under GSPMD sharding (jit with sharded weights, no shard_map) a Pallas call cannot be
partitioned: XLA would gather the whole weight to every device. Use "xla" there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from wna16_jax import _configs, _dispatch
from wna16_jax._quant import dequantize_experts
from wna16_jax._types import AlignedRouting, BlockConfig, QuantizedExperts

LINEAR_IMPLEMENTATIONS = ("xla", "pallas", "pallas_interpret")


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


def _check(x, w: QuantizedExperts) -> None:
    e, _, k = w.shape
    if e != 1:
        raise ValueError(f"a quantized linear weight is [1, N, K], got {w.shape}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight K={k}")


def kernel_reason(w: QuantizedExperts) -> str | None:
    """Why the Pallas GEMM cannot run this weight's shape (None when it can)."""
    try:
        _configs.heuristic_config(_configs.GemmShape.of_weights(w, m=1))
    except ValueError as err:
        return str(err)
    return None


def default_implementation(w: QuantizedExperts) -> str:
    """The Pallas GEMM on a GPU where the kernels run this weight's shape, else xla."""
    if _dispatch.current_platform() != "gpu" or kernel_reason(w) is not None:
        return "xla"
    return "pallas"


@functools.partial(jax.jit, static_argnames=("implementation", "config"))
def quantized_matmul(
    x, w: QuantizedExperts, *, implementation: str | None = None, config: BlockConfig | None = None
):
    """y [..., N] = x [..., K] @ dequant(w[0]).T, accumulated in f32, rounded once to x.dtype.

    Args:
        x: [..., K] bf16 / f16 / f32.
        w: QuantizedExperts [1, N, K].
        implementation: "xla", "pallas", "pallas_interpret", or None (default_implementation).
        config: a BlockConfig for the Pallas GEMM (None: the tuned table, then the heuristic).
    """
    _check(x, w)
    implementation = implementation or default_implementation(w)
    if implementation not in LINEAR_IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={implementation!r} is not one of {LINEAR_IMPLEMENTATIONS}"
        )
    if implementation != "xla" and config is None and (reason := kernel_reason(w)):
        raise ValueError(f"implementation={implementation!r} cannot run this weight: {reason}")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:  # no rows: nothing to launch
        return jnp.zeros((*lead, w.n), x.dtype)
    if implementation == "xla":
        wd = dequantize_experts(w, dtype=x.dtype)[0]  # [N, K]
        # HIGHEST: f32 operands would otherwise run as TF32 on a GPU (measured rel err 2.7e-4
        # on the H200); 16-bit operands are exact products either way.
        y = jnp.einsum(
            "mk,nk->mn",
            x2,
            wd,
            preferred_element_type=jnp.float32,
            precision=jax.lax.Precision.HIGHEST,
        )
    else:
        from pallas_kernels.triton.wna16_gemm import wna16_gemm

        rows = x2.shape[0]
        shape = _configs.GemmShape.of_weights(w, m=rows)
        cfg, _ = _configs.resolve_config(shape, config)
        y = wna16_gemm(
            x2,
            w,
            identity_routing(rows, cfg.block_m),
            top_k=1,
            config=cfg,
            out_dtype=jnp.float32,
            interpret=implementation == "pallas_interpret",
        )
    return y.astype(x.dtype).reshape(*lead, w.n)
