"""The family registry: the one table of model-family packages, each describing itself.

A family is a package `models.<name>` whose `__init__` defines `FAMILY = Family(...)`: the
config.json model types and architectures it reads, its model and config classes, its
loader, random init, sharding and presets. Adding a family is its folder plus its line in
FAMILY_PACKAGES; nothing outside its folder names it (`models.load_pretrained`,
`models.prepare`, `models.generate` and `examples/generate.py` ask this table).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Any

# The packages under models/ that hold a family, in the order they are listed and searched;
# the first is the default family of a random model (examples/generate.py).
FAMILY_PACKAGES = (
    "deepseek_v3",
    "qwen_moe",
    "gpt_oss",
)


@dataclasses.dataclass(frozen=True)
class Family:
    """What a family package registers (its `FAMILY`).

    Attributes:
        name: the package name under models/ (e.g. "qwen_moe").
        model_types: config.json `model_type` values it reads.
        architectures: config.json `architectures` entries it reads (where the model type is
            none of any family's).
        names: its checkpoint name table (`models.common.loader.NameTable`), which names its
            model and config classes and gives `load_pretrained` / `save_pretrained`.
        init_random: `(cfg, *, seed, implementation, mesh, moe_mode, progress, ...) -> model`.
        shard_model: `(model, mesh, *, moe_mode) -> model`, placing an in-memory model.
        presets: {name: (**overrides) -> config} of released sizes ("deepseek-v3", ...).
        full_width: `(num_layers, **overrides) -> config`: its flagship's width with fewer
            layers, for random models at full size; None where it has none.
    """

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    names: Any
    init_random: Callable
    shard_model: Callable
    presets: Mapping[str, Callable] = dataclasses.field(default_factory=dict)
    full_width: Callable | None = None

    @property
    def model_class(self) -> type:
        """Its CausalLM subclass."""
        return self.names.model_class

    @property
    def config_class(self) -> type:
        """Its frozen config (with `from_json`, `tiny`)."""
        return self.names.config_class

    def load_pretrained(self, path, **kwargs):
        """The loader engine on its name table (`models.common.loader.load_pretrained`)."""
        return self.names.load_pretrained(path, **kwargs)

    def save_pretrained(self, model, path, **kwargs) -> None:
        """The writer on its name table (`models.common.loader.save_pretrained`)."""
        self.names.save_pretrained(model, path, **kwargs)


@functools.cache
def families() -> dict[str, Family]:
    """{name: Family} of every package in FAMILY_PACKAGES (imported on first use).

    Raises:
        TypeError: a package without a `FAMILY` Family, or one naming another package.
    """
    out = {}
    for name in FAMILY_PACKAGES:
        family = getattr(importlib.import_module(f"models.{name}"), "FAMILY", None)
        if not isinstance(family, Family) or family.name != name:
            raise TypeError(f"models.{name} defines no FAMILY = Family(name={name!r}, ...)")
        out[name] = family
    return out


def model_types() -> dict[str, str]:
    """{config.json model_type: family name}."""
    return {t: f.name for f in families().values() for t in f.model_types}


def architectures() -> dict[str, str]:
    """{config.json architectures entry: family name}."""
    return {a: f.name for f in families().values() for a in f.architectures}


def presets() -> dict[str, tuple[Family, Callable]]:
    """{preset name: (its family, (**overrides) -> config)} over every family."""
    return {p: (f, make) for f in families().values() for p, make in f.presets.items()}


def family_of(config: Mapping) -> str:
    """The family of a config.json dict: by its model_type, else its architectures.

    Raises:
        ValueError: neither is supported; the supported ones listed.
    """
    types, archs = model_types(), architectures()
    model_type = config.get("model_type")
    if model_type in types:
        return types[model_type]
    for arch in config.get("architectures") or ():
        if arch in archs:
            return archs[arch]
    raise ValueError(
        f"model_type={model_type!r} (architectures {config.get('architectures')}) is not "
        f"supported; supported model types: {sorted(types)}, architectures: {sorted(archs)}"
    )


def family_of_model(model) -> Family:
    """The family whose model_class `model` is (or whose config class its cfg is).

    Raises:
        TypeError: a model of no registered family.
    """
    for family in families().values():
        if isinstance(model, family.model_class) or isinstance(model, family.config_class):
            return family
    raise TypeError(
        f"{type(model).__name__} is no registered family's model "
        f"({', '.join(f.model_class.__name__ for f in families().values())})"
    )
