"""Shared test helpers: float64 numpy oracles, random inputs and the one tolerance table.

The oracles are independent of the library's own packing and reference code (numpy only,
written from the documented layouts), so that kernel tests and reference tests check against
the same oracle. Random quantized weights come from the library's one generator,
`wna16_jax.random_quantized_experts`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import wna16_jax as wj
from wna16_jax import AlignedRouting, QuantizedExperts, _pipeline

# Triton's own package (pip install triton==3.6.0): builds the Pallas-Triton and jax-triton
# kernels for sm_90 and runs the jax-triton ones in Triton's interpreter on the CPU.
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(
    not HAS_TRITON,
    reason="triton is not installed (pip install triton==3.6.0 compiles and interprets the "
    "kernels on CPU)",
)

# ---- tolerances -----------------------------------------------------------------------------

# Relative error ||out - ref|| / ||ref|| allowed for a fused MoE output in each activation dtype,
# against the float64 oracle on the *dequantized* weights (quantization error is not in here).
# Element-wise, the same number is used as rtol with atol = tol * rms(ref).
TOLERANCES: dict[np.dtype, float] = {
    # f32 accumulation over K <= a few hundred: observed ~1e-7.
    jnp.dtype(jnp.float32): 1e-5,
    # Loose: the output is rounded to f16 (unit roundoff 2^-11 = 4.9e-4); kernels may also round
    # the intermediate activation to f16, a second rounding of the same size.
    jnp.dtype(jnp.float16): 2e-3,
    # Loose: the output is rounded to bf16 (unit roundoff 2^-8 = 3.9e-3); kernels may also round
    # the intermediate activation to bf16, a second rounding of the same size.
    jnp.dtype(jnp.bfloat16): 1e-2,
}


@functools.cache
def pipeline_fused_moe(stages, **bound):
    """A backend module's MoE layer as the library runs it: `_pipeline.run` on its stages factory
    with `bound` (e.g. interpret=True), called like fused_moe plus the pipeline's chunk_tokens.
    Cached, so that each (stages, bound) is one static argument of the jitted pipeline."""
    return functools.partial(_pipeline.run, functools.partial(stages, **bound))


def tolerance(dtype) -> float:
    """The TOLERANCES entry of an activation dtype."""
    return TOLERANCES[jnp.dtype(dtype)]


def relative_error(actual, expected) -> float:
    """||actual - expected|| / ||expected|| in float64 (0 when both are empty or zero)."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    num = float(np.linalg.norm((a - e).ravel()))
    den = float(np.linalg.norm(e.ravel()))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def bf16_rounded(w_deq):
    """float64 weights rounded to bf16 once: (q - z) * s has at most 16 significant bits (an
    integer of at most 8 bits times a bf16 scale), exact in f32, so f64 -> f32 does not round."""
    return np.asarray(jnp.asarray(w_deq.astype(np.float32)).astype(jnp.bfloat16), np.float64)


def bf16_weights_of(qw: QuantizedExperts) -> np.ndarray:
    """float64 weights the Mosaic GPU GEMM's bf16_weights path multiplies: (q - z) * s rounded
    to bf16 once; per-channel weights exact (their scales multiply the sums at the end)."""
    w = numpy_dequantize(qw)
    return bf16_rounded(w) if qw.group < qw.shape[2] else w


def assert_close(actual, expected, dtype, what: str = "output") -> None:
    """Checks `actual` against a float64 oracle with the tolerance of activation `dtype`.

    Fails on a shape mismatch, a non-finite value, an element off by more than
    tol * |ref| + tol * rms(ref) (np.testing shows the diff), or a relative error over tol.
    """
    assert_finite_and_close(actual, expected, tolerance(dtype), what)


