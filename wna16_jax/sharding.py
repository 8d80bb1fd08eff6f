"""Expert, tensor and data parallelism for fused_moe: weight placement, expert maps, shard_map."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from wna16_jax import _api
from wna16_jax import linear as _linear
from wna16_jax._checks import as_int, ids_as_int32
from wna16_jax._dispatch import shard_granularity
from wna16_jax._quant import random_quantized_experts
from wna16_jax._types import ActivationQuant, BlockConfig, QuantizedExperts

logger = logging.getLogger("wna16_jax")

MODES = ("replicated", "all_to_all", "auto")
DISPATCHES = ("all_gather", "ragged")
# mode="auto" shards the tokens above this many (see fused_moe_ep). Not measured: at or below it
# one all-reduce (latency-bound) is taken to beat a gather plus a reduce-scatter.
DEFAULT_TOKEN_THRESHOLD = 256
# The dispatch of mode="all_to_all" when none is given: the only one XLA:CPU can run. "ragged"
# (fewer bytes on the wire: each token once per shard it needs) is opt-in, its speed unmeasured.
DEFAULT_DISPATCH = "all_gather"

_logged: set[tuple] = set()


def _log_once(key: tuple, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(msg, *args)


# ---- expert maps ----------------------------------------------------------------------------


def _check_divisible(num_experts: int, num_shards: int) -> None:
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be positive")
    if num_experts < 1 or num_experts % num_shards:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by num_shards={num_shards}; expert "
            f"parallelism needs the same number of experts on every shard"
        )


def expert_map_for_shard(num_experts: int, num_shards: int, shard_index: int) -> np.ndarray:
    """The expert_map of one shard under contiguous placement (E/n experts per shard).

    Shard s holds global experts [s*E/n, (s+1)*E/n) as local experts 0..E/n-1.

    Args:
        num_experts: E, the global number of experts.
        num_shards: n, the number of expert shards (must divide E).
        shard_index: s in [0, n).

    Returns:
        numpy int32 [E]: global id -> local id, -1 for experts of other shards.

    Raises:
        ValueError: n does not divide E, or s is out of range.
    """
    num_experts = as_int("num_experts", num_experts)
    num_shards = as_int("num_shards", num_shards)
    shard_index = as_int("shard_index", shard_index)
    _check_divisible(num_experts, num_shards)
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index={shard_index} is not in [0, num_shards={num_shards})")
    per = num_experts // num_shards
    local = np.arange(num_experts, dtype=np.int32) - shard_index * per
    return np.where((local >= 0) & (local < per), local, -1).astype(np.int32)


def expert_map_for_axis(num_experts: int, axis_name: str):
    """`expert_map_for_shard` for the calling shard, traced: use inside `jax.shard_map`.

    The shard index is `jax.lax.axis_index(axis_name)` and n the size of that mesh axis.

    Returns:
        int32 [E] jax array: global id -> local id, -1 for experts of other shards.
    """
    num_experts = as_int("num_experts", num_experts)
    num_shards = jax.lax.axis_size(axis_name)
    _check_divisible(num_experts, num_shards)
    per = num_experts // num_shards
    local = jnp.arange(num_experts, dtype=jnp.int32) - jax.lax.axis_index(axis_name) * per
    return jnp.where((local >= 0) & (local < per), local, -1).astype(jnp.int32)


# ---- partition specs and placement ----------------------------------------------------------


def expert_specs(
    qw: QuantizedExperts,
    *,
    expert_axis: str | None = None,
    n_axis: str | None = None,
    k_axis: str | None = None,
) -> QuantizedExperts:
    """The PartitionSpec of each array of `qw`, as a QuantizedExperts of specs (a pytree).

    Args:
        qw: the (global) weights [E, N, K]; only bits, group_size and has_zeros are read.
        expert_axis: mesh axis sharding E (expert parallelism), or None.
        n_axis: mesh axis sharding N (the output rows; w13 under tensor parallelism).
        k_axis: mesh axis sharding K (the input features; w2 under tensor parallelism). With
            group_size=-1 the scales and zeros (one group per row) are replicated over it.

    Returns:
        QuantizedExperts whose qweight/scales/zeros/perm are PartitionSpecs (zeros, perm None
        when qw has none; perm [E, K] is split on E only): usable as shard_map in_specs and,
        mapped to NamedShardings, as jit shardings.

    Raises:
        ValueError: k_axis with an input permutation (it spans all of K).
    """
    if qw.has_perm and k_axis is not None:
        raise ValueError(
            f"the weights have an input permutation (perm, act-order), which spans all of K: "
            f"K cannot be split over k_axis={k_axis!r}. For w2, fold it into w13's rows first "
            f"(wna16_jax.formats.fold_w2_act_order)"
        )
    return _specs(
        qw.bits,
        qw.group_size,
        qw.has_zeros,
        expert_axis,
        n_axis,
        k_axis,
        layout=qw.layout,
        has_perm=qw.has_perm,
        codes=qw.codes,
    )


def _specs(
    bits, group_size, has_zeros, expert_axis, n_axis, k_axis, layout="canonical", has_perm=False,
    codes="int",
) -> QuantizedExperts:  # fmt: skip
    k_groups = None if group_size == -1 else k_axis
    # Per-group arrays: [E, N, K//G] canonically, [E, K//G, N] in the mgpu layouts.
    per_group = (
        P(expert_axis, n_axis, k_groups)
        if layout == "canonical"
        else P(expert_axis, k_groups, n_axis)
    )
    return QuantizedExperts(
        qweight=P(expert_axis, n_axis, k_axis),
        scales=per_group,
        zeros=per_group if has_zeros else None,
        bits=bits,
        group_size=group_size,
        layout=layout,
        perm=P(expert_axis, None) if has_perm else None,
        codes=codes,
    )


def tensor_shard(qw: QuantizedExperts, num_shards: int, split: str) -> QuantizedExperts:
    """The first of `num_shards` tensor shards of `qw`: the arrays one tensor shard holds, cut
    where `expert_specs` splits them (split "n": w13's rows, n_axis; "k": w2's K, k_axis), in
    any layout. Shapes are what callers mostly need: wrap it in jax.eval_shape."""
    num_shards = as_int("num_shards", num_shards, minimum=1)
    if split not in ("n", "k"):
        raise ValueError(f"split={split!r} must be 'n' (w13's rows) or 'k' (w2's K)")
    specs = expert_specs(qw, **{f"{split}_axis": "tensor"})

    def cut(a, spec):
        for axis, name in enumerate(spec):
            if name == "tensor":
                return jax.lax.slice_in_dim(a, 0, a.shape[axis] // num_shards, axis=axis)
        return a

    fields = ("qweight", "scales", "zeros", "perm")
    return dataclasses.replace(
        qw,
        **{f: cut(getattr(qw, f), getattr(specs, f)) for f in fields if getattr(qw, f) is not None},
    )


def named_shardings(mesh: Mesh, specs: QuantizedExperts) -> QuantizedExperts:
    """Maps a QuantizedExperts of PartitionSpecs (from `expert_specs`) to NamedShardings."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def _axis_size(mesh: Mesh, axis: str | None, what: str) -> int:
    if axis is None:
        return 1
    if axis not in mesh.shape:
        raise ValueError(f"{what}={axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    return int(mesh.shape[axis])


def _put(qw: QuantizedExperts, mesh: Mesh, specs: QuantizedExperts) -> QuantizedExperts:
    # device_put of a host (numpy) array sends each device only its slice.
    return jax.device_put(qw, named_shardings(mesh, specs))


def shard_experts(qw: QuantizedExperts, mesh: Mesh, axis: str) -> QuantizedExperts:
    """Places each array of `qw` on `mesh` sharded on the expert dim: NamedSharding(P(axis)).

    Each device receives only its E/n experts when `qw` holds host (numpy) arrays. For weights
    too large for one host or device, build each shard where it lives instead, e.g.
    `jax.make_array_from_callback(shape, NamedSharding(mesh, P(axis)), load_slice)` per array
    (the checkpoint loader reads only the slice asked for), or `random_sharded_experts` for
    random weights of a given shape.

    Args:
        qw: QuantizedExperts [E, N, K] (numpy or jax arrays).
        mesh: the device mesh.
        axis: the mesh axis of expert parallelism; its size n must divide E.

    Returns:
        QuantizedExperts with the same values, sharded P(axis) on E.

    Raises:
        ValueError: `axis` not in the mesh, or n does not divide E.
    """
    qw.validate("qw")
    _check_divisible(qw.num_experts, _axis_size(mesh, axis, "axis"))
    return _put(qw, mesh, expert_specs(qw, expert_axis=axis))


def _check_tp(i: int, num_shards: int, qw: QuantizedExperts, what: str) -> None:
    """I/n must be whole, a whole number of packed words and of quantization groups."""
    num_shards = as_int("num_shards", num_shards, minimum=1)
    if i % num_shards:
        raise ValueError(
            f"{what}: the intermediate size I={i} is not divisible by the {num_shards} tensor "
            f"shards"
        )
    per = i // num_shards
    if per % qw.pack_factor:
        raise ValueError(
            f"{what}: I/n = {i}/{num_shards} = {per} is not a multiple of the "
            f"{qw.pack_factor} {qw.bits}-bit values packed per uint32 word"
        )
    if qw.group_size != -1 and per % qw.group_size:
        raise ValueError(
            f"{what}: I/n = {i}/{num_shards} = {per} is not a multiple of "
            f"group_size={qw.group_size}; each tensor shard must hold whole quantization groups"
        )
    _check_whole_tiles(i, num_shards, qw, what)


def _check_whole_tiles(i: int, num_shards: int, qw: QuantizedExperts, what: str) -> None:
    """A tensor shard of a kernel layout (I/n rows of w13's gate and up, or I/n of w2's K) must
    hold whole tiles (the layout's shard granularity)."""
    per = i // num_shards
    tile = shard_granularity(qw.layout)
    if per % tile:
        raise ValueError(
            f"{what}: I/n = {i}/{num_shards} = {per} is not a multiple of {tile}: each "
            f"tensor shard of the {qw.layout} layout must hold whole {tile}x{tile} "
            f"weight tiles (shard canonical weights, then convert each shard)"
        )


def interleave_w13_rows(a, num_shards: int, inverse: bool = False, axis: int = 1):
    """[E, 2R, ...] rows [gate; up] <-> [gate_0; up_0; gate_1; up_1; ...] (blocks of R/n), the
    rows along `axis` (1, or 2 for the per-group arrays of a kernel layout: [E, K//G, N]): one
    array of w13 (a field of QuantizedExperts, as `tp_interleave_w13` moves them, or float
    weights [E, 2I, H]); numpy or jax. inverse: back to [gate; up]."""
    if axis != 1:
        return interleave_w13_rows(a.swapaxes(1, axis), num_shards, inverse).swapaxes(1, axis)
    e, rows = a.shape[:2]
    rest = tuple(a.shape[2:])
    blk = rows // (2 * num_shards)
    src = (e, 2, num_shards, blk) if not inverse else (e, num_shards, 2, blk)
    return a.reshape(src + rest).swapaxes(1, 2).reshape((e, rows) + rest)


def tp_interleave_w13(w13: QuantizedExperts, num_shards: int) -> QuantizedExperts:
    """Reorders w13's rows so that n contiguous row blocks each hold [gate_s; up_s].

    w13 rows are [gate 0..I-1; up I..2I-1]; sharding them naively in n blocks would give the
    first shards only gate rows. After this reorder rows are [gate_0; up_0; gate_1; up_1; ...]
    with gate_s = gate rows [s*I/n, (s+1)*I/n), so block s of 2I/n rows is a valid w13 of the
    intermediate slice s (gate first, then up). Works on numpy (host) and jax arrays, in any
    layout (wna16_jax.layouts; the rows of the mgpu layouts' per-group arrays are their
    last dim).

    Args:
        w13: QuantizedExperts [E, 2I, H].
        num_shards: n, the tensor-parallel degree.

    Returns:
        QuantizedExperts [E, 2I, H] with rows interleaved (zero points moved with their rows).

    Raises:
        ValueError: I/n is not whole, or (for canonical int4 zero points) odd.
    """
    return _tp_reorder_w13(w13, num_shards, inverse=False)


def tp_deinterleave_w13(w13: QuantizedExperts, num_shards: int) -> QuantizedExperts:
    """Inverse of `tp_interleave_w13`: back to rows [gate; up]."""
    return _tp_reorder_w13(w13, num_shards, inverse=True)


def _tp_reorder_w13(w13: QuantizedExperts, num_shards: int, *, inverse: bool):
    num_shards = as_int("num_shards", num_shards, minimum=1)
    w13.validate("w13")
    i = w13.n // 2
    if w13.n % 2 or i % num_shards:
        raise ValueError(
            f"w13: the intermediate size I={w13.n / 2:g} (N={w13.n}) is not divisible by the "
            f"{num_shards} tensor shards"
        )
    canonical = w13.layout == "canonical"
    _check_whole_tiles(i, num_shards, w13, "w13")
    if canonical and w13.has_zeros and w13.bits == 4 and (i // num_shards) % 2:
        raise ValueError(
            f"w13: I/n = {i // num_shards} is odd; int4 zero points pack two rows per byte"
        )
    per_group_axis = 1 if canonical else 2  # [E, N, K//G] or [E, K//G, N]
    reorder = functools.partial(interleave_w13_rows, num_shards=num_shards, inverse=inverse)
    return dataclasses.replace(
        w13,
        qweight=reorder(w13.qweight),
        scales=reorder(w13.scales, axis=per_group_axis),
        zeros=None if w13.zeros is None else reorder(w13.zeros, axis=per_group_axis),
    )


def _put_reordered(qw, reorder, mesh, specs):
    if all(isinstance(a, np.ndarray) for a in jax.tree.leaves(qw)):
        return _put(reorder(qw), mesh, specs)  # reorder on the host, send slices
    # Jax arrays: reorder inside jit so that XLA partitions it over the output sharding.
    return jax.jit(reorder, out_shardings=named_shardings(mesh, specs))(qw)


def shard_w13_for_tp(
    w13: QuantizedExperts, mesh: Mesh, tensor_axis: str, *, expert_axis: str | None = None
) -> QuantizedExperts:
    """Places w13 for tensor parallelism: rows interleaved, then sharded on N over tensor_axis.

    The result holds rows in the `tp_interleave_w13` order (NOT the canonical [gate; up]), so
    that tensor shard s holds [gate_s; up_s]. Pass it only to `fused_moe_tp` /
    `fused_moe_ep(..., tensor_axis=)` with the same mesh axis; `tp_deinterleave_w13` undoes it.

    Args:
        w13: QuantizedExperts [E, 2I, H] with rows [gate; up], in any layout (the shard specs
            follow it); host (numpy) arrays are reordered on the host and each device gets
            only its slice.
        mesh: the device mesh.
        tensor_axis: mesh axis of tensor parallelism (size n): I/n must be a multiple of the
            packing (8 for int4, 4 for int8) and of group_size (w2's K is split the same way).
        expert_axis: optional mesh axis also sharding E (expert x tensor parallelism).

    Returns:
        QuantizedExperts [E, 2I, H] (interleaved rows) sharded P(expert_axis, tensor_axis).

    Raises:
        ValueError: an axis not in the mesh, or I/n, E/n_e not allowed (values quoted).
    """
    w13.validate("w13")
    n_t = _axis_size(mesh, tensor_axis, "tensor_axis")
    if expert_axis is not None:
        _check_divisible(w13.num_experts, _axis_size(mesh, expert_axis, "expert_axis"))
    specs = expert_specs(w13, expert_axis=expert_axis, n_axis=tensor_axis)
    return _put_reordered(w13, functools.partial(tp_interleave_w13, num_shards=n_t), mesh, specs)


def shard_w2_for_tp(
    w2: QuantizedExperts, mesh: Mesh, tensor_axis: str, *, expert_axis: str | None = None
) -> QuantizedExperts:
    """Places w2 [E, H, I] for tensor parallelism: sharded on K (= I) over tensor_axis.

    qweight [E, H, I//pf] and the scales / zeros [E, *, I//G] are split on their K dim
    (replicated when group_size=-1: one group spans the row), so I/n must be a multiple of
    the packing (8 for int4, 4 for int8) and of group_size. Any layout: the shard specs follow
    it (mgpu_int4 / mgpu_int8: qweight tiles [E, H/64, I/64, 64, 64], per-group arrays
    [E, I//G, H]).

    Args:
        w2: QuantizedExperts [E, H, I].
        mesh: the device mesh.
        tensor_axis: mesh axis of tensor parallelism.
        expert_axis: optional mesh axis also sharding E.

    Returns:
        QuantizedExperts [E, H, I] sharded P(expert_axis, None, tensor_axis).

    Raises:
        ValueError: an axis not in the mesh, or I/n, E/n_e not allowed (values quoted).
    """
    w2.validate("w2")
    n_t = _axis_size(mesh, tensor_axis, "tensor_axis")
    if expert_axis is not None:
        _check_divisible(w2.num_experts, _axis_size(mesh, expert_axis, "expert_axis"))
    _check_tp(w2.k, n_t, w2, "w2")
    return _put(w2, mesh, expert_specs(w2, expert_axis=expert_axis, k_axis=tensor_axis))


def random_sharded_experts(
    key,
    num_experts: int,
    n: int,
    k: int,
    *,
    bits: int = 4,
    group_size: int = 128,
    has_zeros: bool = True,
    dtype=jnp.bfloat16,
    mesh: Mesh,
    expert_axis: str | None = None,
    n_axis: str | None = None,
    k_axis: str | None = None,
) -> QuantizedExperts:
    """Random QuantizedExperts [E, N, K] generated directly in their sharding.

    `wna16_jax.random_quantized_experts` inside `jax.jit(out_shardings=...)` with partitionable
    random bits, so each device computes only its own slice and none ever holds all experts:
    this is how to make full-size (e.g. DeepSeek-V3) weights for benchmarks. The values do not
    depend on the mesh (with JAX's default `jax_threefry_partitionable=True`).

    Args:
        key: a jax PRNG key.
        num_experts, n, k: the logical shape [E, N, K].
        bits, group_size, has_zeros, dtype: the format (dtype = scales' dtype), as for
            `wna16_jax.random_quantized_experts`.
        mesh: the device mesh.
        expert_axis, n_axis, k_axis: mesh axes sharding E, N and K (see `expert_specs`).

    Returns:
        QuantizedExperts with every array sharded as `expert_specs` says.

    Raises:
        ValueError: as `wna16_jax.random_quantized_experts` (bits, K, group_size, N).
    """
    make = functools.partial(
        random_quantized_experts,
        shape=(num_experts, n, k),
        bits=bits,
        group_size=group_size,
        has_zeros=has_zeros,
        dtype=dtype,
    )
    specs = expert_specs(
        jax.eval_shape(make, key), expert_axis=expert_axis, n_axis=n_axis, k_axis=k_axis
    )
    return jax.jit(make, out_shardings=named_shardings(mesh, specs))(key)


# ---- the per-shard body ---------------------------------------------------------------------


def _local_moe(
    x, w13, w2, topk_weights, local_ids, *, activation, implementation, config, activation_quant
):
    """This shard's partial layer in f32 (the shards' partials are summed before rounding).

    local_ids already hold local expert ids (-1 = not here): the alignment then pads only the
    E_local runs, which is what fused_moe(..., expert_map=) computes, with fewer blocks.
    """
    return _api.fused_moe(
        x,
        w13,
        w2,
        topk_weights,
        local_ids,
        activation=activation,
        implementation=implementation,
        config=config,
        activation_quant=activation_quant,
        out_dtype=jnp.float32,
    )


def local_expert_ids(topk_ids, num_experts: int, expert_axis: str | None):
    """Global expert ids -> the calling shard's local ids: use inside `jax.shard_map`.

    Args:
        topk_ids: int [..., k] global ids.
        num_experts: E, the global number of experts.
        expert_axis: the mesh axis the experts are split over (contiguously, as
            `expert_map_for_axis` says), or None (every shard holds all E: ids kept).

    Returns:
        int32 [..., k]: local ids, -1 for experts of other shards and for ids outside [0, E).
    """
    num_experts = as_int("num_experts", num_experts, minimum=1)
    ids = ids_as_int32(topk_ids, num_experts)  # an int64 2**32 is out of range, not expert 0
    valid = (ids >= 0) & (ids < num_experts)
    if expert_axis is None:
        return jnp.where(valid, ids, -1)
    emap = expert_map_for_axis(num_experts, expert_axis)
    return jnp.where(valid, emap[jnp.clip(ids, 0, num_experts - 1)], -1)


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """`jax.lax.ragged_all_to_all` (one slice per peer) built from all_gather: any platform.

    The same result as the real collective but every shard receives every operand, so it is
    only for checking the ragged dispatch where XLA has no ragged-all-to-all (XLA:CPU).
    """
    del recv_sizes  # implied by the senders' send_sizes
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)  # [n, R_in, ...]
    in_off = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # [n] per sender
    sizes = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    out_off = jax.lax.all_gather(output_offsets, axis_name)[:, me]
    n, r_in = ops.shape[:2]
    r = jnp.arange(r_in, dtype=jnp.int32)[None, :]  # [1, R_in]
    inside = (r >= in_off[:, None]) & (r < in_off[:, None] + sizes[:, None])  # [n, R_in]
    dest = jnp.where(inside, out_off[:, None] + r - in_off[:, None], output.shape[0])
    rows = ops.reshape((n * r_in,) + ops.shape[2:])
    return output.at[dest.reshape(-1)].set(rows, mode="drop")


# The exchange of dispatch="ragged"; tests swap in `emulated_ragged_all_to_all` on CPU.
_ragged_all_to_all = jax.lax.ragged_all_to_all


def _exclusive_cumsum(a, axis=0):
    return jnp.cumsum(a, axis=axis) - a


def _ragged_moe(x, w13, w2, topk_weights, topk_ids, *, num_experts, expert_axis, **moe_kwargs):
    """Token-sharded EP with a ragged exchange: each token goes once to each shard it needs.

    x [T_l, H] and the routing [T_l, k] are this shard's tokens; returns f32 [T_l, H] summed
    over the experts of all shards.
    """
    t_l, h = x.shape
    k = topk_ids.shape[1]
    n = jax.lax.axis_size(expert_axis)
    me = jax.lax.axis_index(expert_axis)
    per = num_experts // n
    ids = topk_ids.astype(jnp.int32)
    valid = (ids >= 0) & (ids < num_experts)
    dest = jnp.where(valid, ids // per, -1)  # [T_l, k] shard of each slot
    shard = jnp.arange(n, dtype=jnp.int32)[:, None, None]  # [n, 1, 1]
    to_shard = dest[None] == shard  # [n, T_l, k]
    # Send rows are the (shard s, token t) pairs with a slot for s, grouped by s.
    pair_used = to_shard.any(-1).reshape(-1)  # [n*T_l], pair p = s*T_l + t
    send_sizes = to_shard.any(-1).sum(-1).astype(jnp.int32)  # [n]
    input_offsets = _exclusive_cumsum(send_sizes)
    pos = jnp.cumsum(pair_used.astype(jnp.int32)) - 1  # send row of each used pair
    cap = n * t_l  # worst case: every token to every shard
    pair_of_row = (
        jnp.zeros((cap,), jnp.int32)
        .at[jnp.where(pair_used, pos, cap)]
        .set(jnp.arange(cap, dtype=jnp.int32), mode="drop")
    )
    tok_of_row = pair_of_row % t_l
    local_ids = jnp.where(to_shard, ids[None] - shard * per, -1).reshape(cap, k)[pair_of_row]
    # One f32 payload for ids (exact below 2^24) and weights: [cap, 2k].
    meta = jnp.concatenate(
        [local_ids.astype(jnp.float32), topk_weights[tok_of_row].astype(jnp.float32)], axis=1
    )
    sizes_all = jax.lax.all_gather(send_sizes, expert_axis)  # [n, n]: sender j -> receiver r
    output_offsets = _exclusive_cumsum(sizes_all, axis=0)[me]  # where my rows land on each r
    recv_sizes = sizes_all[:, me]
    exchange = functools.partial(_ragged_all_to_all, axis_name=expert_axis)
    x_recv = exchange(
        x[tok_of_row],
        jnp.zeros((cap, h), x.dtype),
        input_offsets,
        send_sizes,
        output_offsets,
        recv_sizes,
    )
    meta_recv = exchange(
        meta,
        jnp.zeros((cap, 2 * k), jnp.float32),
        input_offsets,
        send_sizes,
        output_offsets,
        recv_sizes,
    )
    got = jnp.arange(cap)[:, None] < recv_sizes.sum()
    ids_recv = jnp.where(got, meta_recv[:, :k].astype(jnp.int32), -1)
    y = _local_moe(x_recv, w13, w2, meta_recv[:, k:], ids_recv, **moe_kwargs)  # [cap, H]
    # Send each result row back to where its token came from.
    offsets_all = jax.lax.all_gather(input_offsets, expert_axis)  # [n, n]
    back = exchange(
        y,
        jnp.zeros((cap, h), y.dtype),
        _exclusive_cumsum(recv_sizes),
        recv_sizes,
        offsets_all[:, me],
        send_sizes,
    )
    row_used = jnp.arange(cap) < send_sizes.sum()
    out = jnp.zeros((t_l, h), jnp.float32)
    out = out.at[jnp.where(row_used, tok_of_row, t_l)].add(back.astype(jnp.float32), mode="drop")
    return out  # f32: the caller rounds once after any psum


def fused_moe_local_shard(
    x,
    w13: QuantizedExperts,
    w2: QuantizedExperts,
    topk_weights,
    topk_ids,
    *,
    num_experts: int,
    expert_axis: str | None = None,
    tensor_axis: str | None = None,
    mode: str = "replicated",
    dispatch: str = DEFAULT_DISPATCH,
    activation: str = "silu",
    implementation: str | Sequence[str] | None = None,
    config: BlockConfig | None = None,
    activation_quant: str | ActivationQuant | None = None,
):
    """The per-shard body of sharded fused_moe: call it inside your own `jax.shard_map`.

    Experts are placed contiguously over `expert_axis` (shard s holds global experts
    [s*E/n, (s+1)*E/n)); under `tensor_axis` each shard holds an I-slice, w13 interleaved as
    `shard_w13_for_tp` makes it. The collectives run over the named axes, so the enclosing
    shard_map must map them, and for now pass `check_vma=False`: neither the 'xla' backend's
    loops nor the Pallas calls annotate device-varying values yet.

    Args:
        x: this shard's tokens: [T, H] (mode "replicated") or [T/n, H] (mode "all_to_all",
            tokens sharded over expert_axis, or over tensor_axis when there is no expert axis).
        w13: local QuantizedExperts [E/n_e, 2I/n_t, H].  w2: local [E/n_e, H, I/n_t].
        topk_weights: [T or T/n, k] float.  topk_ids: [T or T/n, k] int global expert ids;
            ids outside [0, num_experts) are dropped.
        num_experts: E, the global number of experts.
        expert_axis: the mesh axis sharding the experts, or None.
        tensor_axis: the mesh axis sharding I, or None.
        mode: "replicated" (every shard has all tokens; one psum) or "all_to_all" (tokens
            sharded; dispatched to the experts' shards and the results sent back).
        dispatch: for mode "all_to_all": "all_gather" (gather all tokens, reduce-scatter the
            partial outputs) or "ragged" (`jax.lax.ragged_all_to_all`: each token is sent once
            to each shard holding one of its experts; not implemented by XLA:CPU).
        activation, implementation, config, activation_quant: as for `wna16_jax.fused_moe` on
            the local shard. Under `tensor_axis`, "int8_per_token" scales GEMM2's input rows by
            their maximum over this shard's I/n slice (each shard quantizes the activations it
            holds); static scales are the same on every shard.

    Returns:
        [T, H] (replicated) or [T/n, H] (this shard's tokens) in x.dtype: the whole layer.
    """
    moe_kwargs = dict(
        activation=activation,
        implementation=implementation,
        config=config,
        activation_quant=activation_quant,
    )
    if mode not in ("replicated", "all_to_all"):
        raise ValueError(f"mode={mode!r} must be 'replicated' or 'all_to_all' inside a shard")
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch={dispatch!r} must be one of {DISPATCHES}")
    if mode == "replicated":
        local_ids = local_expert_ids(topk_ids, num_experts, expert_axis)
        y = _local_moe(x, w13, w2, topk_weights, local_ids, **moe_kwargs)  # f32 partial
        axes = tuple(a for a in (expert_axis, tensor_axis) if a is not None)
        return (jax.lax.psum(y, axes) if axes else y).astype(x.dtype)
    token_axis = expert_axis if expert_axis is not None else tensor_axis
    if token_axis is None:
        raise ValueError("mode='all_to_all' needs an expert_axis or a tensor_axis")
    rest = tensor_axis if expert_axis is not None else None
    if dispatch == "ragged":
        if expert_axis is None:
            raise ValueError("dispatch='ragged' needs an expert_axis (it routes tokens to experts)")
        y = _ragged_moe(
            x,
            w13,
            w2,
            topk_weights,
            topk_ids,
            num_experts=num_experts,
            expert_axis=expert_axis,
            **moe_kwargs,
        )
    else:
        xs = jax.lax.all_gather(x, token_axis, tiled=True)  # [T, H]
        ws = jax.lax.all_gather(topk_weights, token_axis, tiled=True)
        ids = jax.lax.all_gather(topk_ids.astype(jnp.int32), token_axis, tiled=True)
        local_ids = local_expert_ids(ids, num_experts, expert_axis)
        y = _local_moe(xs, w13, w2, ws, local_ids, **moe_kwargs)  # [T, H] partial
        y = jax.lax.psum_scatter(y, token_axis, scatter_dimension=0, tiled=True)  # [T/n, H]
    # The partials are f32 up to here: one rounding to x.dtype, as unsharded.
    return (jax.lax.psum(y, rest) if rest is not None else y).astype(x.dtype)


# ---- global entry points --------------------------------------------------------------------


def _place(a, mesh: Mesh, spec: P):
    """Reshards `a` to spec on meshes with Explicit axes (shard_map reshards Auto ones)."""
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.reshard(a, NamedSharding(mesh, spec))
    return a


def _sharded(
    x,
    w13,
    w2,
    topk_weights,
    topk_ids,
    *,
    mesh: Mesh,
    expert_axis: str | None,
    tensor_axis: str | None,
    data_axis: str | None,
    mode: str,
    dispatch: str | None,
    token_threshold: int,
    activation: str,
    implementation,
    config,
    activation_quant,
):
    _api.validate_fused_moe_inputs(x, w13, w2, topk_weights, topk_ids, None, activation)
    activation_quant = _api.normalize_activation_quant(activation_quant)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {MODES}")
    named = {"expert_axis": expert_axis, "tensor_axis": tensor_axis, "data_axis": data_axis}
    named = {k: v for k, v in named.items() if v is not None}
    if len(set(named.values())) < len(named):
        raise ValueError(f"the mesh axes must differ, got {named}")
    n_e = _axis_size(mesh, expert_axis, "expert_axis")
    n_t = _axis_size(mesh, tensor_axis, "tensor_axis")
    n_d = _axis_size(mesh, data_axis, "data_axis")
    e = w13.num_experts
    _check_divisible(e, n_e)
    i = w13.n // 2
    if tensor_axis is not None:
        _check_tp(i, n_t, w2, "w2")
    t = int(x.shape[0])
    if expert_axis is None and tensor_axis is None:
        mode = "replicated"  # no axis to exchange tokens over: each data shard keeps its own
    if mode == "auto":
        mode = "replicated" if t <= token_threshold else "all_to_all"
        _log_once(
            ("auto", mode, token_threshold),
            "wna16_jax: sharded fused_moe uses mode=%r (T=%d, token_threshold=%d)",
            mode,
            t,
            token_threshold,
        )
    if dispatch is None:
        dispatch = DEFAULT_DISPATCH
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch={dispatch!r} must be one of {DISPATCHES}")
    if mode == "all_to_all" and dispatch == "ragged":
        if expert_axis is None:
            raise ValueError("dispatch='ragged' needs an expert_axis (it routes tokens to experts)")
        platform = mesh.devices.flat[0].platform
        if _ragged_all_to_all is jax.lax.ragged_all_to_all and platform == "cpu":
            raise NotImplementedError(
                "dispatch='ragged' uses jax.lax.ragged_all_to_all, which XLA:CPU does not "
                "implement; use dispatch='all_gather' on CPU"
            )
    w13_specs = expert_specs(w13, expert_axis=expert_axis, n_axis=tensor_axis)
    w2_specs = expert_specs(w2, expert_axis=expert_axis, k_axis=tensor_axis)
    # The tokens: split over data_axis (data parallelism) and, in mode "all_to_all", within
    # each data shard over the token axis (the expert axis, else the tensor axis).
    token_axes = (data_axis,) if data_axis is not None else ()
    n_tok = n_d
    if mode == "all_to_all":
        token_axes += (expert_axis if expert_axis is not None else tensor_axis,)
        n_tok *= n_e if expert_axis is not None else n_t
    tok = P(token_axes if len(token_axes) > 1 else token_axes[0]) if token_axes else P()
    pad = -t % n_tok
    if pad:  # padding tokens route to id -1: dropped
        x = jnp.pad(x, ((0, pad), (0, 0)))
        topk_weights = jnp.pad(topk_weights, ((0, pad), (0, 0)))
        topk_ids = jnp.pad(topk_ids, ((0, pad), (0, 0)), constant_values=-1)
    body = functools.partial(
        fused_moe_local_shard,
        num_experts=e,
        expert_axis=expert_axis,
        tensor_axis=tensor_axis,
        mode=mode,
        dispatch=dispatch,
        activation=activation,
        implementation=implementation,
        config=config,
        activation_quant=activation_quant,
    )
    w13 = jax.tree.map(lambda a, spec: _place(a, mesh, spec), w13, w13_specs)
    w2 = jax.tree.map(lambda a, spec: _place(a, mesh, spec), w2, w2_specs)
    x, topk_weights, topk_ids = (_place(a, mesh, tok) for a in (x, topk_weights, topk_ids))
    out = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(tok, w13_specs, w2_specs, tok, tok),
        out_specs=tok,
        check_vma=False,
    )(x, w13, w2, topk_weights, topk_ids)
    if pad:
        # A token count that is not a multiple of the shards cannot stay sharded once sliced.
        out = _place(out, mesh, P())[:t]
    return out


def fused_moe_ep(
    x,
    w13: QuantizedExperts,
    w2: QuantizedExperts,
    topk_weights,
    topk_ids,
    *,
    mesh: Mesh,
    expert_axis: str | None,
    tensor_axis: str | None = None,
    data_axis: str | None = None,
    mode: str = "auto",
    dispatch: str | None = None,
    token_threshold: int = DEFAULT_TOKEN_THRESHOLD,
    activation: str = "silu",
    implementation: str | Sequence[str] | None = None,
    config: BlockConfig | None = None,
    activation_quant: str | ActivationQuant | None = None,
):
    """fused_moe with the experts sharded over a mesh axis (expert parallelism).

    Each shard runs `wna16_jax.fused_moe` on its E/n experts inside `jax.shard_map`:
    - mode "replicated" (decode): the tokens are replicated; each shard computes the
      contribution of its experts and one `psum` over expert_axis adds them up.
    - mode "all_to_all" (large batches): the tokens are sharded over expert_axis; with
      dispatch "all_gather" (default) every shard gathers all tokens, runs its experts and a
      `psum_scatter` returns each token shard its sum; with dispatch "ragged" each token is
      sent once to each shard holding one of its experts (`jax.lax.ragged_all_to_all`,
      GPU/TPU only) and the results come back the same way. T need not divide by n (padded).
    - mode "auto": "replicated" for T <= token_threshold, else "all_to_all" (logged once).
    With `tensor_axis` (a second mesh axis) every expert is also split on I as in
    `fused_moe_tp` and the partial outputs are summed over it too (expert x tensor parallel).
    With `data_axis` the tokens are split over it first (data parallelism: each data shard runs
    the layer above on its own tokens, the weights replicated over data_axis); with
    expert_axis=None the experts stay whole (tensor or data parallelism alone), and with no
    expert or tensor axis every mode runs "replicated".

    Usable under `jax.jit` (wrap it: the shard_map then compiles once). The weights must be
    placed as `shard_experts` (or, with tensor_axis, `shard_w13_for_tp` / `shard_w2_for_tp`)
    places them, so that no weight byte moves; the output is replicated ("replicated") or
    sharded over expert_axis ("all_to_all" with T a multiple of n).

    Args:
        x: [T, H] activations.
        w13: global QuantizedExperts [E, 2I, H] sharded P(expert_axis) on E (with
            tensor_axis: interleaved by `shard_w13_for_tp`, P(expert_axis, tensor_axis)).
        w2: global QuantizedExperts [E, H, I] sharded P(expert_axis) (with tensor_axis:
            P(expert_axis, None, tensor_axis)).
        topk_weights: [T, k] float.  topk_ids: [T, k] int global ids (out-of-range dropped).
        mesh: the device mesh.
        expert_axis: the mesh axis sharding E; its size n must divide E. None: not split.
        tensor_axis: optional mesh axis sharding I.
        data_axis: optional mesh axis sharding the tokens T (the batch).
        mode: "replicated", "all_to_all" or "auto".
        dispatch: "all_gather" or "ragged" for mode "all_to_all"; None = DEFAULT_DISPATCH.
        token_threshold: the largest T that mode "auto" runs replicated.
        activation, implementation, config, activation_quant: as for `wna16_jax.fused_moe`
            per shard (`fused_moe_local_shard`: with tensor_axis, "int8_per_token" scales
            GEMM2's rows per shard).

    Returns:
        [T, H] in x.dtype.

    Raises:
        ValueError: malformed inputs, an axis not in the mesh, n not dividing E, or an I/n
            tensor slice that is not whole packed words and groups (values quoted).
        NotImplementedError: dispatch "ragged" on CPU.
    """
    return _sharded(
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        mesh=mesh,
        expert_axis=expert_axis,
        tensor_axis=tensor_axis,
        data_axis=data_axis,
        mode=mode,
        dispatch=dispatch,
        token_threshold=token_threshold,
        activation=activation,
        implementation=implementation,
        config=config,
        activation_quant=activation_quant,
    )


def fused_moe_tp(
    x,
    w13: QuantizedExperts,
    w2: QuantizedExperts,
    topk_weights,
    topk_ids,
    *,
    mesh: Mesh,
    tensor_axis: str,
    mode: str = "replicated",
    token_threshold: int = DEFAULT_TOKEN_THRESHOLD,
    activation: str = "silu",
    implementation: str | Sequence[str] | None = None,
    config: BlockConfig | None = None,
    activation_quant: str | ActivationQuant | None = None,
):
    """fused_moe with the intermediate dim I sharded over a mesh axis (tensor parallelism).

    Shard s holds every expert's gate and up rows [s*I/n, (s+1)*I/n) (w13 interleaved by
    `shard_w13_for_tp`) and the matching input columns of w2 (`shard_w2_for_tp`); silu(gate)
    * up is elementwise in I, so each shard computes a partial [T, H] and a psum over
    tensor_axis adds them. mode "replicated" (default): tokens replicated; "all_to_all":
    tokens sharded over tensor_axis, gathered before and reduce-scattered after (sequence
    parallel); "auto": as in `fused_moe_ep`.

    Args:
        x: [T, H].  w13: [E, 2I, H] placed by `shard_w13_for_tp`.  w2: [E, H, I] placed by
            `shard_w2_for_tp`.  topk_weights, topk_ids: [T, k].
        mesh: the device mesh.  tensor_axis: the mesh axis sharding I (size n): I/n must be a
            multiple of the packing (8 for int4, 4 for int8) and of group_size.
        mode, token_threshold, activation, implementation, config, activation_quant: as in
            `fused_moe_ep`.

    Returns:
        [T, H] in x.dtype.

    Raises:
        ValueError: malformed inputs, an axis not in the mesh, or a bad I/n (values quoted).
    """
    return _sharded(
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        mesh=mesh,
        expert_axis=None,
        tensor_axis=tensor_axis,
        data_axis=None,
        mode=mode,
        dispatch="all_gather",
        token_threshold=token_threshold,
        activation=activation,
        implementation=implementation,
        config=config,
        activation_quant=activation_quant,
    )


# ---- the quantized linear under a mesh ----------------------------------------------------------


def linear_specs(w: QuantizedExperts, *, n_axis: str | None = None, k_axis: str | None = None):
    """The PartitionSpecs of a linear weight [1, N, K] with N over n_axis (column parallel)
    and K over k_axis (row parallel), in its layout: `expert_specs` with no expert axis."""
    return expert_specs(w, n_axis=n_axis, k_axis=k_axis)


def _check_linear_shards(w: QuantizedExperts, n_n: int, n_k: int) -> None:
    """Each shard must hold whole packed words, groups and (kernel layouts) 64 x 64 tiles."""
    _, n, k = w.shape
    problems = []
    per_word = 32 // w.bits
    tile = shard_granularity(w.layout)
    if n % (n_n * tile) or (w.has_zeros and w.layout == "canonical" and n // n_n % 2):
        problems.append(f"N={n} does not split into {n_n} shards of whole {tile}-row tiles")
    unit = max(per_word if w.layout == "canonical" else tile, 1)
    if w.group_size != -1:
        unit = max(unit, w.group_size)
    if k % (n_k * unit):
        problems.append(f"K={k} does not split into {n_k} shards of whole units of {unit}")
    if problems:
        raise ValueError(f"linear weight {w.shape} ({w.layout}): " + "; ".join(problems))


def quantized_matmul_sharded(
    x,
    w: QuantizedExperts,
    *,
    mesh: Mesh,
    row_axis: str | None = None,
    n_axis: str | None = None,
    k_axis: str | None = None,
    activation: str | None = None,
    out_dtype=None,
    implementation: str | Sequence[str] | None = None,
    config=None,
):
    """`wj.linear.quantized_matmul` per device through `jax.shard_map`: each device runs the
    kernel on its own rows and its own slice of the weight (a kernel call cannot be partitioned
    by GSPMD, which would gather the whole weight to every device).

    x's leading dim is split over row_axis (data parallel); the weight [1, N, K] (placed with
    `linear_specs`) has N over n_axis (column parallel: each device computes its slice of the
    output features) and K over k_axis (row parallel: x's features are split the same way, each
    device's partial sums are added in f32 by a psum over k_axis, then rounded once).

    Args:
        x: [R, ..., K]; R split over row_axis, K over k_axis.
        w: QuantizedExperts [1, N, K] in any layout its implementation reads.
        mesh: the device mesh; row_axis, n_axis, k_axis: its axes (None: not split).
        activation: as in quantized_matmul (a gated weight): with n_axis each shard's rows
            must be its own [gate; up] (`tp_interleave_w13`); not with k_axis (the activation
            needs whole sums).
        out_dtype, implementation, config: as in quantized_matmul.

    Returns:
        [R, ..., N] (N/2 with activation) in out_dtype (default x.dtype), R over row_axis and the
        features over n_axis.

    Raises:
        ValueError: an axis not in the mesh, axes repeated, activation with k_axis, or a weight
            that does not split into whole words, groups and tiles (values quoted).
    """
    named = {"row_axis": row_axis, "n_axis": n_axis, "k_axis": k_axis}
    named = {key: a for key, a in named.items() if a is not None}
    if len(set(named.values())) < len(named):
        raise ValueError(f"the mesh axes must differ, got {named}")
    sizes = {key: _axis_size(mesh, a, key) for key, a in named.items()}
    if activation is not None and k_axis is not None:
        raise ValueError(
            f"activation={activation!r} needs whole sums: it cannot run with K split over "
            f"k_axis={k_axis!r}"
        )
    _check_linear_shards(w, sizes.get("n_axis", 1), sizes.get("k_axis", 1))
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    lead = (None,) * (x.ndim - 2)
    x_spec = P(row_axis, *lead, k_axis)
    out_spec = P(row_axis, *lead, n_axis)

    def body(x, w):
        partial_dtype = jnp.float32 if k_axis is not None else out_dtype
        y = _linear.quantized_matmul(
            x, w, activation=activation, out_dtype=partial_dtype,
            implementation=implementation, config=config,
        )  # fmt: skip
        if k_axis is not None:
            y = jax.lax.psum(y, k_axis).astype(out_dtype)
        return y

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(x_spec, linear_specs(w, n_axis=n_axis, k_axis=k_axis)),
        out_specs=out_spec,
        check_vma=False,
    )(_place(x, mesh, x_spec), w)
