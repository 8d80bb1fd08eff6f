"""Tests of backend selection: automatic choice, its log line, explicit names and fall-through,
for fused_moe, moe_align_block_size and the grouped GEMM; the public grouped GEMM and
preferred_layout."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from importlib import resources

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wna16_jax as wj
from pallas_kernels.pallas import fused_moe as pallas_moe
from wna16_jax import _backend_order, _dispatch
from wna16_jax import _configs as wj_configs


@pytest.fixture
def problem(rng):
    return helpers.random_moe_inputs(rng, T=3, H=64, I=32, E=4, k=2)


@pytest.fixture
def fresh_log(monkeypatch):
    """Forget which choices were already logged, for this test only."""
    monkeypatch.setattr(wj_configs, "_logged", set())


def _fake(name: str, reason: str | None, marker: float = 7.0) -> _dispatch.Backend:
    """A backend that refuses with `reason` (or runs, returning a constant `marker` output)."""

    def fused_moe(x, w13, w2, topk_weights, topk_ids, *, expert_map, activation, config):
        return jnp.full(x.shape, marker, x.dtype)

    return _dispatch.Backend(
        name=name,
        unsupported_reason=lambda problem: reason,
        fused_moe=fused_moe,
        align_unsupported_reason=lambda problem: reason,
        moe_align_block_size=_dispatch.XLA_BACKEND.moe_align_block_size,
    )


@pytest.fixture
def register(monkeypatch):
    """Registers fake backends for one test; monkeypatch removes them afterwards."""
    _dispatch.registered_backends()  # load the built-ins first, so teardown keeps them

    def add(*backends):
        for b in backends:
            monkeypatch.setitem(_dispatch._REGISTRY, b.name, b)

    return add


def _moe_problem(**changes) -> _dispatch.MoEProblem:
    base = dict(
        platform="cpu",
        num_tokens=3,
        hidden=64,
        intermediate=32,
        num_experts=4,
        num_global_experts=4,
        top_k=2,
        bits=4,
        group_size=32,
        w13_group=32,
        w2_group=32,
        has_zeros=True,
        dtype="bfloat16",
        activation="silu",
    )
    return _dispatch.MoEProblem(**(base | changes))


def _records(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "wna16_jax"]


def test_registered_backends_include_xla():
    names = wj.registered_backends()
    assert "xla" in names
    assert len(set(names)) == len(names)


def test_automatic_selection_on_cpu_logs_once(problem, caplog, fresh_log):
    if _dispatch.current_platform() != "cpu":
        pytest.skip(f"checks the CPU priority list; platform is {_dispatch.current_platform()}")
    caplog.set_level(logging.INFO, logger="wna16_jax")
    first = wj.fused_moe(*problem)
    second = wj.fused_moe(*problem)
    np.testing.assert_array_equal(np.asarray(first, np.float32), np.asarray(second, np.float32))
    want = "wna16_jax: fused_moe uses 'xla' (candidates: xla)"
    assert _records(caplog) == [want]
    info = [r for r in caplog.records if r.name == "wna16_jax"]
    assert info[0].levelno == logging.INFO


def test_automatic_selection_picks_xla_on_cpu():
    if _dispatch.current_platform() != "cpu":
        pytest.skip(f"checks the CPU priority list; platform is {_dispatch.current_platform()}")
    assert _dispatch.select_backend(_moe_problem(), None).name == "xla"
    align = _dispatch.AlignProblem(platform="cpu", num_slots=6, num_experts=4, block_m=16)
    assert _dispatch.select_backend(align, None).name == "xla"


def test_automatic_never_picks_interpret():
    for platform in ("cpu", "gpu", "cuda", "tpu"):
        assert "pallas_interpret" not in _dispatch.PRIORITY.get(
            platform, _dispatch.DEFAULT_PRIORITY
        )


def test_align_logs_its_own_line(caplog, fresh_log):
    caplog.set_level(logging.INFO, logger="wna16_jax")
    ids = jnp.asarray(np.array([[0, 1], [2, 3]], np.int32))
    wj.moe_align_block_size(ids, num_experts=4, block_m=16, implementation="xla")
    wj.moe_align_block_size(ids, num_experts=4, block_m=16, implementation="xla")
    assert _records(caplog) == ["wna16_jax: moe_align_block_size uses 'xla' (candidates: xla)"]


def test_unknown_name_lists_registered(problem):
    with pytest.raises(ValueError) as err:
        wj.fused_moe(*problem, implementation="no_such_backend")
    msg = str(err.value)
    assert "'no_such_backend'" in msg
    for name in wj.registered_backends():
        assert repr(name) in msg, msg
    with pytest.raises(ValueError, match="no_such_backend"):
        wj.fused_moe(*problem, implementation=["xla", "no_such_backend"][::-1])


def test_empty_sequence_rejected(problem):
    with pytest.raises(ValueError, match="empty sequence"):
        wj.fused_moe(*problem, implementation=[])


def test_explicit_backend_that_cannot_run(problem, register):
    reason = "needs an H100-class GPU, this is a toaster"
    register(_fake("fake_refuses", reason))
    with pytest.raises(NotImplementedError) as err:
        wj.fused_moe(*problem, implementation="fake_refuses")
    assert "'fake_refuses'" in str(err.value) and reason in str(err.value)
    with pytest.raises(NotImplementedError, match="toaster"):
        wj.moe_align_block_size(
            problem[4], num_experts=4, block_m=16, implementation="fake_refuses"
        )


def test_explicit_backend_that_can_run(problem, register):
    register(_fake("fake_runs", None, marker=3.0))
    out = wj.fused_moe(*problem, implementation="fake_runs")
    np.testing.assert_array_equal(np.asarray(out, np.float32), 3.0)


def test_sequence_falls_through_to_first_that_works(problem, register, caplog, fresh_log):
    register(_fake("fake_a", "reason a"), _fake("fake_b", None, 2.0), _fake("fake_c", None, 5.0))
    caplog.set_level(logging.INFO, logger="wna16_jax")
    out = wj.fused_moe(*problem, implementation=("fake_a", "fake_b", "fake_c"))
    np.testing.assert_array_equal(np.asarray(out, np.float32), 2.0)
    assert _records(caplog) == [
        "wna16_jax: fused_moe uses 'fake_b' (candidates: fake_a, fake_b, fake_c)"
    ]
    out = wj.fused_moe(*problem, implementation=["fake_a", "xla"])
    ref = wj.fused_moe(*problem, implementation="xla")
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


def test_none_can_run_lists_every_reason(problem, register):
    register(_fake("fake_a", "reason number one"), _fake("fake_b", "reason number two"))
    with pytest.raises(NotImplementedError) as err:
        wj.fused_moe(*problem, implementation=["fake_a", "fake_b"])
    msg = str(err.value)
    for s in ("fake_a", "reason number one", "fake_b", "reason number two"):
        assert s in msg, msg


def test_automatic_falls_through_priority_list(problem, register, monkeypatch, caplog, fresh_log):
    platform = _dispatch.current_platform()
    register(_fake("fake_first", "not on this platform"))
    monkeypatch.setitem(_dispatch.PRIORITY, platform, ("fake_first", "xla"))
    caplog.set_level(logging.INFO, logger="wna16_jax")
    out = wj.fused_moe(*problem)
    ref = wj.fused_moe(*problem, implementation="xla")
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    assert "wna16_jax: fused_moe uses 'xla' (candidates: fake_first, xla)" in _records(caplog)


def test_automatic_none_can_run_lists_every_reason(problem, register, monkeypatch):
    platform = _dispatch.current_platform()
    register(_fake("fake_a", "first reason"), _fake("fake_b", "second reason"))
    monkeypatch.setitem(_dispatch.PRIORITY, platform, ("fake_a", "fake_b"))
    with pytest.raises(NotImplementedError) as err:
        wj.fused_moe(*problem)
    msg = str(err.value)
    for s in ("fake_a", "first reason", "fake_b", "second reason"):
        assert s in msg, msg


def test_xla_refuses_unknown_activation():
    reason = _dispatch.XLA_BACKEND.unsupported_reason(_moe_problem(activation="gelu"))
    assert reason is not None and "'gelu'" in reason
    assert _dispatch.XLA_BACKEND.unsupported_reason(_moe_problem()) is None


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    """A toy backend's own config class."""

    scale: float = 1.0


