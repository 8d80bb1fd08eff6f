"""Tests of the 'triton' backend (pallas_kernels.triton: Triton kernels through jax_triton).

Kernel outputs are compared with `wna16_jax._reference` on the *same* quantized weights (the
GEMM with `grouped_matmul`, the align with `moe_align_block_size`, the layer with the 'xla'
backend), so quantization error never hides inside a tolerance. Inputs are random and fresh per
case (the `rng` fixture seeds from the test id).

How to run:
    CPU without triton (CI): the backend's registration, its unsupported_reason texts, and that
        selection never picks it on CPU; everything else skips with a reason.
    CPU with triton (`pip install triton==3.6.0`; no GPU, no jax_triton needed): also every
        kernel compiles for sm_90 (`triton.compile` with GPUTarget("cuda", 90, 32)), and the
        kernels run in Triton's interpreter (interpret=True) on small cases against the
        references, under jit and inside shard_map.
    GPU with jax-triton installed: `pytest -m gpu tests/test_triton_backend.py` runs the kernels
        compiled: the GEMM grid (int4/int8, G 32/64/128/-1, zero points on/off, bf16/fp16/f32,
        split-K 1/2/4, slices/tile, expert_map with -1 blocks, NaN-poisoned outputs), align,
        and the whole layer against 'xla' (under jit, in shard_map, DeepSeek-V3 shapes with
        w13 over 2^31 bytes). `bash examples/gpu_triton.sh` installs the wheel and runs them.
"""

from __future__ import annotations

import functools
import itertools
import math
import subprocess
import sys
import types

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from backend_cases import CASES, FusedMoeCases

import wna16_jax as wj
from pallas_kernels.common import block_configs
from pallas_kernels.common.block_configs import min_block_k
from pallas_kernels.mgpu.wna16_gemm import SM90_SHARED_MEMORY_BYTES
from pallas_kernels.triton import backend as triton_backend
from wna16_jax import _configs, _dispatch, _reference
from wna16_jax._types import AlignedRouting, BlockConfig, QuantizedExperts

BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
ON_GPU = jax.default_backend() == "gpu"
HAS_TRITON, needs_triton = helpers.HAS_TRITON, helpers.needs_triton


@pytest.fixture
def jax_triton_ready():
    """Skips a GPU test, with the backend's own reason, when triton or jax_triton is missing."""
    reason = triton_backend.import_reason()
    if reason is not None:
        pytest.skip(reason)


# ---- tolerances -----------------------------------------------------------------------------

# Relative error ||out - ref|| / ||ref|| of one GEMM (f32 output) on the same quantized weights.
# Every dot spans one group (or a k-tile inside one), its scale applied to the f32 product.
GEMM_TOLERANCES = {
    # int4: 128 + v (exponent trick), (128 + z) * rowsum(a) subtracted after the dot, which
    # cancels ~3 bits of the f32 sum; int8: v - z exact before the dot. ~1e-6 interpreted.
    BF16: 1e-5,
    # Loose: the f16 offset 1024 cancels ~6 bits of the f32 sum; the Pallas kernel's same
    # arithmetic measured 4e-5 on the H200 at K=2048.
    F16: 1e-4,
    # v - z exact, IEEE f32 dots (TF32 would give ~1e-3).
    F32: 1e-5,
}
# Element-wise |out - ref| <= tol * |ref| + ELEMENT_SLACK * tol * rms(ref): a wrong row, column or
# tile fails, single elements of a rounded sum may stray a few standard deviations.
ELEMENT_SLACK = 5.0


def assert_rows_close(out, ref, rows, tol: float, what: str) -> None:
    """Rows `rows` of out are finite (written) and match ref."""
    helpers.assert_finite_and_close(
        np.asarray(out, np.float32)[rows],
        np.asarray(ref, np.float32)[rows],
        tol,
        what,
        slack=ELEMENT_SLACK,
        require_signal=True,
        nonfinite_hint=" (a slot placed in a block was not written)",
    )


def assert_moe_close(out, ref, dtype, what: str, tol: float | None = None) -> None:
    tol = helpers.tolerance(dtype) if tol is None else tol
    helpers.assert_finite_and_close(
        np.asarray(out, np.float32),
        np.asarray(ref, np.float32),
        tol,
        what,
        slack=ELEMENT_SLACK,
        require_signal=True,
    )


# ---- inputs ---------------------------------------------------------------------------------

_ref_align = jax.jit(_reference.moe_align_block_size, static_argnames=("num_experts", "block_m"))
_ref_gemm = jax.jit(_reference.grouped_matmul, static_argnames=("top_k",))

# Out-of-range ids the alignment drops (E itself is added per case).
INVALID_IDS = (-1, -(2**31), 2**30)


