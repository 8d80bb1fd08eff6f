"""What do the GEMMs' in-register steps cost under the H200's power cap? A timing probe only: its
variants compute WRONG results and exist nowhere but here.

Session 19 found the decode layer at the 700 W power cap from M=16 (the SM clock 8-19% below its
maximum, experiments/power_probe.py). If the dequantization's instructions are a large part of
the energy per weight byte, removing some of them should raise the clock and shorten the layer.
This probe times the DeepSeek-V3 TP=1 layer (zero points, default config) with copies of
pallas_kernels/mgpu_wna16_gemm.py whose source has one step removed:
- "no zero point": the converted tile 128 + q is multiplied as is (no subtraction of 128 + z:
  16 of a thread's ~45 instructions per 64x64 tile). Session 20 measured it at 6.7% of the
  M=256 layer; the correction by per-group row sums built to win that (commit 0018d1c, removed)
  ran slower instead (GEMM1 at M=256 +4.0%) and was wrong on the GPU at 64-wide groups;
- "no group scale": each group's f32 sum is added unscaled;
- "neither";
- "no conversion": a constant tile in place of each loaded one (the upper bound of any cheaper
  conversion).
Each variant: the probe's short timed loop (benchmark.time_loop, chained, median of 5) and a
sustained run of `--seconds` with nvidia-smi's clocks and power (power_probe.sustained, .report).

Usage (H200): PYTHONPATH=$PWD python3 experiments/convert_cost_probe.py [--m 16 256]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.dirname(__file__))
import benchmark  # noqa: E402
import power_probe  # noqa: E402

import wna16_jax as wj  # noqa: E402
from pallas_kernels import mgpu_fused_moe, mgpu_wna16_gemm  # noqa: E402

SUBTRACT = "wt = biased - lax.broadcast_in_dim(offset, biased.shape, [0])"
SCALE = "return accs[:a] + (accs[a] + part * scale,) + accs[a + 1 :]"
VARIANTS = {
    "default": {},
    "no zero point": {SUBTRACT: "wt = biased"},
    "no group scale": {SCALE: "return accs[:a] + (accs[a] + part,) + accs[a + 1 :]"},
}
VARIANTS["neither"] = {**VARIANTS["no zero point"], **VARIANTS["no group scale"]}
# One more 64-wide wgmma per group and half/sub-tile (an existing tile's, into the group's sum):
# what an augmented-K correction would add, the zero point as one more k-chunk of the weights
# (-(128 + z) built in registers) against the rows' sums (extra columns of x). With the zero
# point's subtraction removed too, "no zero point, extra wgmma" bounds what that design wins.
WGMMA = "plgpu.wgmma(part_ref, wt, x_smem.at[:, pl.ds(j * TILE, TILE)].T)"
EXTRA_WGMMA = {
    WGMMA: WGMMA
    + "\n"
    + " " * 24
    + "plgpu.wgmma(part_ref, wts[0], x_smem.at[:, pl.ds(k_tiles[0] * TILE, TILE)].T)",
    "*units[u - 1], tiles_per_part)": "*units[u - 1], tiles_per_part + 1)",  # the wait
}
VARIANTS["extra wgmma"] = EXTRA_WGMMA
VARIANTS["no zero point, extra wgmma"] = {**VARIANTS["no zero point"], **EXTRA_WGMMA}
# No conversion at all: a constant tile in place of the loaded one (the weights still stream into
# shared memory, but no thread reads or converts them): what any cheaper conversion could win.
VARIANTS["no conversion"] = {
    "biased = _biased_tile(q_tile)": (
        "biased = plgpu.layout_cast(jnp.full((TILE, TILE), 130, dtype), plgpu.Layout.WGMMA)"
    ),
}


def variant_gemm(name: str):
    """mgpu_wna16_gemm from a copy of its module's source with VARIANTS[name]'s lines replaced
    (each must occur exactly once)."""
    with open(mgpu_wna16_gemm.__file__) as f:
        source = f.read()
    for old, new in VARIANTS[name].items():
        if source.count(old) != 1:
            raise SystemExit(f"{old!r} occurs {source.count(old)} times in the GEMM's source")
        source = source.replace(old, new)
    spec = importlib.util.spec_from_loader(f"convert_cost_{len(name)}", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = mgpu_wna16_gemm.__file__
    exec(compile(source, mgpu_wna16_gemm.__file__, "exec"), module.__dict__)  # noqa: S102
    return module.mgpu_wna16_gemm


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[16, 256])
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="the variants to time (default: all)")  # fmt: skip
    args = p.parse_args(argv)
    key = jax.random.key(0)
    w13, w2 = benchmark.probe_experts(key, "deepseek-v3", has_zp=True)
    to_mgpu = functools.partial(wj.layouts.to_kernel_layout, layout="mgpu_int4")
    weights = jax.block_until_ready((to_mgpu(w13), to_mgpu(w2)))
    original = mgpu_fused_moe.mgpu_wna16_gemm
    for m in args.m:
        xs, tws, idss = benchmark.probe_inputs(key, "deepseek-v3", m)
        sets = [(xs[s], tws[s], idss[s]) for s in range(4)]
        for name in args.variants:
            mgpu_fused_moe.mgpu_wna16_gemm = variant_gemm(name)
            jax.clear_caches()  # the layer retraces with this variant's GEMM

            def layer(a, b, x, tw, ids):
                return wj.fused_moe(x, a, b, tw, ids, implementation="mgpu")

            iters = 100 if m <= 256 else 20
            short, _ = benchmark.time_loop(layer, sets, iters=iters, repeats=5, consts=weights,
                                           host=False, chain=True)  # fmt: skip
            run, per_run = benchmark.make_loop(layer, sets, iters=4 * iters, consts=weights,
                                               chain=True)  # fmt: skip
            seconds, rows = power_probe.sustained(run, per_run, args.seconds)
            power_probe.report(
                f"M={m:<5} {name:<15}",
                f"short loop {short * 1e6:8.1f} us, sustained {seconds * 1e6:8.1f} us",
                rows,
            )
    mgpu_fused_moe.mgpu_wna16_gemm = original
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