def assert_finite_and_close(
    actual,
    expected,
    tol: float,
    what: str,
    *,
    slack: float = 1.0,
    require_signal=False,
    nonfinite_hint: str = "",
) -> None:
    """`actual` is finite, shaped like `expected` and matches it to tol.

    Element-wise: |a - e| <= tol * |e| + slack * tol * rms(e); norm-wise: relative error <= tol.
    With require_signal, an all-zero reference fails (the case would check nothing).
    """
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    bad = ~np.isfinite(a)
    assert not bad.any(), (
        f"{what}: {bad.sum()} non-finite values (rows {np.nonzero(bad)[0][:20]}){nonfinite_hint}"
    )
    rel = relative_error(a, e)
    rms = float(np.sqrt(np.mean(e**2))) if e.size else 0.0
    if require_signal:
        assert rms > 0, f"{what}: the reference is all zeros, the case checks nothing"
    np.testing.assert_allclose(
        a,
        e,
        rtol=tol,
        atol=slack * tol * rms,
        err_msg=f"{what}: relative error {rel:.3g} (tol {tol:g})",
    )
    assert rel <= tol, f"{what}: relative error {rel:.3g} > tol {tol:g}"


# ---- random inputs --------------------------------------------------------------------------


def random_routing(rng: np.random.Generator, T: int, k: int, E: int, distinct: bool = True):
    """Random top-k routing over E experts.

    Args:
        rng: numpy Generator.
        T, k, E: tokens, slots per token, experts.
        distinct: each token's k experts are distinct (needs k <= E); else drawn with
            replacement (duplicates allowed).

    Returns:
        (topk_weights f32 [T, k] in [0.1, 1), topk_ids int32 [T, k] in [0, E)) as numpy.
    """
    if distinct:
        if k > E:
            raise ValueError(f"k={k} distinct experts out of E={E} is impossible")
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :k]
    else:
        ids = rng.integers(0, E, size=(T, k))
    weights = rng.uniform(0.1, 1.0, size=(T, k))
    return weights.astype(np.float32), ids.astype(np.int32)


def random_quantized_experts(
    rng: np.random.Generator,
    E: int,
    N: int,
    K: int,
    bits: int,
    group_size: int,
    has_zp: bool,
    dtype=jnp.bfloat16,
) -> QuantizedExperts:
    """Random canonical weights [E, N, K] drawn from the test's Generator on the host.

    `wna16_jax.random_quantized_experts` with zero_range="full": every bit of qweight and of
    the zero points random (the corner zero points 0 and 2**bits - 1 included), dequantized
    weights about 1/sqrt(K), so x @ w.T stays O(1) for O(1) activations.
    """
    return wj.random_quantized_experts(
        rng,
        (E, N, K),
        bits=bits,
        group_size=group_size,
        has_zeros=has_zp,
        dtype=dtype,
        zero_range="full",
    )


def device_quantized_experts(
    key, e: int, n: int, k: int, bits: int, group_size: int, has_zp: bool, dtype
) -> QuantizedExperts:
    """Like random_quantized_experts, but drawn with jax.random on the default device: fast at
    GPU sizes."""
    return wj.random_quantized_experts(
        key,
        (e, n, k),
        bits=bits,
        group_size=group_size,
        has_zeros=has_zp,
        dtype=dtype,
        zero_range="full",
    )


def random_moe_inputs(
    rng: np.random.Generator,
    *,
    T: int,
    H: int,
    I: int,
    E: int,
    k: int,
    bits: int = 4,
    group_size: int = 32,
    has_zp: bool = True,
    dtype=jnp.bfloat16,
    distinct: bool = True,
):
    """(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights, topk_ids) as jax arrays.

    Scales are stored in `dtype` (the activation dtype), as in the canonical layout.
    """
    x = jnp.asarray(rng.normal(size=(T, H)), dtype)
    w13 = random_quantized_experts(rng, E, 2 * I, H, bits, group_size, has_zp, dtype)
    w2 = random_quantized_experts(rng, E, H, I, bits, group_size, has_zp, dtype)
    weights, ids = random_routing(rng, T, k, E, distinct=distinct)
    return x, w13, w2, jnp.asarray(weights), jnp.asarray(ids)


# ---- numpy oracles --------------------------------------------------------------------------


def numpy_unpack_k(qweight, bits: int) -> np.ndarray:
    """uint32 [..., W] -> int64 [..., W * 32 // bits]: value k = pf*j + i is field i of word j."""
    w = np.asarray(qweight).astype(np.uint64)
    per_word = 32 // bits
    mask = (1 << bits) - 1
    out = np.empty((*w.shape[:-1], w.shape[-1] * per_word), np.int64)
    for i in range(per_word):
        out[..., i::per_word] = ((w >> np.uint64(bits * i)) & np.uint64(mask)).astype(np.int64)
    return out


