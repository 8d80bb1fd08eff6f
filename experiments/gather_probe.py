"""The 'mgpu' layer's rows in block order: XLA's gather and select against the gather_rows
kernel, kernel time from a device trace (examples/kernel_timeline.py), DeepSeek-V3 TP=1 shapes,
the default block size per M. Needs a GPU.

    PYTHONPATH=$PWD python3 experiments/gather_probe.py --m 16 256 4096
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
)

import benchmark  # noqa: E402
import kernel_timeline  # noqa: E402

from pallas_kernels import mgpu_fused_moe  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--m", type=int, nargs="+", default=[16, 256, 4096])
    args = p.parse_args(argv)
    e, top_k, h, i, g = benchmark.PRESETS["deepseek-v3"]
    key = jax.random.key(0)
    for m in args.m:
        x = jax.random.normal(jax.random.fold_in(key, m), (m, h), jnp.bfloat16)
        _, ids = benchmark.random_routing(jax.random.fold_in(key, 1 + m), m, e, top_k, 1)
        cfg = mgpu_fused_moe.default_config(m * top_k, e, g, i)
        routing = mgpu_fused_moe.align(ids[0], num_experts=e, block_m=cfg.block_m,
                                       expert_map=None, interpret=False)  # fmt: skip
        slots, _ = mgpu_fused_moe.used_blocks(routing, m * top_k, cfg.block_m)
        xla_rows = mgpu_fused_moe.xla_rows_in_block_order
        kernel_rows = mgpu_fused_moe.rows_in_block_order  # gather_rows at these shapes
        assert (xla_rows(x, slots, top_k) == kernel_rows(x, slots, top_k)).all()
        for name, fn in (("xla", xla_rows), ("kernel", kernel_rows)):
            trace, calls = kernel_timeline.trace_loop(
                lambda x, s, fn=fn: fn(x, s, top_k), [(x, slots)], consts=(), calls=20,
                chain=False,
            )  # fmt: skip
            s = kernel_timeline.summarize(kernel_timeline.device_kernels(trace), calls)
            top = s["kernels"][0]
            mb = slots.shape[0] * h * 2 / 1e6
            print(f"M={m:<5} P={slots.shape[0]:<6} {name:<7} {top['total_us_per_call']:8.1f} us "
                  f"per call in {top['name'][:40]} ({mb:.0f} MB written); all kernels "
                  + ", ".join(f"{k['name'][:30]} {k['total_us_per_call']:.1f}"
                              for k in s["kernels"][:4]), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
