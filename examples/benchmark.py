"""Times the fused_moe layer per backend against the copy and matmul ceilings of the same run.

Each row is one backend at one token count M, timed two ways:
  loop  the median over repeats of a jitted loop that calls the layer `--iters` times on rotated
        input sets (`time_loop`): host dispatch excluded, but an XLA loop waits on the host once
        per iteration and that wait is in the figure;
  step  with --straight N: N layer calls written out in one jit, each on the last one's output,
        as a model step runs its layers, steps queued back to back (`time_model_step`).
The host time of one jitted call (dispatch included) is reported beside them. The copy (HBM read
+ write) and dense bf16 matmul (int8 x int8 -> int32 for W8A8) ceilings are measured in the same
run; each row's weight
bandwidth and FLOP/s are quoted against them in a table, written as JSON (--json) and drawn as a
roofline (--plot). --search also times candidate configs through `config=` (wj.MgpuConfig for
the mgpu backends, wj.BlockConfig for the others) and prints the best config per M.

On a GPU the default problem is DeepSeek-V3's MoE layer (E=256, top-8, H=7168, I=2048, int4
g128 with zero points); on a CPU a tiny one in the kernel interpreters, so the script doubles as
a smoke test. A backend that reads only a kernel layout (mgpu: mgpu_int4 or mgpu_int8) gets the
weights converted once, untimed.

Examples (GPU):
    python examples/benchmark.py --implementations mgpu pallas --m 1 16 256 4096 --straight 32
    python examples/benchmark.py --preset deepseek-v3-tp8 --no-zp --m 1 16 --search
    python examples/benchmark.py --bits 8 --group-size -1 --no-zp --m 1 256 4096     # W8A16
    python examples/benchmark.py --activation-quant int8_per_token --m 1 256 4096    # W8A8
    python examples/benchmark.py --group-size 32 --no-zp --scale-dtype float16 --m 1 4096
    python examples/benchmark.py --preset kimi-k2-ep8 --m 64 160 400 --straight 32  # 8/20/50 a GPU
    python examples/benchmark.py --preset gpt-oss-120b --m 1 16 256 4096  # MXFP4, biases
    python examples/benchmark.py --mxfp4 --m 1 4096    # against: --group-size 32 --no-zp
    python examples/benchmark.py --implementations pallas --m 1 64 4096 --batch-invariant
    python examples/benchmark.py --m 1 16 --json out/bench.json --plot out/roofline.png
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import logging
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import wna16_jax as wj

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import arg_types  # noqa: E402
import cli  # noqa: E402

PRESETS = {
    # name: (E, top_k, H, I, group_size)
    "deepseek-v3": (256, 8, 7168, 2048, 128),
    "deepseek-v3-tp8": (256, 8, 7168, 256, 128),  # one of 8 tensor-parallel slices of I
    # One GPU's shard of Kimi-K2 under 8-way expert parallelism (EXPERT_SHARDS): 48 of the 384
    # experts local, native int4 g32 symmetric; M counts the tokens of all 8 GPUs (20 per GPU:
    # --m 160), routed over all 384 experts.
    "kimi-k2-ep8": (384, 8, 7168, 2048, 32),
    # gpt-oss's MoE layers: MXFP4 experts (E2M1 codes, one E8M0 scale per 32 inputs).
    "gpt-oss-120b": (128, 4, 2880, 2880, 32),
    "gpt-oss-20b": (32, 4, 2880, 2880, 32),
    "tiny": (8, 2, 256, 128, 64),
}
# Presets run as one of this many expert-parallel shards (the rest: all experts local).
EXPERT_SHARDS = {"kimi-k2-ep8": 8}
# Presets with symmetric weights by default (Kimi-K2 ships them).
SYMMETRIC_PRESETS = ("kimi-k2-ep8",)
# Presets whose experts are MXFP4 (the checkpoints ship them so); --mxfp4 makes any preset's.
MXFP4_PRESETS = ("gpt-oss-120b", "gpt-oss-20b")
# Presets whose layer is gpt-oss's: per-expert biases on both GEMMs and the clamped SwiGLU.
GPT_OSS_PRESETS = ("gpt-oss-120b", "gpt-oss-20b")


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
    routing: str = "uniform"  # or "identical": every token routed as the set's first
    scale_dtype: str | None = None  # the scales' dtype (None: the activations')
    expert_shards: int = 1  # run one of this many expert-parallel shards: E / shards experts
    scheme: str | None = None  # None (integer codes: bits, group_size, has_zp) or "mxfp4"
    gpt_oss_math: bool = False  # per-expert biases on both GEMMs, activation "swiglu_oai"
    batch_invariant: bool = False  # fused_moe(batch_invariant=True)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.expert_shards


def preset_problem(
    name: str, *, bits: int = 4, no_zp: bool = False, group_size: int | None = None,
    scale_dtype: str | None = None, routing: str = "uniform", mxfp4: bool = False,
    silu: bool = False, batch_invariant: bool = False, activation_quant: str | None = None,
) -> Problem:  # fmt: skip
    """The Problem of preset `name` as the flags of the same names change it: symmetric
    weights for SYMMETRIC_PRESETS, MXFP4 for MXFP4_PRESETS (or mxfp4), gpt-oss's layer for
    GPT_OSS_PRESETS (unless silu), int8 per-channel symmetric weights under activation_quant."""
    e, k, h, i, g = PRESETS[name]
    problem = Problem(
        e, k, h, i, g if group_size is None else group_size, bits,
        not (no_zp or name in SYMMETRIC_PRESETS), routing=routing, scale_dtype=scale_dtype,
        expert_shards=EXPERT_SHARDS.get(name, 1),
        gpt_oss_math=name in GPT_OSS_PRESETS and not silu, batch_invariant=batch_invariant,
    )  # fmt: skip
    if mxfp4 or name in MXFP4_PRESETS:
        problem = dataclasses.replace(
            problem, group_size=32, bits=4, has_zp=False, scale_dtype=None, scheme="mxfp4"
        )
    if activation_quant:  # W8A8 runs int8 per-channel symmetric weights
        problem = dataclasses.replace(
            problem, group_size=-1, bits=8, has_zp=False, activation_quant=activation_quant,
            scheme=None,
        )  # fmt: skip
    return problem


def random_routing(key, m, e, k, num_sets):
    """num_sets independent [m, k] routings (weights f32, ids int32), each token's experts
    distinct."""
    keys = jax.random.split(key, num_sets)
    scores = jnp.stack([jax.random.uniform(kk, (m, e)) for kk in keys])  # [S, m, E]
    _, ids = jax.lax.top_k(scores, k)
    w = jax.random.uniform(jax.random.fold_in(key, 1), (num_sets, m, k), jnp.float32, 0.1, 1.0)
    return w, ids.astype(jnp.int32)


def random_inputs(key, problem: Problem, m: int, num_sets: int):
    """num_sets input sets at M=m: x [S, m, H] (key fold_in 3 + m) and the routing weights and
    ids [S, m, k] (`random_routing`, key fold_in 4 + m; with routing "identical" every token
    takes its set's first token's experts, as one prompt decoded greedily does)."""
    dtype = jnp.dtype(problem.dtype)
    xs = jax.random.normal(jax.random.fold_in(key, 3 + m), (num_sets, m, problem.hidden), dtype)
    tws, idss = random_routing(
        jax.random.fold_in(key, 4 + m), m, problem.num_experts, problem.top_k, num_sets
    )
    if problem.routing == "identical":
        idss = jnp.broadcast_to(idss[:, :1], idss.shape)
    return xs, tws, idss


def random_experts(key, problem: Problem):
    """w13 [E, 2I, H] and w2 [E, H, I]: random canonical weights drawn on the device in the
    quantized domain (keys fold_in 1 and 2 of `key`)."""
    make = functools.partial(
        wj.random_quantized_experts,
        bits=problem.bits,
        group_size=problem.group_size,
        has_zeros=problem.has_zp,
        dtype=jnp.dtype(problem.scale_dtype or problem.dtype),
    )
    if problem.scheme is not None:
        make = functools.partial(wj.random_quantized_experts, scheme=problem.scheme)
    e, h, i = problem.local_experts, problem.hidden, problem.intermediate
    return make(jax.random.fold_in(key, 1), (e, 2 * i, h)), make(
        jax.random.fold_in(key, 2), (e, h, i)
    )


def random_biases(key, problem: Problem):
    """{} or gpt-oss's per-expert biases: w13_bias [E, 2I] and w2_bias [E, H] in the
    activations' dtype (key fold_in 6)."""
    if not problem.gpt_oss_math:
        return {}
    e, h, i = problem.local_experts, problem.hidden, problem.intermediate
    k13, k2 = jax.random.split(jax.random.fold_in(key, 6))
    dtype = jnp.dtype(problem.dtype)
    return dict(
        w13_bias=jax.random.normal(k13, (e, 2 * i), dtype),
        w2_bias=jax.random.normal(k2, (e, h), dtype),
    )