def numpy_unpack_zeros(zeros, bits: int) -> np.ndarray:
    """Canonical zeros -> int64 [E, N, G] (int4: even n is the low nibble of byte n // 2)."""
    z = np.asarray(zeros).astype(np.int64)
    if bits == 8:
        return z
    e, half_n, g = z.shape
    out = np.empty((e, 2 * half_n, g), np.int64)
    out[:, 0::2] = z & 0xF
    out[:, 1::2] = z >> 4
    return out


# The OCP MX E2M1 values, written out from the spec's table (code = sign, exponent, mantissa).
NUMPY_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def numpy_e8m0(x) -> np.ndarray:
    """float64 2^(x - 127) of E8M0 bytes (NaN for 255)."""
    x = np.asarray(x).astype(np.int64)
    return np.where(x == 255, np.nan, np.exp2(x - 127.0))


def numpy_dequantize(qw: QuantizedExperts) -> np.ndarray:
    """float64 [E, N, K]: w = (q - z) * scale[e, n, k // G], with z = 8 / 128 without zeros, K
    in the activations' order (stored input j is input qw.perm[e, j]); MXFP4 (codes "e2m1"):
    w = e2m1(q) * 2^(X - 127)."""
    bits = qw.bits
    q = numpy_unpack_k(qw.qweight, bits)  # [E, N, K]
    e, n, k = q.shape
    g = k if qw.group_size == -1 else qw.group_size
    if qw.codes == "e2m1":
        w = NUMPY_E2M1[q] * np.repeat(numpy_e8m0(qw.scales), g, axis=-1)  # [E, N, K]
    else:
        s = np.asarray(qw.scales, np.float64)  # [E, N, K//G]
        if qw.zeros is None:
            z = np.full(s.shape, 1 << (bits - 1), np.int64)
        else:
            z = numpy_unpack_zeros(qw.zeros, bits)
        w = ((q - np.repeat(z, g, axis=-1)) * np.repeat(s, g, axis=-1)).reshape(e, n, k)
    if qw.perm is None:
        return w
    out = np.empty_like(w)
    np.put_along_axis(out, np.broadcast_to(np.asarray(qw.perm)[:, None, :], w.shape), w, axis=2)
    return out


def numpy_gptq_weight(qweight, qzeros, scales, g_idx, bits: int) -> np.ndarray:
    """float64 [N, K] of GPTQ v1 checkpoint tensors: w[k, n] = (q[k, n] - z[g_idx[k], n]) *
    scales[g_idx[k], n], q packed along K (qweight [K*b/32, N]) and zero - 1 along N (qzeros
    [K/G, N*b/32]), low bits first."""
    q = numpy_unpack_k(np.asarray(qweight).view(np.uint32).T, bits)  # [N, K]
    z = (numpy_unpack_k(np.asarray(qzeros).view(np.uint32), bits) + 1) % (1 << bits)  # [G, N]
    s = np.asarray(scales).astype(np.float64)  # [G, N]
    g_idx = np.asarray(g_idx)
    return (q - z[g_idx].T) * s[g_idx].T


def with_random_perm(rng: np.random.Generator, qw: QuantizedExperts) -> QuantizedExperts:
    """qw with a random input permutation per expert (int32 [E, K] on the host)."""
    perm = np.argsort(rng.random((qw.num_experts, qw.k)), axis=1).astype(np.int32)
    return dataclasses.replace(qw, perm=perm)


def _silu(v: np.ndarray) -> np.ndarray:
    return 0.5 * v * (1.0 + np.tanh(0.5 * v))  # v * sigmoid(v), without exp overflow


def numpy_clamped_swiglu(gate, up, act) -> np.ndarray:
    """gpt-oss's activation (a wj.ClampedSwiGLU `act`) of float64 halves, as transformers'
    GptOssExperts computes it."""
    gate = np.minimum(gate, act.limit)
    sigmoid = 0.5 * (1.0 + np.tanh(0.5 * act.alpha * gate))  # without exp overflow
    return (np.clip(up, -act.limit, act.limit) + 1) * gate * sigmoid


