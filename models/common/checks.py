"""Checks of what users and checkpoints hand the model families: config.json types, token ids."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import jax
import numpy as np

# config.json fields that hold a JSON object (or null), whatever the family.
OBJECT_FIELDS = ("rope_scaling", "rope_parameters", "quantization_config")
# Rope settings' fields and the kind each must be.
ROPE_FIELDS = {
    "type": str, "rope_type": str, "factor": float, "original_max_position_embeddings": int,
    "beta_fast": float, "beta_slow": float, "mscale": float, "mscale_all_dim": float,
    "rope_theta": float,
}  # fmt: skip


def _kind_problem(name: str, value, kind) -> str | None:
    """A sentence where `value` is not of `kind` (bool, int, float: any number, str)."""
    if kind is bool:
        ok, text = isinstance(value, bool), "true or false"
    elif kind is int:
        ok, text = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif kind is float:
        ok, text = isinstance(value, int | float) and not isinstance(value, bool), "a number"
    elif kind is str:
        ok, text = isinstance(value, str), "a string"
    else:
        return None
    return None if ok else f"{name}={value!r} must be {text}"


def _ids_problem(name: str, value) -> str | None:
    """A sentence where `value` is neither an integer nor a list of integers."""
    items = value if isinstance(value, list) else [value]
    if all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        return None
    return f"{name}={value!r} must be an integer or a list of integers"


def hf_config_problems(
    d: Mapping,
    cls,
    *,
    required: Iterable[str] = (),
    int_lists: Iterable[str] = (),
    nullable: Iterable[str] = (),
) -> list[str]:
    """A sentence for each config.json field of the wrong JSON type, before the family's reader
    computes with it: a field named as a field of the config dataclass `cls` must be of its
    default's kind (true/false, an integer, a number, a string); rope_scaling, rope_parameters
    and quantization_config an object (or null), with rope fields of their kinds;
    `int_lists` (e.g. mlp_only_layers) lists of integers; eos_token_id an integer or a list of
    them; each of `required` present; and null only where the field's type allows None or
    the reader gives a default for it (`nullable`).
    """
    problems = [f"{name} is missing" for name in required if d.get(name) is None]
    for f in dataclasses.fields(cls):
        if f.name not in d or f.default is None or f.name in problems:
            continue
        if f.name == "eos_token_id" or f.name in int_lists:
            continue
        if d[f.name] is None:
            if "None" not in str(f.type) and f.name not in nullable and f.name not in required:
                problems.append(f"{f.name}=null is not allowed (give a value or leave it out)")
            continue
        if (p := _kind_problem(f.name, d[f.name], type(f.default))) is not None:
            problems.append(p)
    for name in OBJECT_FIELDS:
        value = d.get(name)
        if value is not None and not isinstance(value, dict):
            problems.append(f"{name}={value!r} must be an object (a JSON {{...}}) or null")
        elif name != "quantization_config" and value:
            for key, kind in ROPE_FIELDS.items():
                if value.get(key) is not None:
                    problem = _kind_problem(f"{name}.{key}", value[key], kind)
                    problems += [problem] if problem else []
    for name in int_lists:
        value = d.get(name)
        if value is not None and not (
            isinstance(value, list)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
        ):
            problems.append(f"{name}={value!r} must be a list of integers")
    for name in ("eos_token_id",):
        if d.get(name) is not None and (p := _ids_problem(name, d[name])) is not None:
            problems.append(p)
    return problems


def check_input_ids(input_ids, vocab_size: int, attention_mask=None) -> None:
    """Refuses token ids outside [0, vocab_size) in a direct model call, as `generate` does:
    jnp.take would clamp them (a finite, wrong logit) and an int32 cast wraps 2**32 + 3 to 3.

    Only a concrete array is read (numpy, a list, or a jax array that is not traced); a traced
    one is not (no host sync inside jit). With `attention_mask`, only the positions it marks
    are checked (padding may hold any id).

    Raises:
        TypeError: ids that are not integers (the dtype named).
        ValueError: the first id outside the vocabulary and its position.
    """
    if isinstance(input_ids, jax.core.Tracer):
        return
    ids = np.asarray(input_ids)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"input_ids are {ids.dtype}, not integer token ids")
    bad = (ids < 0) | (ids >= vocab_size)
    if attention_mask is not None and not isinstance(attention_mask, jax.core.Tracer):
        bad &= np.broadcast_to(np.asarray(attention_mask).astype(bool), bad.shape)
    if bad.any():
        where = tuple(int(i) for i in np.unravel_index(np.argmax(bad), bad.shape))
        raise ValueError(
            f"input_ids[{', '.join(map(str, where))}]={int(ids[where])} is outside the "
            f"vocabulary [0, {vocab_size})"
        )


def tied_weight_problems(cfg, ckpt, *, embed="model.embed_tokens.weight", head="lm_head.weight"):
    """A sentence where config.json ties the head to the embedding (tie_word_embeddings) but the
    checkpoint holds a different `head` tensor, which the model would silently not use."""
    if not getattr(cfg, "tie_word_embeddings", False) or head not in ckpt or embed not in ckpt:
        return []
    if ckpt.meta(head) == ckpt.meta(embed) and np.array_equal(
        np.asarray(ckpt[head]).view(np.uint8), np.asarray(ckpt[embed]).view(np.uint8)
    ):
        return []
    return [
        f"tie_word_embeddings is true, but {head} {list(ckpt.meta(head)[0])} differs from {embed} "
        f"{list(ckpt.meta(embed)[0])}: the model would use the embedding as its head; set "
        f"tie_word_embeddings to false in config.json (or remove {head})"
    ]