def experts_touched(idss, local_experts: int) -> float:
    """The mean count of distinct local experts (ids below local_experts) an input set's
    routing ids [S, m, k] use."""
    return float(np.mean([len(np.unique(ids[ids < local_experts])) for ids in np.asarray(idss)]))


def expert_map(problem: Problem):
    """The shard's expert_map (experts 0 .. local_experts - 1 local, in order; the rest -1), or
    None where every expert is local."""
    if problem.expert_shards == 1:
        return None
    ids = np.arange(problem.num_experts)
    return jnp.asarray(np.where(ids < problem.local_experts, ids, -1).astype(np.int32))


def array_bytes(a) -> int:
    """The bytes an array takes in memory: an int4 array holds two values per byte (its
    `nbytes` counts one byte per value)."""
    return a.size * jax.dtypes.itemsize_bits(a.dtype) // 8


def weight_bytes(qw: wj.QuantizedExperts, experts: float) -> float:
    """The bytes of `experts` experts of qw (packed weights, scales and zero points), in any
    layout."""
    per_expert = sum(
        array_bytes(a) // a.shape[0] for a in (qw.qweight, qw.scales, qw.zeros) if a is not None
    )
    return per_expert * experts


def default_iters(m: int) -> int:
    """Calls per timed loop at M on a GPU: a loop has a fixed cost (its launch, the final
    reduction) that its calls share, so short calls need many."""
    return 100 if m <= 256 else 20


