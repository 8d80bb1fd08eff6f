"""Smoke tests of the example scripts (tiny CPU problems, kernels in the interpreters) and unit
tests of their timing, search and trace helpers.

examples/generate.py has its own smoke tests in test_deepseek_v3_example.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wna16_jax as wj
from pallas_kernels.mgpu import config as mgpu_config
from wna16_jax._configs import GemmShape

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    return helpers.load_script(EXAMPLES / f"{name}.py", f"example_{name}", [EXAMPLES])


@pytest.mark.parametrize(
    "name",
    ["benchmark", "benchmark_linear", "tune", "profile", "profile_decode", "full_deepseek_v3"],
)
def test_help(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        _load(name).main(["--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


# ---- benchmark.py -----------------------------------------------------------------------------


def test_benchmark_tiny(tmp_path, capsys):
    """Loop and model-step rows on the 'xla' backend: the table, the same numbers as JSON, and
    the roofline."""
    out_json, out_png = tmp_path / "bench.json", tmp_path / "roofline.png"
    argv = ["--preset", "tiny", "--implementations", "xla", "--m", "1", "3", "--straight", "2",
            "--iters", "1", "--repeats", "1", "--sets", "2", "--json", str(out_json),
            "--plot", str(out_png)]  # fmt: skip
    result = _load("benchmark").main(argv)
    table = capsys.readouterr().out
    assert "loop us" in table and "step us" in table and "%copy" in table
    assert "outputs: not checked here" in table  # a timing is not a correctness check
    saved = json.loads(out_json.read_text())
    assert saved == json.loads(json.dumps(result))
    assert [(r["implementation"], r["M"]) for r in saved["rows"]] == [("xla", 1), ("xla", 3)]
    for r in saved["rows"]:
        assert r["config"] is None and r["step_calls"] == 2
        assert r["loop_seconds"] > 0 and r["step_seconds"] > 0 and r["host_call_seconds"] > 0
        assert r["weight_bytes"] > 0 and r["step_weight_bytes"] > 0
        assert r["flops"] == 2.0 * r["M"] * 2 * (2 * 128 * 256 + 256 * 128)  # tiny: k=2, I, H
        assert 1 <= r["experts_touched"] <= min(8, 2 * r["M"])
        assert f"{r['loop_seconds'] * 1e6:9.1f}" in table
    assert saved["copy_bytes_per_s"] > 0 and saved["matmul_flops_per_s"] > 0
    assert saved["best"] == [] and saved["failed"] == [] and saved["outputs_checked"] is False
    assert out_png.stat().st_size > 1000


def test_benchmark_search_in_the_interpreter(monkeypatch, capsys):
    """--search on 'mgpu_interpret' (weights converted to its layout once): the backend's own
    config and each candidate; a candidate that cannot run the shapes is reported and skipped,
    and the best config per M is printed."""
    bench = _load("benchmark")
    good, bad = wj.MgpuConfig(8, 128, 2, 0), wj.BlockConfig(block_m=4)  # mgpu: 8-row multiples
    monkeypatch.setattr(bench, "mgpu_candidates", lambda rows, group: [good, bad])
    argv = ["--implementations", "mgpu_interpret", "--m", "1", "--search", "--iters", "1",
            "--repeats", "1", "--sets", "1"]  # fmt: skip
    result = bench.main(argv)
    out = capsys.readouterr().out
    configs = [r["config"] for r in result["rows"]]
    assert configs == [None, bench.config_record(good)]
    assert [f["config"] for f in result["failed"]] == [bench.config_record(bad)]
    assert "block_m=4" in result["failed"][0]["error"]
    [best] = result["best"]
    assert best["implementation"] == "mgpu_interpret" and best["M"] == 1
    assert best["figure"] == "loop_seconds"  # no --straight
    assert best["seconds"] == min(r["loop_seconds"] for r in result["rows"])
    assert "best config per M" in out and "failed: mgpu_interpret M=1" in out


def test_benchmark_expert_shard_in_the_interpreter():
    """One of 4 expert-parallel shards (as the kimi-k2-ep8 preset runs, scaled down): g32
    symmetric weights with float16 scales on 'mgpu_interpret', the tokens routed over all 16
    experts and only the shard's 4 counted; the layer itself equals 'xla' with that
    expert_map."""
    bench = _load("benchmark")
    problem = bench.Problem(
        16, 2, 128, 128, 32, bits=4, has_zp=False, scale_dtype="float16", expert_shards=4
    )
    assert problem.local_experts == 4
    rows, failed = bench.bench_problem(
        problem, [8], ["mgpu_interpret"], iters=1, repeats=1, num_sets=1
    )
    [row] = rows
    assert failed == [] and 0 < row["experts_touched"] <= 4
    assert 0 < row["local_slots"] < 8 * 2  # some slots route off the shard
    assert row["flops"] == 2.0 * row["local_slots"] * (2 * 128 * 128 + 128 * 128)
    key = jax.random.key(0)
    w13, w2 = bench.random_experts(key, problem)
    assert w13.shape[0] == 4 and w13.scales.dtype == jnp.float16 and w13.zeros is None
    [(x, tw, ids)] = [tuple(a[0] for a in bench.random_inputs(key, problem, 8, 1))]
    emap = bench.expert_map(problem)
    np.testing.assert_array_equal(np.asarray(emap)[:4], np.arange(4))
    assert np.all(np.asarray(emap)[4:] == -1)
    mk = wj.layouts.to_kernel_layout
    layer = functools.partial(bench.moe_layer, config=None, problem=problem, expert_map=emap)
    out = layer(mk(w13, "mgpu_int4"), mk(w2, "mgpu_int4"), {}, x, tw, ids,
                implementation="mgpu_interpret")  # fmt: skip
    ref = layer(w13, w2, {}, x, tw, ids, implementation="xla")
    helpers.assert_close(out, np.asarray(ref, np.float64), jnp.bfloat16, "expert shard vs xla")


def test_benchmark_mxfp4(capsys):
    """--mxfp4 (the gpt-oss presets' weights) on a tiny layer: the Pallas and Mosaic GPU
    kernels in their interpreters, the weight bytes a step reads counting half a byte a code
    and the uint8 E8M0 scales; with the gpt-oss presets' math (biases, clamped SwiGLU) each
    layer equal to 'xla' on the same weights."""
    bench = _load("benchmark")
    assert set(bench.MXFP4_PRESETS) <= set(bench.PRESETS)
    assert bench.PRESETS["gpt-oss-120b"] == (128, 4, 2880, 2880, 32)
    assert set(bench.GPT_OSS_PRESETS) <= set(bench.MXFP4_PRESETS)
    result = bench.main(
        ["--preset", "tiny", "--mxfp4", "--implementations", "pallas_interpret",
         "mgpu_interpret", "--m", "2", "--iters", "1", "--repeats", "1", "--sets", "1"]
    )  # fmt: skip
    assert "%copy" in capsys.readouterr().out
    assert result["problem"]["scheme"] == "mxfp4" and result["failed"] == []
    e, k, h, i = 8, 2, 256, 128
    per_expert = 3 * h * i // 2 + 3 * h * i // 32  # codes + scales of w13 and w2
    for row in result["rows"]:
        assert row["weight_bytes"] == per_expert * row["experts_touched"]
    problem = bench.Problem(e, k, h, i, 32, bits=4, has_zp=False, scheme="mxfp4", gpt_oss_math=True)
    key = jax.random.key(0)
    w13, w2 = bench.random_experts(key, problem)
    biases = bench.random_biases(key, problem)
    assert w13.is_mxfp4 and w13.scales.dtype == jnp.uint8 and w2.shape == (e, h, i)
    assert biases["w13_bias"].shape == (e, 2 * i) and biases["w2_bias"].shape == (e, h)
    [(x, tw, ids)] = [tuple(a[0] for a in bench.random_inputs(key, problem, 4, 1))]
    layer = functools.partial(bench.moe_layer, config=None, problem=problem)
    ref = layer(w13, w2, biases, x, tw, ids, implementation="xla")
    plain = bench.moe_layer(w13, w2, {}, x, tw, ids, implementation="xla", config=None,
                            problem=dataclasses.replace(problem, gpt_oss_math=False))  # fmt: skip
    assert not np.allclose(np.asarray(plain, np.float32), np.asarray(ref, np.float32))
    for impl in ("pallas_interpret", "mgpu_interpret"):
        a, b = (wj.layouts.to_kernel_layout(w, wj.backend_layout(impl, 4)) for w in (w13, w2))
        out = layer(a, b, biases, x, tw, ids, implementation=impl)
        helpers.assert_close(out, np.asarray(ref, np.float64), jnp.bfloat16, f"{impl} vs xla")


def test_benchmark_batch_invariant():
    """--batch-invariant: the Pallas layer runs with the flag; mgpu, which cannot guarantee
    it, is a failure that gives its reason."""
    bench = _load("benchmark")
    result = bench.main(
        ["--batch-invariant", "--implementations", "pallas_interpret", "mgpu_interpret",
         "--m", "3", "--iters", "1", "--repeats", "1", "--sets", "1"]
    )  # fmt: skip
    assert result["problem"]["batch_invariant"] is True
    assert [r["implementation"] for r in result["rows"]] == ["pallas_interpret"]
    [failed] = result["failed"]
    assert failed["implementation"] == "mgpu_interpret" and "K splits" in failed["error"]


def test_benchmark_reports_a_backend_that_cannot_run():
    """'mgpu' (compiled) on a CPU: no row, a failure naming each layout's reason."""
    bench = _load("benchmark")
    problem = bench.Problem(*bench.PRESETS["tiny"], bits=4, has_zp=True)
    rows, [failed] = bench.bench_problem(problem, [1], ["mgpu"], iters=1, repeats=1, num_sets=1)
    assert rows == [] and (failed["implementation"], failed["M"]) == ("mgpu", 1)
    assert "canonical:" in failed["error"] and "mgpu_int4:" in failed["error"]


def _tiny_experts(bench):
    problem = bench.Problem(*bench.PRESETS["tiny"], bits=4, has_zp=True)
    return bench.random_experts(jax.random.key(0), problem)


def test_kernel_layout_asks_the_backend():
    bench = _load("benchmark")
    w13, w2 = _tiny_experts(bench)
    assert bench.kernel_layout("pallas_interpret", w13, w2, jnp.bfloat16) == "canonical"
    assert bench.kernel_layout("mgpu_interpret", w13, w2, jnp.bfloat16) == "mgpu_int4"
    with pytest.raises(NotImplementedError, match="no layout"):
        bench.kernel_layout("mgpu_interpret", w13, w2, jnp.float32)  # bf16 activations only


def test_weight_bytes_are_the_same_in_every_layout():
    """An expert's bytes in the mgpu_int4 layout (int4 arrays, two values per byte; zero points
    in the scales' dtype) against its canonical words: the qweight the same, the zero points
    4x (16-bit against 4-bit)."""
    bench = _load("benchmark")
    w13, _ = _tiny_experts(bench)
    mgpu = wj.layouts.to_kernel_layout(w13, "mgpu_int4")
    assert bench.array_bytes(mgpu.qweight) == w13.qweight.nbytes == mgpu.qweight.size // 2
    per_expert_zeros = w13.zeros.nbytes // w13.num_experts  # 4-bit, packed in pairs
    assert bench.weight_bytes(mgpu, 2) == bench.weight_bytes(w13, 2) + 2 * 3 * per_expert_zeros


def test_mgpu_candidates_follow_the_rows_per_expert():
    bench = _load("benchmark")
    cands = bench.mgpu_candidates
    assert {c.block_m for c in cands(0.03, 128)} == {8}  # M=1 of 256 experts, top-8
    assert {c.block_m for c in cands(8, 128)} == {16, 32, 64}
    assert {c.block_m for c in cands(128, 128)} == {64, 128}
    # k-steps of one group (64 where 128 does not divide it), two or four
    assert {c.block_k for c in cands(8, 64)} == {64, 128}
    assert {c.block_k for c in cands(0.03, 128)} == {128, 256, 512}
    assert all(c.block_halvings == 0 for c in cands(0.03, 128))  # 8-row blocks do not halve
    assert any(c.block_halvings for c in cands(8, 128))
    assert any(c.bf16_weights for c in cands(128, 128))
    assert not any(c.bf16_weights for c in cands(64, 128))
    for rows in (0.03, 2, 8, 128):  # two consumers of long k-steps: at most 3 stages
        assert all(
            c.stages <= 3
            for c in cands(rows, 128)
            if c.consumers == 2 and c.block_m * c.block_k > 64 * 128
        )


def test_block_candidates_fit_both_gemms():
    bench = _load("benchmark")
    w13, w2 = _tiny_experts(bench)
    slots = 4 * 2
    cands = bench.block_candidates(w13, w2, slots, "pallas_interpret")
    own = wj.gemm_config(w13, slots, implementation="pallas_interpret")
    assert own in cands and len(cands) == len(set(cands)) > 1
    for cfg in cands:
        for w in (w13, w2):
            assert wj.gemm_config(w, slots, implementation="pallas_interpret", config=cfg) == cfg
    assert bench.block_candidates(w13, w2, slots, "pallas") == []  # no compiled GEMM on a CPU


def test_config_text_names_the_changed_fields():
    bench = _load("benchmark")
    assert bench.config_text(None) == "default"
    record = bench.config_record(wj.MgpuConfig(8, 256, 2, 0, bf16_weights=True))
    assert bench.config_text(record) == "block_m=8,block_k=256,stages=2,bf16_weights=True"
    assert bench.config_text(bench.config_record(wj.BlockConfig(split_k=2))) == "split_k=2"


def test_best_configs_rank_by_the_step_where_timed():
    bench = _load("benchmark")
    rows = [
        dict(implementation="a", M=1, config=None, loop_seconds=3.0, step_seconds=2.0),
        dict(implementation="a", M=1, config={"x": 1}, loop_seconds=1.0, step_seconds=2.5),
        dict(implementation="a", M=1, config={"x": 2}, loop_seconds=4.0, step_seconds=1.0),
        dict(implementation="a", M=2, config=None, loop_seconds=1.0, step_seconds=1.0),
    ]
    [best] = bench.best_configs(rows)  # M=2 had one config only
    assert best == dict(implementation="a", M=1, figure="step_seconds", seconds=1.0,
                        config={"x": 2}, default_seconds=2.0)  # fmt: skip


def test_model_step_calls_once_per_set_each_on_the_last_output():
    """make_model_step: one call per set, written out (traced once, no loop), each call's first
    argument its set's plus 1e-30 x the previous output; fewer than 2 sets are refused."""
    bench = _load("benchmark")
    calls = []

    def fn(w, x, y):
        calls.append(None)  # once per traced call
        return x * w + y

    rng = np.random.default_rng(0)
    sets = [tuple(rng.normal(size=(2, 3)).astype(np.float32)) for _ in range(3)]
    run, n = bench.make_model_step(fn, sets, consts=(jnp.float32(0.5),))
    assert n == 3 and not calls
    got = float(run())
    assert len(calls) == 3
    out = sets[0][0].astype(np.float64)
    for x, y in sets:
        out = (x + out * 1e-30) * 0.5 + y
    np.testing.assert_allclose(got, out.sum(), rtol=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        bench.make_model_step(fn, sets[:1])
    with pytest.raises(ValueError, match="runs >= 2"):
        bench.time_model_step(fn, sets, repeats=1, consts=(jnp.float32(0.5),), runs=1)


def test_model_step_time_is_never_free(monkeypatch):
    """time_model_step: the marginal time of a queued step, (T(runs) - T(1)) / ((runs - 1) x
    calls); a repeat where noise makes it zero or negative takes the queued steps' mean
    T(runs) / (runs x calls) instead (a tuner would rank a negative figure first)."""
    bench = _load("benchmark")
    sets = [(np.ones((2, 3), np.float32),) for _ in range(2)]
    # T(1), T(5) per repeat: 1.0 then 3.0 (marginal 0.25 / call), 2.0 then 1.5 (negative)
    ticks = iter([0.0, 1.0, 0.0, 3.0, 0.0, 2.0, 0.0, 1.5, 0.0, 2.0, 0.0, 1.0])
    monkeypatch.setattr(bench, "_warm_up", lambda *args: None)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(ticks))
    marginal = (3.0 - 1.0) / (4 * 2)
    assert bench.time_model_step(lambda x: x * 2, sets, repeats=1) == marginal
    assert bench.time_model_step(lambda x: x * 2, sets, repeats=1) == 1.5 / (5 * 2)
    assert bench.time_model_step(lambda x: x * 2, sets, repeats=1) == 1.0 / (5 * 2)


def test_make_loop_sums_every_call():
    """make_loop: `iters` calls over the sets in turn, the sum of each output times 1e-30."""
    bench = _load("benchmark")
    rng = np.random.default_rng(0)
    sets = [(rng.normal(size=(3,)).astype(np.float32), np.float32(a)) for a in (0.5, -1.25)]
    run, calls = bench.make_loop(lambda c, x, a: x * a + c, sets, iters=5, consts=(0.75,))
    assert calls == 5
    want = sum((s[0].astype(np.float64) * s[1] + 0.75).sum() for s in (sets * 3)[:5]) * 1e-30
    np.testing.assert_allclose(float(run()), want, rtol=1e-5)


def test_time_loop_warms_up_for_the_seconds_asked(monkeypatch):
    """time_loop(warmup_s=S) runs the loop for S seconds before the timed repeats (the GPU's
    clock settles under a sustained load), and times the same calls as without it."""
    bench = _load("benchmark")
    runs = []
    make_loop = bench.make_loop

    def counting_make_loop(*args, **kwargs):
        run, calls = make_loop(*args, **kwargs)
        return (lambda: runs.append(1) or run()), calls

    monkeypatch.setattr(bench, "make_loop", counting_make_loop)
    sets = [(jnp.arange(4.0),), (jnp.ones(4),)]
    t, host = bench.time_loop(lambda x: x * 2, sets, iters=3, repeats=2, host=False)
    warm = bench.WARMUP_RUNS
    assert t > 0 and host is None and len(runs) == warm + 2  # the warm-up runs, the repeats
    runs.clear()
    start = time.perf_counter()
    t, _ = bench.time_loop(lambda x: x * 2, sets, iters=3, repeats=2, host=False, warmup_s=0.3)
    assert time.perf_counter() - start >= 0.3
    assert t > 0 and len(runs) > warm + 2 + 1


def test_benchmark_linear_tiny(tmp_path, capsys):
    """A row per implementation and M: the time, the bytes a call reads (the weight in the
    layout that implementation reads: int4 + scales + zeros, or bf16) and their share of the
    copy ceiling, the same numbers as JSON."""
    out_json = tmp_path / "linear.json"
    argv = ["--shapes", "tiny_b", "--implementations", "mgpu_interpret", "xla", "bf16",
            "--m", "1", "--repeats", "1", "--json", str(out_json)]  # fmt: skip
    result = _load("benchmark_linear").main(argv)
    header = capsys.readouterr().out.splitlines()[1].split()  # under the device line
    assert header == ["shape", "N", "K", "M", "implementation", "us", "MB", "read", "%copy"]
    assert json.loads(out_json.read_text()) == json.loads(json.dumps(result))
    rows = {r["implementation"]: r for r in result["rows"]}
    assert sorted(rows) == ["bf16", "mgpu_interpret", "xla"]
    n, k = 64, 128
    int4 = n * k // 2 + 2 * n * (k // 128) * 2  # int4 weights, bf16 scales; zero points
    for r in rows.values():
        # A marginal time (benchmark.time_model_step), else the queued steps' mean: > 0.
        assert r["seconds"] > 0 and r["M"] == 1 and (r["N"], r["K"]) == (n, k)
        assert r["copy_fraction"] == pytest.approx(
            r["bytes"] / r["seconds"] / result["copy_bytes_per_s"]
        )
    assert rows["bf16"]["bytes"] == n * k * 2 + k * 2 + n * 2
    assert int4 < rows["xla"]["bytes"] < rows["bf16"]["bytes"]
    # The mgpu_int4 layout: the same int4 weights and scales, zero points as bf16 offsets.
    assert 0 < rows["mgpu_interpret"]["bytes"] - rows["xla"]["bytes"] <= n * (k // 128) * 2


def test_benchmark_linear_splits_and_trace(capsys):
    """--splits: a row per K split count on the Mosaic GPU GEMM (one that does not divide the
    k-steps is said and skipped), the other implementations once; --trace: each row's traced us
    per call beside it."""
    argv = ["--shapes", "tiny_a", "--implementations", "mgpu_interpret", "xla", "--m", "1",
            "--group-size", "64", "--splits", "1", "2", "3", "--trace",
            "--repeats", "1"]  # fmt: skip
    result = _load("benchmark_linear").main(argv)
    captured = capsys.readouterr()
    assert "splits=3: cannot run (splits=3 must divide the 4 k-steps)" in captured.err
    runs = [(r["implementation"], r["splits"]) for r in result["rows"]]
    assert runs == [("mgpu_interpret", 1), ("mgpu_interpret", 2), ("xla", None)]
    assert all(r["trace_us"] > 0 for r in result["rows"])
    assert "traced us" in captured.out


def test_benchmark_linear_gated_rows(capsys):
    """A gated shape ([gate; up] rows, silu(gate) * up) runs on the kernel and on the bf16 dot;
    a call writes N/2 outputs per row."""
    argv = ["--shapes", "tiny_gated", "--implementations", "mgpu_interpret", "bf16",
            "--m", "2", "--repeats", "1"]  # fmt: skip
    result = _load("benchmark_linear").main(argv)
    rows = {r["implementation"]: r for r in result["rows"]}
    assert sorted(rows) == ["bf16", "mgpu_interpret"]
    n, k, m = 128, 128, 2
    assert rows["bf16"]["bytes"] == n * k * 2 + m * k * 2 + m * (n // 2) * 2


# ---- profile.py -------------------------------------------------------------------------------


def _trace(*kernels, host=()):
    """A Perfetto trace as JAX writes it: GPU kernels (name, ts, dur) on /device:GPU:0, host
    events on /host:CPU."""
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
    ]
    x = [{"ph": "X", "pid": 7, "tid": 3, "name": n, "ts": t, "dur": d} for n, t, d in kernels]
    h = [{"ph": "X", "pid": 1, "tid": 2, "name": n, "ts": t, "dur": d, "args": {"hlo_op": n}}
         for n, t, d in host]  # fmt: skip
    return {"traceEvents": meta + h[::-1] + x[::-1]}


def test_profile_summary():
    """Two calls of [gemm 0-10, sum 12-13] and [gemm 20-30, sum 31-32, 31.5-33 overlapping]:
    per call span 16.5, busy (the union) 10 + 1 + 10 + 2 = 23 / 2, the idle gaps by the kernel
    that ends them, host events ignored where the trace has GPU kernels."""
    profile = _load("profile")
    trace = _trace(
        ("gemm", 0.0, 10.0), ("sum", 12.0, 1.0), ("gemm", 20.0, 10.0), ("sum", 31.0, 1.0),
        ("sum", 31.5, 1.5), host=[("fusion", -5.0, 50.0)],
    )  # fmt: skip
    kernels = profile.device_kernels(trace)
    assert [k["name"] for k in kernels] == ["gemm", "sum", "gemm", "sum", "sum"]
    s = profile.summarize(kernels, calls=2)
    assert s["span_us"] == pytest.approx(33.0 / 2)
    assert s["busy_us"] == pytest.approx(23.0 / 2)
    assert s["idle_us"] == pytest.approx(10.0 / 2)
    assert s["kernels_per_call"] == 2.5
    by_name = {r["name"]: r for r in s["kernels"]}
    assert by_name["gemm"]["total_us_per_call"] == pytest.approx(10.0)
    assert by_name["sum"]["per_call"] == 1.5
    assert by_name["sum"]["median_us"] == pytest.approx(1.0)
    # the idle gaps each name's launches end (13-20 before the second gemm; 10-12 and 30-31
    # before sums): they add up to the idle time
    assert by_name["gemm"]["idle_before_us_per_call"] == pytest.approx(7.0 / 2)
    assert by_name["sum"]["idle_before_us_per_call"] == pytest.approx(3.0 / 2)
    with pytest.raises(ValueError, match="no kernel events"):
        profile.summarize([], calls=1)


def test_profile_reads_the_cpu_runtime_ops_without_a_gpu():
    """A trace with no GPU process: the host events that name an HLO op are the kernels."""
    trace = _trace(host=[("fusion", 3.0, 2.0), ("while", 1.0, 1.0)])
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("pid") != 7]
    trace["traceEvents"].append({"ph": "X", "pid": 1, "tid": 2, "name": "PjitFunction",
                                 "ts": 0.0, "dur": 9.0})  # fmt: skip
    kernels = _load("profile").device_kernels(trace)
    assert [(k["name"], k["ts"]) for k in kernels] == [("while", 1.0), ("fusion", 3.0)]


def test_profile_reads_registers_and_spills():
    """ptxas -v's resource lines: the registers line and the indented spill line; not others."""
    lines = _load("profile").ptxas_report(
        "ptxas info    : Compiling entry function 'mosaic_gpu_kernel' for 'sm_90a'\n"
        "ptxas info    : Function properties for mosaic_gpu_kernel\n"
        "    8 bytes stack frame, 24 bytes spill stores, 24 bytes spill loads\n"
        "ptxas info    : Used 232 registers, used 1 barriers, 16 bytes smem\n"
    )
    assert lines == [
        "8 bytes stack frame, 24 bytes spill stores, 24 bytes spill loads",
        "ptxas info    : Used 232 registers, used 1 barriers, 16 bytes smem",
    ]


@pytest.mark.parametrize("run", ["step", "loop"])
def test_profile_tiny(tmp_path, capsys, run):
    out_json = tmp_path / "profile.json"
    argv = ["--implementations", "xla", "--m", "2", "--run", run, "--ptxas", "--top", "3",
            "--json", str(out_json)]  # fmt: skip
    assert _load("profile").main(argv) == 0
    [record] = json.loads(out_json.read_text())["runs"]
    assert (record["implementation"], record["M"], record["run"]) == ("xla", 2, run)
    assert record["calls"] == 2 and record["kernels_per_call"] > 0
    assert 0 < record["busy_us"] <= record["span_us"] + 1e-6
    assert record["ptxas"] == []  # no Mosaic GPU kernel compiled
    out = capsys.readouterr().out
    assert "M=2     xla" in out and "ptxas: no report" in out
    assert "MOSAIC_GPU_DUMP_PTXAS" not in os.environ


# ---- profile_decode.py ------------------------------------------------------------------------


def test_profile_decode_takes_the_difference_per_step():
    """Kernels of the prefill alone and of the prefill + 2 steps: per name, (after - before) / 2;
    names only in the prefill, or launched as often in both, are not the step's."""
    k = lambda name, dur: dict(name=name, ts=0.0, dur=dur)  # noqa: E731
    base = [k("attn", 5.0), k("gemm", 3.0), k("embed", 1.0)]
    more = base + [k("gemm", 2.0), k("gemm", 2.5), k("sample", 0.5), k("sample", 0.5)]
    rows = _load("profile_decode").per_step(base, more, steps=2)
    assert rows == [
        dict(name="gemm", launches=1.0, us=pytest.approx(2.25)),
        dict(name="sample", launches=1.0, us=pytest.approx(0.5)),
    ]


def test_profile_decode_takes_one_loop_iteration():
    """The longer call's loop holds 1 + steps iterations of the same kernels in the same order:
    a step is their mean. The names of the other call's program do not enter (here "f.7" is a
    different kernel in each program: a per-name difference would count it)."""
    k = lambda name, dur: dict(name=name, ts=0.0, dur=dur)  # noqa: E731
    prefill = [k("f.7", 9.0), k("gemm", 3.0)]
    loop = lambda n: [k("f.1", 1.0 + i) if j == 0 else k("mosaic", 2.0)  # noqa: E731
                      for i in range(n) for j in range(3)]  # fmt: skip
    base = prefill + [k("f.7", 4.0)] + loop(1) + [k("out", 0.5)]
    more = prefill + [k("f.2", 4.0)] + loop(3) + [k("out", 0.5)]
    module = _load("profile_decode")
    rows = module.loop_step(base, more, steps=2)
    assert rows == [
        dict(name="mosaic", launches=2.0, us=pytest.approx(4.0)),
        dict(name="f.1", launches=1.0, us=pytest.approx(2.0)),  # (1 + 2 + 3) / 3
    ]
    # In launch order: each position's mean over the 3 iterations.
    assert module.launch_order(module.loop_iterations(base, more, steps=2)) == [
        dict(name="f.1", us=pytest.approx(2.0)), dict(name="mosaic", us=2.0),
        dict(name="mosaic", us=2.0),
    ]  # fmt: skip
    # Copies come and go between iterations: left out, the loop is found the same.
    copied = more[:5] + [k("memcpy32_post", 1.0)] + more[5:9] + [k("Memset", 1.0)] + more[9:]
    assert module.loop_step(base + [k("memcpy32_post", 1.0)], copied, steps=2) == rows
    # Launches that do not split into equal repeating iterations: no loop step.
    assert module.loop_step(base, more[:-2] + [k("x", 1.0), k("out", 0.5)], steps=2) is None
    assert module.loop_step(base, more + [k("extra", 1.0)], steps=2) is None


def test_profile_decode_cuts_differing_iterations_at_an_anchor():
    """Iterations whose launches differ (one launches an extra kernel: no equal repeating
    iterations) are cut at the longest kernel launched once more per step than in the shorter
    call (the lm_head's GEMM; its prefill launch, longer, is not counted): a step is the mean of
    the last `steps` iterations, and the launch order that of the median-length one."""
    k = lambda name, dur: dict(name=name, ts=0.0, dur=dur)  # noqa: E731
    step = [k("f.1", 1.0), k("mosaic", 2.0), k("mosaic", 9.0)]  # the last: the lm_head
    prefill = [k("f.7", 3.0), k("mosaic", 12.0)]
    base = prefill + step + [k("out", 0.5)]
    more = prefill + step + step[:2] + [k("x", 1.0)] + step[2:] + step + [k("out", 0.5)]
    module = _load("profile_decode")
    assert module.loop_iterations(base, more, steps=2) is None
    iterations = module.anchored_iterations(base, more, steps=2)
    assert [[q["name"] for q in it] for it in iterations] == [
        ["f.1", "mosaic", "x", "mosaic"], ["f.1", "mosaic", "mosaic"],
    ]  # fmt: skip
    assert module.per_name(iterations) == [
        dict(name="mosaic", launches=2.0, us=pytest.approx(11.0)),
        dict(name="f.1", launches=1.0, us=pytest.approx(1.0)),
        dict(name="x", launches=0.5, us=pytest.approx(0.5)),
    ]
    assert [r["name"] for r in module.launch_order(iterations)] == ["f.1", "mosaic", "x", "mosaic"]
    # Any kernel launched once more per step is an anchor (here f.1 where the lm_head is not);
    # none: no iterations.
    cut = module.anchored_iterations(base, more[:-1] + [k("mosaic", 9.0), k("out", 0.5)], steps=2)
    assert [q["name"] for q in cut[-1]][-1] == "f.1"
    assert module.anchored_iterations(base, more, steps=3) is None


def test_profile_decode_tiny(tmp_path, capsys):
    out_json = tmp_path / "decode.json"
    argv = ["--steps", "2", "--top", "3", "--json", str(out_json), "--batch-size", "2",
            "--order"]  # fmt: skip
    assert _load("profile_decode").main(argv) == 0
    record = json.loads(out_json.read_text())
    assert (record["batch_size"], record["steps"]) == (2, 2)
    assert record["kernel_us_per_step"] == pytest.approx(sum(r["us"] for r in record["kernels"]))
    assert record["weight_bytes_per_step"] > 0 and record["step_us"] > 0
    out = capsys.readouterr().out
    assert "2 decode steps traced" in out and "others)" in out
    if record["launch_order"] is None:  # the loop not found: said, and the per-name rows
        assert "launch order: no loop iteration found" in out
    else:  # an iteration's kernels, in order: the mean of equal iterations is the step's
        assert "one loop iteration in launch order" in out
        order_us = sum(r["us"] for r in record["launch_order"])
        if "cut at a long kernel" not in record["method"]:
            assert order_us == pytest.approx(record["kernel_us_per_step"])


def test_profile_decode_refuses_several_batch_sizes():
    with pytest.raises(SystemExit):
        _load("profile_decode").parse_args(["--batch-size", "1", "8"])


# ---- tune.py ----------------------------------------------------------------------------------


def test_tune_tiny(tmp_path, capsys):
    """The pallas table at M=1 of the tiny preset: both GEMMs' entries, written to --out, each a
    config the GEMM accepts for its problem; a progress bar per search on stderr."""
    out = tmp_path / "tuned.json"
    argv = ["--m", "1", "--repeats", "1", "--budget-s", "10", "--out", str(out)]
    entries = _load("tune").main(argv)
    printed = capsys.readouterr()
    for gemm in ("w13", "w2"):
        assert re.search(rf"pallas {gemm} M=1: \d+ configs.*best [\d.]+ us", printed.err)
    saved = json.loads(out.read_text())
    assert saved["tables"]["pallas"]["entries"] == entries["pallas"]
    assert len(entries["pallas"]) == 2  # w13 and w2
    rng = np.random.default_rng(0)
    for entry in entries["pallas"]:
        shape = entry["problem"]
        w = wj.random_quantized_experts(
            rng, (shape["E"], shape["N"], shape["K"]), bits=shape["bits"],
            group_size=shape["group_size"],
        )  # fmt: skip
        cfg = wj.BlockConfig(**entry["config"])
        assert wj.gemm_config(w, entry["M"], implementation="pallas_interpret", config=cfg) == cfg
    assert "wrote 2 entries" in printed.out


def test_tune_mgpu_int8_layer(tmp_path, capsys):
    """The mgpu table's search for int8 per-channel experts (the mgpu_int8 layout) at M=1: its
    configs timed on the problem keyed by bits 8 and the layer's group (K: per channel)."""
    trials = tmp_path / "trials.json"
    argv = ["--backends", "mgpu", "--bits", "8", "--group-size", "-1", "--no-zp", "--m", "1",
            "--repeats", "1", "--budget-s", "5", "--trials", str(trials),
            "--no-progress"]  # fmt: skip
    _load("tune").main(argv)
    (search,) = json.loads(trials.read_text())
    assert search["table"] == "mgpu" and search["gemm"] == "layer"
    assert search["problem"]["bits"] == 8 and search["tried"]
    assert re.search(r"mgpu layer +1 ", capsys.readouterr().out)


def test_tune_mgpu_w8a8_layer(tmp_path, monkeypatch):
    """--activation-quant int8_per_token: the mgpu table (the default then) searched on W8A8
    (int8 per-channel symmetric weights implied) at M=1, its winner checked against 'xla' and
    written under the key the layer's lookup builds for int8 rows. The layer without a config
    is reported 1000x slower here, so that the entry is written whatever the interpreter's
    timings."""
    tune = _load("tune")
    timed = tune._timed

    def default_loses(run, sets, *, what, **kwargs):
        t = timed(run, sets, what=what, **kwargs)
        return t * 1e3 if t is not None and what == "the layer without a config" else t

    monkeypatch.setattr(tune, "_timed", default_loses)
    out = tmp_path / "tuned.json"
    argv = ["--activation-quant", "int8_per_token", "--m", "1", "--repeats", "1",
            "--budget-s", "5", "--out", str(out), "--no-progress"]  # fmt: skip
    entries = tune.main(argv)
    (entry,) = entries["mgpu"]
    assert json.loads(out.read_text())["tables"]["mgpu"]["entries"] == [entry]
    e, top_k, h, i, _ = tune.benchmark.PRESETS["tiny"]
    scheme = dict(bits=8, group_size=-1, has_zeros=False)
    w13 = wj.random_quantized_experts(jax.random.key(0), (e, 2 * i, h), **scheme)
    w2 = wj.random_quantized_experts(jax.random.key(0), (e, h, i), **scheme)
    shape = mgpu_config.LayerShape.of_layer(top_k, e, w13, w2, int8_rows=True)
    assert entry["problem"] == shape.table_problem()
    assert entry["problem"]["activations"] == "int8" and entry["M"] == top_k
    wj.MgpuConfig(**entry["config"])


def test_tune_mgpu_gemm_linear(tmp_path, monkeypatch):
    """The mgpu_gemm table at M=1: a tiny gated linear's search from the config it runs today,
    its winner checked against 'xla' and written under the problem the GEMM's lookup builds
    (GemmShape.table_problem, one expert) at M = its rows. Today's config is reported 1000 s
    slower here, so that the entry is written whatever the interpreter's timings."""
    from pallas_kernels.mgpu.grouped_matmul import linear_config

    tune = _load("tune")
    n, k, activation = tune.benchmark_linear.TINY_SHAPES["tiny_gated"]
    group = tune.benchmark.PRESETS["tiny"][4]
    shape = GemmShape(m=1, n=n, k=k, num_experts=1, bits=4, group=group, group_size=group)
    today = linear_config(shape)
    timed = tune._timed_step

    def today_loses(fn, sets, *, what, **kwargs):
        t = timed(fn, sets, what=what, **kwargs)  # noise on a CPU
        return t + 1e3 if t is not None and what == str(today) else t

    monkeypatch.setattr(tune, "_timed_step", today_loses)
    out = tmp_path / "tuned.json"
    # A budget for its 3 candidates on a loaded CPU (at 5 s a busy machine ran only today's).
    argv = ["--backends", "mgpu_gemm", "--linears", "tiny_gated", "--m", "1", "--repeats", "1",
            "--budget-s", "60", "--out", str(out), "--no-progress"]  # fmt: skip
    entries = tune.main(argv)
    (entry,) = entries["mgpu_gemm"]
    assert json.loads(out.read_text())["tables"]["mgpu_gemm"]["entries"] == [entry]
    assert entry["problem"] == shape.table_problem() and entry["M"] == 1
    assert entry["config"] != dataclasses.asdict(today)
    assert entry["microseconds"] < entry["default_microseconds"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--backends", "pallas", "mgpu"], "tunes the mgpu table only"),
        (["--bits", "4"], "(--bits 8), got --bits 4"),
        (["--group-size", "128"], "(--group-size -1), got --group-size 128"),
    ],
)
def test_tune_w8a8_refuses_other_tables_and_weights(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        _load("tune").main(["--activation-quant", "int8_per_token", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_tune_bar_counts_every_config_timed():
    """with_bar: one step per config timed (failures too), the best time so far beside it;
    a disabled bar prints nothing."""
    import io

    from tqdm import tqdm

    tune = _load("tune")
    times = {"a": 3e-6, "b": None, "c": 1e-6, "d": 2e-6}
    stream = io.StringIO()
    with tqdm(desc="search", unit=" configs", file=stream) as bar:
        timed = tune.with_bar(times.get, bar)
        assert [timed(c) for c in times] == list(times.values())
        assert bar.n == 4 and bar.postfix == "best 1.0 us"
    assert "search: 4 configs" in stream.getvalue()
    stream = io.StringIO()
    with tqdm(file=stream, disable=True) as bar:
        tune.with_bar(times.get, bar)("a")
    assert stream.getvalue() == ""


# ---- full_deepseek_v3.py ----------------------------------------------------------------------


def test_full_deepseek_v3_dry_run_on_cpu_devices(tmp_path):
    """The script end to end at tiny size on 4 fake CPU devices (its own process: the device
    count is fixed when JAX starts)."""
    out = tmp_path / "full.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    argv = ["--preset", "tiny", "--cpu-devices", "4", "--mesh", "expert=2", "--batch-sizes", "2",
            "--max-new-tokens", "2",
            "--expert-layout", "mgpu_int4",  # converted per expert shard; the CPU's 'xla' reads it
            "--json", str(out)]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "full_deepseek_v3.py"), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["devices"] == 2 and "expert=2" in result["mesh"]
    assert result["expert_layout"] == "mgpu_int4"
    # auto: no kernel runs on a CPU unless named; kv_b_proj's 3 run no GEMM (not counted)
    assert result["linears"] == "21 on 'xla'"
    assert [r["batch"] for r in result["rows"]] == [2]
    for r in result["rows"]:
        assert r["decode_tokens_per_s"] > 0
        lo, hi = r["bandwidth_bound_seconds"]
        assert 0 < lo <= hi
    assert result["routed_expert_bytes_per_expert_all_layers"] > 0


# ---- flags of every script ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, argv, flag, says",
    [
        ("generate", ["--full-width-layers", "-1"], "--full-width-layers", "-1 must be >= 1"),
        ("generate", ["--batch-size", "0"], "--batch-size", "0 must be >= 1"),
        ("generate", ["--batch-size", "2", "0"], "--batch-size", "0 must be >= 1"),
        ("generate", ["--max-new-tokens", "1.5"], "--max-new-tokens", "'1.5' is not an integer"),
        ("generate", ["--temperature", "-0.5"], "--temperature", "-0.5 must be >= 0"),
        ("generate", ["--temperature", "nan"], "--temperature", "'nan' is not a finite number"),
        ("generate", ["--top-p", "0"], "--top-p", "0.0 must be in (0, 1]"),
        ("generate", ["--top-p", "1.5"], "--top-p", "1.5 must be in (0, 1]"),
        ("generate", ["--eos-id", "-3"], "--eos-id", "-3 must be >= 0"),
        ("generate", ["--seed", "-1"], "--seed", "-1 must be >= 0"),
        ("generate", ["--preset", "deepseek-v3", "--layers", "0"], "--layers", "0 must be >= 1"),
        ("generate", ["--mtp", "4"], "--mtp", "invalid choice: 4"),
        ("generate", ["--num-processes", "2", "--process-id", "2"], "--process-id", "not in"),
        ("benchmark", ["--m", "0"], "--m", "0 must be >= 1"),
        ("benchmark", ["--group-size", "0"], "--group-size", "0 must be positive, or -1"),
        ("benchmark", ["--bits", "3"], "--bits", "invalid choice"),
        ("benchmark", ["--repeats", "0"], "--repeats", "0 must be >= 1"),
        ("benchmark", ["--warmup-s", "inf"], "--warmup-s", "'inf' is not a finite number"),
        ("benchmark_linear", ["--m", "-4"], "--m", "-4 must be >= 1"),
        ("benchmark_linear", ["--splits", "0"], "--splits", "0 must be >= 1"),
        ("tune", ["--budget-s", "0"], "--budget-s", "0.0 must be > 0"),
        ("profile", ["--calls", "1"], "--calls", "1 must be >= 2"),
        ("profile_decode", ["--steps", "0"], "--steps", "0 must be >= 1"),
        ("full_deepseek_v3", ["--layers", "0"], "--layers", "0 must be >= 1"),
    ],
)
def test_a_bad_flag_exits_naming_it(name, argv, flag, says, capsys):
    """A flag's value out of its range exits with status 2 and a message naming the flag and
    the value, before anything is built."""
    script = _load(name)
    parse = getattr(script, "parse_args", None) or script.main
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err or f"{flag} " in err, err
    assert says in err, err


def test_every_flag_has_help():
    """Each flag of each script says what it does in --help (no bare flags)."""
    for path in sorted(EXAMPLES.glob("*.py")):
        source = path.read_text()
        for call in re.findall(r"add_argument\(\s*\"--[^)]*?\)\n", source, flags=re.S):
            assert "help=" in call, f"{path.name}: {call.split(',')[0]} has no help text"
