"""What every family's config shares: how the model quantizes its weights (QuantSpec)."""

from __future__ import annotations

import dataclasses

# The linears a QuantSpec may quantize, by role; each family's name table tags its linears
# with these.
QUANT_TARGETS = ("experts", "shared_experts", "dense_mlp", "attention")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How the model quantizes its weights (random init and quantize-on-load).

    Attributes:
        bits: 4 or 8.
        group_size: G; a layer whose K is not a multiple of G uses one group per row (-1).
        has_zp: asymmetric (zero points stored) or symmetric.
        targets: which linears are quantized: "experts" (routed), "shared_experts",
            "dense_mlp" (the MLPs of dense layers), "attention" (the attention projections).
            The router and the embeddings / lm_head always stay float.
        scale_dtype: the scales' dtype (e.g. "float16", as GPTQ checkpoints store them);
            None: the model's dtype.
    """

    bits: int = 4
    group_size: int = 128
    has_zp: bool = True
    targets: tuple[str, ...] = QUANT_TARGETS
    scale_dtype: str | None = None

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"QuantSpec.bits={self.bits} is not supported (supported: 4, 8)")
        unknown = sorted(set(self.targets) - set(QUANT_TARGETS))
        if unknown:
            raise ValueError(
                f"QuantSpec.targets has unknown entries {unknown}; known: {list(QUANT_TARGETS)}"
            )

    def group_for(self, k: int) -> int:
        """The group size used for a weight with K input features."""
        return self.group_size if self.group_size > 0 and k % self.group_size == 0 else -1

    @classmethod
    def parse(cls, spec: str | QuantSpec | None, *, group_size: int = 128) -> QuantSpec | None:
        """`None`, a QuantSpec, or "int4" / "int8" (asymmetric, `group_size`)."""
        if spec is None or isinstance(spec, QuantSpec):
            return spec
        names = {"int4": 4, "int8": 8}
        if spec not in names:
            raise ValueError(f"quantize={spec!r} is not one of {sorted(names)} or None")
        return cls(bits=names[spec], group_size=group_size)
