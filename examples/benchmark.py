"""Times fused_moe (whole layer and each stage) against the measured HBM and matmul ceilings.

On a GPU the default problem is DeepSeek-V3's MoE layer (E=256, top-8, H=7168, I=2048, int4
g128); on a CPU it is a tiny problem so the script doubles as a smoke test. Each timing is the
median over repeats of a jitted loop that calls the op `--iters` times on rotated input sets, so
host dispatch is excluded; the per-call time of one jitted call from the host (dispatch
included) is reported beside it. An XLA loop waits on the host once per iteration, and that
wait is in the loop's figure; --straight N also times each M as a model step runs its layers
(N calls written out in one jit, steps queued back to back: `time_straight`), which it is not.

With --activation-quant int8_per_token the rows are W8A8 (int8 per-token activations, int8
per-channel symmetric weights; --bits and --no-zp are ignored then).

Example:
    python examples/benchmark.py --m 1 16 256 4096 --json out/bench.json --plot out/roofline.png
    python examples/benchmark.py --implementations mgpu --m 1 16 256 4096 --straight 32
    python examples/benchmark.py --activation-quant int8_per_token --m 256 4096
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import logging
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import wna16_jax as wj

PRESETS = {
    # name: (E, top_k, H, I, group_size)
    "deepseek-v3": (256, 8, 7168, 2048, 128),
    "deepseek-v3-tp8": (256, 8, 7168, 256, 128),
    "tiny": (8, 2, 256, 128, 64),
}


@dataclasses.dataclass(frozen=True)
class Problem:
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    group_size: int
    bits: int
    has_zp: bool
    dtype: str = "bfloat16"
    activation_quant: str | None = None  # None (16-bit activations) or "int8_per_token"


def _random_experts(key, e, n, k, *, bits, group_size, has_zp, dtype):
    """Random packed weights built on device (no float weights materialized)."""
    kq, ks, kz = jax.random.split(key, 3)
    g = k if group_size == -1 else group_size
    qweight = jax.random.bits(kq, (e, n, k * bits // 32), jnp.uint32)
    # Scales ~ 1/sqrt(K) / step so outputs stay O(1).
    scales = jax.random.uniform(ks, (e, n, k // g), jnp.float32, 0.5, 1.5) * (4.0 / k**0.5 / 8)
    zeros = None
    if has_zp:
        zn = n // 2 if bits == 4 else n
        lo, hi = (6, 10) if bits == 4 else (120, 136)
        z = jax.random.randint(kz, (e, n, k // g), lo, hi).astype(jnp.uint8)
        zeros = z if bits == 8 else (z[:, 0::2] | (z[:, 1::2] << 4)).astype(jnp.uint8)
        assert zeros.shape[1] == zn
    return wj.QuantizedExperts(
        qweight=qweight,
        scales=scales.astype(dtype),
        zeros=zeros,
        bits=bits,
        group_size=group_size,
    )


def random_routing(key, m, e, k, num_sets):
    """num_sets independent [m, k] routings, each token's experts distinct."""
    keys = jax.random.split(key, num_sets)
    scores = jnp.stack([jax.random.uniform(kk, (m, e)) for kk in keys])  # [S, m, E]
    _, ids = jax.lax.top_k(scores, k)
    w = jax.random.uniform(jax.random.fold_in(key, 1), (num_sets, m, k), jnp.float32, 0.1, 1.0)
    return w, ids.astype(jnp.int32)


def probe_experts(key, preset: str, *, has_zp: bool):
    """w13 [E, 2I, H] and w2 [E, H, I]: the probes' random int4 bf16 experts of a PRESETS
    entry (keys fold_in 1 and 2 of `key`), in the canonical layout."""
    e, _, h, i, g = PRESETS[preset]
    make = functools.partial(_random_experts, bits=4, group_size=g, has_zp=has_zp,
                             dtype=jnp.bfloat16)  # fmt: skip
    return make(jax.random.fold_in(key, 1), e, 2 * i, h), make(jax.random.fold_in(key, 2), e, h, i)


