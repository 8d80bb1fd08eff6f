"""The backend order a device measured fastest: automatic selection tries it first where a
device's file lists the problem (a backend other than the platform's first won there).

File: wna16_jax/data/backend_order/<device kind>.json (named as the tuned tables are), written
from examples/benchmark.py's figures:

    {"device": "NVIDIA H200", "about": "...", "rules": [
        {"problem": {"num_experts": 256, "hidden": 7168, ...},   # MoEProblem fields, exact
         "min_tokens": 4096, "max_tokens": null,                 # T range, both inclusive
         "order": ["triton", "pallas", "xla"],                   # tried in this order
         "measured_us": {...}}]}                                  # the figures behind it

A backend that cannot run the problem (e.g. jax_triton not installed) is skipped as always, so
the next one in the order runs.
"""

from __future__ import annotations

import functools

from wna16_jax import _configs

BACKEND_ORDER_DIR = "data/backend_order"


@functools.cache
def rules(device_kind: str) -> tuple[dict, ...]:
    """The device's rules (empty when it has no file)."""
    data = _configs.device_file(BACKEND_ORDER_DIR, device_kind)
    return () if data is None else tuple(data["rules"])


def matches(rule: dict, problem) -> bool:
    """Whether `rule` covers `problem` (a MoEProblem): every listed field equal, T in range."""
    if any(getattr(problem, field) != value for field, value in rule["problem"].items()):
        return False
    t = problem.num_tokens
    lo, hi = rule.get("min_tokens"), rule.get("max_tokens")
    return (lo is None or t >= lo) and (hi is None or t <= hi)


def measured_order(problem, device_kind: str) -> tuple[str, ...] | None:
    """The backend order of the first rule covering `problem` on this device, or None."""
    for rule in rules(device_kind):
        if matches(rule, problem):
            return tuple(rule["order"])
    return None
