"""Where the 'mgpu' GEMM's time goes: Mosaic GPU's in-kernel profiler and ptxas' resource report
for the GEMMs of the benchmark's workload, on one sm_90 GPU.

For each M it aligns random routing like the layer (pallas_kernels/mosaic_gpu/fused_moe.py: the used
blocks, as many as fit in --max-programs programs, so that the trace stays small), runs GEMM1
(x rows @ w13) and GEMM2 (activation rows @ w2) once with the profiler on, and summarizes each
warpgroup's trace (one per program, one per consumer with warp specialization):
  - time per group of a k-step (the warpgroup's span / its wgmma regions) and the span itself;
  - the share of the span in each named region: "convert" (int4 -> bf16 and the zero point),
    "wgmma" (issue a group's k-tile products), "wait" (for them, while the next group's are
    issued: read the group's sum), "scale" (group scale, accumulate),
    "store" (output tile); "outside" is the rest: waiting for the k-tile's copies, loop control;
    and each region's mean time per occurrence. --regions picks the regions to record (the
    store's parts "store_smem", "store_reuse", "store_wait", and "program", a warpgroup's whole
    run: pallas_kernels/mgpu_wna16_gemm.REGIONS); fewer regions, fewer registers for the
    profiler (with all five defaults ptxas spilled in GEMM2 at M=4096);
  - warpgroups resident on an SM at once (max, and mean over the time any is resident).
With MOSAIC_GPU_DUMP_PTXAS set (this script sets it) ptxas reports each kernel's registers and
shared memory, which bound how many programs an SM holds: the script catches what the compiler
writes to the process's stdout/stderr while each kernel compiles (--out/compile.log) and keeps
ptxas' resource lines. On the H200 (session 6): 72 registers per thread, so registers did not
cap the 4-7 resident programs per SM.

    python examples/mgpu_profile.py --m 1 16 4096 --out out/profile
    python examples/mgpu_profile.py --preset deepseek-v3-tp8 --m 1 --config 8,128,4,0,4
    python examples/mgpu_profile.py --m 4096 --gemms GEMM2

--interpret runs the same flow in the Mosaic GPU interpreter (no profiler there: a CPU check of
this script only).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import json
import os
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Disjoint regions (pallas_kernels/mgpu_wna16_gemm.REGIONS): "outside" is the span's rest.
# "store_smem" and "store_reuse" are parts of "store"; they count where "store" is not profiled.
REGIONS = ("convert", "wgmma", "wait", "scale", "store", "store_wait")
STORE_PARTS = ("store_smem", "store_reuse")


def summarize_trace(events: list[dict]) -> dict:
    """Summary of one Mosaic GPU profiler trace (Chrome trace events: name, ph "B"/"E", ts in
    us, pid = 1 + SM, tid = one warpgroup of one program); see the module docstring."""
    intervals = defaultdict(list)  # tid -> [(name, begin, end)]
    sm_of = {}
    open_by_tid = defaultdict(list)
    for ev in sorted(events, key=lambda e: (e["tid"], e["ts"], e["ph"] == "B")):
        tid = ev["tid"]
        sm_of[tid] = ev["pid"]
        if ev["ph"] == "B":
            open_by_tid[tid].append(ev)
        elif open_by_tid[tid]:
            begin = open_by_tid[tid].pop()
            intervals[tid].append((begin["name"], begin["ts"], ev["ts"]))
    spans, steps_of, region_time = {}, {}, defaultdict(float)
    region_count = defaultdict(int)
    for tid, ivs in intervals.items():
        spans[tid] = (min(b for _, b, _ in ivs), max(e for _, _, e in ivs))
        steps_of[tid] = sum(name == "wgmma" for name, _, _ in ivs)
        for name, b, e in ivs:
            region_time[name] += e - b
            region_count[name] += 1
    if not spans:
        raise ValueError("the trace has no complete region")
    total = sum(e - b for b, e in spans.values())
    durations = [e - b for b, e in spans.values()]
    per_step = [(e - b) / steps_of[t] for t, (b, e) in spans.items() if steps_of[t]]
    # Resident warpgroups per SM: a sweep over each SM's spans.
    concurrent_max, weighted, busy = 0, 0.0, 0.0
    by_sm = defaultdict(list)
    for tid, (b, e) in spans.items():
        by_sm[sm_of[tid]] += [(b, 1), (e, -1)]
    for points in by_sm.values():
        points.sort(key=lambda p: (p[0], p[1]))
        level, last = 0, None
        for t, delta in points:
            if level and last is not None:
                weighted += level * (t - last)
                busy += t - last
            level += delta
            last = t
            concurrent_max = max(concurrent_max, level)
    shares = {name: region_time[name] / total for name in sorted(region_time)}
    disjoint = REGIONS + (() if "store" in shares else STORE_PARTS)
    return dict(
        warpgroups=len(spans),
        sms=len(by_sm),
        span_us_median=statistics.median(durations),
        step_us_median=statistics.median(per_step) if per_step else None,
        steps_median=statistics.median(steps_of.values()),
        shares=shares,
        outside_share=max(0.0, 1.0 - sum(v for k, v in shares.items() if k in disjoint)),
        region_us_mean={name: region_time[name] / region_count[name] for name in shares},
        resident_max=concurrent_max,
        resident_mean=weighted / busy if busy else 0.0,
    )


def ptxas_report(log_path: str) -> list[str]:
    """The resource lines of ptxas' verbose output: registers, barriers and shared memory
    ("Used ..."), and the stack frame and spill stores and loads ("... bytes spill ...")."""
    with open(log_path, errors="replace") as f:
        lines = [ln.strip() for ln in f]
    return [ln for ln in lines if ("ptxas info" in ln and "Used" in ln) or "bytes spill" in ln]


@contextlib.contextmanager
def fds_to(path: str):
    """Sends file descriptors 1 and 2 (where the compiler's C++ code writes) to path."""
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="deepseek-v3", help="examples/benchmark.py's presets")
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 256, 4096])
    p.add_argument("--no-zp", action="store_true", help="symmetric weights (no zero points)")
    p.add_argument(
        "--config",
        help="MgpuConfig's fields in order as in mgpu_probe.py --configs, e.g. 8,256,3,0 or "
        "64,256,3,2,-,64,1,128,2 ('-' for None; default: the layer's default_config)",
    )
    p.add_argument(
        "--gemms",
        nargs="+",
        choices=("GEMM1", "GEMM2"),
        default=["GEMM1", "GEMM2"],
        help="which of the layer's GEMMs to profile (e.g. GEMM2 alone where GEMM1's stages and "
        "the profiler's buffers do not fit in shared memory together)",
    )
    p.add_argument(
        "--max-programs",
        type=int,
        default=1056,
        help="profile at most this many programs per GEMM (whole blocks; default 1056, about "
        "two waves of 4 per SM on an H200): the trace holds one event pair per region per "
        "k-step per warpgroup",
    )
    p.add_argument(
        "--no-trace",
        action="store_true",
        help="compile and run without the in-kernel profiler (its buffers take shared memory: "
        "configs near the limit fail with it); ptxas' registers and spills only",
    )
    p.add_argument(
        "--regions",
        nargs="+",
        default=None,
        help="named regions to record (default: convert wgmma wait scale store; also "
        "store_smem store_reuse store_wait program)",
    )
    p.add_argument("--out", default="out/profile", help="traces, ptxas dumps and summary.json")
    p.add_argument(
        "--interpret",
        action="store_true",
        help="the Mosaic GPU interpreter: checks this script on CPU (no profile, no ptxas)",
    )
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    compile_log = os.path.join(args.out, "compile.log")
    if not args.interpret:
        # Read when each kernel compiles (jaxlib/mosaic/gpu/dump.cc).
        os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")

    import benchmark
    import jax
    import jax.numpy as jnp
    import mgpu_probe

    import wna16_jax as wj
    from pallas_kernels.mosaic_gpu import config as mgpu_config
    from pallas_kernels.mosaic_gpu import fused_moe as mgpu_fused_moe
    from pallas_kernels.mosaic_gpu.config import default_config
    from pallas_kernels.mosaic_gpu.wna16_gemm import mgpu_wna16_gemm

    if jax.default_backend() != "gpu" and not args.interpret:
        raise SystemExit("mgpu_profile.py profiles compiled Mosaic GPU kernels: it needs an "
                         "sm_90 GPU (or --interpret)")  # fmt: skip
    if args.preset not in benchmark.PRESETS:
        raise SystemExit(f"--preset {args.preset!r}: one of {sorted(benchmark.PRESETS)}")
    e, top_k, h, i, g = benchmark.PRESETS[args.preset]
    group = h if g == -1 else g
    key = jax.random.key(0)
    w13, w2 = benchmark.probe_experts(key, args.preset, has_zp=not args.no_zp)
    to_mgpu = functools.partial(wj.layouts.to_kernel_layout, layout="mgpu_int4")
    weights = {"GEMM1": to_mgpu(w13), "GEMM2": to_mgpu(w2)}
    weights = {what: w for what, w in weights.items() if what in args.gemms}
    regions = {"profile_regions": tuple(args.regions)} if args.regions else {}
    summary = []
    for m in args.m:
        if args.config:
            cfg = mgpu_probe.parse_config(args.config)
        else:
            cfg = default_config(m * top_k, e, group, i)
        xs, _, idss = benchmark.probe_inputs(key, args.preset, m, num_sets=1)
        used, x_rows, _, in_use = mgpu_fused_moe.aligned_blocks(
            xs[0], idss[0], num_experts=e, block_m=cfg.block_m, expert_map=None,
            interpret=args.interpret,
        )  # fmt: skip
        for what, w in weights.items():
            # The splits the layer would take on all its blocks; then at most --max-programs.
            act = jnp.bfloat16 if what == "GEMM1" else None
            rows_dtype = mgpu_fused_moe.down_rows_dtype(cfg, jnp.bfloat16, None)
            this, splits, gated, options = mgpu_config.gemm_plan(
                cfg, w, used.shape[0], act, None if act else rows_dtype
            )
            # programs per block: its runs of output tiles, per split
            runs = mgpu_config.output_tiles(this, w, gated) // options["tiles_per_program"]
            blocks = min(used.shape[0], max(1, args.max_programs // (runs * splits)))
            experts = used[:blocks]
            rows = x_rows if what == "GEMM1" else jax.random.normal(key, x_rows.shape[:1] + (i,))
            rows = rows[: blocks * cfg.block_m].astype(jnp.bfloat16)
            trace_dir = os.path.join(args.out, f"M{m}_{what}")
            os.makedirs(trace_dir, exist_ok=True)
            profile_dir = None if args.interpret or args.no_trace else trace_dir
            with fds_to(compile_log):
                # the rows in use where the config narrows blocks (a pipeline per width)
                rows_in_use = cfg.gemm_rows_in_use(in_use[:blocks])
                out = mgpu_wna16_gemm(
                    rows, w, experts, rows_in_use, **options, interpret=args.interpret,
                    profile_dir=profile_dir, **regions,
                )  # fmt: skip
                jax.block_until_ready(out)
            row = dict(M=m, gemm=what, config=[this.block_m, this.block_k, this.stages,
                                               this.consumers, splits, this.block_n, gated],
                       blocks=blocks)  # fmt: skip
            traces = sorted(glob.glob(os.path.join(trace_dir, "*trace.json")))
            if traces:
                with open(traces[-1]) as f:
                    row.update(summarize_trace(json.load(f)["traceEvents"]))
                shares = " ".join(
                    f"{k} {v:.0%} ({row['region_us_mean'][k]:.2f} us)"
                    for k, v in row["shares"].items()
                )
                step = row["step_us_median"]
                print(f"M={m:<5} {what} {row['config']} {blocks} blocks: step "
                      f"{f'{step:.2f} us' if step else '-'}, span {row['span_us_median']:.1f} us, "
                      f"{shares}, outside {row['outside_share']:.0%}; resident per SM max "
                      f"{row['resident_max']}, mean {row['resident_mean']:.1f}",
                      flush=True)  # fmt: skip
            else:
                why = ("interpreter" if args.interpret else "--no-trace" if args.no_trace
                       else "the profiler wrote none")  # fmt: skip
                print(f"M={m:<5} {what} {row['config']} {blocks} blocks: ran, no trace ({why})")
            summary.append(row)
    resources = ptxas_report(compile_log) if os.path.exists(compile_log) else []
    for line in resources:
        print("ptxas:", line)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                       rows=summary, ptxas=resources), f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