def random_inputs(key, m: int, num_experts: int, top_k: int, hidden: int, num_sets: int, dtype):
    """num_sets input sets at M=m: x [S, m, H] in dtype (key fold_in 3 + m) and the routing
    weights and ids [S, m, k] (`random_routing`, key fold_in 4 + m)."""
    xs = jax.random.normal(jax.random.fold_in(key, 3 + m), (num_sets, m, hidden), dtype)
    tws, idss = random_routing(jax.random.fold_in(key, 4 + m), m, num_experts, top_k, num_sets)
    return xs, tws, idss


def probe_inputs(key, preset: str, m: int, num_sets: int = 4):
    """The probes' num_sets input sets at M=m of a PRESETS entry, bf16 (`random_inputs`)."""
    e, top_k, h, _, _ = PRESETS[preset]
    return random_inputs(key, m, e, top_k, h, num_sets, jnp.bfloat16)


def experts_touched(idss) -> float:
    """The mean count of distinct experts an input set's routing ids [S, m, k] use."""
    return float(np.mean([len(np.unique(np.asarray(ids))) for ids in idss]))


def weight_bytes(qw: wj.QuantizedExperts, experts_touched: int) -> int:
    per_expert = sum(
        a.nbytes // a.shape[0] for a in (qw.qweight, qw.scales, qw.zeros) if a is not None
    )
    return per_expert * experts_touched


def default_iters(m: int) -> int:
    """Calls per timed loop at M on a GPU: a loop has a fixed cost (launch, the final reduction)
    that its calls share, so short calls need many. Session 6 measured the same M=1 layer at
    128.9 us with 20 calls per loop and 115.1 us with 100 (different GPUs and routing draws of
    one call, so part of the gap may be those)."""
    return 100 if m <= 256 else 20