def make_loop(fn, args_sets, *, iters, consts=()):
    """A jitted run() of `iters` calls of fn(*consts, *args), one per iteration of a fori_loop
    on set i % len(args_sets), and the calls it makes. The loop adds up the sum of each call's
    output (so that each is computed; the sum and the loop's counter are kernels of each
    call)."""
    num_sets = len(args_sets)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *args_sets)

    @jax.jit
    def loop(consts, stacked):
        def body(i, acc):
            args = jax.tree.map(lambda s: s[i % num_sets], stacked)
            out = fn(*consts, *args)
            return acc + jnp.sum(out.astype(jnp.float32)) * 1e-30

        return jax.lax.fori_loop(0, iters, body, jnp.float32(0))

    return (lambda: loop(consts, stacked)), iters


def make_model_step(fn, args_sets, *, consts=()):
    """A jitted run() that calls fn(*consts, *args) once per input set, in turn, written out with
    no loop, as a model step runs its layers (a Python loop over the layers inside one jit); and
    the calls it makes (len(args_sets)). run() returns the sum of the last call's output.

    Each call's first argument is its set's plus 1e-30 x the previous call's output (fn's output
    fits its first input: a layer's), so each call waits for the last, as a model's layers do:
    XLA may run independent calls at the same time. The values stay the set's random ones: fed
    back as is, a layer's outputs grow or vanish over the calls, and zeros or infinities draw
    less power than random values (8% faster at M=4096 on the H200). Give one set per call: a
    set used twice lets XLA compute what depends only on its unchanged inputs (the routing's
    alignment) once, and the figure would flatter.
    """
    if len(args_sets) < 2:
        raise ValueError(f"a model step needs at least 2 input sets, got {len(args_sets)}")

    @jax.jit
    def step(consts, sets):
        out = sets[0][0]
        for x, *rest in sets:
            out = fn(*consts, x + (out * 1e-30).astype(x.dtype), *rest)
        return jnp.sum(out.astype(jnp.float32))

    sets = tuple(tuple(a) for a in args_sets)
    return (lambda: step(consts, sets)), len(sets)


# Printed under the table: the timings say nothing about the outputs' values.
OUTPUTS_NOT_CHECKED = (
    "outputs: not checked here (timing only); the tests compare every backend with the xla "
    "reference: pytest tests/test_fused_moe_kernels.py"
)

# Untimed runs before any timing. On the CPU the first two runs of a loop over an interpreted
# kernel each took about 9 s and the third 1 ms: one warm-up run left a one-time cost in the
# first timed repeat (a first row 1000x too slow).
WARMUP_RUNS = 2


def _first_runs(run) -> None:
    for _ in range(WARMUP_RUNS):
        jax.block_until_ready(run())


def _warm_up(run, warmup_s: float, runs: int = 1) -> None:
    """Runs run() (`runs` at a time) for warmup_s seconds: the GPU's clock settles where a
    sustained load puts it (decode at the H200's power cap ran its SM clock 8-19% below the
    maximum)."""
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:
        jax.block_until_ready([run() for _ in range(runs)])


def time_model_step(fn, args_sets, *, repeats, consts=(), runs=5, warmup_s=0.0):
    """Seconds per call of fn(*consts, *args) in a model step (`make_model_step`: one call per
    input set, written out in one jit), steps queued back to back as a decoding loop queues them
    (`time_step`)."""
    run, calls = make_model_step(fn, args_sets, consts=consts)
    return time_step(run, calls, repeats=repeats, runs=runs, warmup_s=warmup_s)


def time_step(run, calls, *, repeats, runs=5, warmup_s=0.0):
    """Seconds per call of a built model step (`make_model_step`'s run() of `calls` calls), steps
    queued back to back as a decoding loop queues them.

    One jitted call of many kernels costs the host time before its first kernel starts (its
    launches: about 0.8 ms for 32 layer calls at M=1 on the H200), and a step timed alone counts
    that time against its calls. Queued behind another step, that host work overlaps the GPU's:
    the figure is the marginal time of a queued step, (T(runs) - T(1)) / ((runs - 1) x calls),
    T(r) the wall time of r steps queued at once and awaited together; the median over
    `repeats`. Where noise makes a repeat's marginal time zero or negative (steps shorter than
    the host's jitter: a CPU, the interpreters), that repeat takes T(runs) / (runs x calls)
    instead, the queued steps' mean, host time included: an upper bound, never a figure that
    would rank a call faster than free. warmup_s: as time_loop's.
    """
    if runs < 2:
        raise ValueError(f"a model step's time needs runs >= 2 (a marginal step), got {runs}")
    _first_runs(run)
    _warm_up(run, warmup_s, runs)

    def queued(r):
        t0 = time.perf_counter()
        jax.block_until_ready([run() for _ in range(r)])
        return time.perf_counter() - t0

    times = []
    for _ in range(repeats):
        one, many = queued(1), queued(runs)
        marginal = (many - one) / ((runs - 1) * calls)
        times.append(marginal if marginal > 0 else many / (runs * calls))
    return statistics.median(times)


