"""Checkpoint formats (AWQ, GPTQ, compressed-tensors, MXFP4) to and from QuantizedExperts."""

from wna16_jax.formats import mxfp4
from wna16_jax.formats._common import stack
from wna16_jax.formats.awq import AWQ_ORDER, from_awq, to_awq
from wna16_jax.formats.compressed_tensors import (
    from_compressed_tensors,
    from_compressed_tensors_int,
    to_compressed_tensors,
    to_compressed_tensors_int,
)
from wna16_jax.formats.config import (
    activation_quant_from_config,
    from_quantization_config,
    static_input_scale,
)
from wna16_jax.formats.gptq import (
    fold_w2_act_order,
    from_gptq,
    gptq_act_order_permutation,
    to_gptq,
)

__all__ = [
    "AWQ_ORDER",
    "activation_quant_from_config",
    "fold_w2_act_order",
    "from_awq",
    "from_compressed_tensors",
    "from_compressed_tensors_int",
    "from_gptq",
    "from_quantization_config",
    "gptq_act_order_permutation",
    "mxfp4",
    "stack",
    "static_input_scale",
    "to_awq",
    "to_compressed_tensors",
    "to_compressed_tensors_int",
    "to_gptq",
]