def make_loop(fn, args_sets, *, iters, consts=(), chain=False, unroll=1):
    """A jitted run() of `iters` calls of fn(*consts, *args) over the rotated input sets, and
    the calls it makes.

    chain=False: one call per iteration of a fori_loop, on set i % len(args_sets); the loop adds
    the sum of each call's output (its own kernels each call: the sum, the loop's counter).
    chain=True: each iteration calls fn once per set, in turn, each call's first argument its
    set's plus 1e-30 x the previous call's output (layers back to back, as in a model's step:
    a call waits for the last; the output must have the first argument's shape and dtype), so
    nothing but the calls runs per call (the add fuses into the call's first pass over it) and
    the loop's own work is spread over the sets. The values stay the set's random ones: fed
    back as is, a layer's outputs grow or vanish over the calls (zeros or infinities draw less
    power and ran 8% faster at M=4096, session 11). unroll (chain=True): each iteration goes
    through the sets that many times. An XLA while loop waits on the host for its condition
    once per iteration, and the GPU then idles until the host has launched the next
    iteration's first kernels: more calls per iteration spread that wait over more calls.
    But the passes repeat each set, and XLA may compute work that depends only on a set's
    unchanged inputs (the routing's alignment) once per iteration: on the H200 (session 18) the
    alignment kernel ran 0.12 times per call at unroll=8, so such figures are a lower bound.
    Calls: iters rounded up to whole iterations.
    """
    if unroll < 1 or (unroll != 1 and not chain):
        raise ValueError(f"unroll={unroll}: a whole number >= 1, and other than 1 only with chain")
    num_sets = len(args_sets)
    if not chain:
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *args_sets)

        @jax.jit
        def loop(consts, stacked):
            def body(i, acc):
                args = jax.tree.map(lambda s: s[i % num_sets], stacked)
                out = fn(*consts, *args)
                return acc + jnp.sum(out.astype(jnp.float32)) * 1e-30

            return jax.lax.fori_loop(0, iters, body, jnp.float32(0))

        return (lambda: loop(consts, stacked)), iters

    rounds = -(-iters // (num_sets * unroll))

    @jax.jit
    def chained(consts, sets):
        def body(_, out):
            for args in sets * unroll:
                x = args[0] + (out * 1e-30).astype(args[0].dtype)
                out = fn(*consts, x, *args[1:])
            return out

        x = jax.lax.fori_loop(0, rounds, body, sets[0][0])
        return jnp.sum(x.astype(jnp.float32))

    sets = tuple(tuple(a) for a in args_sets)
    return (lambda: chained(consts, sets)), rounds * num_sets * unroll


def make_straight(fn, args_sets, *, consts=(), link=None):
    """A jitted run() that calls fn(*consts, *args) once per input set, in turn, written out with
    no loop, and the calls it makes (len(args_sets)): a model step's layers as the model runs
    them (a Python loop over its layers inside one jit).

    Each call must depend on the last: XLA may run calls that do not (their kernels in one CUDA
    graph) at the same time, which no model step's layers do. By default (link None) each
    call's first argument is its set's plus 1e-30 x the previous call's output, as
    make_loop(chain=True) has it (fn's output fits its first input: a layer's), and run()
    returns the sum of the last output. For an fn whose output does not fit its input (one GEMM
    of the layer), link(its set, the previous output) gives a call's arguments (the first
    call's previous output: its set's first array), and run() returns every call's output, so
    that each is computed whole however little of it the link reads (XLA computes only what is
    used: a link that reads one element of a K-split GEMM's output would leave its sum of
    partials undone). Returning 32 arrays costs the host time per run: on the H200 the TP=8
    layer at M=1 took 19.8 against 17.1 us per call so (session 24, one run each), so layers keep
    the one sum.

    An XLA while loop (make_loop) waits on the host once per iteration for its condition, and
    what the GPU idles then is counted in every call it times; here one jitted call runs all the
    calls, so the host's dispatch is shared by them and nothing else runs between them. Give one
    set per call: a set used twice lets XLA compute the work that depends only on that set's
    unchanged inputs (the routing's alignment) once, and the figure would flatter.
    """
    if len(args_sets) < 2:
        raise ValueError(f"make_straight needs at least 2 input sets, got {len(args_sets)}")

    def add_to_first(args, out):  # the default link: fn's output fits its first input
        return (args[0] + (out * 1e-30).astype(args[0].dtype), *args[1:])

    @jax.jit
    def straight(consts, sets):
        outs = [sets[0][0]]
        for args in sets:
            outs.append(fn(*consts, *(link or add_to_first)(args, outs[-1])))
        return jnp.sum(outs[-1].astype(jnp.float32)) if link is None else outs[1:]

    sets = tuple(tuple(a) for a in args_sets)
    return (lambda: straight(consts, sets)), len(sets)


def time_straight(
    fn, args_sets, *, repeats, consts=(), link=None, runs=5, warmup_s=0.0
):  # fmt: skip
    """Seconds per call of fn(*consts, *args) in a model step (`make_straight`: one call per
    input set, written out in one jit), steps queued back to back as a decoding loop queues them.

    One jitted call of many kernels costs the host time before its first kernel starts (its
    launches; on the H200 about 0.8 ms for 32 layer calls at M=1, session 23), and a run timed
    alone counts that time against its calls. Queued behind another run, that host work overlaps
    the GPU's: the figure is the marginal time of a queued run, (T(runs) - T(1)) /
    ((runs - 1) x calls), T(r) the wall time of r runs queued at once and awaited together;
    the median over `repeats`. link: as make_straight's. warmup_s: as time_loop's.
    """
    if runs < 2:
        raise ValueError(f"time_straight needs runs >= 2 (a marginal run), got {runs}")
    run, calls = make_straight(fn, args_sets, consts=consts, link=link)
    jax.block_until_ready(run())
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:
        jax.block_until_ready([run() for _ in range(runs)])

    def queued(r):
        t0 = time.perf_counter()
        jax.block_until_ready([run() for _ in range(r)])
        return time.perf_counter() - t0

    times = []
    for _ in range(repeats):
        one = queued(1)
        times.append((queued(runs) - one) / ((runs - 1) * calls))
    return statistics.median(times)


def time_loop(
    fn, args_sets, *, iters, repeats, consts=(), host=True, chain=False, unroll=1, warmup_s=0.0
):  # fmt: skip
    """Median seconds per call of fn(*consts, *args) inside one jitted loop over rotated inputs
    (`make_loop`; chain=True: each call's first argument the previous call's output).

    `consts` (e.g. the weights) are passed as jit arguments, never captured as constants.
    warmup_s: run the loop for that many seconds before timing it, so that the GPU's clock has
    settled where a sustained run puts it (in a 5 s run the H200 sat at its 700 W power cap in
    decode from 16 tokens, its SM clock 8-19% below the maximum, session 19; how fast the clock
    falls was not measured); 0, only one warm-up run (timings from the start of a burst).
    Returns (device_seconds_per_call, host_seconds_per_single_call); the host time is None
    with host=False (one compile fewer).
    """
    run, calls = make_loop(fn, args_sets, iters=iters, consts=consts, chain=chain, unroll=unroll)
    single = jax.jit(fn)
    jax.block_until_ready(run())
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:
        jax.block_until_ready(run())
    if host:
        jax.block_until_ready(single(*consts, *args_sets[0]))
    loop_times, single_times = [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        loop_times.append((time.perf_counter() - t0) / calls)
        if host:
            t0 = time.perf_counter()
            jax.block_until_ready(single(*consts, *args_sets[r % len(args_sets)]))
            single_times.append(time.perf_counter() - t0)
    host_time = statistics.median(single_times) if host else None
    return statistics.median(loop_times), host_time


def copy_loop(n, *, iters):
    """(loop, x): the copy ceiling's jitted loop of `iters` elementwise passes over n f32 values
    that are read and written (carried), and its random input."""
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)

    @jax.jit
    def loop(x):
        return jax.lax.fori_loop(0, iters, lambda i, y: y * 0.999 + 1e-3, x)

    return loop, x


def time_copy(n, *, iters, repeats):
    """Seconds per elementwise pass over n f32 values that is read and written (carried)."""
    loop, x = copy_loop(n, iters=iters)
    jax.block_until_ready(loop(x))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(x))
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def measure_ceilings(on_gpu: bool, repeats: int):
    """HBM copy bandwidth (read + write bytes) and dense bf16 matmul FLOP/s, measured now."""
    n = (1 << 28) if on_gpu else (1 << 22)  # f32 elements: 1 GiB on GPU
    copy_bps = 2 * n * 4 / time_copy(n, iters=20, repeats=repeats)
    d = 8192 if on_gpu else 512
    ms = [jax.random.normal(jax.random.key(10 + i), (d, d), jnp.bfloat16) for i in range(2)]
    t_mm, _ = time_loop(
        lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
        [(ms[0], ms[1]), (ms[1], ms[0])],
        iters=10,
        repeats=repeats,
    )
    return copy_bps, 2 * d**3 / t_mm


