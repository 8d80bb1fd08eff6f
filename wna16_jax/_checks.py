"""Argument checks of the public functions: array and integer arguments, routing id ranges.

Checks are static (types, shapes, dtypes, Python values) wherever they can be. Those that
need an array's values (expert_map entries, a routing block's expert, in range) read a concrete
array on the host (numpy, or a jax array that is not traced: the same read `check_finite`
does); a traced one is never read (no hidden host sync inside jit): its check is a
`checkify.debug_check`, which runs under `jax.experimental.checkify.checkify` and is dropped
otherwise (opt-in, as JAX's own data-dependent checks).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


def check_array(name: str, a: Any) -> None:
    """Raises TypeError unless `a` is an array (jax or numpy) or a jax.ShapeDtypeStruct: a Python
    list or scalar has no dtype the library could honour, so it is refused, not guessed."""
    if isinstance(a, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        return
    raise TypeError(
        f"{name} must be an array (jax.Array or numpy.ndarray), got {type(a).__name__}; "
        f"convert it with jnp.asarray({name}, dtype=...) choosing the dtype"
    )


def as_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """`value` as a Python int: ints and numpy integer scalars (not bool, not floats).

    Raises:
        TypeError: a bool, float or any other non-integer.
        ValueError: an int below `minimum`.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r} must be an int, got a bool")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}={value!r} must be an int, got {type(value).__name__}") from None
    if minimum is not None and n < minimum:
        raise ValueError(f"{name}={n} must be " + ("positive" if minimum == 1 else f">= {minimum}"))
    return n


def ids_as_int32(ids, num_ids: int):
    """Integer ids of any dtype -> int32, ids outside [0, num_ids) as -1.

    The range is compared in the ids' own dtype before the cast: an int64 2**32 or a uint32
    2**31 would otherwise wrap into [0, num_ids) and name a wrong id. int32 ids are returned
    as they are (the consumers drop ids outside the range themselves). A numpy array stays on
    the host.
    """
    if ids.dtype == np.int32:
        return ids
    xp = np if isinstance(ids, np.ndarray) else jnp
    inside = (ids >= 0) & (ids < num_ids)
    return xp.where(inside, xp.where(inside, ids, 0).astype(np.int32), -1)


def check_expert_map(expert_map, *, num_global: int | None, num_local: int | None):
    """Checks expert_map [E_global] (global id -> local id, -1 off-shard); returns it as int32.

    Static: a 1-D integer array with num_global entries (when given). Values: each entry in
    [-1, num_local) (when num_local is given), raised as ValueError for a concrete map and a
    checkify.debug_check for a traced one, whose out-of-range entries then become -1 (their
    slots contribute zero) instead of wrapping or being clamped onto a real expert.

    Raises:
        TypeError: not an array.
        ValueError: the wrong shape or dtype, or a concrete entry out of range.
    """
    check_array("expert_map", expert_map)
    shape = tuple(int(d) for d in expert_map.shape)
    if len(shape) != 1 or not jnp.issubdtype(expert_map.dtype, jnp.integer):
        raise ValueError(
            f"expert_map must be a 1-D integer array [E_global], got shape {shape} dtype "
            f"{expert_map.dtype}"
        )
    if num_global is not None and shape[0] != num_global:
        raise ValueError(f"expert_map has {shape[0]} entries but num_experts={num_global}")
    if num_local is None or isinstance(expert_map, jax.ShapeDtypeStruct):
        return expert_map
    expert_map = check_values_in("expert_map", expert_map, num_local, "local experts")
    return expert_map.astype(np.int32) if expert_map.dtype != np.int32 else expert_map


def check_values_in(name: str, ids, count: int, what: str):
    """Checks that the integer array `ids` holds values in [-1, count) (-1: none); returns it.

    A concrete array out of range is a ValueError naming the first bad entry; a traced one gets
    a checkify.debug_check and its out-of-range entries become -1, never wrapped or clamped
    onto a real index.
    """
    if isinstance(ids, jax.core.Tracer):
        bad = (ids < -1) | (ids >= count)
        checkify.debug_check(
            ~jnp.any(bad), f"{name} holds entries outside [-1, {count}) (the {count} {what})"
        )
        return jnp.where(bad, -1, ids)
    # Read on the host: a concrete jax array may be a constant inside a jit trace, where jnp
    # operations on it would be traced too.
    host = np.asarray(ids)
    bad = (host < -1) | (host >= count)
    if bad.any():
        index = tuple(int(i) for i in np.unravel_index(np.argmax(bad), bad.shape))
        index_text = ", ".join(map(str, index))
        raise ValueError(
            f"{name}[{index_text}]={int(host[index])} is outside [-1, {count}): there are "
            f"{count} {what} (-1 marks none)"
        )
    return ids


def check_out_dtype(out_dtype) -> None:
    """Raises ValueError unless out_dtype is None or a float dtype (naming out_dtype)."""
    if out_dtype is not None:
        check_float_dtype("out_dtype", out_dtype, error=ValueError)


def check_implementation(implementation):
    """`implementation` as select_backend takes it: None, a backend name, or a sequence of names.

    Raises:
        TypeError: anything else (an int, a sequence holding a non-string), the value named.
    """
    if implementation is None or isinstance(implementation, str):
        return implementation
    if isinstance(implementation, (list, tuple)) and all(
        isinstance(name, str) for name in implementation
    ):
        return tuple(implementation)
    raise TypeError(
        f"implementation={implementation!r} must be None (automatic), a backend name such as "
        f"'xla' or a sequence of backend names, got {type(implementation).__name__}"
    )


def check_config(config) -> None:
    """Raises TypeError unless `config` is None or a config dataclass instance (wj.BlockConfig,
    a backend's own): a dict or other value would be ignored or fail deep inside a backend."""
    if config is None or (dataclasses.is_dataclass(config) and not isinstance(config, type)):
        return
    hint = f"wj.BlockConfig(**{config!r})" if isinstance(config, dict) else "wj.BlockConfig(...)"
    raise TypeError(
        f"config={config!r} is a {type(config).__name__}, not a config: pass {hint} or None"
    )


def check_float_dtype(name: str, dtype, *, error: type[Exception] = TypeError):
    """`dtype` (anything jnp.dtype reads) as a floating jnp dtype.

    Raises:
        `error` (TypeError): not a dtype, or not a floating one (the argument `name` and value
            named).
    """
    try:
        out = jnp.dtype(dtype)
    except TypeError:
        raise error(f"{name}={dtype!r} is not a dtype") from None
    if not jnp.issubdtype(out, jnp.floating):
        raise error(f"{name}={out.name} must be a floating dtype (bfloat16, float16, ...)")
    return out


def check_scales_fit(scales, scale_dtype) -> None:
    """Raises ValueError where concrete f32 `scales` overflow `scale_dtype` (float16's largest
    finite value is 65504): stored they would be inf, and the weights NaN. Traced scales are
    not read (no host sync under jit)."""
    if isinstance(scales, jax.core.Tracer):
        return
    finfo = jnp.finfo(scale_dtype)
    largest = float(np.max(np.asarray(scales), initial=0.0))
    if largest > float(finfo.max):
        name = jnp.dtype(scale_dtype).name
        raise ValueError(
            f"the largest scale, {largest:.4g}, overflows scale_dtype={name} (largest finite "
            f"value {float(finfo.max):.4g}): pass scale_dtype=jnp.float32 or jnp.bfloat16, or "
            f"scale the weights down"
        )