def test_register_backend_adds_a_toy_backend(problem, monkeypatch):
    """wj.register_backend: a backend defined outside the library (its own config class, the
    'xla' alignment) runs under its name through the public API, its config class is
    wj.<name>, and its layouts answer wj.backend_layout."""
    _dispatch.registered_backends()  # the built-ins first, so the teardown keeps them
    monkeypatch.setattr(_dispatch, "_REGISTRY", dict(_dispatch._REGISTRY))
    seen = []

    def fused_moe(x, w13, w2, topk_weights, topk_ids, *, expert_map, activation, config):
        seen.append(config)
        out = wj.fused_moe(x, w13, w2, topk_weights, topk_ids, implementation="xla")
        return out * jnp.asarray(config.scale, x.dtype)

    toy = wj.Backend(
        name="toy",
        unsupported_reason=lambda p: None if p.num_tokens <= 2 else "two tokens at most",
        fused_moe=fused_moe,
        align_unsupported_reason=lambda p: None,
        moe_align_block_size=_dispatch.XLA_BACKEND.moe_align_block_size,
        config_type=ToyConfig,
    )
    wj.register_backend(toy)
    assert "toy" in wj.registered_backends()
    x, w13, w2, tw, ti = (a[:2] if i in (0, 3, 4) else a for i, a in enumerate(problem))
    want = np.asarray(wj.fused_moe(x, w13, w2, tw, ti, implementation="xla"), np.float32)
    got = wj.fused_moe(x, w13, w2, tw, ti, implementation="toy", config=ToyConfig(2.0))
    np.testing.assert_array_equal(np.asarray(got, np.float32), 2 * want)
    assert seen == [ToyConfig(2.0)]
    assert wj.ToyConfig is ToyConfig
    assert wj.backend_layout("toy", 4) == "canonical"
    assert wj.backend_layout("mgpu_interpret", 8) == "mgpu_int8"
    with pytest.raises(NotImplementedError, match="'toy' cannot run this fused_moe: two tokens"):
        wj.fused_moe(*problem, implementation="toy")
    with pytest.raises(TypeError, match="register_backend takes a wna16_jax.Backend"):
        wj.register_backend("toy")