def stage_fns(problem: Problem, implementation: str, config):
    """The fused_moe stages as separate jittable functions (pallas backends only)."""
    from pallas_kernels.triton import fused_moe as pm
    from pallas_kernels.triton.wna16_gemm import wna16_gemm

    interpret = implementation == "pallas_interpret"

    def configs(w13, w2, ids):
        return pm.gemm_configs(ids.size, w13, w2, config)

    def align(w13, w2, x, tw, ids):
        c1, _ = configs(w13, w2, ids)
        r = pm.align(
            ids,
            num_experts=problem.num_experts,
            block_m=c1.block_m,
            expert_map=None,
            interpret=interpret,
        )
        return r.sorted_token_ids

    def gemm1(w13, w2, x, tw, ids, routing):
        """GEMM1 as the pipeline runs it (with the activation when it fuses it): act or h."""
        c1, c2 = configs(w13, w2, ids)
        if pm.fuses_activation(c1, w13, "silu"):
            act, _ = pm.gemm1_and_activation(
                x, w13, w2, routing, top_k=ids.shape[1], c1=c1, c2=c2, activation="silu",
                interpret=interpret,
            )  # fmt: skip
            return act
        return wna16_gemm(x, w13, routing, top_k=ids.shape[1], config=c1, interpret=interpret)

    def gemm2(w13, w2, act, tw, ids, routing):
        c1, c2 = configs(w13, w2, ids)
        return pm.gemm2_routed(
            act,
            w2,
            routing,
            tw,
            c2=c2,
            act_slice_major=pm.act_in_slice_major(c1, c2, w13, "silu"),
            interpret=interpret,
        )

    return align, gemm1, gemm2, configs


