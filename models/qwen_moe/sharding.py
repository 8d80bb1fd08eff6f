"""Qwen2-MoE / Qwen3-MoE on a mesh (models.common.sharding's axes): the routed experts over
`expert` (E) and `tensor` (I, w13's rows interleaved by `wna16_jax.sharding.tp_interleave_w13`),
the attention heads over `tensor` (q_proj / k_proj / v_proj rows and biases, o_proj's columns),
the batch over `data`; everything else replicated.

    mesh = make_mesh(expert=4, tensor=2)
    model = shard_model(models.load_pretrained(path), mesh)
    tokens = models.generate(model, prompts, max_new_tokens=16)   # the same code, sharded

The routed experts run in `wna16_jax.sharding.fused_moe_ep` (each device its own experts);
the rest is XLA's partitioning of the placed weights, and a quantized linear on a kernel runs
per device on its shard (`LinearSharding`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import wna16_jax as wj
from models.common.modules import (
    FloatExperts,
    Linear,
    LinearSharding,
    QuantizedLinear,
    RoutedExperts,
)
from models.common.sharding import AXES, make_mesh, reorder_w13
from models.qwen_moe.config import QwenMoeConfig
from models.qwen_moe.modeling import Attention, KVCache, QwenMoeForCausalLM

# The attention linears split over the heads: column parallel (N) or row parallel (K).
_COLUMNS = ("q_proj", "k_proj", "v_proj")
_ROWS = ("o_proj",)
_BIASES = ("q_bias", "k_bias", "v_bias")


@dataclasses.dataclass(frozen=True)
class ShardingSpecs:
    """The axis of each split dim: `data` (batch), `expert` (E), `tensor` (I and the heads);
    None leaves that dim whole. Letters: b batch, t tokens, l cache slots, v vocab."""

    data: str | None = None
    expert: str | None = None
    tensor: str | None = None
    heads: str | None = None  # `tensor` where it divides the key/value heads, else None

    @classmethod
    def for_mesh(cls, mesh: Mesh, cfg: QwenMoeConfig) -> ShardingSpecs:
        """Axes of size 1 left out; the heads over `tensor` where it divides the key/value
        heads (GQA: a query head's group stays on its key/value head's device).

        Raises:
            ValueError: the expert axis does not divide num_experts, or the tensor axis does
                not divide moe_intermediate_size.
        """
        d, e, t = (a if mesh.shape.get(a, 1) > 1 else None for a in AXES)
        if e is not None and cfg.num_experts % mesh.shape[e]:
            raise ValueError(
                f"num_experts={cfg.num_experts} is not divisible by the expert axis "
                f"({mesh.shape[e]})"
            )
        if t is not None and cfg.moe_intermediate_size % mesh.shape[t]:
            raise ValueError(
                f"moe_intermediate_size={cfg.moe_intermediate_size} is not divisible by the "
                f"tensor axis ({mesh.shape[t]})"
            )
        heads = t if t is not None and cfg.num_key_value_heads % mesh.shape[t] == 0 else None
        return cls(data=d, expert=e, tensor=t, heads=heads)

    @property
    def tokens_bt(self) -> P:
        return P(self.data, None)

    @property
    def logits_bv(self) -> P:
        return P(self.data, None)


@dataclasses.dataclass(frozen=True)
class ModelSharding:
    """How a sharded Qwen model runs (models.common.modules.ModelSharding's protocol, and
    what models.common.generate asks of it). `moe_mode` as in
    `wna16_jax.sharding.fused_moe_ep`."""

    mesh: Mesh
    specs: ShardingSpecs
    moe_mode: str = "replicated"
    token_threshold: int = wj.sharding.DEFAULT_TOKEN_THRESHOLD

    @property
    def expert_axis(self) -> str | None:
        return self.specs.expert

    @property
    def tensor_axis(self) -> str | None:
        return self.specs.tensor

    @property
    def tensor_shards(self) -> int:
        return 1 if self.specs.tensor is None else self.mesh.shape[self.specs.tensor]

    def named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def put(self, host_array, spec: P) -> jax.Array:
        return jax.device_put(np.asarray(host_array), self.named(spec))

    def constrain(self, x, field: str):
        return x  # XLA propagates the weights' placement

    def check_batch(self, batch: int) -> None:
        n = 1 if self.specs.data is None else self.mesh.shape[self.specs.data]
        if batch % n:
            raise ValueError(f"batch {batch} is not divisible by the data axis ({n} devices)")

    def cache_shardings(self, num_layers: int) -> KVCache:
        d, h = self.specs.data, self.specs.heads
        return KVCache(
            kv=(self.named(P(d, None, None, h, None)),) * num_layers,
            valid=self.named(P(d, None)),
            next_pos=self.named(P(d)),
            index=self.named(P()),
        )

    def linear(self, path: tuple, weight) -> LinearSharding:
        """The attention's linears over the heads (q/k/v rows, o_proj's columns) where the
        quantized weight's shard holds whole packed words and groups; others replicated."""
        name, h = path[-1], self.specs.heads
        n_ax = h if name in _COLUMNS else None
        k_ax = h if name in _ROWS else None
        _, n, k = weight.shape
        shards = 1 if h is None else self.mesh.shape[h]
        if k_ax and (k // shards) % max(weight.group_size, 32 // weight.bits):
            k_ax = None
        if n_ax and (n // shards) % 2:
            n_ax = None
        return LinearSharding(self.mesh, row_axis=self.specs.data, n_axis=n_ax, k_axis=k_ax)

    def quantized_moe(
        self, x, w13, w2, topk_weights, topk_ids, *, implementation=None, activation_quant=None
    ):
        """One layer's routed experts: `wna16_jax.sharding.fused_moe_ep` over the mesh."""
        return wj.sharding.fused_moe_ep(
            x,
            w13,
            w2,
            topk_weights,
            topk_ids,
            mesh=self.mesh,
            expert_axis=self.expert_axis,
            tensor_axis=self.tensor_axis,
            data_axis=self.specs.data,
            mode=self.moe_mode,
            token_threshold=self.token_threshold,
            implementation=implementation,
            activation_quant=activation_quant,
        )

    def float_moe(self, local_fn, x, w13, w2, topk_weights, topk_ids):
        """Float routed experts: `local_fn` on each device's experts (ids of experts
        elsewhere -1), summed over the expert and tensor axes."""
        ea, ta = self.expert_axis, self.tensor_axis
        num_experts = w13.shape[0]

        def body(x, w13, w2, topk_weights, topk_ids):
            ids = wj.sharding.local_expert_ids(topk_ids, num_experts, ea)
            y = local_fn(x, w13, w2, topk_weights, ids)
            axes = tuple(a for a in (ea, ta) if a is not None)
            return jax.lax.psum(y, axes) if axes else y

        tok = P(self.specs.data)
        return jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(tok, P(ea, ta, None), P(ea, None, ta), tok, tok),
            out_specs=tok,
            check_vma=False,
        )(x, w13, w2, topk_weights, topk_ids)


def _put_tree(tree, specs, mesh: Mesh):
    return jax.tree.map(
        lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
        tree,
        specs,
        is_leaf=lambda s: isinstance(s, P),
    )


def shard_model(
    model: QwenMoeForCausalLM, mesh: Mesh, *, moe_mode: str = "replicated"
) -> QwenMoeForCausalLM:
    """Places an unsharded model's weights on `mesh` (in place; returns it): experts over
    `expert` and `tensor`, attention heads over `tensor`, the rest replicated.

    Raises:
        ValueError: a model already sharded or running fused linears, or a split the config
            does not allow (ShardingSpecs.for_mesh).
    """
    if model.sharding is not None:
        raise ValueError("shard_model: the model is already sharded")
    if model.fused_linears():
        raise ValueError("shard_model: call model.set_linear_implementation('xla') first")
    specs = ShardingSpecs.for_mesh(mesh, model.cfg)
    ms = ModelSharding(mesh, specs, moe_mode=moe_mode)
    e, t, h = specs.expert, specs.tensor, specs.heads
    replicated = NamedSharding(mesh, P())
    placed = set()
    for path, m in list(nnx.iter_modules(model)):
        if isinstance(m, RoutedExperts):
            w13 = reorder_w13(m.w13.get(), 1, ms.tensor_shards)
            w2 = m.w2.get()
            w13 = _put_tree(w13, wj.sharding.expert_specs(w13, expert_axis=e, n_axis=t), mesh)
            w2 = _put_tree(w2, wj.sharding.expert_specs(w2, expert_axis=e, k_axis=t), mesh)
            m.w13, m.w2 = type(m.w13)(w13), type(m.w2)(w2)
        elif isinstance(m, FloatExperts):
            w13 = reorder_w13(m.w13.get_value(), 1, ms.tensor_shards)
            m.w13.set_value(jax.device_put(w13, NamedSharding(mesh, P(e, t, None))))
            m.w2.set_value(jax.device_put(m.w2.get_value(), NamedSharding(mesh, P(e, None, t))))
        elif isinstance(m, QuantizedLinear):
            m.sharding = ms.linear(path, m.weight)
            w = m.weight.get()
            specs_w = m.sharding.specs(w)
            m.weight = type(m.weight)(_put_tree(w, specs_w, mesh))
        elif isinstance(m, Linear) and path[-1] in _COLUMNS + _ROWS:
            spec = P(h, None) if path[-1] in _COLUMNS else P(None, h)
            m.weight.set_value(jax.device_put(m.weight.get_value(), NamedSharding(mesh, spec)))
        elif isinstance(m, Attention):
            for name in _BIASES:
                b = getattr(m, name)
                if b is not None:
                    b.set_value(jax.device_put(b.get_value(), NamedSharding(mesh, P(h))))
                    placed.add(id(b))
        if isinstance(m, (RoutedExperts, FloatExperts)):
            m.sharding = ms
            m.w13_tp_shards = ms.tensor_shards
    # Whatever is still on one device (norms, embedding, router, lm_head, ...) is replicated.
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Variable) and id(var) not in placed:
            value = var.get_value()
            if isinstance(value, jax.Array) and len(value.sharding.device_set) == 1:
                var.set_value(jax.device_put(value, replicated))
    model.sharding = ms
    return model


__all__ = ["ModelSharding", "ShardingSpecs", "make_mesh", "shard_model"]