def time_loop(fn, args_sets, *, iters, repeats, consts=(), host=True, warmup_s=0.0):
    """Median seconds per call of fn(*consts, *args) inside one jitted loop over rotated inputs
    (`make_loop`).

    `consts` (e.g. the weights) are passed as jit arguments, never captured as constants.
    warmup_s: run the loop for that many seconds before timing it (`_warm_up`); 0: one warm-up
    run only (timings from the start of a burst).
    Returns (device_seconds_per_call, host_seconds_per_single_call); the host time is None
    with host=False (one compile fewer).
    """
    run, calls = make_loop(fn, args_sets, iters=iters, consts=consts)
    single = jax.jit(fn)
    _first_runs(run)
    _warm_up(run, warmup_s)
    if host:
        _first_runs(lambda: single(*consts, *args_sets[0]))
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


def time_copy(n, *, iters, repeats):
    """Seconds per elementwise pass over n f32 values that are read and written (carried)."""
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)

    @jax.jit
    def loop(x):
        return jax.lax.fori_loop(0, iters, lambda i, y: y * 0.999 + 1e-3, x)

    _first_runs(lambda: loop(x))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(x))
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def time_matmul(dtype, d: int, repeats: int) -> float:
    """Operations per second of a dense d^3 `jnp.dot` of `dtype` operands: bf16 accumulated in
    f32 and rounded to bf16, int8 accumulated in int32."""
    key = jax.random.key(10)
    if jnp.issubdtype(dtype, jnp.integer):
        ms = [jax.random.randint(jax.random.fold_in(key, i), (d, d), -127, 128, dtype)
              for i in range(2)]  # fmt: skip
        dot = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.int32).astype(dtype)
    else:
        ms = [jax.random.normal(jax.random.fold_in(key, i), (d, d), dtype) for i in range(2)]
        dot = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype)
    t_mm, _ = time_loop(dot, [(ms[0], ms[1]), (ms[1], ms[0])], iters=10, repeats=repeats,
                        host=False)  # fmt: skip
    return 2 * d**3 / t_mm


def measure_copy(on_gpu: bool, repeats: int) -> float:
    """HBM copy bandwidth (read + write bytes per second), measured now."""
    n = (1 << 28) if on_gpu else (1 << 22)  # f32 elements: 1 GiB on GPU
    return 2 * n * 4 / time_copy(n, iters=20, repeats=repeats)


def measure_ceilings(on_gpu: bool, repeats: int, int8: bool = False):
    """HBM copy bandwidth (`measure_copy`) and dense matmul operations per second, measured
    now: bf16, or int8 x int8 -> int32 (int8: the W8A8 GEMMs' ceiling)."""
    copy_bps, d = measure_copy(on_gpu, repeats), 8192 if on_gpu else 512
    return copy_bps, time_matmul(jnp.int8 if int8 else jnp.bfloat16, d, repeats)


def kernel_layout(implementation: str, w13, w2, dtype, activation_quant=None) -> str:
    """The weight layout `implementation` runs these experts in here: canonical where it reads
    it, else the first of wj.layouts.LAYOUTS it accepts (asked of wj.select_implementation on
    shapes alone).

    Raises:
        NotImplementedError: it runs them in no layout here (each layout's reason quoted).
    """
    x = jax.ShapeDtypeStruct((1, w13.shape[2]), dtype)
    tw = jax.ShapeDtypeStruct((1, 1), jnp.float32)
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    reasons = []
    for layout in wj.layouts.LAYOUTS:
        convert = functools.partial(wj.layouts.to_kernel_layout, layout=layout)
        try:
            a, b = jax.eval_shape(convert, w13), jax.eval_shape(convert, w2)
            wj.select_implementation(
                x, a, b, tw, ids, implementation=implementation, activation_quant=activation_quant
            )
        except (ValueError, NotImplementedError) as err:
            reasons.append(f"{layout}: {str(err).strip().splitlines()[0]}")
            continue
        return layout
    raise NotImplementedError(f"{implementation!r} runs these experts in no layout here ("
                              + "; ".join(reasons) + ")")  # fmt: skip


class WeightsByLayout:
    """The experts in each backend's layout (`kernel_layout`), each layout converted once, not
    timed."""

    def __init__(self, w13, w2, dtype, activation_quant=None):
        self._by_layout = {"canonical": (w13, w2)}
        self._problem = dict(dtype=dtype, activation_quant=activation_quant)

    def for_backend(self, implementation: str):
        w13, w2 = self._by_layout["canonical"]
        layout = kernel_layout(implementation, w13, w2, **self._problem)
        if layout not in self._by_layout:
            convert = functools.partial(wj.layouts.to_kernel_layout, layout=layout)
            self._by_layout[layout] = jax.block_until_ready((convert(w13), convert(w2)))
        return self._by_layout[layout]


