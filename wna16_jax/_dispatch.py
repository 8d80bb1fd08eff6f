"""The backend registry, the one place that knows the backends: the MoE stages, align and
(optionally) the grouped GEMM of each, its weight layouts and config class; each says why it
cannot run a problem; selection by platform priority."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable, Mapping, Sequence

import jax

from wna16_jax import _activations, _backend_order, _configs, _reference, _types
from wna16_jax._checks import check_implementation
from wna16_jax._configs import GemmShape
from wna16_jax._types import CODES, BlockConfig, QuantizedExperts

logger = logging.getLogger("wna16_jax")


@dataclasses.dataclass(frozen=True)
class MoEProblem:
    """The static facts of one fused_moe call that a backend needs to decide if it can run it."""

    platform: str  # "cpu", "gpu", "tpu", ...
    num_tokens: int  # T
    hidden: int  # H
    intermediate: int  # I
    num_experts: int  # E_local (weights' leading dim)
    num_global_experts: int  # len(expert_map) or E_local
    top_k: int
    bits: int
    group_size: int  # as stored (-1 = per channel)
    w13_group: int  # effective group along H
    w2_group: int  # effective group along I
    has_zeros: bool
    dtype: str  # activation dtype name
    activation: str
    # Weight scheme of w2 (the fields above without a prefix describe w13); None = as w13.
    w2_bits: int | None = None
    w2_group_size: int | None = None
    w2_has_zeros: bool | None = None
    # Activation scheme: None (16-bit activations into the GEMMs: WNA16) or an
    # ActivationQuant.scheme ("int8_per_token", "int8_static": W8A8).
    activation_quant: str | None = None
    # QuantizedExperts.layout of both weights ("canonical" or a kernel's private layout).
    layout: str = "canonical"
    # w13 has an input permutation (GPTQ act-order, QuantizedExperts.perm): the pipeline
    # (_pipeline.moe_chunk) applies it; a backend that does not run the pipeline refuses it.
    act_order: bool = False
    # QuantizedExperts.codes of w13 and w2 ("int", or "e2m1": MXFP4); selection refuses codes a
    # backend does not decode (Backend.codes) before asking unsupported_reason.
    codes: str = "int"
    w2_codes: str = "int"
    # Per-expert biases (fused_moe's w13_bias / w2_bias); refused by backends without
    # Backend.biases.
    has_bias: bool = False
    # batch_invariant=True: each token's row must not depend on the other rows of the call.
    batch_invariant: bool = False

    @property
    def gemm_input_dtype(self) -> str:
        """The activation format the GEMMs consume: "int8" under activation_quant, else dtype."""
        return "int8" if self.activation_quant is not None else self.dtype

    def weight_schemes(self) -> tuple[tuple[str, int, int, bool], ...]:
        """((name, bits, group_size, has_zeros), ...) of w13 and w2."""
        w2 = (
            self.bits if self.w2_bits is None else self.w2_bits,
            self.group_size if self.w2_group_size is None else self.w2_group_size,
            self.has_zeros if self.w2_has_zeros is None else self.w2_has_zeros,
        )
        return (("w13", self.bits, self.group_size, self.has_zeros), ("w2", *w2))


@dataclasses.dataclass(frozen=True)
class AlignProblem:
    """The static facts of one moe_align_block_size call."""

    platform: str
    num_slots: int  # T*k
    num_experts: int  # E (global)
    block_m: int


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    """The static facts of one grouped GEMM call (wna16_jax.grouped_matmul, a quantized linear)."""

    platform: str
    shape: GemmShape  # m: the rows (token slots)
    dtype: str  # activation dtype name
    has_zeros: bool
    layout: str = "canonical"
    batch_invariant: bool = False  # as MoEProblem's


# The reason of a backend that does not say it computes rows batch-invariantly.
NOT_BATCH_INVARIANT = (
    "does not guarantee batch-invariant rows (batch_invariant=True): its configs or reduction "
    "order may depend on the number of rows in the call"
)


@dataclasses.dataclass(frozen=True)
class GroupedMatmul:
    """A backend's grouped GEMM (the kernel its fused_moe runs for each GEMM), callable alone.

    Attributes:
        unsupported_reason: GemmProblem -> None when it can run, else a sentence saying why not.
        config: (GemmShape, config | None) -> (config, source): `_configs.resolve` under the
            GEMM's ConfigRules (the caller's config checked against the shape, else the tuned
            table's, else the heuristic's); source is "caller", "tuned:<device>" or
            "heuristic". A config is the backend's config_type (a BlockConfig, or e.g. the
            'mgpu' GEMM's MgpuConfig, which converts a BlockConfig); it has a block_m.
        run: (a, w, routing, routed_weights=None, *, top_k, config, out_dtype=None,
            activation=None) -> [R * top_k, N]: out[s] = a[s // top_k] @ dequant(w[e(s)]).T
            for each slot s of the AlignedRouting (aligned with config.block_m); with
            activation ("silu") w's rows are [gate; up] and out is activation(out)
            [R * top_k, N/2], from the f32 sums; then times routed_weights[s]. Rows of slots
            in no block are unspecified.
        linear: None, or (x [R, K], w [1, N, K], *, config, out_dtype, activation=None) ->
            [R, N] in out_dtype (from the f32 sums; with activation, w's rows are [gate; up]
            and the result activation(...) [R, N/2]): the one-expert GEMM without a routing (a
            quantized linear), where the backend runs it faster than `run` on the identity
            routing (no row gathers); wna16_jax.linear uses it when set.
    """

    unsupported_reason: Callable[[GemmProblem], str | None]
    config: Callable[[GemmShape, object], tuple[object, str]]
    run: Callable
    linear: Callable | None = None


@dataclasses.dataclass(frozen=True)
class LayoutConversion:
    """A backend's kernel layouts (wna16_jax.layouts): what each holds, their checks, shapes
    and shard granularity, and their conversions, lossless both ways.

    Attributes:
        bits: {layout: the bits of the weights it holds} (each layout holds one bit width).
        reason: (layout, *, bits, n, k) -> why `layout` cannot hold weights [E, N, K] of `bits`
            bits (None when it can).
        to_kernel: (qw, layout) -> canonical, validated `qw` (held by `layout`) in `layout`.
        to_canonical: qw in one of the layouts -> the canonical layout.
        shape: qw in one of the layouts -> its logical [E, N, K].
        validate: (qw, name) -> None, raising ValueError naming `name` and the offending
            values where qw's arrays do not have its layout's shapes and dtypes.
        granularity: a shard of weights in these layouts splits N and K into multiples of it
            (the kernel's weight tile).
    """

    bits: Mapping[str, int]
    reason: Callable[..., str | None]
    to_kernel: Callable[[QuantizedExperts, str], QuantizedExperts]
    to_canonical: Callable[[QuantizedExperts], QuantizedExperts]
    shape: Callable[[QuantizedExperts], tuple[int, int, int]]
    validate: Callable[[QuantizedExperts, str], None]
    granularity: int = 1


@dataclasses.dataclass(frozen=True)
class Backend:
    """A fused_moe implementation: the stages it plugs into the one pipeline
    (wna16_jax._pipeline, run by the library), or a layer computed on its own (the 'xla'
    reference, independent of the pipeline by design).

    Attributes:
        name: the name users pass as `implementation`.
        unsupported_reason: problem -> None when it can run, else a sentence saying why not.
        align_unsupported_reason: AlignProblem -> None or why not.
        moe_align_block_size: (topk_ids, *, num_experts, block_m, expert_map) -> AlignedRouting.
        stages: (*, activation, config, activation_quant) -> MoeStages: the backend's part of
            the pipeline, which wna16_jax.fused_moe runs (`_pipeline.run`); hashable (a module
            function or a partial of one, kept). Exactly one of stages and fused_moe is set.
        fused_moe: (x, w13, w2, topk_weights, topk_ids, *, expert_map, activation, config) -> out:
            a layer that does not run the pipeline (the reference); called with the keyword
            activation_quant (an ActivationQuant) too when the problem has one, with
            out_dtype when the caller asks for an output dtype other than x's, and with
            batch_invariant=True when the caller asks for it.
        layouts: the QuantizedExperts layouts its fused_moe (and grouped GEMM) reads;
            selection refuses weights in any other (layout_reason) before asking
            unsupported_reason. None: every layout (the reference converts them back).
        grouped_matmul: its grouped GEMM (GroupedMatmul), or None where it has none that
            takes an AlignedRouting.
        preferred_layouts: kernel layouts (of `layouts`) that wna16_jax.preferred_layout picks
            for this backend, in order, where it runs the weights here: a measurement showed
            it faster on them than the canonical layout's backends.
        config_type: its config class (the `config` fused_moe and the grouped GEMM take), also
            reachable as wna16_jax.<class name>.
        layout_conversion: the conversions of its kernel layouts (those of `layouts` other than
            "canonical" that it defines), or None where it defines none.
        codes: the QuantizedExperts.codes its kernels decode ("int"; "e2m1": MXFP4); selection
            refuses other weights (codes_reason) for fused_moe and the grouped GEMM.
        biases: whether its fused_moe takes w13_bias and w2_bias (keywords, passed only when
            given); selection refuses problems with biases otherwise.
        batch_invariant_reason: None where its stages (and grouped GEMM, through the library's
            `batch_invariant_config`) compute each row in an order that does not depend on the
            other rows of the call: its stages then take batch_invariant=True, which fixes
            their configs for the weights' shape without a K split; else why not (refused for
            batch_invariant=True problems, skipped by the automatic choice).
    """

    name: str
    unsupported_reason: Callable[[MoEProblem], str | None]
    align_unsupported_reason: Callable[[AlignProblem], str | None]
    moe_align_block_size: Callable
    stages: Callable | None = None
    fused_moe: Callable | None = None
    layouts: tuple[str, ...] | None = ("canonical",)
    grouped_matmul: GroupedMatmul | None = None
    preferred_layouts: tuple[str, ...] = ()
    config_type: type = BlockConfig
    layout_conversion: LayoutConversion | None = None
    codes: tuple[str, ...] = ("int",)
    biases: bool = False
    batch_invariant_reason: str | None = NOT_BATCH_INVARIANT

    def __post_init__(self):
        if (self.stages is None) == (self.fused_moe is None):
            raise ValueError(
                f"Backend {self.name!r}: give exactly one of stages (the pipeline's, run by "
                f"the library) and fused_moe (a layer of its own), got "
                f"stages={self.stages!r}, fused_moe={self.fused_moe!r}"
            )


_REGISTRY: dict[str, Backend] = {}

# The reference backend's name: pure jnp in f32, any platform, any layout (its layer is
# _reference.fused_moe, its linear a dequantize and one dot); the CPU default. Model code names
# it through this constant (wna16_jax.REFERENCE_BACKEND), never as a string.
REFERENCE_BACKEND = "xla"

# Tried in order by automatic selection. 'pallas_interpret' is never chosen automatically.
PRIORITY: dict[str, tuple[str, ...]] = {
    # 'mgpu' runs only weights in its own layout, which 'pallas' refuses.
    "gpu": ("pallas", "mgpu", "xla"),
    "cuda": ("pallas", "mgpu", "xla"),
}
DEFAULT_PRIORITY: tuple[str, ...] = ("xla",)

# The modules of the built-in kernel backends, each with a tuple BACKENDS of the Backends it
# registers (imported on the registry's first use; importing the 'triton' backend needs neither
# triton nor jax_triton).
BUILTIN_BACKEND_MODULES = (
    "pallas_kernels.pallas.backend",
    "pallas_kernels.mgpu.backend",
    "pallas_kernels.triton.backend",
)


def register_backend(backend: Backend) -> None:
    """Adds `backend` to the registry (replacing one of the same name): fused_moe,
    grouped_matmul, the quantized linear and moe_align_block_size then take its name as
    `implementation`; automatic selection tries it only where PRIORITY lists it.

    Raises:
        TypeError: `backend` is not a Backend.
    """
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend takes a wna16_jax.Backend, got {backend!r}")
    _ensure_builtin_backends()
    _REGISTRY[backend.name] = backend


def registered_backends() -> tuple[str, ...]:
    """The names of the registered backends."""
    _ensure_builtin_backends()
    return tuple(_REGISTRY)


def preferred_layouts() -> tuple[tuple[str, str], ...]:
    """((kernel layout, backend name), ...): every backend's preferred_layouts, in registry
    order, that wna16_jax.preferred_layout tries in turn ('mgpu' on mgpu_int4 beat 'pallas' on
    the canonical layout for DeepSeek-V3 on the H200: docs/performance.md, 'Mosaic GPU
    layer')."""
    _ensure_builtin_backends()
    return tuple((lay, b.name) for b in _REGISTRY.values() for lay in b.preferred_layouts)


def config_class(name: str) -> type | None:
    """The config class named `name` of a registered backend (e.g. "MgpuConfig"), or None."""
    _ensure_builtin_backends()
    return next((b.config_type for b in _REGISTRY.values() if b.config_type.__name__ == name), None)


def layouts() -> tuple[str, ...]:
    """The QuantizedExperts layouts: "canonical", then every registered backend's kernel
    layouts (those its layout_conversion defines), in registry order."""
    _ensure_builtin_backends()
    found = ["canonical"]
    for b in _REGISTRY.values():
        if b.layout_conversion is not None:
            found += [lay for lay in b.layout_conversion.bits if lay not in found]
    return tuple(found)


def layout_conversion(layout: str) -> LayoutConversion:
    """The conversion of kernel layout `layout`: the first registered backend's that defines
    it.

    Raises:
        ValueError: `layout` is not a kernel layout of a registered backend.
    """
    _ensure_builtin_backends()
    for b in _REGISTRY.values():
        if b.layout_conversion is not None and layout in b.layout_conversion.bits:
            return b.layout_conversion
    raise ValueError(f"layout={layout!r} is not one of the kernel layouts {layouts()[1:]}")


def read_layouts(backend: Backend) -> tuple[str, ...]:
    """The layouts `backend` reads (Backend.layouts; None: every registered one)."""
    return layouts() if backend.layouts is None else backend.layouts


# QuantizedExperts asks the registry for a kernel layout's shape and checks.
_types._registry_layout = layout_conversion


def layout_bits(layout: str) -> int:
    """The bits of the weights kernel layout `layout` holds."""
    return layout_conversion(layout).bits[layout]


def shard_granularity(layout: str) -> int:
    """A shard of weights in `layout` splits N and K into multiples of this: 1 for the
    canonical layout (whose packed words and groups the caller checks), a kernel layout's
    weight tile otherwise.

    Raises:
        ValueError: an unknown layout.
    """
    return 1 if layout == "canonical" else layout_conversion(layout).granularity


def kernel_layout_reason(layout: str, *, bits: int, n: int, k: int) -> str | None:
    """Why the kernel layout `layout` cannot hold weights [E, N, K] of `bits` bits (None when
    it can): the reason `to_kernel_layout` raises."""
    return layout_conversion(layout).reason(layout, bits=bits, n=n, k=k)


def to_kernel_layout(qw: QuantizedExperts, layout: str) -> QuantizedExperts:
    """`qw` (any layout) in `layout`, one of `layouts()` (wna16_jax.layouts)."""
    if layout not in layouts():
        raise ValueError(f"layout={layout!r} is not one of {layouts()}")
    if qw.layout == layout:
        return qw
    qw = to_canonical_layout(qw)
    if layout == "canonical":
        return qw
    qw.validate("weights")
    _, n, k = qw.shape
    if reason := kernel_layout_reason(layout, bits=qw.bits, n=n, k=k):
        raise ValueError(reason)
    return _converted(qw, layout=layout)


def to_canonical_layout(qw: QuantizedExperts) -> QuantizedExperts:
    """`qw` in the canonical layout (docs/design.md); the inverse of to_kernel_layout."""
    if qw.layout == "canonical":
        return qw
    qw.validate("weights")
    return _converted(qw, layout="canonical")


@functools.partial(jax.jit, static_argnames=("layout",))
def _converted(qw: QuantizedExperts, *, layout: str) -> QuantizedExperts:
    """A checked conversion as one compiled program: its temporaries are a few of the scales'
    size, so converting a weight holds about its old and new arrays. Run op by op, each step
    (word flip, bitcast, tile transpose, tile order) held a weight-sized array at once (a
    DeepSeek-V3 layer's w13 is 3.5 GiB in int4)."""
    if layout == "canonical":
        return layout_conversion(qw.layout).to_canonical(qw)
    return layout_conversion(layout).to_kernel(qw, layout)


def backend_layout(implementation: str, bits: int) -> str:
    """The first layout of backend `implementation` that holds `bits`-bit weights
    ("canonical" where the backend reads it first; e.g. "mgpu_int4" for 'mgpu' and
    'mgpu_interpret'): lets a model convert its weights for a named backend without naming
    backends itself.

    Raises:
        ValueError: an unknown implementation, or one that reads no layout of `bits`-bit
            weights (its layouts named).
    """
    layouts_ = read_layouts(get_backend(implementation))
    held = [lay for lay in layouts_ if lay == "canonical" or layout_bits(lay) == bits]
    if not held:
        raise ValueError(
            f"backend {implementation!r} reads no layout of int{bits} weights ({layouts_})"
        )
    return held[0]


def batch_invariant_reason(implementation: str) -> str | None:
    """Why backend `implementation` cannot compute rows batch-invariantly
    (batch_invariant=True), None where it can: lets a model refuse a named backend before it
    converts weights for it.

    Raises:
        ValueError: an unknown implementation.
    """
    return get_backend(implementation).batch_invariant_reason


def get_backend(name: str) -> Backend:
    _ensure_builtin_backends()
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown implementation {name!r}; registered backends: {sorted(_REGISTRY)}"
        )
    return _REGISTRY[name]


# The oldest NVIDIA GPUs the Triton-lowered kernels (Pallas and raw Triton) target (Ampere).
MIN_COMPUTE_CAPABILITY = 8.0


def layout_reason(backend: Backend, problem: MoEProblem | GemmProblem) -> str | None:
    """Why `backend` cannot read `problem`'s weight layout (None when it can)."""
    if problem.layout in read_layouts(backend):
        return None
    if "canonical" in read_layouts(backend):
        return (
            f"the weights are in the {problem.layout!r} layout, which this backend does not "
            f"read (wna16_jax.layouts.to_canonical_layout converts back)"
        )
    # Kernel layouts only: the first that holds the weights (their bits, N and K in its tiles)
    # is the conversion to make; where none does, each one's reason.
    weights = _weight_shapes(problem)
    reasons = []
    for lay in backend.layouts:
        why = next(
            (
                f"{name}: {r}" if len(weights) > 1 else r
                for name, bits, n, k in weights
                if (r := kernel_layout_reason(lay, bits=bits, n=n, k=k))
            ),
            None,
        )
        if why is None:
            return (
                f"reads weights in the {lay!r} layout, not {problem.layout!r} (convert once at "
                f"load: wna16_jax.layouts.to_kernel_layout(qw, {lay!r}))"
            )
        reasons.append(why)
    readers = [
        name
        for name, b in sorted(_REGISTRY.items())
        if "canonical" in read_layouts(b) and not name.endswith("_interpret")
    ]
    return (
        f"reads weights only in the {_listed(backend.layouts, 'or')} layout, which cannot hold "
        f"these ({'; '.join(reasons)}): they stay in the canonical layout, which "
        f"{_listed(readers, 'and')} read"
    )


def _listed(names: Sequence[str], conjunction: str) -> str:
    """The names quoted and listed: 'a', 'b' and 'c' (conjunction "and")."""
    quoted = [repr(name) for name in names]
    if len(quoted) < 2:
        return "".join(quoted)
    return f"{', '.join(quoted[:-1])} {conjunction} {quoted[-1]}"


def _weight_shapes(problem: MoEProblem | GemmProblem) -> tuple[tuple[str, int, int, int], ...]:
    """((name, bits, N, K), ...) of the weights of `problem`: w13 [E, 2I, H] and w2 [E, H, I]
    of fused_moe, the [E, N, K] weight of a grouped GEMM."""
    if isinstance(problem, GemmProblem):
        return (("w", problem.shape.bits, problem.shape.n, problem.shape.k),)
    w2_bits = problem.bits if problem.w2_bits is None else problem.w2_bits
    return (
        ("w13", problem.bits, 2 * problem.intermediate, problem.hidden),
        ("w2", w2_bits, problem.hidden, problem.intermediate),
    )


def cuda_gpu_reason(platform: str, hint: str = "") -> str | None:
    """Why compiled GPU kernels cannot run on `platform` (None when they can): not a GPU
    platform (then `hint` is appended), not a CUDA device, or compute capability below 8.0."""
    if platform != "gpu":
        return f"needs an NVIDIA GPU, the platform is {platform!r}{hint}"
    device = jax.devices()[0]
    cc = getattr(device, "compute_capability", None)
    if cc is None:
        return f"device {device.device_kind!r} is not a CUDA GPU"
    if float(cc) < MIN_COMPUTE_CAPABILITY:
        return (
            f"needs compute capability >= {MIN_COMPUTE_CAPABILITY}, {device.device_kind} has {cc}"
        )
    return None


def compiled_and_interpreted(
    name: str,
    stages: Callable,
    reason: Callable[[MoEProblem], str | None],
    shape_reason: Callable[[MoEProblem], str | None],
    align: Callable,
    layouts: tuple[str, ...] = ("canonical",),
    *,
    gemm: Callable | None = None,
    gemm_config: Callable | None = None,
    gemm_shape_reason: Callable[[GemmProblem], str | None] | None = None,
    gemm_gpu_reason: Callable[[str], str | None] = cuda_gpu_reason,
    gemm_linear: Callable | None = None,
    preferred_layouts: tuple[str, ...] = (),
    config_type: type = BlockConfig,
    layout_conversion: LayoutConversion | None = None,
    codes: tuple[str, ...] = ("int",),
    biases: bool = False,
    batch_invariant_reason: str | None = NOT_BATCH_INVARIANT,
) -> tuple[Backend, Backend]:
    """Backend `name` (compiled, on a CUDA GPU) and `name`_interpret (the same kernels in the
    interpreter, any platform), both reading weights in `layouts`. `stages` (Backend.stages),
    `align` (moe_align_block_size's kernel) and `gemm` (the grouped GEMM: GroupedMatmul.run, or
    None) take the keyword `interpret`; `reason` says why the compiled kernels cannot run a problem,
    `shape_reason` why no kernel can (any platform); gemm_config and gemm_shape_reason are the
    GEMM's GroupedMatmul.config and its shape reason (any platform); gemm_gpu_reason(platform)
    says why the compiled GEMM cannot run on a platform (default: `cuda_gpu_reason`);
    gemm_linear (taking `interpret` too) is GroupedMatmul.linear; preferred_layouts are the
    compiled backend's (an interpreter is never preferred); config_type, layout_conversion,
    batch_invariant_reason, codes and biases are both's."""

    def align_reason(problem: AlignProblem) -> str | None:
        return cuda_gpu_reason(problem.platform)

    def grouped(interpret: bool) -> GroupedMatmul | None:
        if gemm is None:
            return None

        def gemm_reason(problem: GemmProblem) -> str | None:
            if interpret:
                return gemm_shape_reason(problem)
            return gemm_gpu_reason(problem.platform) or gemm_shape_reason(problem)

        return GroupedMatmul(
            unsupported_reason=gemm_reason,
            config=gemm_config,
            run=functools.partial(gemm, interpret=interpret),
            linear=None
            if gemm_linear is None
            else functools.partial(gemm_linear, interpret=interpret),
        )

    return (
        Backend(
            name=name,
            unsupported_reason=reason,
            stages=functools.partial(stages, interpret=False),
            align_unsupported_reason=align_reason,
            moe_align_block_size=functools.partial(align, interpret=False),
            layouts=layouts,
            grouped_matmul=grouped(False),
            preferred_layouts=preferred_layouts,
            config_type=config_type,
            layout_conversion=layout_conversion,
            codes=codes,
            biases=biases,
            batch_invariant_reason=batch_invariant_reason,
        ),
        Backend(
            name=f"{name}_interpret",
            unsupported_reason=shape_reason,
            stages=functools.partial(stages, interpret=True),
            align_unsupported_reason=lambda problem: None,
            moe_align_block_size=functools.partial(align, interpret=True),
            layouts=layouts,
            grouped_matmul=grouped(True),
            config_type=config_type,
            layout_conversion=layout_conversion,
            codes=codes,
            biases=biases,
            batch_invariant_reason=batch_invariant_reason,
        ),
    )


def current_platform() -> str:
    """The platform fused_moe runs on: the default JAX backend ('cpu', 'gpu', 'tpu')."""
    return jax.default_backend()


OPS = {MoEProblem: "fused_moe", AlignProblem: "moe_align_block_size", GemmProblem: "grouped_matmul"}


def backend_reason(
    backend: Backend, problem: MoEProblem | AlignProblem | GemmProblem
) -> str | None:
    """Why `backend` cannot run `problem` (None when it can)."""
    if isinstance(problem, AlignProblem):
        return backend.align_unsupported_reason(problem)
    if isinstance(problem, GemmProblem) and backend.grouped_matmul is None:
        return "has no grouped GEMM that takes an AlignedRouting"
    if reason := layout_reason(backend, problem):
        return reason
    if reason := codes_reason(backend, problem):
        return reason
    if problem.batch_invariant and backend.batch_invariant_reason is not None:
        return backend.batch_invariant_reason
    if isinstance(problem, GemmProblem):
        return backend.grouped_matmul.unsupported_reason(problem)
    return backend.unsupported_reason(problem)


# What each QuantizedExperts.codes value is called in a reason.
CODE_NAMES = {"int": "integer (int4 / int8)", "e2m1": "MXFP4 (E2M1 codes, E8M0 scales)"}


def codes_reason(backend: Backend, problem: MoEProblem | GemmProblem) -> str | None:
    """Why `backend` cannot decode `problem`'s weights or add its biases (None when it can)."""
    if isinstance(problem, GemmProblem):
        weights = (("w", problem.shape.codes),)
    else:
        weights = (("w13", problem.codes), ("w2", problem.w2_codes))
    for name, codes in weights:
        if codes not in backend.codes:
            what = name if len(weights) > 1 else "the"
            return f"{what} weights are {CODE_NAMES.get(codes, codes)}, which it does not decode"
    if isinstance(problem, MoEProblem) and problem.has_bias and not backend.biases:
        return "takes no per-expert biases (w13_bias, w2_bias)"
    return None


def select_backend(
    problem: MoEProblem | AlignProblem | GemmProblem,
    implementation: str | Sequence[str] | None,
) -> Backend:
    """Picks the backend for `problem` (a fused_moe, moe_align_block_size or grouped GEMM call).

    Args:
        problem: the call's static facts; its type says which op is asked for.
        implementation: None (the platform's priority list; for fused_moe led by the order the
            device's benchmark measured fastest for this problem: _backend_order), one name,
            or names tried in order.

    Raises:
        ValueError: an unknown backend name.
        NotImplementedError: no candidate can run the problem; the message gives each reason.
    """
    _ensure_builtin_backends()
    implementation = check_implementation(implementation)
    if implementation is None:
        candidates = PRIORITY.get(problem.platform, DEFAULT_PRIORITY)
        if isinstance(problem, MoEProblem) and problem.platform in PRIORITY:
            # Where a device's benchmark measured another backend faster for this problem.
            measured = _backend_order.measured_order(problem, _configs.device_kind()) or ()
            candidates = measured + tuple(c for c in candidates if c not in measured)
        explicit = False
    elif isinstance(implementation, str):
        candidates = (implementation,)
        explicit = True
    else:
        candidates = tuple(implementation)
        explicit = True
        if not candidates:
            raise ValueError("implementation is an empty sequence; pass None or backend names")
    op = OPS[type(problem)]
    reasons = {}
    for name in candidates:
        backend = get_backend(name)
        reason = backend_reason(backend, problem)
        if reason is None:
            _configs.log_once(
                (op, name, tuple(candidates)),
                "wna16_jax: %s uses %r (candidates: %s)", op, name, ", ".join(candidates),
            )  # fmt: skip
            return backend
        reasons[name] = reason
        logger.debug("wna16_jax: %s skips %r: %s", op, name, reason)
    if explicit and len(candidates) == 1:
        name = candidates[0]
        raise NotImplementedError(f"backend {name!r} cannot run this {op}: {reasons[name]}")
    listed = "; ".join(f"{n}: {r}" for n, r in reasons.items())
    raise NotImplementedError(f"no {op} backend can run this problem ({listed})")


# ---- built-in backends ----------------------------------------------------------------------


def _xla_unsupported_reason(problem: MoEProblem) -> str | None:
    # Every weight scheme, with or without int8 activations (any weights: W8A8, W4A8, ...).
    if _activations.normalize_activation(problem.activation) is None:
        return f"activation {problem.activation!r} is not one of {sorted(_activations.ACTIVATIONS)}"
    return None


def _xla_fused_moe(
    x,
    w13,
    w2,
    topk_weights,
    topk_ids,
    *,
    expert_map,
    activation,
    config,
    activation_quant=None,
    out_dtype=None,
    batch_invariant=False,
    w13_bias=None,
    w2_bias=None,
):
    """The reference layer (`_reference.fused_moe`, independent of the pipeline); config is not
    read (the reference has no tiles)."""
    return _reference.fused_moe(
        x,
        to_canonical_layout(w13),
        to_canonical_layout(w2),
        topk_weights,
        topk_ids,
        expert_map=expert_map,
        activation=activation,
        activation_quant=activation_quant,
        out_dtype=out_dtype,
        batch_invariant=batch_invariant,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
    )


def _xla_grouped_matmul(
    a, w, routing, routed_weights=None, *, top_k, config, out_dtype=None, activation=None
):
    """The reference grouped GEMM in f32 (`_reference.grouped_matmul`); config is not read."""
    w = to_canonical_layout(w)
    if activation is None:
        out = _reference.grouped_matmul(a, w, routing, top_k=top_k, routed_weights=routed_weights)
        return out.astype(out_dtype or a.dtype)
    out = _reference.grouped_matmul(a, w, routing, top_k=top_k)  # [R * top_k, N] f32
    return _activations.activate_then_weight(out, activation, routed_weights, out_dtype or a.dtype)


def _xla_gemm_config(shape: GemmShape, config: BlockConfig | None):
    """Any config runs (the reference reads only the routing); without one, BlockConfig()."""
    return (config, "caller") if config is not None else (BlockConfig(), "default")


XLA_BACKEND = Backend(
    name=REFERENCE_BACKEND,
    unsupported_reason=_xla_unsupported_reason,
    fused_moe=_xla_fused_moe,
    align_unsupported_reason=lambda problem: None,
    moe_align_block_size=_reference.moe_align_block_size,
    layouts=None,  # every layout: the others convert back to the canonical one
    batch_invariant_reason=None,  # fixed token blocks; the linear's rows in fixed blocks too
    grouped_matmul=GroupedMatmul(
        unsupported_reason=lambda problem: None,
        config=_xla_gemm_config,
        run=_xla_grouped_matmul,
    ),
    codes=CODES,
    biases=True,
)

_builtins_loaded = False


def _ensure_builtin_backends() -> None:
    """Registers 'xla' and, when importable, the kernel backends of BUILTIN_BACKEND_MODULES
    (imported by module name on the registry's first use)."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    _REGISTRY[XLA_BACKEND.name] = XLA_BACKEND
    for module in BUILTIN_BACKEND_MODULES:
        try:
            backends = importlib.import_module(module).BACKENDS
        except ImportError as err:  # pragma: no cover - the kernels ship with the package
            logger.debug("wna16_jax: %s unavailable: %s", module, err)
            continue
        for b in backends:
            _REGISTRY[b.name] = b