def test_fakes_do_not_leak():
    assert not any(name.startswith("fake_") for name in wj.registered_backends())


def test_problem_weight_schemes_default_to_w13():
    p = _moe_problem()
    assert p.weight_schemes() == (("w13", 4, 32, True), ("w2", 4, 32, True))
    assert p.gemm_input_dtype == "bfloat16"
    q = _moe_problem(w2_bits=8, w2_group_size=-1, w2_has_zeros=False, activation_quant="x")
    assert q.weight_schemes()[1] == ("w2", 8, -1, False) and q.gemm_input_dtype == "int8"


def test_activation_quant_reaches_only_backends_asked_for_it(problem, register):
    """WNA16 calls keep the old backend signature; W8A8 calls add activation_quant=."""
    seen = []

    def fused_moe(x, w13, w2, topk_weights, topk_ids, **kwargs):
        seen.append(kwargs)
        return jnp.zeros(x.shape, x.dtype)

    register(dataclasses.replace(_fake("fake_kw", None), fused_moe=fused_moe))
    wj.fused_moe(*problem, implementation="fake_kw")
    wj.fused_moe(*problem, implementation="fake_kw", activation_quant="int8_per_token")
    assert "activation_quant" not in seen[0]
    assert seen[1]["activation_quant"] == wj.ActivationQuant("int8_per_token")


def test_xla_runs_int8_activations_with_any_weights():
    for bits, has_zeros in ((4, True), (8, False)):
        p = _moe_problem(bits=bits, has_zeros=has_zeros, activation_quant="int8_per_token")
        assert _dispatch.XLA_BACKEND.unsupported_reason(p) is None


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU defaults and refusals")
def test_select_implementation_names_the_backend_without_running(rng):
    """select_implementation answers from shapes alone, the same choice fused_moe makes."""
    e, h, i, t, k = 4, 128, 128, 3, 2
    w13 = helpers.random_quantized_experts(rng, e, 2 * i, h, 4, 64, True, jnp.bfloat16)
    w2 = helpers.random_quantized_experts(rng, e, h, i, 4, 64, True, jnp.bfloat16)
    x = jax.ShapeDtypeStruct((t, h), jnp.bfloat16)
    tw = jax.ShapeDtypeStruct((t, k), jnp.float32)
    ids = jax.ShapeDtypeStruct((t, k), jnp.int32)
    assert wj.select_implementation(x, w13, w2, tw, ids) == "xla"  # CPU default
    assert wj.select_implementation(x, w13, w2, tw, ids, implementation="pallas_interpret") == (
        "pallas_interpret"
    )
    with pytest.raises(NotImplementedError, match="needs an NVIDIA GPU"):
        wj.select_implementation(x, w13, w2, tw, ids, implementation="pallas")
    with pytest.raises(ValueError, match="topk_weights shape"):
        wj.select_implementation(x, w13, w2, jax.ShapeDtypeStruct((t, 1), jnp.float32), ids)


# ---- the measured order (wna16_jax/_backend_order.py, data/backend_order/*.json) ------------


def _dsv3_tp1(**changes) -> _dispatch.MoEProblem:
    """DeepSeek-V3 TP=1 int4 g128 with zero points on a GPU: the H200 file's rule."""
    base = dict(
        platform="gpu", num_tokens=4096, hidden=7168, intermediate=2048, num_experts=256,
        num_global_experts=256, top_k=8, bits=4, group_size=128, w13_group=128, w2_group=128,
        has_zeros=True, dtype="bfloat16", activation="silu",
    )  # fmt: skip
    return _dispatch.MoEProblem(**(base | changes))


@pytest.fixture
def on_h200(monkeypatch):
    """Selection as on an H200: its measured-order file, and fake 'pallas'/'triton' that run."""
    _dispatch.registered_backends()
    monkeypatch.setattr(_dispatch._configs, "device_kind", lambda: "NVIDIA H200")
    for name in ("pallas", "triton"):
        monkeypatch.setitem(_dispatch._REGISTRY, name, _fake(name, None))