def mgpu_candidates(rows_per_expert: float, group: int) -> list[wj.MgpuConfig]:
    """MgpuConfigs to try where the used experts get `rows_per_expert` rows each on average.

    block_m around the rows; no warp specialization, or a producer with 1-2 consumer
    warpgroups; k-steps of one group (block_k 128 where it divides the group: 64-wide steps lost
    to 128 at every M measured), two or four; 4 stages, 2 with the longer k-steps, at most 3
    where two consumers' 4 stages would not fit in shared memory; blocks that halve where a half
    is a whole wgmma (the first variant); from 64 rows, 128-row blocks on weights rounded to bf16.
    """
    bk, g2, g4 = (128 if group % 128 == 0 else 64), 2 * group, 4 * group
    if rows_per_expert <= 1:
        bms = (8,)
        variants = [(bk, 4, 0), (g2, 4, 0), (g2, 2, 0), (g4, 4, 0), (g4, 2, 0), (bk, 8, 2)]
    elif rows_per_expert <= 4:
        bms, variants = (8, 16), [(bk, 4, 0), (g2, 4, 0), (g2, 2, 0)]
    elif rows_per_expert <= 64:
        bms, variants = (16, 32, 64), [(bk, 4, 0), (bk, 4, 2), (g2, 3, 2)]
    else:
        bms = (64, 128)
        variants = [(bk, 4, 2), (bk, 4, 1), (g2, 3, 2), (g2, 2, 2), (g2, 3, 1), (g4, 2, 2)]
    configs = []
    for bm in bms:
        for k, stages, consumers in variants:
            if bm * k > 64 * 128 and consumers == 2:
                stages = min(stages, 3)
            configs.append(wj.MgpuConfig(bm, k, stages, consumers))
            if bm >= 16 and (k, consumers) == variants[0][::2]:
                configs.append(wj.MgpuConfig(bm, k, stages, consumers, block_halvings=1))
    if rows_per_expert > 64:
        configs += [
            wj.MgpuConfig(128, bk, 3, 2, bf16_weights=True),
            wj.MgpuConfig(128, g2, 2, 2, bf16_weights=True),
        ]
    return list(dict.fromkeys(configs))


def block_candidates(w13, w2, num_slots: int, implementation: str) -> list[wj.BlockConfig]:
    """BlockConfigs to try (one for both GEMMs, as fused_moe takes it): each GEMM's config today
    (`wj.gemm_config`) and each of those with block_n, split_k, num_stages or num_warps changed;
    those that do not fit both GEMMs' shapes are left out (none where the backend has no
    grouped GEMM here)."""
    dtype = w13.scales.dtype

    def fits(cfg) -> bool:
        try:
            for w in (w13, w2):
                wj.gemm_config(w, num_slots, dtype=dtype, implementation=implementation, config=cfg)
        except ValueError:
            return False
        return True

    try:
        bases = [wj.gemm_config(w, num_slots, dtype=dtype, implementation=implementation)
                 for w in (w13, w2)]  # fmt: skip
    except NotImplementedError:
        return []
    configs = list(bases)
    for base in bases:
        for field, values in (
            ("block_n", (32, 64, 128)),
            ("split_k", (1, 2, 4)),
            ("num_stages", (2, 3, 4)),
            ("num_warps", (4, 8)),
        ):
            configs += [dataclasses.replace(base, **{field: v}) for v in values]
    return [c for c in dict.fromkeys(configs) if fits(c)]


def search_candidates(implementation: str, problem: Problem, m: int, w13, w2) -> list:
    """The configs --search times for `implementation` at M=m (see the module docstring)."""
    if implementation.startswith("mgpu"):
        rows = m if problem.routing == "identical" else m * problem.top_k / problem.num_experts
        group = problem.hidden if problem.group_size == -1 else problem.group_size
        return mgpu_candidates(rows, group)
    if implementation == "xla":
        return []  # the reference takes no config
    return block_candidates(w13, w2, m * problem.top_k, implementation)


def config_record(cfg) -> dict | None:
    """A config as JSON: its class name and fields (None: the backend's own)."""
    return None if cfg is None else dict(type=type(cfg).__name__, **dataclasses.asdict(cfg))


def config_text(record: dict | None) -> str:
    """A config record in short: the fields that differ from the class's defaults."""
    if record is None:
        return "default"
    cls = {"MgpuConfig": wj.MgpuConfig, "BlockConfig": wj.BlockConfig}[record["type"]]
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    fields = [f"{k}={v}" for k, v in record.items() if k != "type" and defaults.get(k) != v]
    return ",".join(fields) or "class defaults"


def moe_layer(
    w13, w2, biases, x, tw, ids, *, implementation, config, problem: Problem, expert_map=None
):
    """wj.fused_moe with the weights and biases ({} or `random_biases`) first (the timed
    functions take consts, then a set); the problem's activation_quant, gpt-oss math and
    batch_invariant."""
    return wj.fused_moe(
        x,
        w13,
        w2,
        tw,
        ids,
        expert_map=expert_map,
        implementation=implementation,
        config=config,
        activation="swiglu_oai" if problem.gpt_oss_math else "silu",
        activation_quant=problem.activation_quant,
        batch_invariant=problem.batch_invariant,
        **biases,
    )


