"""The GPU kernels of one fused_moe call, from a device trace: what each kernel takes and how
much of a call the GPU sits idle between kernels (launch gaps).

The layer runs `--calls` times inside one jitted loop under `jax.profiler.trace`: by default
chained, each call's input the previous call's output (layers back to back, as in a model's
step), or with `--loop sum` the way benchmark.py and mgpu_probe.py time it (the sum of each
call's output and the loop's counter are then kernels of every call). The device's kernel
events (CUPTI, in the Perfetto trace JAX writes) are summed per kernel name:

    M=<m> <implementation> per call: span, kernels busy, idle (share), kernels per call
        <launches per call> / call  <us per call> (median <us per launch>, idle before <us
        per call the GPU sat idle just before this kernel's launches>)  <kernel name>

    python examples/kernel_timeline.py --m 1 16 --implementation mgpu pallas
    python examples/kernel_timeline.py --preset deepseek-v3-tp8 --m 1 --json out/timeline.json

Needs a GPU (the device trace comes from CUPTI); the figures are per call, the mean over the
traced calls. Tracing adds a little to each launch, so the span here can exceed the probe's
time for the same call: compare kernels within one trace.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import benchmark  # noqa: E402

import wna16_jax as wj  # noqa: E402


def device_kernels(trace: dict) -> list[dict]:
    """The kernel events ('X' events with a duration) of the trace's GPU device processes
    (process name "/device:GPU:<n>"), each {name, ts, dur} in us, in start order."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu_pids = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and str(e.get("args", {}).get("name", "")).startswith("/device:GPU")
    }
    kernels = [
        dict(name=e["name"], ts=float(e["ts"]), dur=float(e["dur"]))
        for e in events
        if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e
    ]
    return sorted(kernels, key=lambda k: k["ts"])


def summarize(kernels: list[dict], calls: int) -> dict:
    """Per call: the span from the first kernel's start to the last one's end, the time some
    kernel runs (the union of their intervals), the idle rest, and per kernel name its count,
    total and median duration (us)."""
    if not kernels:
        raise ValueError("no GPU kernel events in the trace (is CUPTI available?)")
    start = kernels[0]["ts"]
    end = max(k["ts"] + k["dur"] for k in kernels)
    busy, cover_end = 0.0, start
    idle_before = collections.defaultdict(float)  # per name: the idle gaps its launches end
    for k in kernels:  # the union of intervals, in start order
        k_end = k["ts"] + k["dur"]
        idle_before[k["name"]] += max(k["ts"] - cover_end, 0.0)
        if k_end > cover_end:
            busy += k_end - max(k["ts"], cover_end)
            cover_end = k_end
    by_name = collections.defaultdict(list)
    for k in kernels:
        by_name[k["name"]].append(k["dur"])
    rows = sorted(
        (
            dict(
                name=name,
                per_call=len(durs) / calls,
                total_us_per_call=sum(durs) / calls,
                median_us=statistics.median(durs),
                idle_before_us_per_call=idle_before[name] / calls,
            )
            for name, durs in by_name.items()
        ),
        key=lambda r: -r["total_us_per_call"],
    )
    span = (end - start) / calls
    busy /= calls
    return dict(
        span_us=span,
        busy_us=busy,
        idle_us=span - busy,
        kernels_per_call=len(kernels) / calls,
        kernels=rows,
    )


