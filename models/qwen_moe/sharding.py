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
from models.common.sharding import AXES, ShardedExperts, make_mesh, reorder_w13
from models.qwen_moe.config import QwenMoeConfig
from models.qwen_moe.modeling import Attention, QwenMoeForCausalLM

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
class ModelSharding(ShardedExperts):
    """How a sharded Qwen model runs (models.common.modules.ModelSharding's protocol; the
    routed experts' shard_map, the batch check and the cache's shardings: `ShardedExperts`);
    `specs` a ShardingSpecs."""

    @property
    def expert_axis(self) -> str | None:
        return self.specs.expert

    @property
    def tensor_axis(self) -> str | None:
        return self.specs.tensor

    @property
    def data_axis(self) -> str | None:
        return self.specs.data

    def put(self, host_array, spec: P) -> jax.Array:
        return jax.device_put(np.asarray(host_array), self.named(spec))

    def constrain(self, x, field: str):
        return x  # XLA propagates the weights' placement

    def cache_specs(self) -> tuple[P, P, P]:
        d = self.specs.data
        return P(d, None, None, self.specs.heads, None), P(d, None), P(d)

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


def init_random(
    cfg: QwenMoeConfig,
    *,
    seed: int = 0,
    implementation=None,
    on_device: bool | None = None,
    mesh=None,
    moe_mode: str = "replicated",
    progress: bool = True,
) -> QwenMoeForCausalLM:
    """A model of random weights, quantized where cfg.quant says (scales in
    cfg.quant.scale_dtype, e.g. GPTQ's float16): drawn on the device or with numpy on the
    host (`on_device`: `CausalLM.draws_on_device`); with a `mesh`, then placed on it
    (`shard_model`, `moe_mode` its MoE token mode). `progress` is accepted for the registry's
    signature (the model is drawn whole, without a bar)."""
    on_device = QwenMoeForCausalLM.draws_on_device(cfg, on_device)
    rngs = nnx.Rngs(seed) if on_device else np.random.default_rng(seed)
    model = QwenMoeForCausalLM(cfg, rngs=rngs, implementation=implementation)
    if mesh is not None:
        shard_model(model, mesh, moe_mode=moe_mode)
    return model


__all__ = ["ModelSharding", "ShardingSpecs", "init_random", "make_mesh", "shard_model"]