def test_h200_file_orders_triton_first_from_4096_tokens(on_h200):
    assert _dispatch.select_backend(_dsv3_tp1(num_tokens=4096), None).name == "triton"
    assert _dispatch.select_backend(_dsv3_tp1(num_tokens=8192), None).name == "triton"
    # Measured slower there (2048: 63.2 ms against 14.3 ms): the platform's priority.
    assert _dispatch.select_backend(_dsv3_tp1(num_tokens=2048), None).name == "pallas"


def test_measured_order_needs_the_exact_problem(on_h200):
    # Not measured: no zero points, an expert shard, the TP=8 slice, f16.
    for changes in (
        dict(has_zeros=False),
        dict(num_experts=128),
        dict(intermediate=256),
        dict(dtype="float16"),
    ):
        assert _dispatch.select_backend(_dsv3_tp1(**changes), None).name == "pallas", changes


def test_measured_order_skips_a_backend_that_cannot_run(on_h200, monkeypatch):
    monkeypatch.setitem(_dispatch._REGISTRY, "triton", _fake("triton", "jax_triton is missing"))
    assert _dispatch.select_backend(_dsv3_tp1(), None).name == "pallas"


def test_measured_order_leaves_explicit_names_and_other_devices_alone(on_h200, monkeypatch):
    assert _dispatch.select_backend(_dsv3_tp1(), "pallas").name == "pallas"
    monkeypatch.setattr(_dispatch._configs, "device_kind", lambda: "NVIDIA H100 80GB HBM3")
    assert _dispatch.select_backend(_dsv3_tp1(), None).name == "pallas"


def test_shipped_measured_order_files_are_valid():
    """Every rule names known MoEProblem fields and registered backends, and carries figures
    in which its first backend is the faster one at every measured T it covers."""
    fields = {f.name for f in dataclasses.fields(_dispatch.MoEProblem)}
    registered = set(_dispatch.registered_backends())
    folder = resources.files("wna16_jax").joinpath(_backend_order.BACKEND_ORDER_DIR)
    files = [f for f in folder.iterdir() if f.name.endswith(".json")]
    assert files
    for f in files:
        for rule in json.loads(f.read_text())["rules"]:
            assert set(rule["problem"]) <= fields, f.name
            assert set(rule["order"]) <= registered, f.name
            first = rule["order"][0]
            lo, hi = rule["min_tokens"] or 0, rule["max_tokens"] or float("inf")
            covered = {int(t): us for t, us in rule["measured_us"].items() if lo <= int(t) <= hi}
            assert covered, f"{f.name}: no figure behind the rule"
            for t, us in covered.items():
                assert us[first] == min(us.values()), (f.name, t, us)


def test_measured_order_falls_back_to_the_platform_order(on_h200, monkeypatch):
    """A measured order naming only backends that cannot run still ends in the platform's."""
    for name in ("triton", "pallas"):
        monkeypatch.setitem(_dispatch._REGISTRY, name, _fake(name, "cannot"))
    monkeypatch.setitem(_dispatch._REGISTRY, "mgpu", _fake("mgpu", "cannot"))
    assert _dispatch.select_backend(_dsv3_tp1(), None).name == "xla"
    # Weights in a kernel's layout do not match the rule (made for canonical weights).
    mgpu = dataclasses.replace(_fake("mgpu", None), layouts=("mgpu_int4",))
    monkeypatch.setitem(_dispatch._REGISTRY, "mgpu", mgpu)
    assert _dispatch.select_backend(_dsv3_tp1(layout="mgpu_int4"), None).name == "mgpu"


def test_selection_refuses_a_layout_the_backend_does_not_read(register):
    """Backend.layouts: a backend (registered ones included) never gets weights in a layout it
    does not declare; 'xla' reads every layout (it converts back)."""
    register(_fake("fake_canonical", None))
    kernel_layout = _moe_problem(layout="mgpu_int4")
    with pytest.raises(NotImplementedError, match="'mgpu_int4' layout, which this backend does"):
        _dispatch.select_backend(kernel_layout, "fake_canonical")
    assert _dispatch.select_backend(kernel_layout, "xla").name == "xla"
    assert _dispatch.select_backend(_moe_problem(), "fake_canonical").name == "fake_canonical"


# ---- the grouped GEMM (Backend.grouped_matmul, wj.grouped_matmul, wj.gemm_config) -----------


def _gemm_inputs(rng, *, e=4, n=64, k=256, t=5, top_k=2, group=128, dtype=jnp.bfloat16):
    """A GEMM whose k-tiles lie inside one group: exact products in every backend (a k-tile
    spanning groups rounds (q - z) * s to bf16 in the Pallas GEMM: tests/test_wna16_gemm.py)."""
    w = helpers.random_quantized_experts(rng, e, n, k, 4, group, True, dtype)
    a = jnp.asarray(rng.normal(size=(t, k)), dtype)
    _, ids = helpers.random_routing(rng, t, top_k, e)
    return a, w, jnp.asarray(ids)