def numpy_fused_moe(
    x, w13_deq, w2_deq, topk_weights, topk_ids, expert_map=None, activation_dtype=None,
    rows_dtype=None, activation=None, w13_bias=None, w2_bias=None,
) -> np.ndarray:  # fmt: skip
    """The MoE layer in float64: out[t] = sum_j w[t,j] * w2[e] @ silu_mul(w13[e] @ x[t]).

    Args:
        x: [T, H].  w13_deq: [E_local, 2I, H] dequantized.  w2_deq: [E_local, H, I].
        topk_weights: [T, k].  topk_ids: [T, k] global ids; ids outside [0, E_global) and ids
            whose expert_map entry is -1 contribute nothing.
        expert_map: optional [E_global] global -> local id (-1 off-shard).
        activation_dtype: round silu_mul's output to this dtype before GEMM2, for a backend
            whose contract does (its GEMM2 reads the activation in x's dtype). The rounding
            error can be amplified by cancellation in GEMM2's sums beyond the output tolerance
            (a bf16 case: 0.0052 on an element of 0.097), so such a backend is checked against
            its own contract.
        rows_dtype: likewise, round each slot's GEMM2 row (before its routing weight) to this
            dtype, for a backend that writes its rows so (the mgpu backend's opt-in
            bf16_down_rows).
        activation: None (silu) or a wj.ClampedSwiGLU (`numpy_clamped_swiglu`).
        w13_bias, w2_bias: optional per-expert biases [E_local, 2I] and [E_local, H], added to
            each GEMM's products (GEMM2's before the routing weight).

    Returns:
        float64 [T, H].
    """
    x = np.asarray(x, np.float64)
    w13 = np.asarray(w13_deq, np.float64)
    w2 = np.asarray(w2_deq, np.float64)
    wts = np.asarray(topk_weights, np.float64)
    ids = np.asarray(topk_ids).astype(np.int64)
    t, h = x.shape
    e_local, two_i, _ = w13.shape
    i = two_i // 2
    e_global = e_local if expert_map is None else len(expert_map)
    valid = (ids >= 0) & (ids < e_global)
    local = np.full(ids.shape, -1, np.int64)
    if expert_map is None:
        local[valid] = ids[valid]
    else:
        local[valid] = np.asarray(expert_map).astype(np.int64)[ids[valid]]
    out = np.zeros((t, h), np.float64)
    for e in range(e_local):
        rows, slots = np.nonzero(local == e)
        if rows.size == 0:
            continue
        hid = x[rows] @ w13[e].T  # [n, 2I]
        if w13_bias is not None:
            hid = hid + np.asarray(w13_bias, np.float64)[e]
        if activation is None:
            act = _silu(hid[:, :i]) * hid[:, i:]  # [n, I]
        else:
            act = numpy_clamped_swiglu(hid[:, :i], hid[:, i:], activation)
        if activation_dtype is not None:
            act = np.asarray(jnp.asarray(act, activation_dtype), np.float64)
        y = act @ w2[e].T  # [n, H]
        if w2_bias is not None:
            y = y + np.asarray(w2_bias, np.float64)[e]
        if rows_dtype is not None:
            y = np.asarray(jnp.asarray(y, rows_dtype), np.float64)
        y = y * wts[rows, slots][:, None]
        np.add.at(out, rows, y)
    return out