def bench_problem(
    problem, ms, implementations, *, iters, repeats, num_sets, stages, config, straight=0
):  # fmt: skip
    """Rows of the timings per implementation and M; straight=N (>= 2): each row also times N
    calls as a model step runs them (`time_straight`, N input sets of their own)."""
    key = jax.random.key(0)
    dtype = jnp.dtype(problem.dtype)
    e, k, h, i = problem.num_experts, problem.top_k, problem.hidden, problem.intermediate
    w13 = _random_experts(
        jax.random.fold_in(key, 1),
        e,
        2 * i,
        h,
        bits=problem.bits,
        group_size=problem.group_size,
        has_zp=problem.has_zp,
        dtype=dtype,
    )
    w2 = _random_experts(
        jax.random.fold_in(key, 2),
        e,
        h,
        i,
        bits=problem.bits,
        group_size=problem.group_size,
        has_zp=problem.has_zp,
        dtype=dtype,
    )
    weights = _WeightsByLayout(w13, w2)
    rows = []
    for m in ms:
        xs, tws, idss = random_inputs(key, m, e, k, h, num_sets, dtype)
        touched = experts_touched(idss)
        wbytes = weight_bytes(w13, 1) * touched + weight_bytes(w2, 1) * touched
        flops = 2.0 * m * k * (2 * i * h + h * i)
        sets = [(xs[s], tws[s], idss[s]) for s in range(num_sets)]
        m_iters = iters or default_iters(m)
        if straight:
            sxs, stws, sidss = random_inputs(
                jax.random.fold_in(key, 5), m, e, k, h, straight, dtype
            )
            ssets = [(sxs[s], stws[s], sidss[s]) for s in range(straight)]
            stouched = experts_touched(sidss)
        for impl in implementations:
            fn = functools.partial(
                _moe, implementation=impl, config=config, activation_quant=problem.activation_quant
            )
            try:
                consts = weights.for_backend(impl)
                t, t_host = time_loop(fn, sets, iters=m_iters, repeats=repeats, consts=consts)
                t_step = (
                    time_straight(fn, ssets, repeats=repeats, consts=consts) if straight else None
                )
            except Exception as err:  # a backend that cannot run this size: report, go on
                logging.warning("%s M=%d failed: %s", impl, m, str(err).splitlines()[0])
                continue
            row = dict(
                implementation=impl,
                M=m,
                seconds=t,
                host_call_seconds=t_host,
                weight_bytes=wbytes,
                flops=flops,
                experts_touched=touched,
                activation_quant=problem.activation_quant,
            )
            if straight:
                row.update(
                    straight_calls=straight,
                    straight_seconds=t_step,
                    straight_weight_bytes=(weight_bytes(w13, 1) + weight_bytes(w2, 1)) * stouched,
                )
            if stages and impl.startswith("pallas") and problem.activation_quant is None:
                row["stages"] = bench_stages(
                    problem, impl, config, w13, w2, sets, iters=m_iters, repeats=repeats
                )
            rows.append(row)
            step = f", in a step {t_step * 1e6:.1f} us" if straight else ""
            print(f"  {impl:>16} M={m:<6} {t * 1e6:10.1f} us{step}", file=sys.stderr, flush=True)
    return rows


class _WeightsByLayout:
    """The benchmark's weights in each backend's layout, converted once (not timed): a backend
    that reads only a kernel layout (e.g. 'mgpu': mgpu_int4) gets its own copy."""

    def __init__(self, w13, w2):
        self._by_layout = {"canonical": (w13, w2)}

    def for_backend(self, name: str):
        from wna16_jax import _dispatch

        layouts = _dispatch.get_backend(name).layouts
        layout = "canonical" if "canonical" in layouts else layouts[0]
        if layout not in self._by_layout:
            w13, w2 = self._by_layout["canonical"]
            convert = functools.partial(wj.layouts.to_kernel_layout, layout=layout)
            self._by_layout[layout] = jax.block_until_ready((convert(w13), convert(w2)))
        return self._by_layout[layout]


def _moe(w13, w2, x, tw, ids, *, implementation, config, activation_quant=None):
    return wj.fused_moe(
        x,
        w13,
        w2,
        tw,
        ids,
        implementation=implementation,
        config=config,
        activation_quant=activation_quant,
    )