def _gemm_problem(**changes) -> _dispatch.GemmProblem:
    shape = wj_configs.GemmShape(m=8, n=64, k=128, num_experts=4, bits=4, group=64, group_size=64)
    base = dict(platform="cpu", shape=shape, dtype="bfloat16", has_zeros=True)
    return _dispatch.GemmProblem(**(base | changes))


def test_grouped_matmul_selection_on_cpu_logs_once(rng, caplog, fresh_log):
    if _dispatch.current_platform() != "cpu":
        pytest.skip(f"checks the CPU priority list; platform is {_dispatch.current_platform()}")
    caplog.set_level(logging.INFO, logger="wna16_jax")
    assert _dispatch.select_backend(_gemm_problem(), None).name == "xla"
    _dispatch.select_backend(_gemm_problem(), None)
    assert _records(caplog) == ["wna16_jax: grouped_matmul uses 'xla' (candidates: xla)"]


@pytest.mark.parametrize(
    "w13_bits,w2_bits,hidden,holds",
    [
        (4, 4, 128, "mgpu_int4"),
        (8, 8, 128, "mgpu_int8"),
        # the reasons of the layouts that cannot hold the experts (the first weight each refuses)
        (4, 4, 96, "w13: the mgpu_int4 layout holds 64x64 tiles: N=128 and K=96 must be "
                   "multiples of 64; w13: the mgpu_int8 layout holds int8 weights, not int4"),
        (4, 8, 128, "w2: the mgpu_int4 layout holds int4 weights, not int8; "
                    "w13: the mgpu_int8 layout holds int8 weights, not int4"),
    ],
    ids=["int4", "int8", "H_not_in_tiles", "mixed_bits"],
)  # fmt: skip
def test_layout_reason_says_whether_the_experts_convert(rng, w13_bits, w2_bits, hidden, holds):
    """A backend that reads kernel layouts only, refusing canonical experts: where one of its
    layouts holds both weights, it names the conversion; where none does, each layout's
    reason, and that the experts run canonical on the backends that read it (no conversion
    advised that would fail)."""
    w13 = helpers.random_quantized_experts(rng, 2, 128, hidden, w13_bits, 32, True, jnp.bfloat16)
    w2 = helpers.random_quantized_experts(rng, 2, hidden, 64, w2_bits, 32, True, jnp.bfloat16)
    x = jax.ShapeDtypeStruct((1, hidden), jnp.bfloat16)
    tw, ids = jax.ShapeDtypeStruct((1, 2), jnp.float32), jax.ShapeDtypeStruct((1, 2), jnp.int32)
    with pytest.raises(NotImplementedError) as err:
        wj.select_implementation(x, w13, w2, tw, ids, implementation="mgpu_interpret")
    message = str(err.value)
    if holds.startswith("mgpu_int"):
        assert message.endswith(
            f"reads weights in the '{holds}' layout, not 'canonical' (convert once at load: "
            f"wna16_jax.layouts.to_kernel_layout(qw, '{holds}'))"
        )
        convert = functools.partial(wj.layouts.to_kernel_layout, layout=holds)
        jax.eval_shape(convert, w13)  # both convert
        jax.eval_shape(convert, w2)
    else:
        assert "convert" not in message, message
        assert message.endswith(
            f"reads weights only in the 'mgpu_int4' or 'mgpu_int8' layout, which cannot hold "
            f"these ({holds}): they stay in the canonical layout, which 'pallas', 'triton' "
            f"and 'xla' read"
        ), message
    names = ("mgpu_interpret", "xla")
    assert wj.select_implementation(x, w13, w2, tw, ids, implementation=names) == "xla"


def test_layout_reason_of_a_linear_no_layout_holds(rng):
    """A linear weight no mgpu layout tiles (N=40: kv_a_proj_with_mqa's in the tiny model):
    the reason names the tiles, not a conversion; the same weight converted is refused by
    to_kernel_layout with that reason."""
    w = helpers.random_quantized_experts(rng, 1, 40, 128, 4, 64, True, jnp.bfloat16)
    tiles = "the mgpu_int4 layout holds 64x64 tiles: N=40 and K=128 must be multiples of 64"
    with pytest.raises(NotImplementedError) as err:
        wj.linear.select_implementation(w, implementation="mgpu_interpret")
    assert f"({tiles}; the mgpu_int8 layout holds int8" in str(err.value)
    assert "convert" not in str(err.value)
    assert "they stay in the canonical layout, which 'pallas', " in str(err.value)
    with pytest.raises(ValueError, match=tiles):
        wj.layouts.to_kernel_layout(w, "mgpu_int4")


