"""The backend API: what a kernel backend (pallas_kernels/<name>/) imports of the library."""

# A backend is a folder named after it with a module `backend` holding BACKENDS, a tuple of the
# Backends it registers (wna16_jax._dispatch.BUILTIN_BACKEND_MODULES lists the built-in ones;
# another package calls register_backend). A Backend gives its MoE stages (MoeStages, run by the
# library's one pipeline: no backend defines its own fused_moe), its align kernel, optionally its
# grouped GEMM, its configs' rules (ConfigRules, resolved by `resolve`), the reasons it cannot run
# a problem, and the kernel layouts it defines (LayoutConversion: bits, checks, shapes, shard
# granularity and conversions). Kernel files import this module and public wna16_jax names only.

from wna16_jax._activations import (
    ACTIVATIONS,
    ClampedSwiGLU,
    Int8Rows,
    activate,
    activate_then_weight,
    activation_fn,
    normalize_activation,
    weighted_rows,
)
from wna16_jax._configs import (
    BATCH_INVARIANT_M,
    TUNED_M_RATIO,
    ConfigRules,
    GemmShape,
    batch_invariant_config,
    gemm_entry_shape,
    gemm_table_key,
    log_once,
    resolve,
)
from wna16_jax._dispatch import (
    AlignProblem,
    Backend,
    GemmProblem,
    GroupedMatmul,
    LayoutConversion,
    MoEProblem,
    compiled_and_interpreted,
    cuda_gpu_reason,
    register_backend,
)
from wna16_jax._pipeline import DEFAULT_CHUNK_TOKENS, MoeStages, Routed, slots_in_blocks
from wna16_jax._quant import e2m1_to_f32, e8m0_to_f32, implicit_zero, pack_zeros, unpack_zeros
from wna16_jax._routing import (
    all_padding_routing,
    check_align_kernel_args,
    local_expert_of,
    max_padded_len,
)
from wna16_jax._types import (
    CODES,
    MAX_ARRAY_ELEMENTS,
    ActivationQuant,
    AlignedRouting,
    BlockConfig,
    QuantizedExperts,
)

__all__ = [
    "ACTIVATIONS",
    "BATCH_INVARIANT_M",
    "CODES",
    "ClampedSwiGLU",
    "DEFAULT_CHUNK_TOKENS",
    "MAX_ARRAY_ELEMENTS",
    "TUNED_M_RATIO",
    "ActivationQuant",
    "AlignProblem",
    "AlignedRouting",
    "Backend",
    "BlockConfig",
    "ConfigRules",
    "GemmProblem",
    "GemmShape",
    "GroupedMatmul",
    "Int8Rows",
    "LayoutConversion",
    "MoEProblem",
    "MoeStages",
    "QuantizedExperts",
    "Routed",
    "activate",
    "activate_then_weight",
    "activation_fn",
    "all_padding_routing",
    "batch_invariant_config",
    "check_align_kernel_args",
    "compiled_and_interpreted",
    "cuda_gpu_reason",
    "e2m1_to_f32",
    "e8m0_to_f32",
    "gemm_entry_shape",
    "gemm_table_key",
    "implicit_zero",
    "local_expert_of",
    "log_once",
    "max_padded_len",
    "normalize_activation",
    "pack_zeros",
    "register_backend",
    "resolve",
    "slots_in_blocks",
    "unpack_zeros",
    "weighted_rows",
]