def bench_stages(problem, impl, config, w13, w2, sets, *, iters, repeats):
    from wna16_jax import _reference

    align, gemm1, gemm2, configs = stage_fns(problem, impl, config)
    from pallas_kernels.triton import fused_moe as pm

    interpret = impl == "pallas_interpret"
    routed = []
    fused = False
    for x, tw, ids in sets:
        c1, _ = configs(w13, w2, ids)
        fused = pm.fuses_activation(c1, w13, "silu")
        r = pm.align(
            ids,
            num_experts=problem.num_experts,
            block_m=c1.block_m,
            expert_map=None,
            interpret=interpret,
        )
        h = gemm1(w13, w2, x, tw, ids, r)
        act = h if fused else _reference.silu_and_mul(h.astype(jnp.float32)).astype(x.dtype)
        y = gemm2(w13, w2, act, tw, ids, r)
        routed.append((x, tw, ids, r, h, act, y))
    out = {}

    def t(fn, args):
        return time_loop(fn, args, iters=iters, repeats=repeats, consts=(w13, w2))[0]

    out["align"] = t(
        lambda w13, w2, tw, ids: align(w13, w2, None, tw, ids), [(s[1], s[2]) for s in routed]
    )
    out["gemm1"] = t(gemm1, [s[:4] for s in routed])  # with the activation when fused
    if not fused:
        out["activation"] = t(
            lambda w13, w2, h: _reference.silu_and_mul(h.astype(jnp.float32)).astype(h.dtype),
            [(s[4],) for s in routed],
        )
    out["gemm2"] = t(gemm2, [(s[5], s[1], s[2], s[3]) for s in routed])
    k = problem.top_k
    out["reduction"] = t(
        lambda w13, w2, y: y.reshape(-1, k, y.shape[-1]).sum(1).astype(jnp.bfloat16),
        [(s[6],) for s in routed],
    )
    return out


def print_table(rows, copy_bps, mm_flops):
    print(
        f"{'impl':>16} {'M':>6} {'time us':>10} {'host us':>9} {'weight GB/s':>12} "
        f"{'%copy':>6} {'TFLOP/s':>8} {'%mm':>6}"
    )
    for r in rows:
        bw = r["weight_bytes"] / r["seconds"]
        fl = r["flops"] / r["seconds"]
        print(
            f"{r['implementation']:>16} {r['M']:>6} {r['seconds'] * 1e6:>10.1f} "
            f"{r['host_call_seconds'] * 1e6:>9.1f} {bw / 1e9:>12.1f} {100 * bw / copy_bps:>6.1f} "
            f"{fl / 1e12:>8.2f} {100 * fl / mm_flops:>6.1f}"
        )
        if "straight_seconds" in r:
            t = r["straight_seconds"]
            sbw = r["straight_weight_bytes"] / t
            print(
                f"{'':>16} in a step of {r['straight_calls']} calls (queued steps): "
                f"{t * 1e6:.1f} us, {100 * sbw / copy_bps:.1f}% of copy, "
                f"{100 * r['flops'] / t / mm_flops:.1f}% of matmul"
            )
        if "stages" in r:
            st = "  ".join(f"{k}={v * 1e6:.1f}us" for k, v in r["stages"].items())
            print(f"{'':>16} stages: {st}")


