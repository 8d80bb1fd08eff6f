"""Smoke tests of examples/benchmark.py, examples/tune.py and examples/mgpu_probe.py (tiny CPU
defaults; the probe in the Mosaic GPU interpreter).

examples/generate.py has its own smoke test in test_deepseek_v3_example.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import helpers
import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    return helpers.load_script(EXAMPLES / f"{name}.py", f"example_{name}", [EXAMPLES])


@pytest.mark.parametrize(
    "name", ["benchmark", "tune", "mgpu_probe", "mgpu_profile", "kernel_timeline"]
)
def test_help(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        _load(name).main(["--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_benchmark_tiny(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "roofline.png"
    result = _load("benchmark").main(
        [
            "--m",
            "1",
            "3",
            "--implementations",
            "pallas_interpret",
            "mgpu_interpret",
            "xla",
            "--stages",
            "--iters",
            "1",
            "--repeats",
            "1",
            "--sets",
            "2",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ]
    )
    table = capsys.readouterr().out
    assert "% copy" in table.replace("%copy", "% copy") and "stages:" in table
    saved = json.loads(out_json.read_text())
    assert saved == json.loads(json.dumps(result))
    rows = {(r["implementation"], r["M"]) for r in saved["rows"]}
    # mgpu_interpret: the weights converted to its layout once (it reads no other).
    impls = ("pallas_interpret", "mgpu_interpret", "xla")
    assert rows == {(i, m) for i in impls for m in (1, 3)}
    for r in saved["rows"]:
        assert r["seconds"] > 0 and r["weight_bytes"] > 0 and r["flops"] > 0
        if r["implementation"] == "pallas_interpret":
            # The heuristic's GEMM1 (split_k 1) computes silu(gate) * up in its epilogue.
            assert set(r["stages"]) == {"align", "gemm1", "gemm2", "reduction"}
    assert saved["copy_bytes_per_s"] > 0 and saved["matmul_flops_per_s"] > 0
    assert out_png.stat().st_size > 1000


@pytest.mark.parametrize("routing", ["uniform", "identical"])
def test_mgpu_probe_tiny_in_the_interpreter(tmp_path, capsys, routing):
    """The probe's rows on the tiny preset, the kernels in the Mosaic GPU interpreter."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    out_json = tmp_path / "mgpu.json"
    argv = ["--preset", "tiny", "--m", "3", "--interpret", "--iters", "1", "--repeats", "1",
            "--routing", routing]  # fmt: skip
    assert _load("mgpu_probe").main([*argv, "--json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert all(r["routing"] == routing for r in rows)
    whats = [r["what"] for r in rows]
    assert whats[0] == "pallas layer" and {"mgpu backend", "backend by routing"} <= set(whats)
    assert {"mgpu GEMM1", "mgpu GEMM2"} <= set(whats), whats
    assert all(r["seconds"] > 0 for r in rows if "seconds" in r)
    # Each row's work is what it timed: GEMM1 (2I x H) has twice GEMM2's (H x I), the layer both.
    work = {r["what"]: (r["weight_bytes"], r["flops"]) for r in rows}
    (b1, f1), (b2, f2) = work["mgpu GEMM1"], work["mgpu GEMM2"]
    assert f1 == 2 * f2 and work["mgpu backend"] == work["backend by routing"] == (b1 + b2, f1 + f2)
    assert b1 == pytest.approx(2 * b2, rel=0.05)


def test_chained_loop_unrolls_whole_passes():
    """make_loop(chain=True, unroll=N): N passes over the sets per iteration, the calls counted
    in whole iterations, each call's input the last call's output; unroll is refused below 1
    and without chain."""
    import jax.numpy as jnp

    bench = _load("benchmark")
    calls = []

    def fn(x, y):
        calls.append(None)  # once per traced call
        return x * 0.5 + y

    sets = [(jnp.ones(3), jnp.full(3, float(s))) for s in range(2)]
    run, n = bench.make_loop(fn, sets, iters=5, chain=True, unroll=3)
    assert n == 6 and len(calls) == 0  # ceil(5 / (2 sets x 3)) = 1 iteration of 6 calls
    assert float(run()) > 0 and len(calls) == 6  # traced once: 6 calls in the loop body
    with pytest.raises(ValueError, match="unroll"):
        bench.make_loop(fn, sets, iters=5, chain=True, unroll=0)
    with pytest.raises(ValueError, match="unroll"):
        bench.make_loop(fn, sets, iters=5, unroll=2)


def test_straight_run_calls_once_per_set_each_on_the_last_output():
    """make_straight: one call per set, written out (traced once, no loop), each call's first
    argument its set's plus 1e-30 x the previous output; fewer than 2 sets are refused."""
    import jax.numpy as jnp

    bench = _load("benchmark")
    calls = []

    def fn(w, x, y):
        calls.append(None)  # once per traced call
        return x * w + y

    rng = np.random.default_rng(0)
    sets = [tuple(rng.normal(size=(2, 3)).astype(np.float32)) for _ in range(3)]
    run, n = bench.make_straight(fn, sets, consts=(jnp.float32(0.5),))
    assert n == 3 and not calls
    got = float(run())
    assert len(calls) == 3
    out = sets[0][0].astype(np.float64)
    for x, y in sets:
        out = (x + out * 1e-30) * 0.5 + y
    np.testing.assert_allclose(got, out.sum(), rtol=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        bench.make_straight(fn, sets[:1])


def test_straight_run_links_each_call_to_the_last_output():
    """make_straight(link=...): each call takes link(its set, the previous output); every
    call's output is returned."""
    import jax.numpy as jnp

    bench = _load("benchmark")
    rng = np.random.default_rng(1)
    sets = [(rng.normal(size=3).astype(np.float32), rng.normal(size=3).astype(np.float32))
            for _ in range(3)]  # fmt: skip
    run, n = bench.make_straight(
        lambda w, x, y: x * w + y, sets, consts=(jnp.float32(0.5),),
        link=lambda args, out: (args[0], args[1] + out),
    )  # fmt: skip
    out = sets[0][0].astype(np.float64)
    for (x, y), call_out in zip(sets, run(), strict=True):
        out = x * 0.5 + (y + out)
        np.testing.assert_allclose(call_out, out, rtol=1e-5)
    assert n == 3


def test_gemm_link_keeps_the_experts_and_depends_on_the_output():
    """mgpu_probe's straight-run link for a GEMM: the block experts unchanged for a finite
    output, changed by a NaN (so the next call depends on the last's output)."""
    import jax.numpy as jnp

    link = _load("mgpu_probe")._after_last_gemm
    a, ex, used = jnp.ones((2, 3)), jnp.arange(4, dtype=jnp.int32), jnp.ones(4, jnp.int32)
    got = link((a, ex, used), jnp.full((2, 2), 3.0))
    assert got[0] is a and got[2] is used
    np.testing.assert_array_equal(got[1], ex)
    np.testing.assert_array_equal(link((a, ex, used), jnp.full((2, 2), jnp.nan))[1], ex + 1)


def test_time_straight_is_the_marginal_queued_step(monkeypatch):
    """time_straight: a positive time per call from runs queued at once (5 queued runs and one
    alone per repeat, after one warm-up run); fewer than 2 runs are refused."""
    import jax.numpy as jnp

    bench = _load("benchmark")
    runs = []
    make_straight = bench.make_straight

    def counting(*args, **kwargs):
        run, calls = make_straight(*args, **kwargs)
        return (lambda: runs.append(None) or run()), calls

    monkeypatch.setattr(bench, "make_straight", counting)
    sets = [(jnp.full(4, float(s)),) for s in range(3)]
    t = bench.time_straight(lambda x: x * 2.0, sets, repeats=2, runs=5)
    assert t > 0 and len(runs) == 1 + 2 * (1 + 5)
    with pytest.raises(ValueError, match="runs >= 2"):
        bench.time_straight(lambda x: x, sets, repeats=1, runs=1)


def test_benchmark_times_a_model_step(tmp_path, capsys):
    """benchmark.py --straight N: each row also has the step's time per call, and the table
    prints it."""
    out_json = tmp_path / "bench.json"
    argv = ["--m", "2", "--implementations", "xla", "--iters", "1", "--repeats", "1",
            "--straight", "3", "--json", str(out_json)]  # fmt: skip
    _load("benchmark").main(argv)
    assert "in a step of 3 calls" in capsys.readouterr().out
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["straight_calls"] == 3 and row["straight_seconds"] > 0
    assert row["straight_weight_bytes"] > 0
    with pytest.raises(SystemExit):
        _load("benchmark").main([*argv[:-2], "--straight", "1"])


def test_mgpu_probe_times_the_straight_run_in_the_interpreter(tmp_path):
    """--straight N: the backend, the default layer and its GEMMs alone with N calls written
    out, work per call as the loop's rows."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    out_json = tmp_path / "mgpu.json"
    argv = ["--preset", "tiny", "--m", "2", "--interpret", "--iters", "1", "--repeats", "1",
            "--straight", "2", "--json", str(out_json)]  # fmt: skip
    assert _load("mgpu_probe").main(argv) == 0
    rows = {r["what"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert {"backend straight x2", "mgpu straight x2"} <= set(rows)
    for what in ("backend straight x2", "mgpu straight x2"):
        assert rows[what]["seconds"] > 0
        assert rows[what]["flops"] == rows["mgpu backend"]["flops"]
    for what in ("mgpu GEMM1", "mgpu GEMM2"):
        assert rows[f"{what} straight x2"]["seconds"] > 0
        assert rows[f"{what} straight x2"]["flops"] == rows[what]["flops"]
    with pytest.raises(SystemExit):
        _load("mgpu_probe").main([*argv[:-2], "--straight", "1"])


def test_mgpu_probe_times_only_the_gemms(tmp_path):
    """--gemms-only: no layer row; GEMM1 and GEMM2 alone at the default and each --configs
    (--gemms-only 1: GEMM1 only)."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    out_json = tmp_path / "mgpu.json"
    argv = ["--preset", "tiny", "--m", "2", "--interpret", "--iters", "1", "--repeats", "1",
            "--gemms-only", "--configs", "default:splits=2", "--json", str(out_json)]  # fmt: skip
    assert _load("mgpu_probe").main(argv) == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert sorted(r["what"] for r in rows) == ["mgpu GEMM1"] * 2 + ["mgpu GEMM2"] * 2
    assert len({tuple(r["config"]) for r in rows}) == 2
    assert all(r["seconds"] > 0 for r in rows)
    argv[argv.index("--gemms-only") + 1 : argv.index("--gemms-only") + 1] = ["1"]
    assert _load("mgpu_probe").main(argv) == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["what"] for r in rows] == ["mgpu GEMM1"] * 2


def test_mgpu_probe_lowers_configs_without_a_gpu(capsys):
    """--lower-only: each GEMM of each config lowered for sm_90 from shapes alone; a config the
    layer cannot run (blocks of 12 rows: not whole wgmmas) is reported as FAILED and the exit
    code says so; "default:FIELD=VALUE" replaces fields of each M's default."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    probe = _load("mgpu_probe")
    argv = ["--preset", "tiny", "--m", "1", "--lower-only", "--configs", "default:down_stages=2"]
    assert probe.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count(" lowers (") == 4, out  # the default and the given config, both GEMMs
    assert "stages 2" in out
    assert probe.main([*argv, "default:block_m=12"]) == 1
    failed = [line for line in capsys.readouterr().out.splitlines() if "FAILED" in line]
    assert failed and all("12" in line for line in failed), failed
    with pytest.raises(SystemExit):
        probe.main(["--lower-only", "--configs", "default:no_such_field=1"])


def test_mgpu_probe_candidates_follow_the_rows_per_expert():
    probe = _load("mgpu_probe")
    assert {c.block_m for c in probe.candidates(0.03, 128)} == {8}  # M=1 of 256 experts, top-8
    assert {c.block_m for c in probe.candidates(64, 128)} == {16, 32, 64}  # 64 rows on 8 experts
    assert {c.block_m for c in probe.candidates(128, 128)} == {64, 128}
    # block_k divides the group, or a k-step spans two or four groups
    assert {c.block_k for c in probe.candidates(8, 64)} == {64, 128}
    assert {c.block_k for c in probe.candidates(0.03, 128)} == {128, 256, 512}


def test_tune_tiny(tmp_path, capsys):
    out = tmp_path / "tuned.json"
    entries = _load("tune").main(["--m", "1", "--repeats", "1", "--out", str(out)])
    table = json.loads(out.read_text())
    assert table["entries"] == entries and len(entries) == 2  # w13 and w2 of the tiny preset
    from wna16_jax import BlockConfig, _configs

    for entry in entries:
        cfg = BlockConfig(**entry["config"])
        shape = _configs.GemmShape(
            m=entry["M"],
            n=entry["N"],
            k=entry["K"],
            num_experts=entry["E"],
            bits=entry["bits"],
            group=entry["group_size"] if entry["group_size"] != -1 else entry["K"],
            group_size=entry["group_size"],
        )
        assert _configs.config_problems(cfg, shape) == []
    assert "wrote 2 entries" in capsys.readouterr().out


def test_full_deepseek_v3_dry_run_on_cpu_devices(tmp_path):
    """The issue-9 script end to end at tiny size on 4 fake CPU devices (its own process: the
    device count is fixed when JAX starts)."""
    import subprocess

    out = tmp_path / "full.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "full_deepseek_v3.py"),
            "--preset",
            "tiny",
            "--cpu-devices",
            "4",
            "--mesh",
            "expert=2",
            "--batch-sizes",
            "1",
            "2",
            "--max-new-tokens",
            "2",
            "--expert-layout",
            "mgpu_int4",  # converted per expert shard; the CPU's 'xla' reads it
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["devices"] == 2 and "expert=2" in result["mesh"]
    assert result["expert_layout"] == "mgpu_int4"
    assert [r["batch"] for r in result["rows"]] == [1, 2]
    for r in result["rows"]:
        assert r["decode_tokens_per_s"] > 0
        lo, hi = r["bandwidth_bound_seconds"]
        assert 0 < lo <= hi
    assert result["routed_expert_bytes_per_expert_all_layers"] > 0


def _warpgroup_trace(pid, tid, start):
    """One warpgroup's events: two k-steps (convert 1 us, wgmma 2, scale 1, then 1 us outside
    any region) and a 1 us store: a 10 us span."""
    regions = [("convert", 0, 1), ("wgmma", 1, 3), ("scale", 3, 4), ("convert", 5, 6),
               ("wgmma", 6, 8), ("scale", 8, 9), ("store", 9, 10)]  # fmt: skip
    events = []
    for name, b, e in regions:
        events.append(dict(name=name, ph="B", ts=start + b, pid=pid, tid=tid))
        events.append(dict(name=name, ph="E", ts=start + e, pid=pid, tid=tid))
    return events


def test_mgpu_profile_summarizes_a_trace():
    """Two warpgroups overlapping on SM 1 (the second starts 5 us later), one alone on SM 2."""
    events = (_warpgroup_trace(1, 1, 0.0) + _warpgroup_trace(1, 2, 5.0)
              + _warpgroup_trace(2, 3, 0.0))  # fmt: skip
    summary = _load("mgpu_profile").summarize_trace(events[::-1])  # any event order
    assert summary["warpgroups"] == 3 and summary["sms"] == 2
    assert summary["span_us_median"] == 10.0 and summary["steps_median"] == 2
    assert summary["step_us_median"] == 5.0
    assert summary["shares"] == pytest.approx(dict(convert=0.2, wgmma=0.4, scale=0.2, store=0.1))
    assert summary["outside_share"] == pytest.approx(0.1)
    # SM 1: 1, 2, then 1 resident over 5 us each; SM 2: 1 over 10 us.
    assert summary["resident_max"] == 2
    assert summary["resident_mean"] == pytest.approx((5 + 10 + 5 + 10) / 25)


def test_mgpu_profile_summarizes_the_stores_parts():
    """A warpgroup's "program" span (10 us) holding two store copies, each a 1 us "store_reuse"
    and a 2 us "store_smem", then a 1 us "store_wait": without "store", its parts count as
    regions (outside: 10 - 7 = 3 us) and each region's mean time is per occurrence."""
    regions = [("program", 0, 10), ("store_reuse", 2, 3), ("store_smem", 3, 5),
               ("store_reuse", 5, 6), ("store_smem", 6, 8), ("store_wait", 8, 9)]  # fmt: skip
    events = []
    for name, b, e in regions:
        events += [dict(name=name, ph="B", ts=b, pid=1, tid=1),
                   dict(name=name, ph="E", ts=e, pid=1, tid=1)]  # fmt: skip
    summary = _load("mgpu_profile").summarize_trace(events)
    assert summary["span_us_median"] == 10.0 and summary["step_us_median"] is None
    assert summary["outside_share"] == pytest.approx(0.3)
    assert summary["region_us_mean"] == pytest.approx(
        dict(program=10.0, store_reuse=1.0, store_smem=2.0, store_wait=1.0)
    )


def test_mgpu_profile_reads_registers_and_spills(tmp_path):
    """ptxas -v's resource lines: the registers line and the indented spill line; not others."""
    log = tmp_path / "ptxas.log"
    log.write_text(
        "ptxas info    : Compiling entry function 'mosaic_gpu_kernel' for 'sm_90a'\n"
        "ptxas info    : Function properties for mosaic_gpu_kernel\n"
        "    8 bytes stack frame, 24 bytes spill stores, 24 bytes spill loads\n"
        "ptxas info    : Used 232 registers, used 1 barriers, 16 bytes smem\n"
    )
    lines = _load("mgpu_profile").ptxas_report(str(log))
    assert lines == [
        "8 bytes stack frame, 24 bytes spill stores, 24 bytes spill loads",
        "ptxas info    : Used 232 registers, used 1 barriers, 16 bytes smem",
    ]


def test_mgpu_profile_runs_in_the_interpreter(tmp_path, capsys):
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    argv = ["--preset", "tiny", "--m", "1", "--interpret", "--out", str(tmp_path)]
    assert _load("mgpu_profile").main(argv) == 0
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert [r["gemm"] for r in rows] == ["GEMM1", "GEMM2"]
    assert "no trace (interpreter)" in capsys.readouterr().out


def _trace(*kernels, host=()):
    """A Perfetto trace as JAX writes it: GPU kernels (name, ts, dur) on /device:GPU:0, host
    events on /host:CPU."""
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
    ]
    x = [{"ph": "X", "pid": 7, "tid": 3, "name": n, "ts": t, "dur": d} for n, t, d in kernels]
    h = [{"ph": "X", "pid": 1, "tid": 2, "name": n, "ts": t, "dur": d} for n, t, d in host]
    return {"traceEvents": meta + h[::-1] + x[::-1]}


