"""The kernels of fused_moe calls from a device trace: what each kernel takes and how long the GPU
sits idle between kernels (launch gaps).

For each backend and M the layer runs as benchmark.py times it, under `jax.profiler.trace`:
  --run step (default): a model step, --calls layer calls written out in one jit, each on the
        last one's output, one input set each (benchmark.make_model_step);
  --run loop: --calls calls in benchmark.make_loop's jitted loop over 4 input sets (the sum of
        each call's output and the loop's counter are then kernels of every call).
The device's kernel events (CUPTI, in the Perfetto trace JAX writes) are summed per kernel name
and reported per call, the mean over the traced calls:

    M=<m> <implementation> per call: span, kernels busy, idle (share), kernels
        <launches per call> / call  <us per call> (median <us per launch>, idle before <us per
        call the GPU sat idle just before this kernel's launches>)  <kernel name>

--ptxas also lists ptxas' resource report (registers, spills, barriers, shared memory) of the
Mosaic GPU kernels each layer compiles (MOSAIC_GPU_DUMP_PTXAS), caught from the compiler's
output (the compile's other output is dropped while it is caught).

Tracing adds a little to each launch, so a span here can exceed benchmark.py's time for the
same call: compare kernels within one trace. On a CPU (the tiny default, the kernels in the
interpreters) the XLA CPU runtime's op events (host events that name an HLO op) stand in for the
kernels: a check of this script, not a profile.

    python examples/profile.py --implementations mgpu pallas --m 1 16
    python examples/profile.py --preset deepseek-v3-tp8 --m 1 --ptxas --json out/profile.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
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

import arg_types  # noqa: E402
import benchmark  # noqa: E402
import cli  # noqa: E402


def device_kernels(trace: dict | list) -> list[dict]:
    """The kernel events of a Perfetto trace, each {name, ts, dur} in us, in start order: the
    'X' events (with a duration) of the GPU device processes (process name "/device:GPU:<n>");
    where there are none (a CPU run), the events that name an HLO op (args "hlo_op": the XLA CPU
    runtime's ops)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu_pids = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and str(e.get("args", {}).get("name", "")).startswith("/device:GPU")
    }
    timed = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in timed if e.get("pid") in gpu_pids]
    if not gpu_pids:
        kernels = [e for e in timed if "hlo_op" in e.get("args", {})]
    found = [dict(name=e["name"], ts=float(e["ts"]), dur=float(e["dur"])) for e in kernels]
    return sorted(found, key=lambda k: k["ts"])


def summarize(kernels: list[dict], calls: int) -> dict:
    """Per call: the span from the first kernel's start to the last one's end, the time some
    kernel runs (the union of their intervals), the idle rest, and per kernel name its launches,
    total and median duration (us) and the idle gaps its launches end."""
    if not kernels:
        raise ValueError("no kernel events in the trace (is CUPTI available?)")
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


def ptxas_report(text: str) -> list[str]:
    """The resource lines of ptxas' verbose output: registers, barriers and shared memory
    ("Used ..."), and the stack frame and spill stores and loads ("... bytes spill ...")."""
    lines = [ln.strip() for ln in text.splitlines()]
    return [ln for ln in lines if ("ptxas info" in ln and "Used" in ln) or "bytes spill" in ln]


@contextlib.contextmanager
def caught_output(path: str):
    """Sends file descriptors 1 and 2 (where the compiler's C++ code writes) to `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


@contextlib.contextmanager
def ptxas_dump():
    """MOSAIC_GPU_DUMP_PTXAS=1 while the block runs (read as each Mosaic GPU kernel compiles)."""
    before = os.environ.get("MOSAIC_GPU_DUMP_PTXAS")
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["MOSAIC_GPU_DUMP_PTXAS"]
        else:
            os.environ["MOSAIC_GPU_DUMP_PTXAS"] = before


def trace_run(run, *, ptxas: bool = False) -> tuple[dict, list[str]]:
    """Compiles and runs run() once, then traces one more run; returns the Perfetto trace (dict)
    and, with ptxas, ptxas' resource lines of the compile (else [])."""
    with tempfile.TemporaryDirectory() as log_dir:
        resources = []
        if ptxas:
            compile_log = os.path.join(log_dir, "compile.log")
            with ptxas_dump(), caught_output(compile_log):
                jax.block_until_ready(run())
            with open(compile_log, errors="replace") as f:
                resources = ptxas_report(f.read())
        else:
            jax.block_until_ready(run())
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            jax.block_until_ready(run())
        paths = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
        if not paths:
            raise RuntimeError(f"the profiler wrote no perfetto_trace.json.gz under {log_dir}")
        with gzip.open(paths[0]) as f:
            return json.load(f), resources