def plot_roofline(rows, copy_bps, mm_flops, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    xs = np.logspace(-1, 4, 200)
    ax.loglog(xs, np.minimum(xs * copy_bps, mm_flops) / 1e12, "k-", label="measured ceilings")
    for impl in sorted({r["implementation"] for r in rows}):
        pts = [r for r in rows if r["implementation"] == impl]
        ai = [r["flops"] / r["weight_bytes"] for r in pts]
        perf = [r["flops"] / r["seconds"] / 1e12 for r in pts]
        ax.loglog(ai, perf, "o-", label=impl)
        for r, a, p in zip(pts, ai, perf, strict=True):
            ax.annotate(f"M={r['M']}", (a, p), fontsize=7)
    ax.set_xlabel("FLOP per weight byte")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("fused_moe roofline (weight bytes only)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="deepseek-v3" if on_gpu else "tiny",
        help="problem shape (default: deepseek-v3 on GPU, tiny on CPU)",
    )
    p.add_argument(
        "--m",
        type=int,
        nargs="+",
        default=None,
        help="token counts (default: 1 4 16 64 256 1024 4096 on GPU, 1 8 on CPU)",
    )
    p.add_argument("--bits", type=int, choices=(4, 8), default=4)
    p.add_argument("--no-zp", action="store_true", help="symmetric weights (no zero points)")
    p.add_argument(
        "--implementations",
        nargs="+",
        default=None,
        help="backends to time (default: pallas xla on GPU, pallas_interpret xla on CPU); a "
        "backend that reads its own weight layout (mgpu, mgpu_interpret) gets the weights "
        "converted once, untimed",
    )
    p.add_argument(
        "--xla-max-m",
        type=int,
        default=64,
        help="skip the slow xla reference above this many tokens",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help="calls per timed loop (default on a GPU: 100 for M <= 256, 20 above, as "
        "mgpu_probe.py; each loop has a fixed cost that the calls share)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed loops (median taken)")
    p.add_argument("--sets", type=int, default=4, help="input sets rotated through the loop")
    p.add_argument(
        "--straight",
        type=int,
        default=0,
        metavar="N",
        help="also time each M as a model step runs its layers: N calls written out in one jit "
        "(no loop), one input set each, each call's input the previous call's output, steps "
        "queued back to back; the marginal time of a queued step per call (time_straight). "
        "The loop's figure counts the host's wait per loop iteration; this one does not. "
        "0: off; else N >= 2",
    )
    p.add_argument(
        "--stages", action="store_true", help="also time each stage (pallas, WNA16 only)"
    )
    p.add_argument(
        "--activation-quant",
        choices=("int8_per_token",),
        default=None,
        help="W8A8 rows: int8 per-token activations with int8 per-channel symmetric weights",
    )
    p.add_argument(
        "--block-config",
        type=str,
        default=None,
        help='BlockConfig as JSON, e.g. \'{"block_m":16,"block_n":64,"block_k":256}\'',
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="quantization group (default: the preset's; -1 = per channel)",
    )
    p.add_argument("--json", type=str, default=None, help="write results here")
    p.add_argument("--plot", type=str, default=None, help="write a roofline PNG here")
    args = p.parse_args(argv)
    if args.straight == 1 or args.straight < 0:
        p.error(f"--straight must be 0 (off) or at least 2, got {args.straight}")
    logging.basicConfig(level=logging.WARNING)
    e, k, h, i, g = PRESETS[args.preset]
    if args.group_size is not None:
        g = args.group_size
    problem = Problem(e, k, h, i, g, args.bits, not args.no_zp)
    if args.activation_quant:  # W8A8 runs int8 per-channel symmetric weights
        problem = Problem(e, k, h, i, -1, 8, False, activation_quant=args.activation_quant)
    ms = args.m or ([1, 4, 16, 64, 256, 1024, 4096] if on_gpu else [1, 8])
    impls = args.implementations or (["pallas", "xla"] if on_gpu else ["pallas_interpret", "xla"])
    iters = args.iters or (None if on_gpu else 2)  # None: per M, default_iters
    config = wj.BlockConfig(**json.loads(args.block_config)) if args.block_config else None
    copy_bps, mm_flops = measure_ceilings(on_gpu, args.repeats)
    print(
        f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  "
        f"copy ceiling {copy_bps / 1e12:.2f} TB/s  bf16 matmul ceiling "
        f"{mm_flops / 1e12:.1f} TFLOP/s",
        flush=True,
    )
    print(f"problem: {problem}", flush=True)
    rows = []
    for impl in impls:
        run_ms = [m for m in ms if impl != "xla" or m <= args.xla_max_m]
        rows += bench_problem(
            problem,
            run_ms,
            [impl],
            iters=iters,
            repeats=args.repeats,
            num_sets=args.sets,
            stages=args.stages,
            config=config,
            straight=args.straight,
        )
    print_table(rows, copy_bps, mm_flops)
    result = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        python=platform.python_version(),
        problem=dataclasses.asdict(problem),
        copy_bytes_per_s=copy_bps,
        matmul_flops_per_s=mm_flops,
        rows=rows,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot_roofline(rows, copy_bps, mm_flops, args.plot)
    return result


if __name__ == "__main__":
    main()