def trace_loop(
    fn, args_sets, *, consts, calls: int, chain: bool, unroll: int = 1, straight: bool = False,
    link=None,
):  # fmt: skip
    """Runs fn(*consts, *args) about `calls` times in one jitted loop (benchmark.make_loop's,
    compiled and run once before) under the profiler; returns the Perfetto trace (dict) and
    the calls traced (unroll: benchmark.make_loop's passes over the sets per iteration).
    straight=True: no loop, one call per set written out (benchmark.make_straight with `link`;
    `calls`, chain and unroll unused)."""
    if straight:
        run, calls = benchmark.make_straight(fn, args_sets, consts=consts, link=link)
    else:
        run, calls = benchmark.make_loop(
            fn, args_sets, iters=calls, consts=consts, chain=chain, unroll=unroll
        )
    jax.block_until_ready(run())
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            jax.block_until_ready(run())
        paths = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
        if not paths:
            raise RuntimeError(f"the profiler wrote no perfetto_trace.json.gz under {log_dir}")
        with gzip.open(paths[0]) as f:
            return json.load(f), calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(benchmark.PRESETS), default="deepseek-v3")
    p.add_argument("--m", type=int, nargs="+", default=[1, 16])
    p.add_argument("--implementation", nargs="+", default=["mgpu"],
                   choices=("mgpu", "pallas", "xla"))  # fmt: skip
    p.add_argument("--no-zp", action="store_true", help="symmetric weights (no zero points)")
    p.add_argument("--calls", type=int, default=20, help="calls traced (one jitted loop)")
    p.add_argument(
        "--loop",
        choices=("chain", "sum", "straight"),
        default="chain",
        help="chain: each call's input the previous call's output, 4 input sets in turn "
        "(layers back to back; benchmark.make_loop(chain=True)); straight: as chain, with no "
        "loop: --calls calls written out in one jit, one input set each "
        "(benchmark.make_straight, a model step's layers); sum: one call per loop "
        "iteration and the sum of its output, as mgpu_probe.py and benchmark.py time it (the "
        "loop's own kernels then appear once per call)",
    )
    p.add_argument(
        "--unroll",
        type=int,
        default=1,
        help="chain: passes over the 4 input sets per loop iteration (the loop waits on the "
        "host for its condition once per iteration)",
    )
    p.add_argument("--top", type=int, default=12, help="kernel names listed per run")
    p.add_argument("--json", help="write the summaries here")
    args = p.parse_args(argv)
    if args.unroll < 1:
        p.error(f"--unroll must be at least 1, got {args.unroll}")
    if jax.default_backend() != "gpu":
        raise SystemExit("kernel_timeline.py reads a GPU's kernel trace: it needs a GPU")

    key = jax.random.key(0)
    w13, w2 = benchmark.probe_experts(key, args.preset, has_zp=not args.no_zp)
    out = []
    for impl in args.implementation:
        weights = (w13, w2)
        if impl == "mgpu":
            to_mgpu = functools.partial(wj.layouts.to_kernel_layout, layout="mgpu_int4")
            weights = jax.block_until_ready((to_mgpu(w13), to_mgpu(w2)))
        for m in args.m:
            num_sets = args.calls if args.loop == "straight" else 4
            xs, tws, idss = benchmark.probe_inputs(key, args.preset, m, num_sets)
            sets = [(xs[s], tws[s], idss[s]) for s in range(num_sets)]
            layer = lambda a, b, x, tw, ids, impl=impl: wj.fused_moe(  # noqa: E731
                x, a, b, tw, ids, implementation=impl
            )
            t0 = time.perf_counter()
            trace, calls = trace_loop(
                layer, sets, consts=weights, calls=args.calls, chain=args.loop == "chain",
                unroll=args.unroll, straight=args.loop == "straight",
            )  # fmt: skip
            s = summarize(device_kernels(trace), calls)
            print(f"M={m:<5} {impl:<6} per call: span {s['span_us']:.1f} us, kernels busy "
                  f"{s['busy_us']:.1f} us, idle {s['idle_us']:.1f} us "
                  f"({s['idle_us'] / s['span_us']:.0%}), {s['kernels_per_call']:.1f} kernels "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
            for r in s["kernels"][: args.top]:
                print(f"    {r['per_call']:5.2f} / call {r['total_us_per_call']:9.1f} us "
                      f"(median {r['median_us']:8.1f}, idle before "
                      f"{r['idle_before_us_per_call']:5.1f})  {r['name'][:90]}")  # fmt: skip
            out.append(dict(preset=args.preset, zp=not args.no_zp, M=m, implementation=impl,
                            loop=args.loop, calls=calls, **s))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                           date=time.strftime("%Y-%m-%d"), runs=out), f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
