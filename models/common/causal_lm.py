"""The causal-LM base every family subclasses: stack, head, cache, prefill, decode, serving set-up.

A family's model is `class MyForCausalLM(CausalLM)` naming its decoder layer (`LAYER`, a
`PreNormDecoderLayer` holding the family's attention and MoE block) and writing what only it
knows: its rotary embedding (`rope`) and the shape of one layer's cache entry
(`cache_layer_shape`). Everything else is written here once: the forward without a cache,
prefill and decode over a `KVCache`, the logits, the MTP hooks (`return_hidden`, the `mtp`
slot), the kernel and layout choices of the routed experts and quantized linears (which
`models.prepare` calls, in order), and the helpers that build a model part by part.
Letters in shapes: B batch, S query tokens, L cache slots, H hidden, V vocabulary.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import wna16_jax as wj
from models.common.checks import check_input_ids
from models.common.config import QuantSpec
from models.common.modules import (
    DecoderStack,
    Embed,
    FloatExperts,
    FusedLinear,
    Linear,
    ModelSharding,
    QuantizedLinear,
    RMSNorm,
    Rng,
    RoutedExperts,
    activation_quant_of,
    chunk_mask,
    constrain,
    decode_mask,
    matmul_nk,
    module_at,
    positions_from_mask,
    set_module,
)
from models.common.progress import progress_bar

_F32 = jnp.float32

# Above this many bytes of weights a random model is drawn on the device (jax.random under
# jit); below it on the host with numpy (XLA would compile each random op of a tiny model
# separately: tens of seconds on a CPU).
HOST_INIT_MAX_BYTES = 1 << 30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The attention cache of every family.

    Attributes:
        layers: per layer one array [B, L, ...] in the model dtype, whose trailing dims the
            family's attention chooses (`CausalLM.cache_layer_shape`: DeepSeek's latent
            [B, L, R + dr], Qwen's keys and values [B, L, 2, m, D]).
        valid: bool [B, L]: the slot holds a real token (left padding is False).
        next_pos: int32 [B]: rope position of each row's next token.
        index: int32 []: the next slot to write (shared by all rows).
    """

    layers: tuple
    valid: jax.Array
    next_pos: jax.Array
    index: jax.Array

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]