def bench_problem(
    problem: Problem, ms, implementations, *, iters, repeats, num_sets, configs=None,
    straight=0, search=False, warmup_s=0.0, key=None,
):  # fmt: skip
    """(rows, failures): per implementation, M and config, the loop timing and with straight=N
    (>= 2) the model step's (N input sets of their own). configs: {implementation: config} run
    by default (missing: the backend's own); search: also every `search_candidates` config.
    A run that fails (a backend or config that cannot run the size) is logged and listed among
    the failures."""
    key = jax.random.key(0) if key is None else key
    w13, w2 = random_experts(key, problem)
    biases = random_biases(key, problem)
    weights = WeightsByLayout(w13, w2, jnp.dtype(problem.dtype), problem.activation_quant)
    k, i, h = problem.top_k, problem.intermediate, problem.hidden
    rows, failures = [], []
    for m in ms:
        xs, tws, idss = random_inputs(key, problem, m, num_sets)
        sets = [(xs[s], tws[s], idss[s]) for s in range(num_sets)]
        touched = experts_touched(idss, problem.local_experts)
        local_slots = float(np.mean(np.asarray(idss) < problem.local_experts)) * m * k
        work = dict(
            weight_bytes=weight_bytes(w13, touched) + weight_bytes(w2, touched),
            flops=2.0 * local_slots * (2 * i * h + h * i),
            experts_touched=touched,
            local_slots=local_slots,
        )
        if straight:
            sxs, stws, sidss = random_inputs(jax.random.fold_in(key, 5), problem, m, straight)
            step_sets = [(sxs[s], stws[s], sidss[s]) for s in range(straight)]
            step_touched = experts_touched(sidss, problem.local_experts)
            step_bytes = weight_bytes(w13, step_touched) + weight_bytes(w2, step_touched)
        for impl in implementations:
            tried = [(configs or {}).get(impl)]
            if search:
                tried += search_candidates(impl, problem, m, w13, w2)
            for cfg in dict.fromkeys(tried):
                fn = functools.partial(
                    moe_layer,
                    implementation=impl,
                    config=cfg,
                    problem=problem,
                    expert_map=expert_map(problem),
                )
                row = dict(implementation=impl, M=m, config=config_record(cfg))
                try:
                    consts = (*weights.for_backend(impl), biases)
                    t, t_host = time_loop(
                        fn, sets, iters=iters or default_iters(m), repeats=repeats,
                        consts=consts, warmup_s=warmup_s,
                    )  # fmt: skip
                    row.update(loop_seconds=t, host_call_seconds=t_host, **work)
                    if straight:
                        t_step = time_model_step(
                            fn, step_sets, repeats=repeats, consts=consts, warmup_s=warmup_s
                        )
                        row.update(
                            step_calls=straight, step_seconds=t_step, step_weight_bytes=step_bytes
                        )
                except Exception as err:  # cannot run this size or config: report, go on
                    msg = str(err).strip().splitlines() or [type(err).__name__]
                    logging.warning("%s M=%d %s failed: %s", impl, m, config_text(row["config"]),
                                    msg[0][:200])  # fmt: skip
                    failures.append(dict(row, error=msg[0]))
                    continue
                rows.append(row)
                step = f", step {row['step_seconds'] * 1e6:.1f} us" if straight else ""
                print(f"  {impl:>16} M={m:<6} {config_text(row['config']):<28} "
                      f"loop {t * 1e6:.1f} us{step}", file=sys.stderr, flush=True)  # fmt: skip
    return rows, failures


def best_configs(rows) -> list[dict]:
    """Per implementation and M with more than one config timed: the fastest row (by the step
    figure where there is one, else the loop's) and the backend's own config's time."""
    best = []
    for impl, m in dict.fromkeys((r["implementation"], r["M"]) for r in rows):
        timed = [r for r in rows if (r["implementation"], r["M"]) == (impl, m)]
        if len(timed) < 2:
            continue
        figure = "step_seconds" if "step_seconds" in timed[0] else "loop_seconds"
        fastest = min(timed, key=lambda r: r[figure])
        own = next((r[figure] for r in timed if r["config"] is None), None)
        best.append(dict(implementation=impl, M=m, figure=figure, seconds=fastest[figure],
                         config=fastest["config"], default_seconds=own))  # fmt: skip
    return best


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}"