def test_grouped_matmul_refuses_backends_without_one(register):
    """A backend without a grouped GEMM is refused with that reason; the compiled kernels need
    a GPU; the interpreters run; the 'mgpu' GEMM reads its own layout only."""
    register(_fake("fake_no_gemm", None))
    with pytest.raises(NotImplementedError, match="has no grouped GEMM"):
        _dispatch.select_backend(_gemm_problem(), "fake_no_gemm")
    with pytest.raises(NotImplementedError, match="reads weights in the 'mgpu_int4' layout"):
        _dispatch.select_backend(_gemm_problem(), "mgpu_interpret")
    mgpu = _gemm_problem(layout="mgpu_int4")
    assert _dispatch.select_backend(mgpu, "mgpu_interpret").name == "mgpu_interpret"
    if _dispatch.current_platform() == "cpu":
        with pytest.raises(NotImplementedError, match="needs an NVIDIA GPU"):
            _dispatch.select_backend(mgpu, "mgpu")
    if _dispatch.current_platform() == "cpu":
        with pytest.raises(NotImplementedError, match="needs an NVIDIA GPU"):
            _dispatch.select_backend(_gemm_problem(), "pallas")
    assert _dispatch.select_backend(_gemm_problem(), "pallas_interpret").name == (
        "pallas_interpret"
    )
    # A kernel layout the backend does not read is refused as fused_moe's is.
    with pytest.raises(NotImplementedError, match="'mgpu_int4' layout"):
        _dispatch.select_backend(_gemm_problem(layout="mgpu_int4"), "pallas_interpret")


def test_grouped_matmul_shape_reasons():
    """The Pallas GEMM refuses shapes no config tiles (quoting the heuristic's problems) and
    activation dtypes it does not take."""
    gemm = _dispatch.get_backend("pallas_interpret").grouped_matmul
    assert gemm.unsupported_reason(_gemm_problem()) is None
    odd = _gemm_problem(shape=dataclasses.replace(_gemm_problem().shape, n=24))
    assert "no block config fits" in gemm.unsupported_reason(odd)
    assert "int8" in gemm.unsupported_reason(_gemm_problem(dtype="int8"))
    mgpu = _dispatch.get_backend("mgpu_interpret").grouped_matmul
    assert mgpu.unsupported_reason(_gemm_problem(layout="mgpu_int4")) is None
    assert "float16 is not bfloat16" in mgpu.unsupported_reason(_gemm_problem(dtype="float16"))
    narrow = dataclasses.replace(_gemm_problem().shape, group=32, group_size=32)
    assert mgpu.unsupported_reason(_gemm_problem(shape=narrow, layout="mgpu_int4")) is None
    narrower = dataclasses.replace(_gemm_problem().shape, group=8, group_size=8)
    assert "group size 8 neither is a multiple of 64" in mgpu.unsupported_reason(
        _gemm_problem(shape=narrower)
    )


