"""Meshes, partition specs, weight placement and random models for DeepSeek-V3 (EP, TP, DP).

Three mesh axes: `expert` shards the routed experts (expert parallelism: each device holds
E/n experts and runs them through `wna16_jax.sharding.fused_moe_ep`, the library's shard_map),
`tensor` shards the experts' intermediate dim I (w13 rows interleaved as
`wna16_jax.sharding.tp_interleave_w13` does) and the attention heads (q_b_proj / q_proj /
kv_b_proj rows, o_proj columns), `data` shards the batch. Everything else is replicated.
The specs are data (`ShardingSpecs`): the model runs under `jax.jit` with in/out shardings on
an Auto-axis mesh, so XLA's partitioner follows whatever the specs say; the routed experts
and the quantized linears on a kernel run in an explicit `jax.shard_map` (a kernel call cannot
be partitioned), so no expert weight byte ever moves and each kernel reads its own shard.

    mesh = make_mesh(expert=8)                       # or expert=4, tensor=2, ...
    model = init_random(cfg, mesh=mesh)              # weights generated in their shards
    model = load_pretrained(path, mesh=mesh)         # each device reads only its slice
    model = shard_model(model, mesh)                 # an in-memory model, placed
    forward, state = jit_forward(model)              # jax.jit with in/out shardings
    logits = forward(state, ids, mask)
    tokens = generate(model, prompts, max_new_tokens=16)   # same code, sharded

Several hosts: call `maybe_initialize_distributed(...)` first on every host (same program,
its own process id); `make_mesh` then spans every host's devices and the loaders place only
the slices of this host's devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import wna16_jax as wj
from models.common.modules import (
    FloatExperts,
    LinearSharding,
    QuantizedLinear,
    QuantizedTensor,
    RoutedExperts,
    module_at,
    set_module,
)

# The sharding base (models.common.sharding), under this module's names too.
from models.common.sharding import AXES as AXES
from models.common.sharding import DATA as DATA
from models.common.sharding import EXPERT as EXPERT
from models.common.sharding import MOE_MODES as MOE_MODES
from models.common.sharding import TENSOR as TENSOR
from models.common.sharding import ShardedExperts
from models.common.sharding import describe as describe
from models.common.sharding import host_device as host_device
from models.common.sharding import make_mesh as make_mesh
from models.common.sharding import maybe_initialize_distributed as maybe_initialize_distributed
from models.common.sharding import parse_mesh as parse_mesh
from models.common.sharding import reorder_w13 as reorder_w13
from models.common.sharding import state_shardings as state_shardings
from models.common.sharding import use_cpu_devices as use_cpu_devices
from models.deepseek_v3.config import DeepseekV3Config
from models.deepseek_v3.modeling import (
    DeepseekV3ForCausalLM,
    abstract_model,
    progress_bar,
    random_parts,
)
from models.deepseek_v3.mtp import random_mtp

logger = logging.getLogger("models.deepseek_v3")

_logged: set = set()


def _log_once(key, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(msg, *args)


# ---- specs ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardingSpecs:
    """The PartitionSpec of every parameter and activation; field names end in axis letters.

    Letters: b batch, t query tokens, l cache slots, d hidden (H), v vocab, n attention heads
    (in weights: heads x per-head features flattened, heads outermost, so splitting n splits
    whole heads), k per-head features, r a LoRA / latent rank, f intermediate (dense MLP and
    shared experts; 2I rows of w13, I of w2), e routed experts. Weights are in their stored
    [N, K] (HF [out, in]) layout; a quantized weight [1, N, K] applies the spec's N and K
    entries to its qweight, scales and zeros. `for_mesh` gives the defaults.
    """

    # activations
    tokens_bt: P = P()
    act_btd: P = P()
    act_btnk: P = P()  # q and the attention output per head [B, S, h, dk]
    logits_btv: P = P()
    logits_bv: P = P()  # generation's logits of one position
    cache_blr: P = P()  # the latent cache [B, L, R + dr] (c_kv and k_pe side by side)
    cache_bl: P = P()  # which cache slots hold a token
    cache_b: P = P()  # next rope position per row
    # weights
    embed_vd: P = P()
    lm_head_vd: P = P()
    norm_d: P = P()
    norm_r: P = P()  # q_a_layernorm [Q], kv_a_layernorm [R]
    attn_q_nd: P = P()  # q_proj [h*(dn+dr), H] (no q LoRA)
    attn_q_a_rd: P = P()  # q_a_proj [Q, H]
    attn_q_b_nr: P = P()  # q_b_proj [h*(dn+dr), Q]
    attn_kv_a_rd: P = P()  # kv_a_proj_with_mqa [R+dr, H]
    attn_kv_b_nr: P = P()  # kv_b_proj [h*(dn+dv), R]
    attn_o_dn: P = P()  # o_proj [H, h*dv]
    mlp_gate_up_fd: P = P()  # dense MLP / shared experts gate_proj, up_proj [F, H]
    mlp_down_df: P = P()  # down_proj [H, F]
    router_ed: P = P()  # mlp.gate [E, H]
    router_bias_e: P = P()  # e_score_correction_bias [E]
    moe_w13_efd: P = P()  # routed experts w13 [E, 2I, H] (gate;up rows, TP-interleaved)
    moe_w2_edf: P = P()  # routed experts w2 [E, H, I]

    @classmethod
    def for_mesh(cls, mesh: Mesh, cfg: DeepseekV3Config) -> ShardingSpecs:
        """The default specs: experts over "expert" (E) and "tensor" (I), attention heads over
        "tensor" (when it divides the head count), batch over "data", the rest replicated.
        Axes of size 1 are left out, so a spec names exactly the axes that split its array.

        Raises:
            ValueError: the expert axis does not divide n_routed_experts.
        """
        d, e, t = (a if mesh.shape.get(a, 1) > 1 else None for a in AXES)
        if e is not None and cfg.n_routed_experts and cfg.n_routed_experts % mesh.shape[e]:
            raise ValueError(
                f"n_routed_experts={cfg.n_routed_experts} is not divisible by the expert "
                f"axis ({mesh.shape[e]}); expert parallelism needs the same number of experts "
                f"on every device"
            )
        heads = t
        if t is not None and cfg.num_attention_heads % mesh.shape[t]:
            heads = None
            logger.warning(
                "num_attention_heads=%d is not divisible by tensor=%d: attention stays replicated",
                cfg.num_attention_heads,
                mesh.shape[t],
            )
        return cls(
            tokens_bt=P(d, None),
            act_btd=P(d, None, None),
            act_btnk=P(d, None, heads, None),
            logits_btv=P(d, None, None),
            logits_bv=P(d, None),
            cache_blr=P(d, None, None),
            cache_bl=P(d, None),
            cache_b=P(d),
            attn_q_nd=P(heads, None),
            attn_q_b_nr=P(heads, None),
            attn_kv_b_nr=P(heads, None),
            attn_o_dn=P(None, heads),
            moe_w13_efd=P(e, t, None),
            moe_w2_edf=P(e, None, t),
        )


# The ShardingSpecs field of each weight, by the name of the module owning it.
_WEIGHT_FIELDS = {
    "embed_tokens": "embed_vd",
    "lm_head": "lm_head_vd",
    "norm": "norm_d",
    "input_layernorm": "norm_d",
    "post_attention_layernorm": "norm_d",
    "q_a_layernorm": "norm_r",
    "kv_a_layernorm": "norm_r",
    "q_proj": "attn_q_nd",
    "q_a_proj": "attn_q_a_rd",
    "q_b_proj": "attn_q_b_nr",
    "kv_a_proj_with_mqa": "attn_kv_a_rd",
    "kv_b_proj": "attn_kv_b_nr",
    "o_proj": "attn_o_dn",
    "gate_proj": "mlp_gate_up_fd",
    "up_proj": "mlp_gate_up_fd",
    "down_proj": "mlp_down_df",
    "gate": "router_ed",
}


def _entry_size(mesh: Mesh, entry) -> int:
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[a] for a in names)


def _at(spec: P, i: int):
    """Entry i of a spec (None past its end: trailing dims are unsplit)."""
    return spec[i] if i < len(spec) else None


def _clean(entries) -> P:
    """P(None, None) -> P(): a spec that splits nothing is written as replicated."""
    entries = tuple(entries)
    return P(*entries) if any(a is not None for a in entries) else P()


@dataclasses.dataclass(frozen=True)
class ModelSharding(ShardedExperts):
    """How a sharded model runs: its mesh and specs, and the MoE token mode (the routed
    experts' shard_map, the batch check and the cache's shardings: `ShardedExperts`);
    `specs` a ShardingSpecs."""

    def __post_init__(self):
        super().__post_init__()
        w13, w2 = self.specs.moe_w13_efd, self.specs.moe_w2_edf
        if (_at(w13, 0), _at(w13, 1)) != (_at(w2, 0), _at(w2, 2)):
            raise ValueError(
                f"moe_w13_efd={w13} and moe_w2_edf={w2} must split E over the same axis and "
                f"w13's rows (2I) and w2's columns (I) over the same axis"
            )

    # --- axes ----------------------------------------------------------------------------
    @property
    def expert_axis(self) -> str | None:
        return _at(self.specs.moe_w13_efd, 0)

    @property
    def tensor_axis(self) -> str | None:
        return _at(self.specs.moe_w13_efd, 1)

    @property
    def data_axis(self) -> str | None:
        return _at(self.specs.act_btd, 0)

    # --- activations ---------------------------------------------------------------------
    def constrain(self, x, field: str):
        """`x` pinned to the spec `field` of ShardingSpecs (inside jit)."""
        return jax.lax.with_sharding_constraint(x, self.named(getattr(self.specs, field)))

    def cache_specs(self) -> tuple[P, P, P]:
        return self.specs.cache_blr, self.specs.cache_bl, self.specs.cache_b

    def put(self, host_array, spec: P) -> jax.Array:
        """A host (numpy) array placed on the mesh, each device given only its slice."""
        return _place(host_array, self.named(spec))

    # --- quantized linears ---------------------------------------------------------------
    def linear(self, path: tuple, weight: QuantizedTensor) -> LinearSharding:
        """The LinearSharding of the QuantizedLinear at module path `path` (its name picks the
        ShardingSpecs field, `_WEIGHT_FIELDS`): N and K over the axes that field names where
        they split evenly (`_linear_spec`: else replicated on that dim, logged), the rows over
        the data axis. Exactly the axes `param_specs` places the weight with.

        Raises:
            ValueError: a linear name with no sharding rule (e.g. a FusedLinear's).
        """
        what = ".".join(map(str, path))
        field = _WEIGHT_FIELDS.get(path[-1])
        if field is None:
            raise ValueError(
                f"{what}: no sharding rule for the linear {path[-1]!r} (fused linears are not "
                f"split per shard: set_linear_implementation(..., fuse=False) first)"
            )
        _, n, k = weight.shape
        n_ax, k_ax = _linear_spec(
            self.mesh, getattr(self.specs, field), (n, k), weight, f"{what}.weight"
        )
        return LinearSharding(self.mesh, row_axis=self.data_axis, n_axis=n_ax, k_axis=k_ax)


# ---- the spec of every variable -------------------------------------------------------------


def _check_experts(mesh: Mesh, spec3, shape, qt: QuantizedTensor | None, what: str) -> None:
    """E, N (w13: 2I interleaved) or K (w2: I) must split evenly; raises naming the values."""
    e_ax, n_ax, k_ax = (_at(spec3, i) for i in range(3))
    e, n, k = shape
    problems = []
    n_e = _entry_size(mesh, e_ax)
    if e % n_e:
        problems.append(f"E={e} is not divisible by the {n_e} expert shards")
    for dim, ax, is_w13 in ((n, n_ax, True), (k, k_ax, False)):
        s = _entry_size(mesh, ax)
        if s == 1:
            continue
        i = dim // 2 if is_w13 else dim
        if i % s:
            problems.append(f"I={i} is not divisible by the {s} tensor shards")
            continue
        per = i // s
        if qt is not None and not is_w13:
            pf = 32 // qt.bits
            if per % pf:
                problems.append(f"I/n = {per} is not a multiple of {pf} ({qt.bits}-bit packing)")
            if qt.group_size != -1 and per % qt.group_size:
                problems.append(
                    f"I/n = {per} is not a multiple of group_size={qt.group_size} (each shard "
                    f"must hold whole quantization groups)"
                )
        if qt is not None and is_w13 and qt.zeros is not None and qt.bits == 4 and per % 2:
            problems.append(f"I/n = {per} is odd; int4 zero points pack two rows per byte")
    if problems:
        raise ValueError(f"{what}: cannot shard as {spec3}: " + "; ".join(problems))


def _linear_spec(mesh: Mesh, spec2, shape, qt: QuantizedTensor | None, what: str):
    """(N axis, K axis) of a [N, K] weight, an axis dropped (logged) when it cannot split:
    into whole packed words, groups and int4 zero-point row pairs (canonical layout) or whole
    64 x 64 tiles (the kernel layouts); K also when an input order (act-order perm) spans it."""
    n_ax, k_ax = _at(spec2, 0), _at(spec2, 1)
    n, k = shape
    s_n, s_k = _entry_size(mesh, n_ax), _entry_size(mesh, k_ax)
    tile = 1 if qt is None else wj.layouts.shard_granularity(qt.layout)
    pairs = qt is not None and qt.layout == "canonical" and qt.zeros is not None and qt.bits == 4
    if n % s_n or (n // s_n) % tile or (pairs and (n // s_n) % 2):
        _log_once((what, "n"), "%s: N=%d cannot split %d ways; replicated on N", what, n, s_n)
        n_ax = None
    ok_k = k % s_k == 0
    if ok_k and qt is not None:
        per = k // s_k
        ok_k = per % max(32 // qt.bits, tile) == 0 and (
            qt.group_size == -1 or per % qt.group_size == 0
        )
    if s_k > 1 and qt is not None and qt.perm is not None:
        why = "%s: its input order (act-order) spans all of K; replicated on K"
        _log_once((what, "perm"), why, what)
        k_ax = None
    elif not ok_k:
        _log_once((what, "k"), "%s: K=%d cannot split %d ways; replicated on K", what, k, s_k)
        k_ax = None
    return n_ax, k_ax


def _quant_leaf_spec(leaf: str, qt: QuantizedTensor, e_ax, n_ax, k_ax) -> P:
    if leaf == "perm":  # [E, K]: an input order spans all of K
        return _clean((e_ax, None))
    groups = None if qt.group_size == -1 else k_ax
    return _clean((e_ax, n_ax, k_ax if leaf == "qweight" else groups))


def _variable_spec(mesh: Mesh, specs: ShardingSpecs, path: tuple, var, parent) -> P:
    """The PartitionSpec of the variable at `path` (module names, list indices)."""
    what = ".".join(str(p) for p in path)
    shape = tuple(var.get_value().shape)
    if "experts" in path:
        i = path.index("experts")
        which = path[i + 1]
        spec = specs.moe_w13_efd if which == "w13" else specs.moe_w2_edf
        axes = tuple(_at(spec, j) for j in range(3))
        if isinstance(parent, QuantizedTensor):
            _check_experts(mesh, axes, parent.shape, parent, what)
            return _quant_leaf_spec(path[-1], parent, *axes)
        _check_experts(mesh, axes, shape, None, what)
        return _clean(axes)
    if path[-1] == "e_score_correction_bias":
        return specs.router_bias_e
    quantized = isinstance(parent, QuantizedTensor)
    owner = path[-3] if quantized else path[-2]
    field = _WEIGHT_FIELDS.get(owner)
    if field is None:
        raise ValueError(f"{what}: no sharding rule for this variable (owner {owner!r})")
    spec = getattr(specs, field)
    if quantized:
        _, n, k = parent.shape
        weight = ".".join(str(p) for p in path[:-1])  # logged once per weight, not per array
        n_ax, k_ax = _linear_spec(mesh, spec, (n, k), parent, weight)
        # The weight's own layout: the kernel layouts hold per-group arrays as [1, K//G, N].
        specs = wj.sharding.linear_specs(parent.get(), n_axis=n_ax, k_axis=k_ax)
        return _clean(getattr(specs, path[-1]))
    if len(shape) == 2:
        return _clean(_linear_spec(mesh, spec, shape, None, what))
    return spec


def _variable_specs(model, ms: ModelSharding) -> dict[tuple, P]:
    """{variable path: PartitionSpec} for every variable of `model` (abstract or not)."""
    nodes = dict(nnx.iter_graph(model))
    out = {}
    for path, node in nodes.items():
        if isinstance(node, nnx.Variable):
            out[path] = _variable_spec(ms.mesh, ms.specs, path, node, nodes.get(path[:-1]))
    return out


def _key_path(kp) -> tuple:
    return tuple(k.key for k in kp if isinstance(k, jax.tree_util.DictKey))


def param_specs(model, ms: ModelSharding):
    """The PartitionSpec of each array of `nnx.state(model)`, as a tree of the same structure.

    Quantized weights whose N or K cannot split evenly (packing, groups, int4 zero-point pairs)
    stay replicated on that dim (logged once); routed experts that cannot split raise.
    """
    by_path = _variable_specs(model, ms)
    return jax.tree_util.tree_map_with_path(lambda kp, _: by_path[_key_path(kp)], nnx.state(model))


def param_shardings(model, ms: ModelSharding):
    """`param_specs` as NamedShardings: usable as jit in/out shardings of the model's state."""
    return jax.tree.map(ms.named, param_specs(model, ms), is_leaf=lambda x: isinstance(x, P))


def _experts_modules(model):
    for _, m in nnx.iter_modules(model):
        if isinstance(m, (RoutedExperts, FloatExperts)):
            yield m


def _set_w13(module, w13) -> None:
    if isinstance(module, RoutedExperts):
        module.w13.qweight.set_value(w13.qweight)
        module.w13.scales.set_value(w13.scales)
        if w13.zeros is not None:
            module.w13.zeros.set_value(w13.zeros)
    else:
        module.w13.set_value(w13)


def _w13_value(module):
    return module.w13.get() if isinstance(module, RoutedExperts) else module.w13.get_value()


# ---- placing models -------------------------------------------------------------------------


def model_sharding(
    mesh: Mesh,
    cfg: DeepseekV3Config,
    *,
    specs: ShardingSpecs | None = None,
    moe_mode: str = "replicated",
    token_threshold: int = wj.sharding.DEFAULT_TOKEN_THRESHOLD,
) -> ModelSharding:
    """The ModelSharding of `cfg` on `mesh` (default specs: `ShardingSpecs.for_mesh`).

    Raises:
        TypeError: mesh is not a jax.sharding.Mesh.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (see make_mesh), got {type(mesh)}")
    specs = specs if specs is not None else ShardingSpecs.for_mesh(mesh, cfg)
    return ModelSharding(mesh, specs, moe_mode=moe_mode, token_threshold=token_threshold)


def shard_model(
    model: DeepseekV3ForCausalLM,
    mesh: Mesh | None,
    *,
    specs: ShardingSpecs | None = None,
    moe_mode: str = "replicated",
    token_threshold: int = wj.sharding.DEFAULT_TOKEN_THRESHOLD,
) -> DeepseekV3ForCausalLM:
    """Places an in-memory model's weights on `mesh` as `specs` say (in place; returns it).

    For models that fit in one host's memory (tests, small models); large models are built
    in their shards by `init_random(cfg, mesh=)` or `load_pretrained(path, mesh=)`. With a
    tensor axis the routed experts' w13 rows are reordered (`tp_interleave_w13`).

    Quantized linears keep their implementation: one on a kernel is placed in the canonical
    layout, then converted again on the new placement (`QuantizedLinear.set_implementation`:
    the layout and kernel of one device's shard, each device converting its own), so a model
    sharded after `set_linear_implementation` ends as one sharded before it.

    Args:
        model: the model (on one device, or sharded for another mesh).
        mesh: a mesh from `make_mesh`; None moves the model back to one device (default
            device) with canonical w13 rows.
        specs: the partition specs (default `ShardingSpecs.for_mesh(mesh, model.cfg)`).
        moe_mode, token_threshold: see ModelSharding.

    Raises:
        ValueError: the routed experts cannot be split as the specs say (values quoted), or
            linears run fused (`set_linear_implementation`: a fused weight is not split per
            shard).
    """
    fused = model.fused_linears()
    if mesh is not None and fused:
        raise ValueError(
            f"shard_model: {len(fused)} linears run fused ({fused[0]}, ...), which are not "
            f"split per shard; call model.set_linear_implementation(<implementation>, "
            f"fuse=False) first (it splits them back into the checkpoint's linears and keeps "
            f"their kernel)"
        )
    ms = None
    if mesh is not None:
        ms = model_sharding(
            mesh, model.cfg, specs=specs, moe_mode=moe_mode, token_threshold=token_threshold
        )
        param_specs(model, ms)  # validates the experts' split before anything changes
    on_kernel = [
        m
        for _, m in nnx.iter_modules(model)
        if isinstance(m, QuantizedLinear) and m.implementation != wj.REFERENCE_BACKEND
    ]
    for m in on_kernel:
        m.set_layout("canonical")  # placed as the canonical weight, converted again below
    if ms is None:
        for m in _experts_modules(model):
            _set_w13(m, reorder_w13(_w13_value(m), m.w13_tp_shards, 1))
            m.w13_tp_shards = 1
        device = jax.devices()[0]
        nnx.update(model, jax.device_put(nnx.state(model), device))
        model.set_sharding(None)
    else:
        shardings = param_shardings(model, ms)
        for m in _experts_modules(model):
            _set_w13(m, reorder_w13(_w13_value(m), m.w13_tp_shards, ms.tensor_shards))
            m.w13_tp_shards = ms.tensor_shards
        nnx.update(model, jax.tree.map(_place, nnx.state(model), shardings))
        model.set_sharding(ms)
    for m in on_kernel:
        m.set_implementation(m.implementation, dtype=model.cfg.dtype)
    return model


def _place(value, sharding: NamedSharding) -> jax.Array:
    """`value` with `sharding`: a global (multi-host) array is resharded by XLA; anything
    local goes through the host, each device sent only its slice (multi-host safe)."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])


def init_random(
    cfg: DeepseekV3Config,
    *,
    seed: int = 0,
    implementation=None,
    on_device: bool | None = None,
    mesh: Mesh | None = None,
    specs: ShardingSpecs | None = None,
    moe_mode: str = "replicated",
    progress: bool = True,
) -> DeepseekV3ForCausalLM:
    """A randomly initialized model (quantized as `cfg.quant` says).

    The model is drawn part by part (`random_parts`: the embedding, each layer, the final norm,
    the head), with the values of `DeepseekV3ForCausalLM(cfg, rngs=...)` built whole.

    Args:
        cfg: the configuration.
        seed: random seed.
        implementation: fused_moe backend of the routed experts (None = automatic).
        on_device: generate the weights on the device(s) (True: one jitted program per kind
            of part, `part_programs`) or with numpy on the host (False); None picks the host
            below `causal_lm.HOST_INIT_MAX_BYTES`.
        mesh: a mesh (`make_mesh`) to place the model on. On device, every device
            generates only its own shard of the weights (`init_sharded`: no device ever
            holds all experts; values equal those of on_device=True without a mesh); on the
            host, the model is drawn as without a mesh and each device sent its slice.
        specs: partition specs for the mesh (default `ShardingSpecs.for_mesh`).
        moe_mode: the sharded MoE's token mode (see `ModelSharding`).
        progress: show a tqdm bar over the parts drawn (`models.common.progress`: it appears
            once the build has run PROGRESS_DELAY_S seconds).

    With cfg.num_nextn_predict_layers = 1 the model also holds a random MTP layer
    (`model.mtp`, mtp.random_mtp: its own random stream), on one device only.

    Raises:
        ValueError: an MTP layer asked for with a mesh.
    """
    if cfg.num_nextn_predict_layers and mesh is not None:
        raise ValueError(
            f"num_nextn_predict_layers={cfg.num_nextn_predict_layers} with a mesh: the MTP "
            f"layer runs on one device (pass num_nextn_predict_layers=0 in the config)"
        )
    on_device = DeepseekV3ForCausalLM.draws_on_device(cfg, on_device)
    if mesh is not None and on_device:
        model = init_sharded(
            cfg, mesh, seed=seed, specs=specs, moe_mode=moe_mode, progress=progress
        )
    else:
        host = host_device() if mesh is not None else None
        with jax.default_device(host) if host is not None else contextlib.nullcontext():
            model = draw_parts(cfg, seed=seed, on_device=on_device, progress=progress)
        if mesh is not None:
            shard_model(model, mesh, specs=specs, moe_mode=moe_mode)
    if cfg.num_nextn_predict_layers:
        model.mtp = random_mtp(cfg, seed=seed, on_device=on_device)
    if implementation is not None:
        model.set_implementation(implementation)
    return model


def init_sharded(
    cfg: DeepseekV3Config,
    mesh: Mesh,
    *,
    seed: int = 0,
    specs: ShardingSpecs | None = None,
    moe_mode: str = "replicated",
    token_threshold: int = wj.sharding.DEFAULT_TOKEN_THRESHOLD,
    progress: bool = True,
) -> DeepseekV3ForCausalLM:
    """A random model generated directly in its shards (what `init_random(cfg, mesh=)` runs).

    Each part is drawn by a `jax.jit` whose out_shardings are the parameter shardings
    (`part_programs`); JAX's partitionable threefry makes every device draw only its own
    slice, so no device ever holds more than its shard of the experts (the compiled programs
    have no collectives) and the values do not depend on the mesh: they equal
    `init_random(cfg, seed=seed, on_device=True)`'s. With a tensor axis the random w13 rows are
    taken as already interleaved (a random model's rows have no order to keep).
    """
    ms = model_sharding(mesh, cfg, specs=specs, moe_mode=moe_mode, token_threshold=token_threshold)
    model = draw_parts(cfg, seed=seed, on_device=True, ms=ms, progress=progress)
    for m in _experts_modules(model):
        m.w13_tp_shards = ms.tensor_shards
    model.set_sharding(ms)
    return model


def draw_parts(
    cfg: DeepseekV3Config,
    *,
    seed: int = 0,
    on_device: bool,
    ms: ModelSharding | None = None,
    progress: bool = True,
) -> DeepseekV3ForCausalLM:
    """The random model built part by part (`random_parts`) into the abstract model: with
    numpy on the host, or on device by `part_programs` (placed as `ms` says; the model's
    sharding is left unset). Each part is ready before the next starts, so the bar follows
    the device."""
    model = abstract_model(cfg)
    if on_device:
        programs = part_programs(cfg, ms, seed=seed, abstract=model)
        count = jnp.zeros((), jnp.uint32)  # the random stream's position: draws so far
    else:
        rng = np.random.default_rng(seed)
    parts = random_parts(cfg)
    for path, kind, build in progress_bar(
        parts, desc="random weights", unit="part", enabled=progress
    ):
        if on_device:
            program, graphdef = programs[kind]
            state, count = jax.block_until_ready(program(count))
            set_module(model, path, nnx.merge(graphdef, state))
        else:
            set_module(model, path, build(rng))
    return model


def part_programs(
    cfg: DeepseekV3Config,
    ms: ModelSharding | None,
    *,
    seed: int = 0,
    abstract: DeepseekV3ForCausalLM | None = None,
) -> dict[str, tuple[Callable, nnx.GraphDef]]:
    """The jitted programs that draw a random model's parts on device, one per kind of part.

    Returns:
        {kind: (fn, graphdef)}: fn(count) -> (the part's nnx.State, count after it), where
        count (uint32 scalar) is the position in the random stream of `nnx.Rngs(seed)` where
        the part starts (0 for the first part; each part's output count for the next);
        `nnx.merge(graphdef, state)` is the part. With `ms`, the state is sharded as
        `param_specs` says (out_shardings) and the count replicated.
    """
    abstract = abstract if abstract is not None else abstract_model(cfg)
    shardings = None if ms is None else param_shardings(abstract, ms)
    programs = {}
    for path, kind, build in random_parts(cfg):
        if kind in programs:
            continue

        def draw(count, build=build):
            rngs = nnx.Rngs(seed)
            rngs.params.count[...] = count
            part = build(rngs)
            return nnx.state(part), rngs.params.count[...]

        jit_kw = {}
        if ms is not None:
            part_shardings = functools.reduce(lambda tree, key: tree[key], path, shardings)
            jit_kw["out_shardings"] = (part_shardings, ms.named(P()))
        programs[kind] = (jax.jit(draw, **jit_kw), nnx.graphdef(module_at(abstract, path)))
    return programs


def place_variables(model, path: tuple, ms: ModelSharding) -> None:
    """Moves every variable under the module or variable at `path` onto its sharding, each
    device receiving only its slice of the host copy (multi-host safe)."""
    path = tuple(path)
    root = model
    for p in path[:-1]:
        root = root[p] if isinstance(p, int) else getattr(root, p)
    nodes = dict(nnx.iter_graph(root))
    for sub, var in nodes.items():
        if sub[:1] != path[-1:] or not isinstance(var, nnx.Variable):
            continue
        spec = _variable_spec(ms.mesh, ms.specs, path[:-1] + sub, var, nodes.get(sub[:-1]))
        value = var.get_value()
        if isinstance(value, jax.ShapeDtypeStruct):  # not loaded yet
            continue
        if isinstance(value, jax.Array) and value.sharding == ms.named(spec):
            continue
        var.set_value(ms.put(value, spec))


def jit_forward(model: DeepseekV3ForCausalLM):
    """`model(ids, mask)` under jax.jit with explicit in/out shardings.

    Models of the same structure and sharding (equal graphdefs) share one jitted function,
    hence one compilation per input shape.

    Returns:
        (fn, state): call fn(state, input_ids int32 [B, S], attention_mask bool [B, S]) ->
        f32 logits [B, S, V]; sharded as logits_btv on a sharded model, and the same code
        (no shardings) for an unsharded one.
    """
    graphdef, state = nnx.split(model)
    ms = model.sharding
    shardings = None if ms is None else state_shardings(state)
    return _jitted_forward(graphdef, ms, shardings), state


def _forward(state, input_ids, attention_mask, *, graphdef):
    return nnx.merge(graphdef, state)(input_ids, attention_mask=attention_mask)


_FORWARDS: dict = {}


def _jitted_forward(graphdef, ms: ModelSharding | None, shardings):
    fn = _FORWARDS.get((graphdef, ms))
    if fn is None:
        forward = functools.partial(_forward, graphdef=graphdef)
        if ms is None:
            fn = jax.jit(forward)
        else:
            tok = ms.named(ms.specs.tokens_bt)
            fn = jax.jit(
                forward,
                in_shardings=(shardings, tok, tok),
                out_shardings=ms.named(ms.specs.logits_btv),
            )
        _FORWARDS[(graphdef, ms)] = fn
    return fn