def quarter_local_map(rng, num_experts: int) -> jax.Array:
    """int32 [E]: a random quarter of the experts local (random local ids), the rest -1."""
    local = rng.permutation(num_experts)[: max(1, num_experts // 4)]
    m = np.full(num_experts, -1, np.int32)
    m[local] = rng.permutation(len(local))
    return jnp.asarray(m)


def routing_ids(rng, t: int, k: int, e: int, *, drop: bool = True) -> np.ndarray:
    """int32 [T, k] distinct ids per token; with `drop`, ~1/8 of the slots out of range."""
    _, ids = helpers.random_routing(rng, t, k, e)
    if drop and t * k > 1:
        mask = rng.random(ids.shape) < 0.125
        mask.flat[0] = True
        ids = np.where(mask, rng.choice(np.array((*INVALID_IDS, e)), size=ids.shape), ids)
    return ids.astype(np.int32)


def gemm_config(
    qw, *, block_m: int, block_k: int, split_k: int, unpack: str, group_m: int = 1
) -> BlockConfig:
    """A valid config: block_k and split_k clamped to what K and the unpack mode allow."""
    lo = min_block_k(qw.bits) if unpack == "slices" else 16
    split_k = max(1, min(split_k, qw.k // lo))
    bk = max(lo, min(block_k, qw.k // split_k))
    return BlockConfig(
        block_m=block_m,
        block_n=min(64, qw.n),
        block_k=bk,
        split_k=split_k,
        group_m=group_m,
        unpack=unpack,
    )


def block_m_for(t: int) -> int:
    return 16 if t < 32 else 32 if t < 128 else 64


# ---- CPU: registration, reasons, selection --------------------------------------------------


def _problem(**changes) -> _dispatch.MoEProblem:
    base = dict(
        platform="gpu",
        num_tokens=3,
        hidden=256,
        intermediate=128,
        num_experts=8,
        num_global_experts=8,
        top_k=2,
        bits=4,
        group_size=128,
        w13_group=128,
        w2_group=128,
        has_zeros=True,
        dtype="bfloat16",
        activation="silu",
    )
    return _dispatch.MoEProblem(**(base | changes))


def test_registered_without_importing_triton():
    """'triton' is registered; importing wna16_jax and registering it imports neither triton
    nor jax_triton (a fresh interpreter: this one may have imported them already)."""
    assert "triton" in wj.registered_backends()
    code = (
        "import sys, wna16_jax as wj; names = wj.registered_backends(); "
        "assert 'triton' in names, names; "
        "bad = [m for m in ('triton', 'jax_triton') if m in sys.modules]; "
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_priority_unchanged():
    """The lead picks the default after GPU measurements: 'triton' is in no priority list."""
    for platform in ("cpu", "gpu", "cuda", "tpu"):
        assert "triton" not in _dispatch.PRIORITY.get(platform, _dispatch.DEFAULT_PRIORITY)


@pytest.mark.skipif(ON_GPU, reason="checks the reasons given on a CPU")
def test_reasons_on_cpu():
    want = "needs an NVIDIA GPU, the platform is 'cpu'"
    assert triton_backend.unsupported_reason(_problem(platform="cpu")) == want
    align = _dispatch.AlignProblem(platform="cpu", num_slots=6, num_experts=4, block_m=16)
    assert triton_backend.align_unsupported_reason(align) == want
    # A 'gpu' problem while JAX's device is a CPU: not a CUDA device.
    reason = triton_backend.unsupported_reason(_problem(platform="gpu"))
    assert reason is not None and "is not a CUDA GPU" in reason, reason


@pytest.mark.skipif(ON_GPU, reason="checks selection on a CPU")
def test_selection_on_cpu(rng):
    """Automatic selection never picks 'triton' on CPU; an explicit request raises with its
    reason; a sequence falls through to 'xla'."""
    problem = _problem(platform="cpu")
    assert _dispatch.select_backend(problem, None).name == "xla"
    assert _dispatch.select_backend(problem, ("triton", "xla")).name == "xla"
    x, w13, w2, tw, ti = helpers.random_moe_inputs(rng, T=3, H=64, I=32, E=4, k=2)
    with pytest.raises(NotImplementedError, match="'triton' cannot run .*needs an NVIDIA GPU"):
        wj.fused_moe(x, w13, w2, tw, ti, implementation="triton")
    with pytest.raises(NotImplementedError, match="'triton' cannot run .*needs an NVIDIA GPU"):
        wj.moe_align_block_size(ti, num_experts=4, block_m=16, implementation="triton")


@pytest.mark.parametrize("module", ["triton", "jax_triton"])
def test_import_reason_names_the_error(monkeypatch, module):
    if module == "jax_triton":  # triton itself imports (a stand-in when it is not installed)
        monkeypatch.setitem(
            sys.modules, "triton", sys.modules.get("triton") or types.ModuleType("t")
        )
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    triton_backend.import_reason.cache_clear()
    try:
        reason = triton_backend.import_reason()
    finally:
        monkeypatch.undo()
        triton_backend.import_reason.cache_clear()
    want = f"{module} is not importable (ModuleNotFoundError: import of {module} halted"
    assert reason is not None and reason.startswith(want), reason
    assert "wna16_jax[triton]" in reason


SHAPE_REASONS = [
    (dict(activation_quant="int8_per_token"), "int8 activations"),
    (dict(dtype="float64"), "activation dtype float64 is not one of"),
    (dict(activation="gelu"), "activation 'gelu' is not one of"),
    (dict(num_global_experts=2048), "2048 experts, over the align kernel's 1024"),
    (dict(hidden=200), "H=200 output features are not a multiple of 16"),
    (dict(intermediate=12), "2I=24 output features are not a multiple of 16"),
    (dict(w13_group=8), "w13 group size 8 is not a multiple of 16"),
    (dict(w2_group=24), "w2 group size 24 is not a multiple of 16"),
]


@pytest.mark.parametrize(
    "changes, message", SHAPE_REASONS, ids=[m.split()[0] for _, m in SHAPE_REASONS]
)
def test_shape_reasons(changes, message):
    reason = triton_backend.shape_reason(_problem(**changes))
    assert reason is not None and message in reason, reason


def test_supported_shapes_have_no_reason():
    for changes in ({}, dict(bits=8, has_zeros=False), dict(w13_group=256, w2_group=128)):
        assert triton_backend.shape_reason(_problem(**changes)) is None, changes


# ---- CPU with triton: compiled for sm_90 (no GPU) -------------------------------------------


def _traced(fn, *args):
    """fn(*args) evaluated on abstract values (the kernel launches need only shapes/dtypes)."""
    box = []

    def capture(*a):
        box.append(fn(*a))
        return jnp.zeros(())

    jax.eval_shape(capture, *args)
    return box[0]


def _abstract_gemm(e, n, k, bits, group_size, zp, dtype, m, top_k, block_m, routed):
    sds = jax.ShapeDtypeStruct
    g = k if group_size == -1 else group_size
    zeros = sds((e, n // 2 if bits == 4 else n, k // g), jnp.uint8) if zp else None
    qw = QuantizedExperts(
        sds((e, n, k * bits // 32), jnp.uint32), sds((e, n, k // g), dtype), zeros, bits, group_size
    )
    slots = m * top_k
    p = _reference.max_padded_len(slots, e, block_m)
    routing = AlignedRouting(
        sds((p,), jnp.int32), sds((p // block_m,), jnp.int32), sds((), jnp.int32), block_m
    )
    a = sds((m, k), dtype)
    rw = sds((slots,), jnp.float32) if routed else None
    return a, qw, routing, rw


# (E, N, K, bits, group_size, zp, dtype, M, top_k, config, routed weights, NaN out_init)
COMPILE_GEMMS = [
    (8, 256, 256, 4, 128, True, BF16, 4, 2, BlockConfig(16, 64, 128), False, False),
    (8, 256, 256, 4, 64, False, BF16, 4, 2, BlockConfig(16, 64, 128, 2, unpack="tile"), True,
     False),
    (8, 256, 256, 8, 32, True, F16, 4, 2, BlockConfig(16, 64, 128, group_m=4), True, True),
    (8, 256, 256, 8, -1, False, F32, 4, 2, BlockConfig(32, 64, 64, unpack="tile"), True, False),
    (8, 256, 512, 4, 32, True, F16, 40, 1, BlockConfig(64, 128, 256, 2, num_stages=3), True,
     False),
    # DeepSeek-V3 GEMM1 / GEMM2 at TP=1 (w13 qweight 3.76e9 bytes), and GEMM1 at TP=8.
    (256, 4096, 7168, 4, 128, True, BF16, 1, 8, BlockConfig(16, 64, 128), False, False),
    (256, 7168, 2048, 4, 128, False, BF16, 64, 1, BlockConfig(32, 64, 128), True, False),
    (256, 512, 7168, 4, 128, True, BF16, 16, 8, BlockConfig(16, 64, 128, split_k=4), False,
     False),
]  # fmt: skip


def _sm90():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


@needs_triton
@pytest.mark.parametrize("case", COMPILE_GEMMS, ids=[f"gemm{i}" for i in range(len(COMPILE_GEMMS))])
def test_gemm_compiles_for_sm90(case):
    from pallas_kernels.triton import _launch
    from pallas_kernels.triton import wna16_gemm as gemm

    *shape, config, routed, poisoned = case
    e, n, k, bits, group_size, zp, dtype, m, top_k = shape
    a, qw, routing, rw = _abstract_gemm(
        e, n, k, bits, group_size, zp, dtype, m, top_k, config.block_m, routed
    )
    out_init = jax.ShapeDtypeStruct((m * top_k, n), dtype) if poisoned else None
    launch = _traced(
        lambda a, qw, r, rw, o: gemm.gemm_launch(
            a, qw, r, rw, top_k=top_k, config=config, out_init=o
        ),
        a,
        qw,
        routing,
        rw,
        out_init,
    )
    assert launch.kernel is (gemm._wna16_gemm_into_kernel if poisoned else gemm._wna16_gemm_kernel)
    compiled = _launch.compile_for(launch, _sm90())
    assert len(compiled.asm["cubin"]) > 0
    assert ".target sm_90" in compiled.asm["ptx"]
    assert compiled.metadata.shared <= SM90_SHARED_MEMORY_BYTES, compiled.metadata.shared


@needs_triton
@pytest.mark.parametrize("m", [1, 64, 4096])
def test_deepseek_heuristic_configs_compile_for_sm90(m):
    """Both GEMMs of DeepSeek-V3 (TP=1) with the configs the triton pipeline picks untuned."""
    from pallas_kernels.common.block_configs import block_configs
    from pallas_kernels.triton import _launch
    from pallas_kernels.triton import wna16_gemm as gemm
    from pallas_kernels.triton.config import RULES

    w13 = _abstract_gemm(256, 4096, 7168, 4, 128, True, BF16, m, 8, 16, False)[1]
    w2 = _abstract_gemm(256, 7168, 2048, 4, 128, True, BF16, m, 8, 16, False)[1]
    for qw, config, top_k, routed in zip(
        (w13, w2),
        block_configs(m * 8, w13, w2, None, rules=RULES),
        (8, 1),
        (False, True),
        strict=True,
    ):
        a, qw, routing, rw = _abstract_gemm(
            256, qw.n, qw.k, 4, 128, True, BF16, m * 8 // top_k, top_k, config.block_m, routed
        )
        launch = _traced(
            lambda a, qw, r, rw, c=config, k=top_k: gemm.gemm_launch(
                a, qw, r, rw, top_k=k, config=c
            ),
            a,
            qw,
            routing,
            rw,
        )
        compiled = _launch.compile_for(launch, _sm90())
        assert compiled.metadata.shared <= SM90_SHARED_MEMORY_BYTES, (
            config,
            compiled.metadata.shared,
        )


@needs_triton
@pytest.mark.parametrize("m", [1, 4096])
def test_gpt_oss_120b_biased_gemms_compile_for_sm90(m):
    """gpt-oss-120b's two GEMMs (MXFP4, E = 128, top-4, H = I = 2880) with their per-expert
    biases in the epilogue, at the configs the triton pipeline picks untuned."""
    from pallas_kernels.common.block_configs import block_configs
    from pallas_kernels.triton import _launch
    from pallas_kernels.triton import wna16_gemm as gemm
    from pallas_kernels.triton.config import RULES

    e, top_k, h = 128, 4, 2880
    sds = jax.ShapeDtypeStruct

    def mxfp4(n, k):
        return QuantizedExperts(
            sds((e, n, k // 8), jnp.uint32), sds((e, n, k // 32), jnp.uint8), None, 4, 32,
            codes="e2m1",
        )  # fmt: skip

    w13, w2 = mxfp4(2 * h, h), mxfp4(h, h)
    configs = block_configs(m * top_k, w13, w2, None, rules=RULES)
    for qw, config, k, routed in zip((w13, w2), configs, (top_k, 1), (False, True), strict=True):
        rows = m * top_k // k
        p = _reference.max_padded_len(m * top_k, e, config.block_m)
        routing = AlignedRouting(
            sds((p,), jnp.int32), sds((p // config.block_m,), jnp.int32), sds((), jnp.int32),
            config.block_m,
        )  # fmt: skip
        rw = sds((m * top_k,), jnp.float32) if routed else None
        launch = _traced(
            lambda a, qw, r, rw, b, c=config, k=k: gemm.gemm_launch(
                a, qw, r, rw, top_k=k, config=c, bias=b
            ),
            sds((rows, qw.k), BF16), qw, routing, rw, sds((e, qw.n), F32),
        )  # fmt: skip
        assert launch.constexprs["HAS_BIAS"] and launch.constexprs["E2M1"]
        compiled = _launch.compile_for(launch, _sm90())
        assert ".target sm_90" in compiled.asm["ptx"]
        assert compiled.metadata.shared <= SM90_SHARED_MEMORY_BYTES, (
            config,
            compiled.metadata.shared,
        )


@needs_triton
@pytest.mark.parametrize(
    "e, t, k, block_m, with_map",
    [
        (256, 1, 8, 16, False),
        (512, 333, 6, 64, True),
        (1024, 8192, 8, 64, True),
        (4, 7, 2, 48, False),
    ],
)
def test_align_compiles_for_sm90(e, t, k, block_m, with_map):
    from pallas_kernels.triton import _launch, align

    ids = jax.ShapeDtypeStruct((t, k), jnp.int32)
    emap = jax.ShapeDtypeStruct((e,), jnp.int32) if with_map else None

    def launches(ids, emap):
        count, place = align.align_launches(ids, num_experts=e, block_m=block_m, expert_map=emap)
        return count, place(*count.outputs)

    for launch in _traced(launches, ids, emap):
        compiled = _launch.compile_for(launch, _sm90())
        assert len(compiled.asm["cubin"]) > 0
        assert compiled.metadata.shared <= SM90_SHARED_MEMORY_BYTES


def test_launch_signature_checked():
    """A launch whose arrays or constexprs do not match the kernel's parameters is refused."""
    from pallas_kernels.triton import _launch

    class FakeKernel:
        arg_names = ["x_ptr", "out_ptr", "N"]
        __name__ = "fake"

    out = jax.ShapeDtypeStruct((4,), jnp.float32)
    ok = _launch.Launch(FakeKernel(), (out,), (out,), (1,), {"N": 4})
    ok.check_signature()
    bad = _launch.Launch(FakeKernel(), (out,), (out,), (1,), {"M": 4})
    with pytest.raises(ValueError, match=r"fake takes \['x_ptr', 'out_ptr', 'N'\]"):
        bad.check_signature()


# ---- the GEMM against the reference: interpreted on CPU, compiled on GPU --------------------


def run_gemm_case(
    rng,
    *,
    T,
    top_k,
    E,
    N,
    K,
    bits,
    group,
    has_zp,
    dtype,
    split_k,
    unpack,
    ep,
    weights,
    interpret,
    group_m=1,
):
    """One grouped GEMM through the kernel and the reference, with rows a [T, K] shared by
    top_k slots (GEMM1) and again with one row per slot and routed weights (GEMM2).

    ~1/8 of the slots carry out-of-range ids; with `ep`, expert_map keeps a quarter of the
    experts local (blocks of expert -1). split_k == 1 writes into a NaN-poisoned buffer, so a
    placed row the kernel skips fails the finiteness check.
    """
    from pallas_kernels.triton.wna16_gemm import wna16_gemm

    dtype = jnp.dtype(dtype)
    e_local = max(1, E // 4) if ep else E
    expert_map = quarter_local_map(rng, E) if ep else None
    qw = weights(rng, e_local, N, K, bits, group, has_zp, dtype)
    ids = routing_ids(rng, T, top_k, E)
    emap = np.arange(E) if expert_map is None else np.asarray(expert_map)
    # Token 0's first slot (always dropped by routing_ids) goes to a local expert unless one of
    # its slots already has one, so the comparison has rows: at T=1, top_k=2 the other slot is
    # dropped with probability 1/8, and the H200 run drew such a case ("the reference is all
    # zeros, the case checks nothing").
    local = np.nonzero(emap >= 0)[0]
    if not np.isin(ids[0], local).any():
        ids[0, 0] = rng.choice([x for x in local if x not in ids[0]])
    flat = ids.reshape(-1)
    placed = (flat >= 0) & (flat < E)
    off_shard = placed & (emap[np.clip(flat, 0, E - 1)] < 0)
    block_m = block_m_for(T)
    routing = _ref_align(jnp.asarray(ids), num_experts=E, block_m=block_m, expert_map=expert_map)
    config = gemm_config(
        qw, block_m=block_m, block_k=128, split_k=split_k, unpack=unpack, group_m=group_m
    )
    slots = T * top_k
    gemms = (
        ("GEMM1", jnp.asarray(rng.normal(size=(T, K)), dtype), top_k, None),
        (
            "GEMM2",
            jnp.asarray(rng.normal(size=(slots, K)), dtype),
            1,
            jnp.asarray(rng.uniform(0.1, 1.0, size=slots), jnp.float32),
        ),
    )
    for what, a, k, routed in gemms:
        out_init = jnp.full((slots, N), jnp.nan, F32) if config.split_k == 1 else None
        out = wna16_gemm(
            a,
            qw,
            routing,
            routed,
            top_k=k,
            config=config,
            out_dtype=F32,
            out_init=out_init,
            interpret=interpret,
        )
        ref = _ref_gemm(a, qw, routing, top_k=k, routed_weights=routed)
        assert out.shape == (slots, N) and out.dtype == F32
        out = np.asarray(out)
        np.testing.assert_array_equal(out[off_shard], 0.0, err_msg=f"{what} off-shard slots")
        if config.split_k == 1:  # dropped slots sit in no block: never written
            assert np.isnan(out[~placed]).all(), f"{what} wrote rows of dropped slots"
        else:  # the zeroed split-K buffer
            np.testing.assert_array_equal(out[~placed], 0.0, err_msg=f"{what} dropped slots")
        assert_rows_close(out, ref, placed & ~off_shard, GEMM_TOLERANCES[dtype], f"{what} {config}")


def host_weights(rng, e, n, k, bits, group, has_zp, dtype):
    return helpers.random_quantized_experts(rng, e, n, k, bits, group, has_zp, dtype)


def device_weights(rng, e, n, k, bits, group, has_zp, dtype):
    key = jax.random.key(int(rng.integers(2**31)))
    return helpers.device_quantized_experts(key, e, n, k, bits, group, has_zp, dtype)


def _grid():
    """Every (bits, G, zero points, dtype); split-K, unpack, T, E and expert_map cycle."""
    cases = []
    for i, (bits, group, zp, dtype) in enumerate(
        itertools.product((4, 8), (32, 64, 128, -1), (True, False), (BF16, F16))
    ):
        cases.append(
            dict(
                T=(1, 7, 33, 130)[i % 4],
                top_k=(2, 6)[i % 2],
                E=(8, 64)[(i // 4) % 2],
                N=256,
                K=256,
                bits=bits,
                group=group,
                has_zp=zp,
                dtype=dtype,
                split_k=(1, 2, 4)[i % 3],
                unpack=("slices", "tile")[(i // 3) % 2],
                ep=i % 5 in (1, 3),
                group_m=(1, 4)[i % 7 == 3],
            )
        )
    for i, bits in enumerate((4, 8)):  # f32 activations: IEEE dots
        cases.append(
            dict(
                T=9, top_k=2, E=8, N=128, K=256, bits=bits, group=64, has_zp=bool(i),
                dtype=F32, split_k=1 + i, unpack="slices", ep=bool(i),
            )
        )  # fmt: skip
    return cases


GEMM_GRID = _grid()


def _gemm_id(c) -> str:
    return (
        f"T{c['T']}-k{c['top_k']}-E{c['E']}-int{c['bits']}-g{c['group']}-"
        f"{'zp' if c['has_zp'] else 'sym'}-{c['dtype'].name}-sk{c['split_k']}-{c['unpack']}"
        f"{'-ep' if c['ep'] else ''}{'-gm4' if c.get('group_m', 1) > 1 else ''}"
    )


# Interpreted on CPU (small T and E): every bits, dtype, split_k, unpack, span kind (G < block_k:
# one dot per group; G >= block_k: one per k-tile) and zero-point setting, and expert_map.
_SMALL = dict(N=128, K=256)
INTERPRETED_GEMMS = [
    dict(T=1, top_k=2, E=8, bits=4, group=32, has_zp=True, dtype=BF16, split_k=1,
         unpack="slices", ep=False, **_SMALL),
    dict(T=7, top_k=6, E=8, bits=4, group=128, has_zp=False, dtype=F16, split_k=2,
         unpack="tile", ep=True, **_SMALL),
    dict(T=7, top_k=2, E=8, bits=8, group=-1, has_zp=True, dtype=BF16, split_k=4,
         unpack="slices", ep=False, **_SMALL),
    dict(T=5, top_k=2, E=16, bits=8, group=64, has_zp=False, dtype=F16, split_k=1,
         unpack="tile", ep=True, group_m=4, **_SMALL),
    dict(GEMM_GRID[-1], T=3),  # f32, IEEE dots
]  # fmt: skip


@needs_triton
@pytest.mark.parametrize("case", INTERPRETED_GEMMS, ids=[_gemm_id(c) for c in INTERPRETED_GEMMS])
def test_gemm_interpreted(rng, case):
    run_gemm_case(rng, **case, weights=host_weights, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GEMM_GRID, ids=[_gemm_id(c) for c in GEMM_GRID])
def test_gemm_gpu(rng, jax_triton_ready, case):
    run_gemm_case(rng, **case, weights=device_weights, interpret=False)


@needs_triton
@pytest.mark.parametrize(
    "bits, group, split_k, dtype",
    [(4, 64, 1, BF16), (8, -1, 2, F16), (4, 32, 2, F32)],
    ids=["int4-g64-bf16", "int8-channel-f16-split2", "int4-g32-f32-split2"],
)
def test_gemm_bias_epilogue_interpreted(rng, bits, group, split_k, dtype):
    """out[s] = (a[s // top_k] @ w[e].T + bias[e]) * routed_weight[s] (the 'xla' layer's
    order), the bias added once under split-K, blocks of off-shard experts (expert_map -1)
    exactly zero, not their bias."""
    from pallas_kernels.triton.wna16_gemm import wna16_gemm

    t, top_k, e, n, k = 5, 2, 8, 64, 256
    expert_map = quarter_local_map(rng, e)
    e_local = e // 4
    qw = host_weights(rng, e_local, n, k, bits, group, True, dtype)
    ids = routing_ids(rng, t, top_k, e, drop=False)
    emap = np.asarray(expert_map)
    local = np.nonzero(emap >= 0)[0]
    if not np.isin(ids[0], local).any():
        ids[0, 0] = rng.choice([x for x in local if x not in ids[0]])
    config = BlockConfig(block_m=16, block_n=32, block_k=64, split_k=split_k, unpack="tile")
    routing = _ref_align(jnp.asarray(ids), num_experts=e, block_m=16, expert_map=expert_map)
    a = jnp.asarray(rng.normal(size=(t, k)), dtype)
    bias = jnp.asarray(rng.normal(size=(e_local, n)) * 8.0, dtype)
    rw = jnp.asarray(rng.uniform(0.1, 1.0, size=t * top_k), jnp.float32)
    out = wna16_gemm(
        a, qw, routing, rw, top_k=top_k, config=config, out_dtype=F32, interpret=True, bias=bias
    )
    local_of = emap[ids.reshape(-1)]  # [T*k] local expert of each slot, -1 off-shard
    w = helpers.numpy_dequantize(qw)  # [E_local, N, K]
    rows = np.asarray(a, np.float64)[np.arange(t * top_k) // top_k]
    safe = np.maximum(local_of, 0)
    ref = np.einsum("sk,snk->sn", rows, w[safe]) + np.asarray(bias, np.float64)[safe]
    ref = ref * np.asarray(rw, np.float64)[:, None]
    on = local_of >= 0
    out = np.asarray(out)
    np.testing.assert_array_equal(out[~on], 0.0, err_msg="off-shard slots")
    assert_rows_close(out, ref, on, GEMM_TOLERANCES[dtype], f"biased GEMM {config}")
    with pytest.raises(ValueError, match=r"bias must be \[E, N\] = \[2, 64\]"):
        wna16_gemm(a, qw, routing, top_k=top_k, config=config, interpret=True, bias=bias[:, :8])


@needs_triton
def test_gemm_default_out_dtype_is_rounded_f32(rng):
    """out_dtype=None gives a.dtype: the same f32 accumulator rounded once (bitwise)."""
    from pallas_kernels.triton.wna16_gemm import wna16_gemm

    qw = helpers.random_quantized_experts(rng, 4, 64, 128, 4, 64, True, BF16)
    a = jnp.asarray(rng.normal(size=(5, 128)), BF16)
    routing = _ref_align(
        jnp.asarray(routing_ids(rng, 5, 2, 4, drop=False)), num_experts=4, block_m=16
    )
    config = BlockConfig(16, 32, 128)
    run = functools.partial(wna16_gemm, a, qw, routing, top_k=2, config=config, interpret=True)
    out16, out32 = run(), run(out_dtype=F32)
    assert out16.dtype == BF16 and out32.dtype == F32
    np.testing.assert_array_equal(np.asarray(out16), np.asarray(out32.astype(BF16)))


BAD_GEMM_CONFIGS = [
    # (bits, K, group, config, message)
    (4, 256, 64, BlockConfig(16, 64, 512), "K=256 is not a multiple of block_k=512"),
    (4, 512, 64, BlockConfig(16, 64, 128, split_k=3), "split_k=3 does not divide the 4 k-tiles"),
    (4, 256, 64, BlockConfig(16, 64, 64), "block_k=64 is below 128 for int4"),
    (8, 256, 8, BlockConfig(16, 64, 64, unpack="tile"), "dots over 8 input features"),
    (4, 256, 128, BlockConfig(16, 64, 128, dot="fma"), "tensor-core dots only"),
    (4, 256, 128, BlockConfig(1, 64, 128, dot="fma"), "below Triton's 16-row dot tile"),
]


@needs_triton
@pytest.mark.parametrize(
    "bits, kdim, group, config, message",
    BAD_GEMM_CONFIGS,
    ids=["bk-over-K", "split-vs-tiles", "slices-minimum", "span-under-16", "fma", "block-m-1"],
)
def test_bad_gemm_config_raises(rng, bits, kdim, group, config, message):
    from pallas_kernels.triton.wna16_gemm import wna16_gemm

    qw = helpers.random_quantized_experts(rng, 4, 128, kdim, bits, group, True, BF16)
    a = jnp.asarray(rng.normal(size=(3, kdim)), BF16)
    ids = jnp.asarray(routing_ids(rng, 3, 2, 4, drop=False))
    routing = _ref_align(ids, num_experts=4, block_m=config.block_m)
    with pytest.raises(ValueError, match=message):
        wna16_gemm(a, qw, routing, top_k=2, config=config, interpret=True)


@needs_triton
def test_tuned_fma_entries_give_way_to_the_heuristic(rng, monkeypatch):
    """A tuned table's CUDA-core entries (block_m 1, dot="fma": the H200 table's decode
    configs) are the Pallas kernel's: the Triton pipeline reads no table, takes the heuristic
    and stays right (before, it ran them and returned garbage: relative error 1.0)."""
    from pallas_kernels.triton import fused_moe as triton_moe

    fma = BlockConfig(block_m=1, block_n=64, block_k=64, split_k=2, dot="fma")
    monkeypatch.setattr(_configs, "lookup_tuned", lambda *args, **kwargs: fma)
    e, h, i, t, k = 8, 256, 128, 3, 2
    w13 = helpers.random_quantized_experts(rng, e, 2 * i, h, 4, 64, True, BF16)
    w2 = helpers.random_quantized_experts(rng, e, h, i, 4, 64, True, BF16)
    c1, c2 = triton_moe._plan(t * k, e, w13, w2, config=None, batch_invariant=False)
    heuristic = block_configs.heuristic_config(
        _configs.GemmShape.of_weights(w13, m=t * k), allow_fma=False
    )
    assert c1 == heuristic
    assert c1.dot == c2.dot == "mma" and c2.block_m == c1.block_m >= 16
    x = jnp.asarray(rng.normal(size=(t, h)), BF16)
    tw, ids = helpers.random_routing(rng, t, k, e)
    args = (x, w13, w2, jnp.asarray(tw, F32), jnp.asarray(ids, jnp.int32))
    out = helpers.pipeline_fused_moe(triton_moe.stages, interpret=True)(*args)
    ref = wj.fused_moe(*args, implementation="xla")
    # The layer's tolerance (assert_moe_close): GEMM1's sums rounded to bf16 move single
    # outputs by up to ~2% of rms(ref) against 'xla' (as the Pallas layer's do).
    assert_moe_close(out, ref, BF16, "triton fused_moe with an fma tuned entry")


# ---- align against the reference ------------------------------------------------------------


def make_ids(rng, t, k, e, pattern):
    """int32 [T, k]: 'random' (10% out of range), 'one_expert' or 'distinct' rows."""
    if pattern == "random":
        ids = rng.integers(0, e, size=(t, k))
        bad = rng.random((t, k)) < 0.1
        ids = np.where(bad, rng.choice(np.array((*INVALID_IDS, e)), size=(t, k)), ids)
    elif pattern == "one_expert":
        ids = np.full((t, k), rng.integers(0, e))
    else:
        ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).reshape(t, k)
    return jnp.asarray(ids, jnp.int32)


def check_align(rng, t, k, e, block_m, *, with_map, pattern, interpret):
    """The kernel's routing equals the reference's: counts, expert_ids and sentinel positions
    exactly, each expert's run as a set (the order inside a run follows the atomics)."""
    from pallas_kernels.triton.align import moe_align_block_size

    ids = make_ids(rng, t, k, e, pattern)
    expert_map = quarter_local_map(rng, e) if with_map else None
    got = moe_align_block_size(
        ids, num_experts=e, block_m=block_m, expert_map=expert_map, interpret=interpret
    )
    want = _ref_align(ids, num_experts=e, block_m=block_m, expert_map=expert_map)
    slots = t * k
    g_ids, w_ids = np.asarray(got.sorted_token_ids), np.asarray(want.sorted_token_ids)
    assert got.block_m == block_m and g_ids.shape == w_ids.shape and g_ids.dtype == np.int32
    assert np.asarray(got.num_tokens_post_padded).shape == ()
    np.testing.assert_array_equal(got.num_tokens_post_padded, want.num_tokens_post_padded)
    np.testing.assert_array_equal(got.expert_ids, want.expert_ids, err_msg="expert_ids")
    np.testing.assert_array_equal(g_ids == slots, w_ids == slots, err_msg="sentinel positions")
    flat = np.asarray(ids).reshape(-1)
    counts = np.bincount(flat[(flat >= 0) & (flat < e)], minlength=e)
    padded = -(-counts // block_m) * block_m
    run_start = np.cumsum(padded) - padded
    for x in np.flatnonzero(counts):
        run = slice(run_start[x], run_start[x] + padded[x])
        np.testing.assert_array_equal(
            np.sort(g_ids[run]), np.sort(w_ids[run]), err_msg=f"run of expert {x}"
        )


# (T, k, E, block_m, expert_map, pattern)
ALIGN_CASES = [
    (0, 8, 256, 16, False, "random"),
    (1, 8, 256, 16, False, "distinct"),
    (1, 8, 256, 64, True, "random"),
    (7, 6, 64, 16, True, "random"),
    (64, 8, 4, 48, False, "random"),  # block_m not a power of two
    (64, 1, 8, 64, False, "one_expert"),
    (333, 6, 512, 32, True, "random"),
    (333, 8, 64, 16, True, "one_expert"),
    (100, 8, 1024, 16, False, "distinct"),
]
# Larger on the GPU: many programs in both launches.
GPU_ALIGN_CASES = ALIGN_CASES + [
    (4096, 8, 256, 64, False, "distinct"),
    (8192, 8, 256, 16, True, "random"),
    (3000, 6, 512, 128, True, "random"),
    (8192, 8, 64, 64, False, "one_expert"),
]


@needs_triton
@pytest.mark.parametrize("t, k, e, block_m, with_map, pattern", ALIGN_CASES)
def test_align_interpreted(rng, t, k, e, block_m, with_map, pattern):
    check_align(rng, t, k, e, block_m, with_map=with_map, pattern=pattern, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("t, k, e, block_m, with_map, pattern", GPU_ALIGN_CASES)
def test_align_gpu(rng, jax_triton_ready, t, k, e, block_m, with_map, pattern):
    check_align(rng, t, k, e, block_m, with_map=with_map, pattern=pattern, interpret=False)


# ---- the MoE layer: interpreted on CPU, through the public API on GPU -----------------------


@needs_triton
class TestTritonInterpreted(FusedMoeCases):
    """The fused_moe checks of every backend (tests/backend_cases.py), the kernels in Triton's
    interpreter (the backend module's fused_moe: no registered backend runs them so)."""

    IMPLEMENTATION = "triton (interpreted)"
    BACKEND = "triton"
    CASES = CASES[:2]  # Triton's interpreter is slow
    BATCH_INVARIANT = None  # no registered backend runs the interpreted kernels

    def supports_scheme(self, scheme) -> bool:
        """None: the scheme checks call the public API, which runs no Triton kernel in Triton's
        interpreter (the MXFP4 kernels' interpreted checks are in tests/test_mxfp4.py)."""
        return False

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids, **kwargs):
        from pallas_kernels.triton import fused_moe as triton_moe

        return helpers.pipeline_fused_moe(triton_moe.stages, interpret=True)(
            x, w13, w2, topk_weights, topk_ids, **kwargs
        )

    def fused_moe_in_chunks(self, x, w13, w2, topk_weights, topk_ids, **kwargs):
        return self.fused_moe(x, w13, w2, topk_weights, topk_ids, **kwargs)


@pytest.mark.gpu
class TestTritonCompiled(FusedMoeCases):
    IMPLEMENTATION = "triton"

    @pytest.fixture(autouse=True)
    def _ready(self, jax_triton_ready):
        pass

    def fused_moe_in_chunks(self, x, w13, w2, topk_weights, topk_ids, **kwargs):
        from pallas_kernels.triton import fused_moe as triton_moe

        return helpers.pipeline_fused_moe(triton_moe.stages)(
            x, w13, w2, topk_weights, topk_ids, **kwargs
        )


def _with_dropped_ids(ti, e):
    ids = np.asarray(ti).copy()
    ids[0, -1] = -1
    if ids.shape[0] > 2:
        ids[2, 0] = e + 3
    return jnp.asarray(ids)


@pytest.fixture
def triton_interpret_backend(monkeypatch):
    """Registers, for one test, 'triton_interpret': the triton backend run interpreted."""
    from pallas_kernels.triton import align
    from pallas_kernels.triton import fused_moe as triton_moe

    _dispatch.registered_backends()  # the built-ins first, so teardown keeps them
    backend = _dispatch.Backend(
        name="triton_interpret",
        unsupported_reason=triton_backend.shape_reason,
        stages=functools.partial(triton_moe.stages, interpret=True),
        align_unsupported_reason=lambda problem: None,
        moe_align_block_size=functools.partial(align.moe_align_block_size, interpret=True),
    )
    monkeypatch.setitem(_dispatch._REGISTRY, backend.name, backend)
    return backend.name


@needs_triton
def test_interpreted_in_shard_map(rng, triton_interpret_backend):
    """The pipeline through the public API inside jax.shard_map (EP over JAX's devices) equals
    the 'xla' backend."""
    from jax.sharding import PartitionSpec as P

    from wna16_jax import sharding as sh

    name = triton_interpret_backend
    t, e = 10, 8
    x, w13, w2, tw, ti = helpers.random_moe_inputs(rng, T=t, H=128, I=64, E=e, k=2)
    ti = _with_dropped_ids(ti, e)
    ref = wj.fused_moe(x, w13, w2, tw, ti, implementation="xla")

    n = math.gcd(jax.device_count(), e)
    mesh = jax.make_mesh((n,), ("e",), devices=jax.devices()[:n])

    def shard(x, w13, w2, tw, ti):  # this shard's experts, summed over the shards
        expert_map = sh.expert_map_for_axis(e, "e")
        y = wj.fused_moe(x, w13, w2, tw, ti, expert_map=expert_map, implementation=name)
        return jax.lax.psum(y.astype(jnp.float32), "e").astype(y.dtype)

    w13_specs = sh.expert_specs(w13, expert_axis="e")
    w2_specs = sh.expert_specs(w2, expert_axis="e")
    sharded = jax.jit(
        jax.shard_map(
            shard,
            mesh=mesh,
            in_specs=(P(), w13_specs, w2_specs, P(), P()),
            out_specs=P(),
            check_vma=False,
        )
    )(x, sh.shard_experts(w13, mesh, "e"), sh.shard_experts(w2, mesh, "e"), tw, ti)
    assert_moe_close(sharded, ref, BF16, f"shard_map over {n} devices vs xla")


@pytest.mark.gpu
def test_layer_split_k_with_expert_map_gpu(rng, jax_triton_ready):
    """split_k=2 with a quarter of the experts local: tokens routed only off-shard give exactly
    0, the rest matches 'xla' with the same map; under jax.jit with expert_map traced."""
    t, k, e = 10, 2, 16
    expert_map = quarter_local_map(rng, e)
    emap = np.asarray(expert_map)
    local, remote = np.nonzero(emap >= 0)[0], np.nonzero(emap < 0)[0]
    x, w13, w2, tw, _ = helpers.random_moe_inputs(
        rng, T=t, H=128, I=128, E=len(local), k=k, bits=8, group_size=32
    )
    _, ids = helpers.random_routing(rng, t, k, e)
    ids[:3] = rng.choice(remote, size=(3, k), replace=False)
    ids[3] = rng.choice(local, size=k, replace=False)
    ids[4, 0] = -1
    ti = jnp.asarray(ids)
    config = BlockConfig(16, 64, 64, split_k=2)

    @jax.jit
    def layer(x, w13, w2, tw, ti, expert_map):
        return wj.fused_moe(
            x, w13, w2, tw, ti, expert_map=expert_map, implementation="triton", config=config
        )

    out = layer(x, w13, w2, tw, ti, expert_map)
    ref = wj.fused_moe(x, w13, w2, tw, ti, expert_map=expert_map, implementation="xla")
    np.testing.assert_array_equal(np.asarray(out[:3], np.float32), 0.0, err_msg="off-shard only")
    assert_moe_close(out, ref, BF16, "triton (jit, expert_map) vs xla")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["replicated", "all_to_all"])
def test_layer_shard_map_gpu(rng, jax_triton_ready, mode):
    """Expert parallelism over every local GPU (jax.shard_map inside sharding.fused_moe_ep)."""
    from wna16_jax import sharding as sh

    e = 8
    n = math.gcd(jax.device_count(), e)
    mesh = jax.make_mesh((n,), ("e",), devices=jax.devices()[:n])
    x, w13, w2, tw, ti = helpers.random_moe_inputs(rng, T=12, H=256, I=128, E=e, k=3)
    ti = _with_dropped_ids(ti, e)
    w13_s, w2_s = sh.shard_experts(w13, mesh, "e"), sh.shard_experts(w2, mesh, "e")
    run = jax.jit(
        functools.partial(
            sh.fused_moe_ep, mesh=mesh, expert_axis="e", mode=mode, implementation="triton"
        )
    )
    out = run(x, w13_s, w2_s, tw, ti)
    ref = wj.fused_moe(x, w13, w2, tw, ti, implementation="xla")
    assert_moe_close(out, ref, BF16, f"EP over {n} GPUs ({mode}) vs xla")


# ---- GPU only: DeepSeek-V3 ------------------------------------------------------------------

DSV3_E, DSV3_TOP_K, DSV3_H, DSV3_G = 256, 8, 7168, 128
DSV3_TOL = 1e-2  # bf16 layer output against 'xla' (helpers.TOLERANCES' bf16 entry)


def deepseek_layer(rng, *, m: int, intermediate: int, has_zp: bool):
    """(x, w13, w2, topk_weights, topk_ids) of one DeepSeek-V3 MoE layer, int4 G=128, bf16;
    token 0 routes to the last expert, whose w13 words start past 2^31 bytes."""
    key = jax.random.key(int(rng.integers(2**31)))
    k13, k2, kx = jax.random.split(key, 3)
    w13 = helpers.device_quantized_experts(
        k13, DSV3_E, 2 * intermediate, DSV3_H, 4, DSV3_G, has_zp, BF16
    )
    w2 = helpers.device_quantized_experts(k2, DSV3_E, DSV3_H, intermediate, 4, DSV3_G, has_zp, BF16)
    x = jax.random.normal(kx, (m, DSV3_H), BF16)
    tw, ti = helpers.random_routing(rng, m, DSV3_TOP_K, DSV3_E)
    if DSV3_E - 1 not in ti[0]:
        ti[0, 0] = DSV3_E - 1
    return x, w13, w2, jnp.asarray(tw), jnp.asarray(ti)


@pytest.mark.gpu
@pytest.mark.parametrize("has_zp", [True, False], ids=["zp", "sym"])
@pytest.mark.parametrize("m", [1, 64])
def test_deepseek_v3_tp1_gpu(rng, jax_triton_ready, m, has_zp):
    """TP=1: w13's qweight is uint32 [256, 4096, 896], 3.76e9 bytes: the kernel's expert
    offsets must be 64-bit."""
    x, w13, w2, tw, ti = deepseek_layer(rng, m=m, intermediate=2048, has_zp=has_zp)
    nbytes = w13.qweight.size * w13.qweight.dtype.itemsize
    assert nbytes == 3_758_096_384 > 2**31, nbytes
    out = wj.fused_moe(x, w13, w2, tw, ti, implementation="triton")
    ref = wj.fused_moe(x, w13, w2, tw, ti, implementation="xla")
    assert_moe_close(out, ref, BF16, "triton vs xla at DeepSeek-V3 TP=1", tol=DSV3_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [None, 2], ids=["heuristic", "split2"])
@pytest.mark.parametrize("m", [1, 16])
def test_deepseek_v3_tp8_gpu(rng, jax_triton_ready, m, split_k):
    """TP=8 slice (I=256): GEMM1 is N=512, K=7168, where split-K matters."""
    x, w13, w2, tw, ti = deepseek_layer(rng, m=m, intermediate=256, has_zp=True)
    config = None if split_k is None else BlockConfig(16, 64, 128, split_k=split_k)
    out = wj.fused_moe(x, w13, w2, tw, ti, implementation="triton", config=config)
    ref = wj.fused_moe(x, w13, w2, tw, ti, implementation="xla")
    assert_moe_close(out, ref, BF16, "triton vs xla at DeepSeek-V3 TP=8", tol=DSV3_TOL)
