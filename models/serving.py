"""The one serving call: `models.prepare` chooses the kernels and converts the weights once."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from jax.sharding import Mesh

import wna16_jax as wj
from models.common.causal_lm import CausalLM
from models.common.config import QuantSpec
from models.registry import family_of_model

logger = logging.getLogger("models")


def prepare(
    model: CausalLM,
    *,
    implementation: str | Sequence[str] | None = None,
    linear_implementation: str = wj.REFERENCE_BACKEND,
    expert_layout: str = "auto",
    quantize_lm_head: str | QuantSpec | None = None,
    mesh: Mesh | None = None,
    moe_mode: str = "replicated",
    fuse_linears: bool = True,
    batch_invariant: bool = False,
    progress: bool = True,
) -> CausalLM:
    """Makes a built or loaded model ready to serve, in place (returns it): the steps in the
    one order they need, each weight converted to the layout its kernel reads once, here, so
    the forward names no backend.

    1. `quantize_lm_head`: the float vocabulary head quantized ("int4", "int8" or a
       QuantSpec; round to nearest), before sharding;
    2. `mesh`: the model placed on the mesh by its family's `shard_model` (experts over
       "expert" and "tensor", heads over "tensor", the batch over "data"; `moe_mode` the
       sharded MoE's token mode), unless it is already placed there;
    3. `implementation`: the routed experts' fused_moe backend (None: automatic);
    4. `linear_implementation`: the quantized non-expert linears' (default the reference,
       `wj.REFERENCE_BACKEND`; "auto" or a registered backend; `fuse_linears`: linears
       reading one input as one GEMM on a kernel, unsharded models only), each weight in the
       layout that backend reads;
    5. `expert_layout`: the routed experts' layout ("auto": the one the experts' backend
       reads, `CausalLM.resolve_expert_layout`), converted one layer at a time, each layer's
       old arrays dropped before the next converts (never both layouts of the whole model).

    `batch_invariant`: every row computed as it would be alone, bitwise, on every run
    (`CausalLM.set_batch_invariant`, docs/design.md 'Batch invariance'), bound before steps
    3-5 so the kernels and layouts chosen are ones that run it (the automatic choice passes
    over a backend that refuses it; a named one raises its reason). One device only.

    Each choice is logged at INFO. `progress`: tqdm bars over the conversions.

    Raises:
        ValueError: a value the step refuses (named), e.g. quantize_lm_head on a tied or
            already-sharded head, an unknown linear implementation or layout,
            batch_invariant=True with a mesh.
        NotImplementedError: batch_invariant=True with an implementation that cannot run it
            (its reason).
        TypeError: a model of no registered family, or mesh not a jax.sharding.Mesh.
    """
    family = family_of_model(model)
    if expert_layout != "auto" and expert_layout not in wj.layouts.LAYOUTS:
        raise ValueError(
            f"expert_layout={expert_layout!r} is neither 'auto' nor one of {wj.layouts.LAYOUTS}"
        )
    if quantize_lm_head is not None:
        model.quantize_lm_head(quantize_lm_head)
        logger.info("lm_head quantized to %s", QuantSpec.parse(quantize_lm_head))
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh (see make_mesh), got {type(mesh)}")
        if model.sharding is None or model.sharding.mesh != mesh:
            model.unfuse_linears()  # a fused weight has no sharding rule
            family.shard_model(model, mesh, moe_mode=moe_mode)
            logger.info("placed on the mesh %s", dict(mesh.shape))
    if batch_invariant and (mesh is not None or model.sharding is not None):
        raise ValueError(
            "batch_invariant=True runs on one device: a sharded model sums the experts' "
            "partial outputs with a psum or all-to-all chosen by the token count "
            "(wna16_jax.sharding); prepare it without a mesh"
        )
    model.set_batch_invariant(batch_invariant)
    if batch_invariant:
        logger.info("batch-invariant: every row computed as it would be alone")
        _check_batch_invariant(implementation, linear_implementation)
    model.set_implementation(implementation)
    model.set_linear_implementation(linear_implementation, fuse=fuse_linears, progress=progress)
    logger.info("quantized linears on %r", linear_implementation)
    layout = model.resolve_expert_layout(expert_layout, implementation)
    if layout != "canonical" or any(m.layout != layout for m in model.routed_experts()):
        t0 = time.perf_counter()
        model.set_expert_layout(layout, progress=progress)
        logger.info("routed experts in the %s layout (%.1f s)", layout, time.perf_counter() - t0)
    return model


def _check_batch_invariant(implementation, linear_implementation: str) -> None:
    """Raises NotImplementedError with the backend's reason where the one implementation named
    for the routed experts or the linears cannot compute rows batch-invariantly (a sequence
    of names is tried in order: one that cannot is passed over)."""
    for name in dict.fromkeys((implementation, linear_implementation)):
        if isinstance(name, str) and name != "auto":
            if (why := wj.batch_invariant_reason(name)) is not None:
                raise NotImplementedError(f"batch_invariant=True: backend {name!r} {why}")