def print_table(rows, copy_bps, mm_flops):
    """One line per row: the loop's (and the step's) time and its share of the copy ceiling
    (weight bytes) and of the matmul ceiling (FLOP/s), and one call's host time."""
    print(
        f"{'implementation':<16} {'M':>5} {'config':<24} {'loop us':>9} {'%copy':>6} {'%mm':>6} "
        f"{'step us':>9} {'%copy':>6} {'%mm':>6} {'host us':>9}"
    )
    for r in rows:
        t = r["loop_seconds"]
        cells = [f"{t * 1e6:9.1f}", f"{_percent(r['weight_bytes'] / t, copy_bps):>6}",
                 f"{_percent(r['flops'] / t, mm_flops):>6}"]  # fmt: skip
        if "step_seconds" in r:
            ts = r["step_seconds"]
            cells += [f"{ts * 1e6:9.1f}", f"{_percent(r['step_weight_bytes'] / ts, copy_bps):>6}",
                      f"{_percent(r['flops'] / ts, mm_flops):>6}"]  # fmt: skip
        else:
            cells += [f"{'-':>9}", f"{'-':>6}", f"{'-':>6}"]
        host = r["host_call_seconds"]
        cells.append(f"{host * 1e6:9.1f}" if host is not None else f"{'-':>9}")
        config = config_text(r["config"])
        print(f"{r['implementation']:<16} {r['M']:>5} {config:<24} " + " ".join(cells))


def print_best(best):
    print("best config per M (by the step figure where timed, else the loop's):")
    for b in best:
        own = b["default_seconds"]
        versus = f" (default {own * 1e6:.1f} us: {own / b['seconds']:.2f}x)" if own else ""
        print(f"  {b['implementation']:<16} M={b['M']:<6} {b['seconds'] * 1e6:9.1f} us{versus}  "
              f"{config_text(b['config'])}")  # fmt: skip