@pytest.mark.parametrize(
    "implementation, n, act_order",
    [
        ("pallas_interpret", 64, False),
        ("xla", 64, False),
        ("mgpu_interpret", 64, False),
        ("mgpu_interpret", 128, False),
        ("pallas_interpret", 64, True),
        ("xla", 64, True),
        ("mgpu_interpret", 128, True),
    ],
)
@pytest.mark.parametrize("activation", [None, "silu"])
def test_public_grouped_matmul_matches_numpy(rng, implementation, n, act_order, activation):
    """wj.grouped_matmul on a routing from wj.moe_align_block_size at the config
    wj.gemm_config gives, with routed weights; with activation, silu(gate) * up times them
    (the 'mgpu' GEMM: weights in its layout; silu in its epilogue where a half of w's rows is
    whole tiles, n=128, else after it); act_order: w with an input permutation per expert."""
    a, w, ids = _gemm_inputs(rng, n=n)
    if act_order:
        w = helpers.with_random_perm(rng, w)
    t, top_k = ids.shape
    layout = "mgpu_int4" if implementation.startswith("mgpu") else "canonical"
    wk = wj.layouts.to_kernel_layout(w, layout)
    cfg = wj.gemm_config(wk, t * top_k, implementation=implementation)
    routing = wj.moe_align_block_size(ids, num_experts=4, block_m=cfg.block_m, implementation="xla")
    rw = jnp.asarray(rng.uniform(0.5, 1.5, size=t * top_k), jnp.float32)
    out = wj.grouped_matmul(
        a, wk, routing, rw, top_k=top_k, implementation=implementation, out_dtype=jnp.float32,
        activation=activation,
    )  # fmt: skip
    wd = helpers.numpy_dequantize(w)  # [E, N, K] float64
    rows = np.asarray(a, np.float64)[np.arange(t * top_k) // top_k]
    ref = np.einsum("sk,snk->sn", rows, wd[np.asarray(ids).reshape(-1)])
    if activation == "silu":
        gate, up = ref[:, : n // 2], ref[:, n // 2 :]
        ref = gate / (1 + np.exp(-gate)) * up
    ref = ref * np.asarray(rw, np.float64)[:, None]  # after the activation
    assert out.shape == ref.shape and out.dtype == jnp.float32
    helpers.assert_close(out, ref, jnp.bfloat16, f"{implementation} grouped_matmul")


def test_public_grouped_matmul_errors(rng):
    a, w, ids = _gemm_inputs(rng)
    routing = wj.moe_align_block_size(ids, num_experts=4, block_m=16, implementation="xla")
    run = functools.partial(wj.grouped_matmul, a, w, routing, top_k=2)
    with pytest.raises(ValueError, match="aligned with block_m=16 but the config has block_m=32"):
        run(config=wj.BlockConfig(block_m=32, block_k=64, unpack="tile"), implementation="xla")
    with pytest.raises(ValueError, match="split_k=3 does not divide"):
        run(config=wj.BlockConfig(block_k=64, split_k=3, unpack="tile"),
            implementation="pallas_interpret")  # fmt: skip
    with pytest.raises(ValueError, match="a has K=64 input features but w has K=256"):
        wj.grouped_matmul(a[:, :64], w, routing, top_k=2)
    with pytest.raises(ValueError, match=r"routed_weights must be \[R \* top_k\] = \[10\]"):
        run(jnp.ones(3), implementation="xla")
    with pytest.raises(ValueError, match="activation='gelu'"):
        run(activation="gelu")
    with pytest.raises(ValueError, match="unknown implementation 'nope'"):
        run(implementation="nope")


def test_gemm_config_is_the_backends(rng, monkeypatch):
    """wj.gemm_config: the caller's config checked, else the backend's resolution (the
    tuned table, then the heuristic); the Triton GEMM's never "fma"."""
    _, w, _ = _gemm_inputs(rng, e=256, n=512, k=512, group=128)
    shape = wj_configs.GemmShape.of_weights(w, m=8)
    want = wj_configs.resolve(pallas_moe.RULES, shape)[0]
    assert wj.gemm_config(w, 8, implementation="pallas_interpret") == want
    assert want.dot == "fma"  # decode: 8 slots over 256 experts
    triton = _dispatch.get_backend("triton").grouped_matmul
    cfg, source = triton.config(shape, None)
    assert cfg.dot == "mma" and source == "heuristic"
    with pytest.raises(ValueError, match="split_k=3"):
        wj.gemm_config(w, 8, implementation="pallas_interpret",
                       config=wj.BlockConfig(split_k=3))  # fmt: skip
    pytest.importorskip("triton", reason="the Triton GEMM's own rules import triton")
    with pytest.raises(ValueError, match="the Triton GEMM runs tensor-core dots only"):
        triton.config(shape, want)


# ---- preferred_layout -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "bits,group_size,dtype,want",
    [
        (4, 64, jnp.bfloat16, "mgpu_int4"),
        (4, 128, jnp.bfloat16, "mgpu_int4"),
        (4, 32, jnp.bfloat16, "mgpu_int4"),  # two groups per 64-wide k-tile
        (4, 8, jnp.bfloat16, "canonical"),  # fewer inputs than a bf16 wgmma takes
        (4, 64, jnp.float16, "canonical"),
        (8, 64, jnp.bfloat16, "mgpu_int8"),
        (8, 64, jnp.float16, "canonical"),
    ],
    ids=str,
)
def test_preferred_layout(rng, monkeypatch, bits, group_size, dtype, want):
    """The layout of the experts' bits (mgpu_int4, mgpu_int8) exactly where its backend takes
    them (the interpreter stands in for 'mgpu', which needs an sm_90 GPU), canonical elsewhere;
    mixed bits (no layout holds both) stay canonical."""
    w13 = helpers.random_quantized_experts(rng, 2, 256, 256, bits, group_size, True, jnp.bfloat16)
    w2 = helpers.random_quantized_experts(rng, 2, 256, 128, bits, group_size, True, jnp.bfloat16)
    if _dispatch.current_platform() != "gpu":
        assert wj.preferred_layout(w13, w2, dtype=dtype) == "canonical"
    preferred = (("mgpu_int4", "mgpu_interpret"), ("mgpu_int8", "mgpu_interpret"))
    monkeypatch.setattr(_dispatch, "preferred_layouts", lambda: preferred)
    assert wj.preferred_layout(w13, w2, dtype=dtype) == want
    other = helpers.random_quantized_experts(rng, 2, 256, 128, 12 - bits, 64, True, jnp.bfloat16)
    assert wj.preferred_layout(w13, other, dtype=dtype) == "canonical"
    with pytest.raises(ValueError, match="activation='gelu'"):
        wj.preferred_layout(w13, w2, dtype=dtype, activation="gelu")


@pytest.mark.parametrize(
    "bits,group_size,has_zp,dtype,want",
    [
        (8, -1, False, jnp.float32, "mgpu_int8"),  # int8 rows from any x dtype
        (8, -1, False, jnp.float16, "mgpu_int8"),
        (8, 128, False, jnp.float32, "mgpu_int8"),  # groups of whole k-tiles
        (8, -1, True, jnp.float32, "canonical"),  # zero points: not symmetric
        (4, 64, False, jnp.bfloat16, "canonical"),  # W8A8 needs int8 weights
    ],
    ids=str,
)
def test_preferred_layout_of_w8a8_experts(rng, monkeypatch, bits, group_size, has_zp, dtype, want):
    """With activation_quant the layout is the one whose backend runs the W8A8 problem (int8
    activations whatever x's dtype: an f32 or f16 model's W8A8 experts take mgpu_int8), as
    fused_moe would select it; without it, 16-bit activations (mgpu: bfloat16 only)."""
    w13 = helpers.random_quantized_experts(rng, 2, 256, 256, bits, group_size, has_zp, dtype)
    w2 = helpers.random_quantized_experts(rng, 2, 256, 128, bits, group_size, has_zp, dtype)
    aq = "int8_per_token"
    if _dispatch.current_platform() != "gpu":
        assert wj.preferred_layout(w13, w2, dtype=dtype, activation_quant=aq) == "canonical"
    preferred = (("mgpu_int4", "mgpu_interpret"), ("mgpu_int8", "mgpu_interpret"))
    monkeypatch.setattr(_dispatch, "preferred_layouts", lambda: preferred)
    assert wj.preferred_layout(w13, w2, dtype=dtype, activation_quant=aq) == want
    static = wj.ActivationQuant("int8_static", gemm1_scale=0.5, gemm2_scale=0.5)
    assert wj.preferred_layout(w13, w2, dtype=dtype, activation_quant=static) == want
    if dtype != jnp.bfloat16:  # 16-bit activations: the mgpu GEMM takes bfloat16 only
        assert wj.preferred_layout(w13, w2, dtype=dtype) == "canonical"
    if want != "canonical":  # what selection runs in that layout
        convert = functools.partial(wj.layouts.to_kernel_layout, layout=want)
        x = jax.ShapeDtypeStruct((1, 256), dtype)
        tw, ids = jax.ShapeDtypeStruct((1, 2), jnp.float32), jax.ShapeDtypeStruct((1, 2), jnp.int32)
        chosen = wj.select_implementation(
            x, convert(w13), convert(w2), tw, ids, activation_quant=aq,
            implementation=("mgpu_interpret", "xla"),
        )  # fmt: skip
        assert chosen == "mgpu_interpret"
    with pytest.raises(ValueError, match="activation_quant"):
        wj.preferred_layout(w13, w2, dtype=dtype, activation_quant="int4_per_token")


@pytest.mark.gpu
def test_preferred_layout_on_this_gpu(rng):
    """On an sm_90 GPU the preferred layout of int4 bf16 experts is mgpu_int4 (the 'mgpu'
    backend runs them); on other GPUs canonical."""
    if _dispatch.current_platform() != "gpu":
        pytest.skip("needs a GPU")
    w13 = helpers.random_quantized_experts(rng, 2, 256, 256, 4, 128, True, jnp.bfloat16)
    w2 = helpers.random_quantized_experts(rng, 2, 256, 128, 4, 128, True, jnp.bfloat16)
    sm90 = str(getattr(jax.devices()[0], "compute_capability", "")) == "9.0"
    want = "mgpu_int4" if sm90 else "canonical"
    assert wj.preferred_layout(w13, w2, dtype=jnp.bfloat16) == want


@pytest.mark.parametrize("has_zeros", [True, False])
def test_layout_conversion_holds_about_its_old_and_new_arrays(has_zeros):
    """Converting to a kernel layout and back is one compiled program whose temporaries stay a
    small fraction of the weight (run op by op, each step held a weight-sized array)."""
    from wna16_jax import _dispatch

    canonical = jax.eval_shape(
        lambda: wj.random_quantized_experts(
            jax.random.key(0), (16, 1024, 2048), bits=4, group_size=128, has_zeros=has_zeros
        )
    )
    layout = wj.backend_layout("mgpu_interpret", bits=4)
    kernel = jax.eval_shape(functools.partial(_dispatch._converted, layout=layout), canonical)
    assert kernel.layout == layout
    for src, dst in ((canonical, layout), (kernel, "canonical")):
        memory = _dispatch._converted.lower(src, layout=dst).compile().memory_analysis()
        assert memory.temp_size_in_bytes <= memory.output_size_in_bytes / 16, (dst, memory)