def main(argv=None) -> int:
    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    cli.setup_parser(p)
    p.add_argument(
        "--preset",
        choices=sorted(benchmark.PRESETS),
        default="deepseek-v3" if on_gpu else "tiny",
        help="problem shape (default: deepseek-v3 on GPU, tiny on CPU)",
    )
    p.add_argument(
        "--m",
        type=arg_types.positive_int,
        nargs="+",
        default=None,
        help="token counts (default: 1 16; 1 on CPU)",
    )
    p.add_argument(
        "--implementation",
        "--implementations",
        dest="implementations",
        nargs="+",
        default=None,
        help="backends to trace (default: mgpu pallas on GPU, pallas_interpret on CPU)",
    )
    p.add_argument("--no-zp", action="store_true", help="symmetric weights (no zero points)")
    p.add_argument(
        "--run",
        choices=("step", "loop"),
        default="step",
        help="step: a model step of --calls calls written out in one jit; loop: --calls calls "
        "in benchmark.py's timing loop (see above)",
    )
    p.add_argument(
        "--calls",
        type=arg_types.int_at_least(2),
        default=None,
        help="calls traced (default 20; 2 on CPU; >= 2)",
    )
    p.add_argument(
        "--ptxas", action="store_true", help="also ptxas' resource report of each compile"
    )
    p.add_argument(
        "--top", type=arg_types.positive_int, default=12, help="kernel names listed per run"
    )
    p.add_argument("--json", help="write the summaries here")
    args = p.parse_args(argv)
    calls = args.calls or (20 if on_gpu else 2)
    if calls < 2:
        p.error(f"--calls must be at least 2, got {calls}")
    ms = args.m or ([1, 16] if on_gpu else [1])
    impls = args.implementations or (["mgpu", "pallas"] if on_gpu else ["pallas_interpret"])

    problem = benchmark.preset_problem(args.preset, no_zp=args.no_zp)
    key = jax.random.key(0)
    weights = benchmark.WeightsByLayout(*benchmark.random_experts(key, problem), problem.dtype)
    biases = benchmark.random_biases(key, problem)
    out = []
    for impl in impls:
        consts = (*weights.for_backend(impl), biases)
        layer = functools.partial(
            benchmark.moe_layer, implementation=impl, config=None, problem=problem
        )
        for m in ms:
            num_sets = calls if args.run == "step" else 4
            xs, tws, idss = benchmark.random_inputs(key, problem, m, num_sets)
            sets = [(xs[s], tws[s], idss[s]) for s in range(num_sets)]
            if args.run == "step":
                run, traced = benchmark.make_model_step(layer, sets, consts=consts)
            else:
                run, traced = benchmark.make_loop(layer, sets, iters=calls, consts=consts)
            t0 = time.perf_counter()
            trace, resources = trace_run(run, ptxas=args.ptxas)
            s = summarize(device_kernels(trace), traced)
            print(f"M={m:<5} {impl:<6} per call: span {s['span_us']:.1f} us, kernels busy "
                  f"{s['busy_us']:.1f} us, idle {s['idle_us']:.1f} us "
                  f"({s['idle_us'] / s['span_us']:.0%}), {s['kernels_per_call']:.1f} kernels "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
            for r in s["kernels"][: args.top]:
                print(f"    {r['per_call']:5.2f} / call {r['total_us_per_call']:9.1f} us "
                      f"(median {r['median_us']:8.1f}, idle before "
                      f"{r['idle_before_us_per_call']:5.1f})  {r['name'][:90]}")  # fmt: skip
            if args.ptxas:
                for line in resources or ["no report (no Mosaic GPU kernel compiled)"]:
                    print(f"    ptxas: {line}")
            out.append(dict(preset=args.preset, zp=not args.no_zp, M=m, implementation=impl,
                            run=args.run, calls=traced, ptxas=resources, **s))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                           runs=out), f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    cli.run(main)