def plot_roofline(rows, copy_bps, mm_flops, path):
    """Achieved FLOP/s against FLOP per weight byte under the measured ceilings: each
    implementation's rows at its own configs, the loop's figures and the step's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    xs = np.logspace(-1, 4, 200)
    ax.loglog(xs, np.minimum(xs * copy_bps, mm_flops) / 1e12, "k-", label="measured ceilings")
    own = [r for r in rows if r["config"] is None]
    for impl in sorted({r["implementation"] for r in own}):
        pts = [r for r in own if r["implementation"] == impl]
        for figure, style, nbytes in (("loop_seconds", "o-", "weight_bytes"),
                                      ("step_seconds", "s--", "step_weight_bytes")):  # fmt: skip
            timed = [r for r in pts if figure in r]
            if not timed:
                continue
            ai = [r["flops"] / r[nbytes] for r in timed]
            perf = [r["flops"] / r[figure] / 1e12 for r in timed]
            ax.loglog(ai, perf, style, label=f"{impl} ({figure.split('_')[0]})")
            for r, a, p in zip(timed, ai, perf, strict=True):
                ax.annotate(f"M={r['M']}", (a, p), fontsize=7)
    ax.set_xlabel("FLOP per weight byte")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("fused_moe roofline (weight bytes only)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _config_arg(cls):
    def parse(text: str):
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError) as err:
            raise argparse.ArgumentTypeError(f"bad {cls.__name__} {text!r}: {err}") from None

    return parse


def main(argv=None):
    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    cli.setup_parser(p)
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="deepseek-v3" if on_gpu else "tiny",
        help="problem shape (default: deepseek-v3 on GPU, tiny on CPU)",
    )
    p.add_argument(
        "--m",
        type=arg_types.positive_int,
        nargs="+",
        default=None,
        help="token counts (default: 1 4 16 64 256 1024 4096 on GPU, 1 4 on CPU)",
    )
    p.add_argument(
        "--implementation",
        "--implementations",
        dest="implementations",
        nargs="+",
        default=None,
        help="backends to time (default: mgpu pallas xla on GPU, pallas_interpret xla on CPU)",
    )
    p.add_argument(
        "--bits", type=int, choices=(4, 8), default=4, help="weight bits, 4 or 8 (default 4)"
    )
    p.add_argument(
        "--no-zp",
        action="store_true",
        help="symmetric weights (no zero points; the default of "
        + ", ".join(SYMMETRIC_PRESETS)
        + ")",
    )
    p.add_argument(
        "--mxfp4",
        action="store_true",
        help="MXFP4 weights (E2M1 codes, E8M0 scales per 32 inputs: the default of "
        + ", ".join(MXFP4_PRESETS)
        + "; --bits, --group-size, --no-zp and --scale-dtype are ignored then)",
    )
    p.add_argument(
        "--silu",
        action="store_true",
        help="the plain layer (silu, no biases) for the presets that run gpt-oss's by default ("
        + ", ".join(GPT_OSS_PRESETS)
        + ": per-expert biases on both GEMMs, the clamped SwiGLU)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="fused_moe(batch_invariant=True): configs fixed per weight shape, no split-K (its "
        "cost against a run without; mgpu refuses it)",
    )
    p.add_argument(
        "--scale-dtype",
        choices=("bfloat16", "float16", "float32"),
        default=None,
        help="the scales' dtype (default: the activations', bfloat16; GPTQ checkpoints store "
        "float16)",
    )
    p.add_argument(
        "--group-size",
        type=arg_types.group_size,
        default=None,
        help="quantization group (default: the preset's; -1 = per channel)",
    )
    p.add_argument(
        "--activation-quant",
        choices=("int8_per_token",),
        default=None,
        help="W8A8 rows: int8 per-token activations with int8 per-channel symmetric weights "
        "(--bits, --group-size and --no-zp are ignored then)",
    )
    p.add_argument(
        "--routing",
        choices=("uniform", "identical"),
        default="uniform",
        help="uniform: each token picks k distinct experts at random; identical: every token of "
        "a set picks the first token's experts, as one prompt decoded greedily does",
    )
    p.add_argument(
        "--straight",
        type=arg_types.non_negative_int,
        default=0,
        metavar="N",
        help="also time each row in a model step: N calls written out in one jit, one input set "
        "each, each call's input the previous call's output, steps queued back to back "
        "(time_model_step; 0: off, else N >= 2)",
    )
    p.add_argument(
        "--search",
        action="store_true",
        help="also time candidate configs (MgpuConfig for mgpu*, BlockConfig for the others) "
        "and print the best per M",
    )
    p.add_argument(
        "--block-config",
        type=_config_arg(wj.BlockConfig),
        default=None,
        help='BlockConfig for the non-mgpu backends as JSON, e.g. \'{"block_m":16,"block_n":64}\'',
    )
    p.add_argument(
        "--mgpu-config",
        type=_config_arg(wj.MgpuConfig),
        default=None,
        help='MgpuConfig for the mgpu backends as JSON, e.g. \'{"block_m":8,"block_k":256}\'',
    )
    p.add_argument(
        "--xla-max-m",
        type=arg_types.non_negative_int,
        default=64,
        help="skip the slow xla reference above this M",
    )
    p.add_argument(
        "--iters",
        type=arg_types.positive_int,
        default=None,
        help="calls per timed loop (default on a GPU: 100 for M <= 256, 20 above; 1 on CPU)",
    )
    p.add_argument(
        "--repeats",
        type=arg_types.positive_int,
        default=None,
        help="timed runs, median taken (default 5; 3 on CPU)",
    )
    p.add_argument(
        "--sets", type=arg_types.positive_int, default=4, help="input sets rotated through the loop"
    )
    p.add_argument(
        "--warmup-s",
        type=arg_types.non_negative_float,
        default=0.0,
        help="run each timed loop or step this many seconds before timing it, so the GPU's "
        "clock settles where a sustained load puts it (default 0: timings of a burst)",
    )
    p.add_argument("--json", type=str, default=None, help="write the results here")
    p.add_argument("--plot", type=str, default=None, help="write a roofline PNG here")
    args = p.parse_args(argv)
    if args.straight == 1 or args.straight < 0:
        p.error(f"--straight must be 0 (off) or at least 2, got {args.straight}")
    logging.basicConfig(level=logging.WARNING)
    problem = preset_problem(
        args.preset, bits=args.bits, no_zp=args.no_zp, group_size=args.group_size,
        scale_dtype=args.scale_dtype, routing=args.routing, mxfp4=args.mxfp4, silu=args.silu,
        batch_invariant=args.batch_invariant, activation_quant=args.activation_quant,
    )  # fmt: skip
    ms = args.m or ([1, 4, 16, 64, 256, 1024, 4096] if on_gpu else [1, 4])
    impls = args.implementations or (
        ["mgpu", "pallas", "xla"] if on_gpu else ["pallas_interpret", "xla"]
    )
    iters = args.iters or (None if on_gpu else 1)  # None: per M, default_iters
    repeats = args.repeats or (5 if on_gpu else 3)
    configs = {}
    for impl in impls:
        given = args.mgpu_config if impl.startswith("mgpu") else args.block_config
        if given is not None:
            configs[impl] = given
    int8 = problem.activation_quant is not None  # %mm: of the int8 matmul's ceiling
    copy_bps, mm_flops = measure_ceilings(on_gpu, repeats, int8=int8)
    print(
        f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  "
        f"copy ceiling {copy_bps / 1e12:.2f} TB/s  {'int8' if int8 else 'bf16'} matmul ceiling "
        f"{mm_flops / 1e12:.1f} {'TOP/s' if int8 else 'TFLOP/s'}",
        flush=True,
    )
    print(f"problem: {problem}", flush=True)
    rows, failures = [], []
    for impl in impls:
        run_ms = [m for m in ms if impl != "xla" or m <= args.xla_max_m]
        more, failed = bench_problem(
            problem, run_ms, [impl], iters=iters, repeats=repeats, num_sets=args.sets,
            configs=configs, straight=args.straight, search=args.search,
            warmup_s=args.warmup_s,
        )  # fmt: skip
        rows += more
        failures += failed
    print_table(rows, copy_bps, mm_flops)
    print(OUTPUTS_NOT_CHECKED)
    best = best_configs(rows) if args.search else []
    if best:
        print_best(best)
    for f in failures:
        print(f"failed: {f['implementation']} M={f['M']} {config_text(f['config'])}: {f['error']}")
    result = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        python=platform.python_version(),
        problem=dataclasses.asdict(problem),
        copy_bytes_per_s=copy_bps,
        matmul_flops_per_s=mm_flops,
        matmul_dtype="int8" if int8 else "bfloat16",
        rows=rows,
        best=best,
        failed=failures,
        outputs_checked=False,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot_roofline(rows, copy_bps, mm_flops, args.plot)
    return result


if __name__ == "__main__":
    cli.run(main)
