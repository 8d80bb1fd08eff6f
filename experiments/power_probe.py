"""Is the mgpu layer power- or clock-limited on the H200? The GPU's clocks, power and throttle
reasons (nvidia-smi, sampled every 50 ms) while the DeepSeek-V3 TP=1 layer (zero points, the
default config) runs back to back for `--seconds` at each M, beside the time per call.

Why: the layer's time has varied by up to 4.5% between H200s at one code (M=256: 1887-1975 us
over sessions 16-19), and session 11 saw degenerate values (zeros, infinities) run 8% faster at
M=4096, which points at power. If the SM clock sits below its maximum with a power or thermal
reason while the layer runs, the spread between machines is theirs, not the kernels'.

Usage (H200): PYTHONPATH=$PWD python3 experiments/power_probe.py [--m 1 16 256 4096] [--copy]
    [--configs default default:down_block_n=128]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import io
import os
import statistics
import subprocess
import sys
import time

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import benchmark  # noqa: E402
import mgpu_probe  # noqa: E402

import wna16_jax as wj  # noqa: E402
from pallas_kernels import mgpu_fused_moe  # noqa: E402

FIELDS = (
    "clocks.sm", "clocks.max.sm", "clocks.mem", "power.draw", "power.limit", "temperature.gpu",
    "clocks_throttle_reasons.active",
)  # fmt: skip


def sample(seconds: float, run) -> tuple[list[dict], int]:
    """nvidia-smi's FIELDS every 50 ms while run() is called for `seconds`; (samples, calls)."""
    smi = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
         "-lms", "50"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        jax.block_until_ready(run())
        calls += 1
    smi.terminate()
    out, _ = smi.communicate()
    rows = [dict(zip(FIELDS, (v.strip() for v in r), strict=True))
            for r in csv.reader(io.StringIO(out)) if len(r) == len(FIELDS)]  # fmt: skip
    return rows, calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 256, 4096])
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--preset", choices=sorted(benchmark.PRESETS), default="deepseek-v3")
    p.add_argument("--copy", action="store_true", help="also the copy ceiling's pass (1 GiB f32)")
    p.add_argument(
        "--configs", nargs="+", type=mgpu_probe.parse_config, default=[mgpu_probe.DefaultWith(())],
        help="mgpu configs to run, as mgpu_probe.py --configs takes them (default: each M's "
        "default config), e.g. default:down_block_n=128",
    )  # fmt: skip
    p.add_argument("--implementation", default="mgpu", help="fused_moe's (xla: a CPU dry run)")
    args = p.parse_args(argv)
    key = jax.random.key(0)
    e, top_k, _, i, group = benchmark.PRESETS[args.preset]
    w13, w2 = benchmark.probe_experts(key, args.preset, has_zp=True)
    weights = (w13, w2)
    if args.implementation == "mgpu":
        to_mgpu = functools.partial(wj.layouts.to_kernel_layout, layout="mgpu_int4")
        weights = jax.block_until_ready((to_mgpu(w13), to_mgpu(w2)))
    idle, _ = sample(1.0, lambda: jax.numpy.zeros(()))
    print("idle: " + ", ".join(f"{f} {idle[-1][f]}" for f in FIELDS), flush=True)
    if args.copy:  # the copy ceiling's pass (benchmark.measure_ceilings'), sustained
        n, iters = 1 << 28, 20
        copy, x = benchmark.copy_loop(n, iters=iters)
        seconds, rows = sustained(lambda: copy(x), iters, args.seconds)
        report("copy", f"{2 * n * 4 / seconds / 1e12:.2f} TB/s (read + write, sustained)", rows)
    for m in args.m:
        xs, tws, idss = benchmark.probe_inputs(key, args.preset, m)
        sets = [(xs[s], tws[s], idss[s]) for s in range(4)]

        default = mgpu_fused_moe.default_config(m * top_k, e, group, i)
        for asked in args.configs:
            cfg = asked.at(default) if isinstance(asked, mgpu_probe.DefaultWith) else asked
            config = cfg if args.implementation == "mgpu" else None

            def layer(a, b, x, tw, ids, config=config):
                return wj.fused_moe(x, a, b, tw, ids, implementation=args.implementation,
                                    config=config)  # fmt: skip

            run, per_run = benchmark.make_loop(layer, sets, iters=400 if m <= 256 else 40,
                                               consts=weights, chain=True)  # fmt: skip
            seconds, rows = sustained(run, per_run, args.seconds)
            label = "" if cfg == default else f" {dataclasses.astuple(cfg)}"
            report(f"M={m:<5}{label}", f"{seconds * 1e6:8.1f} us/call (host-timed, chained)", rows)
    return 0


def sustained(run, calls_per_run: int, seconds: float) -> tuple[float, list[dict]]:
    """(seconds per call, nvidia-smi samples) of run() (calls_per_run calls each) repeated for
    `seconds` after one run to compile it, timed on the host."""
    jax.block_until_ready(run())
    t0 = time.perf_counter()
    rows, runs = sample(seconds, run)
    return (time.perf_counter() - t0) / (runs * calls_per_run), rows


def report(what: str, speed: str, rows: list[dict]) -> None:
    """One line: the speed, and the samples' clocks, power and throttle reasons past the first
    fifth of the run (the clocks settle)."""
    busy = rows[len(rows) // 5 :]

    def med(field):
        return statistics.median(float(r[field]) for r in busy)

    reasons = sorted({r["clocks_throttle_reasons.active"] for r in busy})
    lowest = min(float(r["clocks.sm"]) for r in busy)
    print(f"{what} {speed}  SM clock median {med('clocks.sm'):.0f} MHz (min {lowest:.0f}, max "
          f"{med('clocks.max.sm'):.0f}), memory {med('clocks.mem'):.0f} MHz, power "
          f"{med('power.draw'):.0f} W of {med('power.limit'):.0f}, {med('temperature.gpu'):.0f} "
          f"C, throttle reasons {reasons}", flush=True)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