def test_kernel_timeline_summary():
    """Two calls of [gemm 0-10, sum 12-13] and [gemm 20-30, sum 31-32, 31.5-33 overlapping]:
    per call span 16.5, busy (the union) 10 + 1 + 10 + 2 = 23 / 2, the idle gaps by the kernel
    that ends them, host events ignored."""
    timeline = _load("kernel_timeline")
    trace = _trace(
        ("gemm", 0.0, 10.0), ("sum", 12.0, 1.0), ("gemm", 20.0, 10.0), ("sum", 31.0, 1.0),
        ("sum", 31.5, 1.5), host=[("PjitFunction", -5.0, 50.0)],
    )  # fmt: skip
    kernels = timeline.device_kernels(trace)
    assert [k["name"] for k in kernels] == ["gemm", "sum", "gemm", "sum", "sum"]
    s = timeline.summarize(kernels, calls=2)
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
    with pytest.raises(ValueError, match="no GPU kernel"):
        timeline.summarize(timeline.device_kernels(_trace(host=[("x", 0.0, 1.0)])), calls=1)


def test_time_loop_warms_up_for_the_seconds_asked(monkeypatch):
    """time_loop(warmup_s=S) runs the loop for S seconds before the timed repeats (the GPU's
    clock settles under a sustained load), and times the same calls as without it."""
    import jax.numpy as jnp

    bench = _load("benchmark")
    runs = []
    make_loop = bench.make_loop

    def counting_make_loop(*args, **kwargs):
        run, calls = make_loop(*args, **kwargs)
        return (lambda: runs.append(1) or run()), calls

    monkeypatch.setattr(bench, "make_loop", counting_make_loop)
    sets = [(jnp.arange(4.0),), (jnp.ones(4),)]
    t, _ = bench.time_loop(lambda x: x * 2, sets, iters=3, repeats=2, host=False)
    assert t > 0 and len(runs) == 1 + 2  # a warm-up run, then the repeats
    runs.clear()
    start = time.perf_counter()
    t, _ = bench.time_loop(lambda x: x * 2, sets, iters=3, repeats=2, host=False, warmup_s=0.3)
    assert time.perf_counter() - start >= 0.3
    assert t > 0 and len(runs) > 1 + 2 + 1


def test_make_loop_chain_feeds_each_output_to_the_next_call():
    """benchmark.make_loop(chain=True): the sets in turn, each call's first argument its set's
    plus 1e-30 x the last output; 5 calls asked of 2 sets run 3 rounds (6 calls), checked
    against numpy (the last call's output summed)."""
    import numpy as np

    bench = _load("benchmark")
    rng = np.random.default_rng(0)
    sets = [(rng.normal(size=(3,)).astype(np.float32), np.float32(a)) for a in (0.5, -1.25)]
    run, calls = bench.make_loop(
        lambda c, x, a: x * a + c, sets, iters=5, consts=(0.75,), chain=True
    )
    assert calls == 6
    out = sets[0][0].astype(np.float64)
    for _ in range(3):
        for x, a in sets:
            out = (x + 1e-30 * out) * a + 0.75
    np.testing.assert_allclose(float(run()), out.sum(), rtol=1e-5)
    run, calls = bench.make_loop(lambda c, x, a: x * a + c, sets, iters=5, consts=(0.75,))
    assert calls == 5
    want = sum((s[0].astype(np.float64) * s[1] + 0.75).sum() for s in (sets * 3)[:5]) * 1e-30
    np.testing.assert_allclose(float(run()), want, rtol=1e-5)