def empty_cache(layer_shape: tuple[int, ...], num_layers: int, dtype) -> KVCache:
    """A KVCache of `num_layers` zero arrays of `layer_shape` ([B, L, ...]), nothing valid."""
    b, length = layer_shape[:2]
    return KVCache(
        layers=tuple(jnp.zeros(layer_shape, dtype) for _ in range(num_layers)),
        valid=jnp.zeros((b, length), bool),
        next_pos=jnp.zeros((b,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )


def decode_positions_and_mask(cache: KVCache, b: int, s: int):
    """For S tokens appended to every row at slots index..index+S-1: their rope positions
    int32 [B, S] (from next_pos), the cache's valid slots bool [B, L] with them, and the
    attention mask bool [B, S, L] (`decode_mask`: valid slots up to each query's own)."""
    idx = cache.index
    positions = cache.next_pos[:, None] + jnp.arange(s, dtype=jnp.int32)[None]
    valid = jax.lax.dynamic_update_slice(cache.valid, jnp.ones((b, s), bool), (0, idx))
    return positions, valid, decode_mask(valid, idx, s)


def _fusion_of(module):
    return getattr(type(module), "FUSION", None)


class CausalLM(nnx.Module):
    """The causal LM: `model(input_ids)` -> f32 logits; `prefill` / `decode` for generation.

    A family sets `LAYER` (its PreNormDecoderLayer) and writes `rope` and `cache_layer_shape`;
    `model` is the DecoderStack of those layers (HF's module tree: model.embed_tokens,
    model.layers, model.norm).
    Modules with a `FUSION` class attribute (a `Fusion`: linears that read one input) run
    those linears as one GEMM on a kernel; modules with a `DEQUANTIZED` tuple name the
    linears read only as their dequantized weight (never a GEMM), which stay canonical on
    "xla" and are dequantized once before the decode loop (`prepare_decode`).
    """

    LAYER: type
    # None until models.prepare chooses (`set_batch_invariant`); then whether every row is
    # computed as it would be alone.
    batch_invariant: bool | None = None

    def __init__(self, cfg, *, rngs: Rng, implementation=None):
        self.cfg = cfg
        self.model = DecoderStack(cfg, self.LAYER, rngs=rngs)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg, cfg.hidden_size, cfg.vocab_size, rngs=rngs)
        # Set by shard_model / init_random(mesh=) / load_pretrained(mesh=) / models.prepare.
        self.sharding: ModelSharding | None = None
        # A family's multi-token-prediction draft layer, where one is loaded or drawn.
        self.mtp = nnx.data(None)
        if implementation is not None:
            self.set_implementation(implementation)

    # --- what a family writes --------------------------------------------------------------
    def rope(self, positions):
        """positions int32 [B, S] -> (cos, sin) f32, as the family's attention takes them."""
        raise NotImplementedError(f"{type(self).__name__} does not define rope")

    def cache_layer_shape(self, batch: int, max_len: int) -> tuple[int, ...]:
        """The shape [B, L, ...] of one layer's cache entry."""
        raise NotImplementedError(f"{type(self).__name__} does not define cache_layer_shape")

    @classmethod
    def logger(cls) -> logging.Logger:
        """The family's logger: its package's name ("models.deepseek_v3", ...)."""
        return logging.getLogger(cls.__module__.rpartition(".")[0])

    # --- parts -----------------------------------------------------------------------------
    @classmethod
    def abstract(cls, cfg):
        """The model with jax.ShapeDtypeStruct in place of every array (nothing allocated):
        the frame that loading and random init fill part by part."""
        return nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))

    @classmethod
    def param_bytes(cls, cfg) -> int:
        """Bytes of the model's weights (from an abstract model: nothing is allocated)."""
        return sum(
            int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
            for a in jax.tree.leaves(nnx.state(cls.abstract(cfg)))
        )

    @classmethod
    def draws_on_device(cls, cfg, on_device: bool | None = None) -> bool:
        """Whether a random model is drawn on the device: `on_device`, by default when its
        weights take more than HOST_INIT_MAX_BYTES."""
        return cls.param_bytes(cfg) > HOST_INIT_MAX_BYTES if on_device is None else on_device

    @classmethod
    def random_parts(cls, cfg) -> list[tuple[tuple, str, Callable[[Rng], nnx.Module]]]:
        """The parts that hold weights, as (path, kind, build(rngs)), in the order the
        constructor draws their random weights: built one after another from one random
        stream they hold the constructor's values. Parts of one kind have one structure."""
        layer = cls.LAYER
        parts = [(("model", "embed_tokens"), "embed", lambda rngs: Embed(cfg, rngs=rngs))]
        for i in range(cfg.num_hidden_layers):
            kind = "moe_layer" if cfg.is_moe_layer(i) else "dense_layer"
            parts.append((("model", "layers", i), kind, lambda rngs, i=i: layer(cfg, i, rngs=rngs)))
        norm = lambda rngs: RMSNorm(cfg, cfg.hidden_size, eps=cfg.rms_norm_eps, rngs=rngs)
        parts.append((("model", "norm"), "norm", norm))
        if not cfg.tie_word_embeddings:
            head = lambda rngs: Linear(cfg, cfg.hidden_size, cfg.vocab_size, rngs=rngs)
            parts.append((("lm_head",), "lm_head", head))
        return parts

    def routed_experts(self) -> list[RoutedExperts]:
        """The quantized routed-expert layers, in order."""
        return [m for _, m in nnx.iter_modules(self) if isinstance(m, RoutedExperts)]

    # --- batch invariance ------------------------------------------------------------------
    def set_batch_invariant(self, batch_invariant: bool) -> None:
        """Computes every row as it would be alone (`batch_invariant=True`) or not: the flag
        set on each module with a batch-invariant form (`models.common.modules`: the kernels'
        `batch_invariant=True`, the float linears, head and router in row blocks, RMSNorm per
        row block, the attention in key chunks). `models.prepare` calls it before choosing
        kernels and layouts, which then pass over a backend that refuses the flag; generate
        rows are then bitwise those of the prompt alone, on every run (docs/design.md,
        'Batch invariance').

        Raises:
            ValueError: batch_invariant is not a bool, or True on a sharded model (one device
                only: the sharded MoE's psum or all-to-all order follows the token count).
        """
        if not isinstance(batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {batch_invariant!r}")
        if batch_invariant and self.sharding is not None:
            raise ValueError(
                "batch_invariant=True runs on one device: a sharded model sums the experts' "
                "partial outputs with a psum or all-to-all chosen by the token count "
                "(wna16_jax.sharding); serve it without a mesh"
            )
        for _, m in nnx.iter_modules(self):
            if hasattr(type(m), "batch_invariant"):
                m.batch_invariant = batch_invariant

    # --- the routed experts ----------------------------------------------------------------
    def set_implementation(self, implementation: str | Sequence[str] | None) -> None:
        """Selects the fused_moe backend of every routed-expert layer (None = automatic)."""
        if implementation is not None and not isinstance(implementation, str):
            implementation = tuple(implementation)
        for m in self.routed_experts():
            m.implementation = implementation

    @property
    def implementation(self):
        experts = self.routed_experts()
        return experts[0].implementation if experts else None

    def set_activation_quant(self, activation_quant: str | wj.ActivationQuant | None) -> None:
        """Sets how every routed-expert layer quantizes its activations (fused_moe's
        activation_quant): None (16-bit activations), "int8_per_token" or a
        wj.ActivationQuant (static scales: the same in every layer). A checkpoint's own
        (per-layer static scales included) is set by the loader.

        W8A8 kernels need int8 per-channel symmetric experts (QuantSpec(bits=8,
        group_size=-1, has_zp=False)); the 'xla' backend runs any weights, and fused_moe
        names the reason where a backend cannot. The non-expert linears keep 16-bit
        activations.

        Raises:
            ValueError: a value `activation_quant_of` refuses, or int8 activations on a model
                without quantized routed experts (float experts run 16-bit activations).
        """
        aq = activation_quant_of(activation_quant)
        experts = self.routed_experts()
        if aq is not None and not experts:
            raise ValueError(
                f"activation_quant={aq}: the model has no quantized routed experts (float "
                f"experts run 16-bit activations)"
            )
        for m in experts:
            m.activation_quant = aq

    def set_expert_layout(self, layout: str, *, progress: bool = True) -> None:
        """Converts every routed-expert layer's weights to `layout` (wna16_jax.layouts), one
        layer at a time: each layer's new arrays are made and the old ones dropped before the
        next layer starts, so the two layouts of the whole model are never held at once.
        `progress`: a tqdm bar over the layers (`progress_bar`)."""
        layers = self.routed_experts()
        bar = progress_bar(layers, desc=f"experts to {layout}", unit="layer", enabled=progress)
        for m in bar:
            m.set_layout(layout)
            jax.block_until_ready(m.w13.qweight.get_value())  # the bar follows the device

    def resolve_expert_layout(self, requested: str, implementation=None) -> str:
        """The experts' layout for a `requested` one ("auto", or a wna16_jax.layouts name) and
        a fused_moe `implementation`: "auto" means, for a named implementation, the first of
        its layouts that holds the experts' bits (`wna16_jax.backend_layout`), and
        `preferred_expert_layout()` when none is named."""
        if requested != "auto":
            return requested
        if isinstance(implementation, str):
            experts = self.routed_experts()
            bits = experts[0].w13.bits if experts else 4
            return wj.backend_layout(implementation, bits=bits)
        if implementation is not None:  # a sequence of names: the first decides
            return self.resolve_expert_layout("auto", tuple(implementation)[0])
        return self.preferred_expert_layout()

    def preferred_expert_layout(self) -> str:
        """wna16_jax.preferred_layout for the routed experts on this platform, for the
        activations they run (cfg.dtype, their activation_quant) and for one tensor shard's
        slice when they are split over a tensor axis; "canonical" without routed experts."""
        experts = self.routed_experts()
        if not experts:
            return "canonical"
        m = experts[0]
        w13, w2 = m.w13.get(), m.w2.get()
        n = m.w13_tp_shards
        if n != 1:  # one tensor shard's slice: 2I/n rows of w13, I/n of w2's K
            shard = functools.partial(wj.sharding.tensor_shard, num_shards=n)
            w13 = jax.eval_shape(functools.partial(shard, split="n"), w13)
            w2 = jax.eval_shape(functools.partial(shard, split="k"), w2)
        return wj.preferred_layout(
            w13,
            w2,
            dtype=self.cfg.dtype,
            activation_quant=m.activation_quant,
            batch_invariant=bool(self.batch_invariant),
        )

    # --- the quantized linears -------------------------------------------------------------
    def set_linear_implementation(
        self, implementation: str, *, fuse: bool = True, progress: bool = True
    ) -> None:
        """Selects how every quantized non-expert linear runs, converting its weight to the
        layout that implementation reads (`wna16_jax.linear.preferred_layout`):
        - "xla" (the default): dequantize + dot, canonical layout; works under any sharding;
        - "auto": the fastest kernel here (`wna16_jax.linear.quantized_matmul`'s choice);
        - a backend with a grouped GEMM (a name of `wna16_jax.registered_backends()`).
        Layers a kernel does not take here stay on "xla" (why, for a named backend, is
        logged). `progress`: a tqdm bar over the linears (`progress_bar`).

        On a sharded model each kernel runs per device on its shard of the weight
        (`LinearSharding`): the layout and the kernel are chosen for the shard. The linears
        read only as a dequantized weight (`dequantized_linears`) stay canonical on "xla".

        On an unsharded model a kernel also runs the linears that read one input as one GEMM
        (`FusedLinear`, by each module's `FUSION`), where both parts are QuantizedLinears of
        one format and the kernel takes the fused weight (why a pair stays apart is logged);
        `fuse=False` keeps them apart. "xla" splits them back into the HF module tree,
        bit-identically. A sharded model never fuses (a fused weight has no sharding rule).

        Raises:
            ValueError: `implementation` is neither "auto" nor a registered backend.
        """
        if implementation != "auto" and implementation not in wj.registered_backends():
            raise ValueError(
                f"linear implementation {implementation!r} is neither 'auto' nor a registered "
                f"backend {wj.registered_backends()}"
            )
        chosen = None if implementation == "auto" else implementation
        self.unfuse_linears()
        for m in self.dequantized_linears().values():
            m.set_implementation(wj.REFERENCE_BACKEND, dtype=self.cfg.dtype)
        pairs = []  # (owner, {name: part}): linears that may run as one GEMM
        if fuse and implementation != wj.REFERENCE_BACKEND and self.sharding is None:
            for owner in self._fusing_modules():
                parts = owner.FUSION.unfused(owner)
                if parts and any(isinstance(m, QuantizedLinear) for m in parts.values()):
                    pairs.append((owner, parts))
        paired = {id(m) for _, parts in pairs for m in parts.values()}
        singles = [m for m in self.gemm_linears().values() if id(m) not in paired]
        paths = {id(m): ".".join(map(str, p)) for p, m in nnx.iter_modules(self)}
        on_xla = collections.defaultdict(list)  # why a named kernel does not run a linear
        apart = collections.Counter()  # why pairs stay two GEMMs
        desc = f"linears for {implementation}"
        for item in progress_bar(pairs + singles, desc=desc, unit="linear", enabled=progress):
            if isinstance(item, QuantizedLinear):
                module, alone = item, [item]
            else:
                module, parts = item
                why = module.FUSION.fuse(module, chosen, cfg=self.cfg)  # converts the fused one
                alone = []
                if why is not None:
                    apart[why] += 1
                    alone = [m for m in parts.values() if isinstance(m, QuantizedLinear)]
            for m in alone:
                m.set_implementation(chosen, dtype=self.cfg.dtype)
                if (why := m.kernel_reason(self.cfg.dtype)) is not None:
                    on_xla[why].append(paths[id(m)])
            jax.block_until_ready(nnx.state(module))  # the bar follows the device
        log = self.logger()
        for why, count in apart.items():
            log.info("%s (%d modules)", why, count)
        for why, where in on_xla.items():
            more = f" and {len(where) - 1} more linears stay" if len(where) > 1 else " stays"
            log.info("%s%s on 'xla': %s", where[0], more, why)

    def _quantized_linears(self, *, dequantized: bool) -> dict[str, QuantizedLinear]:
        """{module path: layer} of the QuantizedLinears read only as a dequantized weight
        (`dequantized`), or of the others."""
        read_dense = {
            id(getattr(m, name))
            for _, m in nnx.iter_modules(self)
            for name in getattr(type(m), "DEQUANTIZED", ())
        }
        return {
            ".".join(map(str, path)): m
            for path, m in nnx.iter_modules(self)
            if isinstance(m, QuantizedLinear) and (id(m) in read_dense) == dequantized
        }

    def gemm_linears(self) -> dict[str, QuantizedLinear]:
        """{module path: layer} of the quantized linears the model runs as a GEMM of their
        input, on their `implementation` (FusedLinears included, in place of their parts)."""
        return self._quantized_linears(dequantized=False)

    def dequantized_linears(self) -> dict[str, QuantizedLinear]:
        """{module path: layer} of the quantized linears the model reads only as their
        dequantized weight, never as a GEMM (a module's `DEQUANTIZED` names)."""
        return self._quantized_linears(dequantized=True)

    def _fusing_modules(self) -> list[nnx.Module]:
        """The modules with a `Fusion` (their linears that read one input)."""
        return [m for _, m in nnx.iter_modules(self) if _fusion_of(m) is not None]

    def unfuse_linears(self) -> None:
        """Every FusedLinear split back into its parts (the HF module tree)."""
        for owner in self._fusing_modules():
            owner.FUSION.unfuse(owner)

    def fused_linears(self) -> list[str]:
        """The module paths of the FusedLinears this model runs (e.g.
        "model.layers.0.mlp.gate_up_proj"); empty on "xla" or a sharded model."""
        return [
            ".".join(map(str, path))
            for path, m in nnx.iter_modules(self)
            if isinstance(m, FusedLinear)
        ]

    def quantize_lm_head(self, spec: QuantSpec | str) -> None:
        """Replaces the float lm_head with a QuantizedLinear of `spec` ("int4", "int8" or a
        QuantSpec: bits, group_size, has_zp; round to nearest), canonical layout on "xla";
        `set_linear_implementation` then moves it to a kernel with the other linears.

        The vocabulary projection is the largest weight a decode step reads; int4 g128 reads
        about a quarter of its bf16 bytes, int8 half, for the quantization error in the
        logits that the model's other linears already carry. A serving choice: a checkpoint
        keeps a float lm_head (`save_pretrained` writes this one quantized).

        Raises:
            ValueError: the lm_head is tied to the embedding table, already quantized, or the
                model is sharded (quantize before sharding).
        """
        spec = QuantSpec.parse(spec)
        if self.lm_head is None:
            raise ValueError(
                "the lm_head is the embedding table (tie_word_embeddings): it is not quantized"
            )
        if isinstance(self.lm_head, QuantizedLinear):
            raise ValueError("the lm_head is already quantized")
        if self.sharding is not None:
            raise ValueError("quantize_lm_head needs an unsharded model (quantize, then shard)")
        w = self.lm_head.weight.get_value()  # [V, H]
        n, k = w.shape
        qe = wj.quantize_experts(
            w[None],
            bits=spec.bits,
            group_size=spec.group_for(k),
            has_zp=spec.has_zp,
            scale_dtype=jnp.dtype(self.cfg.dtype),
        )
        head = QuantizedLinear(self.cfg, k, n, rngs=None, qe=qe)
        head.batch_invariant = self.lm_head.batch_invariant
        self.lm_head = head

    def dequantize_attention_linears(self) -> None:
        """Replaces every quantized linear read only as its dequantized weight (the modules'
        `DEQUANTIZED`, e.g. MLA's kv_b_proj) with a float Linear of that weight in cfg.dtype,
        in place. `generate` runs it on its own traced copy of the model before the decode
        loop (XLA does not hoist loop-invariant work out of a loop on GPUs), so the weights
        are dequantized once per call and the stored ones stay quantized."""
        for _, m in list(nnx.iter_modules(self)):
            for name in getattr(type(m), "DEQUANTIZED", ()):
                linear = getattr(m, name)
                if isinstance(linear, QuantizedLinear):
                    _, n, k = linear.weight.shape
                    dense = linear.dense_weight(self.cfg.dtype)
                    dense = Linear(self.cfg, k, n, rngs=None, weight=dense)
                    dense.batch_invariant = linear.batch_invariant
                    setattr(m, name, dense)

    def prepare_decode(self) -> None:
        """What `generate` runs on its traced copy of the model before the decode loop."""
        self.dequantize_attention_linears()

    def set_sharding(self, sharding: ModelSharding | None) -> None:
        """Records the mesh and specs the model runs with on every module that uses them.

        Low level: it moves no weight; the family's `shard_model` places the weights and
        calls it. Each QuantizedLinear gets its own LinearSharding (`sharding.linear`).
        """
        for path, m in nnx.iter_modules(self):
            if isinstance(m, QuantizedLinear):
                m.sharding = None if sharding is None else sharding.linear(path, m.weight)
            elif hasattr(m, "sharding"):
                m.sharding = sharding

    # --- forward ---------------------------------------------------------------------------
    def _logits(self, x):
        if isinstance(self.lm_head, QuantizedLinear):
            return self.lm_head(x, out_dtype=_F32)
        if self.lm_head is None:
            w = self.model.embed_tokens.weight.get_value()
        else:
            w = self.lm_head.dense_weight(x.dtype)
        return matmul_nk(x, w, _F32, batch_invariant=bool(self.batch_invariant))

    def _run(self, ids, positions, mask, *, mode, cache=None, index=None):
        cos, sin = self.rope(positions)
        x = constrain(self.sharding, self.model.embed_tokens(ids), "act_btd")
        new = []
        for i, layer in enumerate(self.model.layers):
            layer_cache = None if cache is None else cache.layers[i]
            x, nc = layer(x, cos=cos, sin=sin, mask=mask, mode=mode, cache=layer_cache, index=index)
            x = constrain(self.sharding, x, "act_btd")
            new.append(nc)
        return self.model.norm(x), new

    def __call__(self, input_ids, attention_mask=None):
        """Logits without a cache.

        Args:
            input_ids: int32 [B, S].
            attention_mask: optional [B, S] (1 = token, 0 = left padding).

        Returns:
            f32 [B, S, V].

        Raises:
            ValueError: a concrete id outside [0, vocab_size) where attention_mask marks a
                token (`check_input_ids`; traced ids are not read).
        """
        check_input_ids(input_ids, self.cfg.vocab_size, attention_mask)
        input_ids = jnp.asarray(input_ids, jnp.int32)
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, bool)
        key_valid = jnp.asarray(attention_mask).astype(bool)
        x, _ = self._run(
            input_ids, positions_from_mask(key_valid), chunk_mask(key_valid), mode="full"
        )
        return self._logits(x)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty cache of `max_len` slots per row."""
        shape = self.cache_layer_shape(batch, max_len)
        return empty_cache(shape, self.cfg.num_hidden_layers, self.cfg.dtype)

    def prefill(self, input_ids, attention_mask, *, max_len: int, return_hidden: bool = False):
        """Runs the (left-padded) prompt and fills a fresh cache of `max_len` slots.

        Args:
            input_ids: int32 [B, S].  attention_mask: [B, S], 0 on left padding.
            max_len: static cache length L >= S.
            return_hidden: also return the final norm's output [B, S, H] (what an MTP layer
                reads).

        Returns:
            (f32 [B, V] logits of the last column, KVCache with index = S), then the hidden
            states with return_hidden.
        """
        input_ids = jnp.asarray(input_ids, jnp.int32)
        b, s = input_ids.shape
        if max_len < s:
            raise ValueError(f"max_len={max_len} is shorter than the prompt ({s} tokens)")
        key_valid = jnp.asarray(attention_mask).astype(bool)
        cache = self.init_cache(b, max_len)
        x, new = self._run(
            input_ids,
            positions_from_mask(key_valid),
            chunk_mask(key_valid),
            mode="prefill",
            cache=cache,
        )
        cache = KVCache(
            layers=tuple(new),
            valid=jax.lax.dynamic_update_slice(cache.valid, key_valid, (0, 0)),
            next_pos=key_valid.sum(axis=1).astype(jnp.int32),
            index=jnp.asarray(s, jnp.int32),
        )
        if return_hidden:
            return self._logits(x[:, -1]), cache, x
        return self._logits(x[:, -1]), cache

    def decode(self, tokens, cache: KVCache, *, return_hidden: bool = False):
        """Appends tokens int32 [B, S] (or [B]) to every row and attends over the cache.

        Returns:
            (f32 logits [B, S, V] (or [B, V]), the updated KVCache), then with return_hidden
            the final norm's output [B, S, H] (or [B, H]).
        """
        tokens = jnp.asarray(tokens, jnp.int32)
        squeeze = tokens.ndim == 1
        if squeeze:
            tokens = tokens[:, None]
        positions, valid, mask = decode_positions_and_mask(cache, *tokens.shape)
        idx = cache.index
        x, new = self._run(tokens, positions, mask, mode="decode", cache=cache, index=idx)
        s = tokens.shape[1]
        cache = KVCache(layers=tuple(new), valid=valid, next_pos=cache.next_pos + s, index=idx + s)
        logits = self._logits(x)
        if squeeze:
            logits, x = logits[:, 0], x[:, 0]
        return (logits, cache, x) if return_hidden else (logits, cache)


def linear_at(root: CausalLM, path: tuple):
    """The linear at the HF module path `path` (e.g. ("model", "layers", 0, "mlp",
    "gate_proj")), also while it runs fused: then split off its FusedLinear (canonical
    layout, bit-identical)."""
    owner = module_at(root, path[:-1])
    fusion = _fusion_of(owner)
    if fusion is not None and path[-1] in fusion.parts:
        return fusion.part(owner, path[-1])
    return getattr(owner, path[-1])


def dequantize_model(model: CausalLM) -> CausalLM:
    """A float copy of `model`: every quantized linear and the routed experts replaced by float
    modules holding the dequantized weights (f32, held in cfg.dtype). The test oracle for
    WNA16 layers; float experts run 16-bit activations (a W8A8 model's activation_quant is
    not kept).

    Raises:
        ValueError: the model is sharded (move it to one device with its shard_model first).
    """
    if model.sharding is not None:
        raise ValueError("dequantize_model needs an unsharded model: shard_model(model, None)")
    new = nnx.clone(model)
    new.unfuse_linears()  # the HF module tree: a float Linear per part
    cfg = new.cfg
    for path, module in list(nnx.iter_modules(new)):
        if isinstance(module, QuantizedLinear):
            _, n, k = module.weight.shape
            repl = Linear(cfg, k, n, rngs=None, weight=module.dense_weight(_F32))
        elif isinstance(module, RoutedExperts):
            repl = FloatExperts(
                cfg,
                rngs=None,
                w13=wj.dequantize_experts(module.canonical_w13(), _F32),
                w2=wj.dequantize_experts(module.w2.get(), _F32),
            )
        else:
            continue
        set_module(new, path, repl)
    return new
