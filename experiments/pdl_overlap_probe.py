"""Did programmatic dependent launch (PDL) let GEMM2 start before GEMM1 ended?

Needs the mgpu GEMM with PDL: commit a9facbb (`MgpuConfig.pdl`, reverted in 1d50bba); the
script checks for it. Traces the chained mgpu layer (DeepSeek-V3 TP=1 with zero points) at the
default config and at pdl=2, and prints per call the span, the kernels' busy time, and the gap
from each Mosaic GPU kernel's end to the next one's start (negative: they overlapped, as PDL
allows; GEMM1 -> GEMM2 within a call, GEMM2 -> the next call's GEMM1 across calls).

Usage (H200): PYTHONPATH=$PWD python3 experiments/pdl_overlap_probe.py [--m 1 16] [--calls 40]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import benchmark  # noqa: E402
import kernel_timeline  # noqa: E402

import wna16_jax as wj  # noqa: E402
from pallas_kernels import mgpu_fused_moe  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[1, 16])
    p.add_argument("--calls", type=int, default=40)
    args = p.parse_args(argv)
    if "pdl" not in {f.name for f in dataclasses.fields(mgpu_fused_moe.MgpuConfig)}:
        raise SystemExit("needs the PDL code of commit a9facbb (MgpuConfig.pdl)")
    key = jax.random.key(0)
    w13, w2 = benchmark.probe_experts(key, "deepseek-v3", has_zp=True)
    to_mgpu = functools.partial(wj.layouts.to_kernel_layout, layout="mgpu_int4")
    weights = jax.block_until_ready((to_mgpu(w13), to_mgpu(w2)))
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    for m in args.m:
        xs, tws, idss = benchmark.probe_inputs(key, "deepseek-v3", m)
        sets = [(xs[s], tws[s], idss[s]) for s in range(4)]
        default = mgpu_fused_moe.default_config(8 * m, 256, 128)
        for name, cfg in (("default", default), ("pdl=2", dataclasses.replace(default, pdl=2))):

            def layer(a, b, x, tw, ids, cfg=cfg):
                return wj.fused_moe(x, a, b, tw, ids, implementation="mgpu", config=cfg)

            trace, calls = kernel_timeline.trace_loop(
                layer, sets, consts=weights, calls=args.calls, chain=True
            )
            kernels = kernel_timeline.device_kernels(trace)
            s = kernel_timeline.summarize(kernels, calls)
            gemms = [k for k in kernels if k["name"].startswith("kernel_mosaic_gpu")]
            gaps = [
                b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(gemms[:-1], gemms[1:], strict=True)
            ]
            within, across = gaps[0::2], gaps[1::2]  # GEMM1 -> GEMM2, GEMM2 -> next GEMM1
            print(f"M={m:<4} {name:<8} span {s['span_us']:.1f} us/call, busy {s['busy_us']:.1f}, "
                  f"GEMM1->GEMM2 gap median {statistics.median(within):.2f} us (min "
                  f"{min(within):.2f}), GEMM2->next GEMM1 median {statistics.median(across):.2f} "
                  f"(min {min(across):.2f})", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