def numpy_moe_align(topk_ids, *, num_experts: int, block_m: int, expert_map=None) -> dict:
    """The expected moe_align_block_size layout (runs in ascending expert order, like vLLM).

    Returns:
        dict with max_padded, sentinel (T*k), total (num_tokens_post_padded), expert_ids
        (int32 [max_padded // block_m]) and runs: [(global expert, start, padded length,
        sorted list of the flat slot indices t*k + j routed to it)], experts without slots
        omitted.
    """
    flat = np.asarray(topk_ids).astype(np.int64).reshape(-1)
    num_slots = flat.size
    max_padded = -(-(num_slots + num_experts * (block_m - 1)) // block_m) * block_m
    expert_ids = np.full(max_padded // block_m, -1, np.int32)
    runs = []
    start = 0
    for e in range(num_experts):
        slots = sorted(np.nonzero(flat == e)[0].tolist())
        if not slots:
            continue
        padded = -(-len(slots) // block_m) * block_m
        local = e if expert_map is None else int(np.asarray(expert_map)[e])
        expert_ids[start // block_m : (start + padded) // block_m] = local
        runs.append((e, start, padded, slots))
        start += padded
    return dict(
        max_padded=max_padded,
        sentinel=num_slots,
        total=start,
        expert_ids=expert_ids,
        runs=runs,
    )


def assert_alignment_matches(
    routing: AlignedRouting, topk_ids, *, num_experts: int, block_m: int, expert_map=None
) -> None:
    """Checks an AlignedRouting against `numpy_moe_align`: runs compared as sets, ints exact."""
    want = numpy_moe_align(
        topk_ids, num_experts=num_experts, block_m=block_m, expert_map=expert_map
    )
    assert routing.block_m == block_m
    ids = np.asarray(routing.sorted_token_ids)
    eids = np.asarray(routing.expert_ids)
    assert ids.dtype == np.int32 and ids.shape == (want["max_padded"],), (ids.dtype, ids.shape)
    assert eids.dtype == np.int32 and eids.shape == (want["max_padded"] // block_m,)
    npp = np.asarray(routing.num_tokens_post_padded)
    assert npp.shape == () and npp.dtype == np.int32, (npp.shape, npp.dtype)
    assert int(npp) == want["total"], f"num_tokens_post_padded {int(npp)} != {want['total']}"
    sentinel = want["sentinel"]
    for e, start, padded, slots in want["runs"]:
        run = ids[start : start + padded]
        got = sorted(run[run != sentinel].tolist())
        assert got == slots, f"expert {e}: run [{start}, {start + padded}) holds {got} != {slots}"
    np.testing.assert_array_equal(
        ids[want["total"] :], sentinel, err_msg="padding past num_tokens_post_padded"
    )
    np.testing.assert_array_equal(eids, want["expert_ids"], err_msg="expert_ids")


# ---- tests that need several devices --------------------------------------------------------

# Set in the subprocess that re-runs a test file with fake CPU devices.
CPU_DEVICES_CHILD_ENV = "WNA16_TEST_CPU_DEVICES_CHILD"


def require_devices(n: int):
    """The first n devices, or a skip (fail inside the re-run subprocess) when JAX has fewer."""
    import os

    import jax
    import pytest

    if jax.device_count() < n:
        if os.environ.get(CPU_DEVICES_CHILD_ENV):
            pytest.fail(f"the subprocess has {jax.device_count()} devices despite XLA_FLAGS")
        pytest.skip(
            f"needs {n} devices, JAX has {jax.device_count()}; the file's "
            f"test_run_this_file_with_8_cpu_devices re-runs it with {n} CPU devices"
        )
    return jax.devices()[:n]


def run_file_with_cpu_devices(path, n: int, *extra_pytest_args: str) -> str:
    """Runs the test file `path` in a fresh pytest process with n fake CPU devices.

    The device count is fixed when JAX starts, so sharded tests re-run their own file this way
    when the main test process has one device. Returns the output; asserts that it passed.
    """
    import os
    import pathlib
    import re
    import subprocess
    import sys

    import jax
    import pytest

    if jax.device_count() >= n:
        pytest.skip(f"{jax.device_count()} devices: the sharded tests ran in this process")
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    env["JAX_PLATFORMS"] = "cpu"
    env[CPU_DEVICES_CHILD_ENV] = "1"
    path = pathlib.Path(path)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    proc = subprocess.run(
        [*cmd, *extra_pytest_args, str(path)],
        cwd=path.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{n}-device run failed (rc {proc.returncode}):\n{out[-20000:]}"
    assert re.search(r"\d+ passed", out), out[-5000:]
    return out


def load_script(path: pathlib.Path, name: str, search=()):
    """The script at `path` (e.g. in examples/) imported as module `name`, registered in
    sys.modules (dataclasses look their module up by name), with the folders in `search` on
    sys.path while it loads (its own imports of sibling scripts)."""
    folders = [str(f) for f in search]
    sys.path[:0] = folders
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        del sys.path[: len(folders)]
