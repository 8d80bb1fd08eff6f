"""The sharding base every family builds on: meshes of three named axes, several hosts, fake
CPU devices, and the helpers that move weights between layouts and devices.

Three mesh axes: `expert` shards the routed experts (expert parallelism), `tensor` the
experts' intermediate dim and the attention heads (tensor parallelism), `data` the batch. A
family's sharding module holds its ShardingSpecs (one PartitionSpec per weight and activation)
and places its model on a mesh made here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import wna16_jax as wj
from models.common.causal_lm import KVCache

logger = logging.getLogger("models")

DATA, EXPERT, TENSOR = "data", "expert", "tensor"
AXES = (DATA, EXPERT, TENSOR)


# ---- meshes ---------------------------------------------------------------------------------


def make_mesh(expert: int = 1, tensor: int = 1, data: int = 1, *, devices=None) -> Mesh:
    """A `jax.make_mesh` mesh with axes ("data", "expert", "tensor") (Auto axis types).

    `tensor` is the innermost axis, so tensor-parallel partners are neighbouring devices.

    Args:
        expert: size of the expert-parallel axis (must divide n_routed_experts).
        tensor: size of the tensor-parallel axis (experts' I and the attention heads).
        data: size of the data-parallel axis (the batch).
        devices: the devices to use (default: the first data*expert*tensor of `jax.devices()`,
            which with several hosts are all processes' devices).

    Raises:
        ValueError: a size below 1, or more devices asked for than exist.
    """
    sizes = {DATA: data, EXPERT: expert, TENSOR: tensor}
    bad = {k: v for k, v in sizes.items() if not isinstance(v, (int, np.integer)) or v < 1}
    if bad:
        raise ValueError(f"mesh axis sizes must be positive integers, got {bad}")
    n = data * expert * tensor
    if devices is None:
        avail = jax.devices()
        if n > len(avail):
            raise ValueError(
                f"mesh data={data} x expert={expert} x tensor={tensor} needs {n} devices, JAX "
                f"has {len(avail)} ({jax.default_backend()}); on CPU start JAX with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={n} (examples/generate.py: "
                f"--cpu-devices {n})"
            )
        devices = None if n == len(avail) else avail[:n]
    elif len(devices) != n:
        raise ValueError(f"mesh of {n} devices, but {len(devices)} devices were given")
    return jax.make_mesh(
        (data, expert, tensor), AXES, axis_types=(AxisType.Auto,) * 3, devices=devices
    )


def parse_mesh(text: str) -> dict[str, int]:
    """ "expert=2,tensor=2" -> {"expert": 2, "tensor": 2}: the keyword arguments of make_mesh.

    Raises:
        ValueError: an unknown axis name, a repeated one, or a size that is not a positive int.
    """
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in AXES:
            raise ValueError(f"mesh {text!r}: {part!r} is not <axis>=<size> with axis in {AXES}")
        if name in out:
            raise ValueError(f"mesh {text!r}: axis {name!r} given twice")
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1:
            raise ValueError(f"mesh {text!r}: size of {name!r} must be a positive integer")
        out[name] = size
    return out


def describe(mesh: Mesh | None) -> str:
    """A one-line description, e.g. "data=1 x expert=2 x tensor=2 on 4 cpu devices"."""
    if mesh is None:
        return f"none (one {jax.default_backend()} device)"
    axes = " x ".join(f"{name}={size}" for name, size in mesh.shape.items())
    procs = len({d.process_index for d in mesh.devices.flat})
    where = f" in {procs} processes" if procs > 1 else ""
    return f"{axes} on {mesh.devices.size} {mesh.devices.flat[0].platform} devices{where}"


def maybe_initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    initialize: Callable[..., None] | None = None,
) -> bool:
    """Starts JAX's multi-process runtime (`jax.distributed.initialize`) when asked to.

    Call it first thing on every host, before JAX touches a device, with the same coordinator
    ("host:port" of process 0) and process count everywhere and each host's own process id;
    afterwards `jax.devices()` lists every host's devices and `make_mesh` spans them. With no
    arguments (or num_processes=1) nothing happens: a single process.

    Args:
        coordinator_address: "host:port" of process 0's coordinator service.
        num_processes: the number of processes (hosts) taking part.
        process_id: this process's index in [0, num_processes).
        initialize: the function called (default `jax.distributed.initialize`; tests swap it).

    Returns:
        True when the multi-process runtime is (now) initialized, False for a single process.

    Raises:
        ValueError: only some of the three are given, or process_id is out of range.
    """
    given = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    if all(v is None for v in given.values()) or (
        num_processes == 1 and coordinator_address is None
    ):
        return False
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ValueError(
            f"multi-process JAX needs coordinator_address, num_processes and process_id; "
            f"missing {missing} (given {given})"
        )
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} is not in [0, num_processes={num_processes})")
    if initialize is None:
        if jax.distributed.is_initialized():
            logger.info("jax.distributed is already initialized")
            return True
        initialize = jax.distributed.initialize
    logger.info(
        "jax.distributed.initialize(coordinator=%s, num_processes=%d, process_id=%d)",
        coordinator_address,
        num_processes,
        process_id,
    )
    initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )
    return True


def use_cpu_devices(n: int) -> None:
    """Makes JAX run on `n` fake CPU devices (XLA_FLAGS' host platform device count).

    Works only before JAX has started its backend (the first `jax.devices()` or computation;
    importing jax is fine): call it at the top of main().

    Raises:
        RuntimeError: JAX already runs with another number of devices.
    """
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    )
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    jax.config.update("jax_platforms", "cpu")
    if jax.device_count() != n or jax.default_backend() != "cpu":
        raise RuntimeError(
            f"asked for {n} CPU devices but JAX already runs with {jax.device_count()} "
            f"{jax.default_backend()} device(s): set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={n} JAX_PLATFORMS=cpu before JAX starts"
        )


def host_device():
    """This host's CPU device, where host-side conversions run (None where JAX runs without
    its CPU backend, e.g. JAX_PLATFORMS=cuda)."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None


def reorder_w13(w13, from_shards: int, to_shards: int):
    """w13 (QuantizedExperts or float [E, 2I, H], numpy or jax) with rows interleaved for
    `from_shards` tensor shards -> interleaved for `to_shards` (1 = canonical [gate; up])."""
    if from_shards == to_shards:
        return w13
    if isinstance(w13, wj.QuantizedExperts):
        if from_shards != 1:
            w13 = wj.sharding.tp_deinterleave_w13(w13, from_shards)
        return w13 if to_shards == 1 else wj.sharding.tp_interleave_w13(w13, to_shards)
    if from_shards != 1:
        w13 = wj.sharding.interleave_w13_rows(w13, from_shards, inverse=True)
    return w13 if to_shards == 1 else wj.sharding.interleave_w13_rows(w13, to_shards)


def state_shardings(state):
    """The shardings of the arrays of a state (its current placement), as a tree."""
    return jax.tree.map(lambda a: a.sharding, state)


# ---- a sharded model's plan -----------------------------------------------------------------


MOE_MODES = ("replicated", "all_to_all", "auto")


@dataclasses.dataclass(frozen=True)
class ShardedExperts:
    """What every family's ModelSharding shares: its mesh, its specs (the family's
    ShardingSpecs), the MoE token mode, and from them the routed experts on the mesh, the
    batch check and the cache's shardings. A family's subclass gives the axes
    (`expert_axis`, `tensor_axis`, `data_axis`: a name or None) and `cache_specs`.

    Static (hashable): the modules hold it as an attribute, so it is part of the graphdef and
    every trace sees it. `moe_mode` as in `wna16_jax.sharding.fused_moe_ep`: "replicated"
    (every device sees every token; one psum), "all_to_all" (tokens split over the expert
    axis, gathered and reduce-scattered) or "auto" (replicated up to `token_threshold`
    tokens).
    """

    mesh: Mesh
    specs: Any
    moe_mode: str = "replicated"
    token_threshold: int = wj.sharding.DEFAULT_TOKEN_THRESHOLD

    def __post_init__(self):
        if self.moe_mode not in MOE_MODES:
            raise ValueError(f"moe_mode={self.moe_mode!r} is not one of {MOE_MODES}")

    def size(self, entry) -> int:
        """Devices along a spec entry (an axis name, a tuple of names, or None)."""
        if entry is None:
            return 1
        names = entry if isinstance(entry, tuple) else (entry,)
        return int(np.prod([self.mesh.shape[a] for a in names]))

    @property
    def expert_shards(self) -> int:
        return self.size(self.expert_axis)

    @property
    def tensor_shards(self) -> int:
        return self.size(self.tensor_axis)

    def named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def check_batch(self, batch: int) -> None:
        n = self.size(self.data_axis)
        if batch % n:
            raise ValueError(
                f"batch {batch} is not divisible by the data axis ({n} devices); pad the batch "
                f"or use a mesh with data=1"
            )

    def cache_specs(self) -> tuple[P, P, P]:
        """The PartitionSpecs of a cache layer [B, L, ...], of its valid slots [B, L] and of
        its next positions [B]."""
        raise NotImplementedError(f"{type(self).__name__} does not define cache_specs")

    def cache_shardings(self, num_layers: int) -> KVCache:
        """NamedShardings of a KVCache (a KVCache of shardings)."""
        layer, valid, pos = self.cache_specs()
        return KVCache(
            layers=(self.named(layer),) * num_layers,
            valid=self.named(valid),
            next_pos=self.named(pos),
            index=self.named(P()),
        )

    def quantized_moe(
        self, x, w13, w2, topk_weights, topk_ids, *, implementation=None, activation_quant=None
    ):
        """The routed experts of one layer: `wna16_jax.sharding.fused_moe_ep` over this mesh's
        expert, tensor and data axes (each device runs its own experts; no weight moves).

        Args:
            x: [T, H].  w13: QuantizedExperts [E, 2I, H], E over the expert axis, rows over
                the tensor axis (interleaved for it).  w2: [E, H, I], I over the tensor axis.
            topk_weights: f32 [T, k].  topk_ids: int32 [T, k] global expert ids.
            implementation: the fused_moe backend.
            activation_quant: None or the experts' W8A8 activation quantization (fused_moe's),
                run on every shard.

        Returns:
            [T, H] in x.dtype.
        """
        return wj.sharding.fused_moe_ep(
            x,
            w13,
            w2,
            topk_weights,
            topk_ids,
            mesh=self.mesh,
            expert_axis=self.expert_axis,
            tensor_axis=self.tensor_axis,
            data_axis=self.data_axis,
            mode=self.moe_mode,
            token_threshold=self.token_threshold,
            implementation=implementation,
            activation_quant=activation_quant,
        )

    def float_moe(self, local_fn, x, w13, w2, topk_weights, topk_ids):
        """Float routed experts (tokens replicated): `local_fn(x, w13, w2, weights, local_ids)`
        on each device's experts (local_ids -1 for experts elsewhere), psum over the expert and
        tensor axes. Shapes as in `quantized_moe` with float w13 / w2."""
        ea, ta = self.expert_axis, self.tensor_axis
        num_experts = w13.shape[0]

        def body(x, w13, w2, topk_weights, topk_ids):
            ids = wj.sharding.local_expert_ids(topk_ids, num_experts, ea)
            y = local_fn(x, w13, w2, topk_weights, ids)
            axes = tuple(a for a in (ea, ta) if a is not None)
            return jax.lax.psum(y, axes) if axes else y

        tok = P(self.data_axis)
        return jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(tok, P(ea, ta, None), P(ea, None, ta), tok, tok),
            out_specs=tok,
            check_vma=False,
        )(x, w13, w2, topk_weights, topk_ids)
