"""The fused_moe checks every backend passes: FusedMoeCases, subclassed once per backend and mode.

Each check compares the backend with the 'xla' reference on the *same* quantized weights (and,
on the grid, with the float64 numpy layer of tests/helpers.py), so quantization error never
hides inside a tolerance: a grid of (T, E, k, H, I) in the spirit of vLLM's test_fused_moe
(odd T, duplicate experts, several formats), an expert_map with -1 experts, ids out of range,
token chunks, jit, an f32 output, act-order w13 (an input permutation) and zero tokens.

A subclass names the backend and says what it runs:

    class TestPallasInterpreted(FusedMoeCases):
        IMPLEMENTATION = "pallas_interpret"
        BACKEND_FUSED_MOE = staticmethod(
            helpers.pipeline_fused_moe(pallas_moe.stages, interpret=True)
        )

    @pytest.mark.gpu
    class TestPallasCompiled(TestPallasInterpreted):
        IMPLEMENTATION = "pallas"
        BACKEND_FUSED_MOE = staticmethod(helpers.pipeline_fused_moe(pallas_moe.stages))

BITS, ZERO_POINTS, DTYPES and ACTIVATION_QUANTS filter the grid CASES (or a subclass gives its
own CASES); SMALL is the problem of the other checks; LAYOUT the weights' layout the backend
reads (converted with wj.layouts.to_kernel_layout). SchemeCases, FusedMoeCases' base, runs the
matrix of weight schemes (SCHEMES: bits x group size x zero points x scale dtype) on fused_moe,
the grouped GEMM and the quantized linear; a backend without a fused_moe of its own ('xla')
subclasses it alone.
"""

from __future__ import annotations

import dataclasses
import os

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wna16_jax as wj
from wna16_jax import _dispatch

# Element-wise, |out - ref| <= tol * |ref| + ELEMENT_SLACK * tol * rms(ref) (tol: the norm-wise
# tolerance of the output dtype, helpers.TOLERANCES). Loose by design: a wrong row or column (an
# error of order rms) fails it, while single elements of sums of rounded terms may stray several
# standard deviations (measured up to ~2.5 tol * rms for bf16, the activation rounded to bf16
# before GEMM2 as the kernels do and the reference does not).
ELEMENT_SLACK = 5.0

# Out-of-range ids the alignment drops (E itself is added per case).
INVALID_IDS = (-1, -(2**31), 2**30)


@dataclasses.dataclass(frozen=True)
class MoeCase:
    """One fused_moe problem: shapes, weight format, activation dtype, activation quantization
    (None: 16-bit activations; "int8_per_token"; "int8_static": static scales from x)."""

    T: int
    E: int
    k: int
    H: int
    I: int
    bits: int = 4
    group_size: int = 64
    has_zp: bool = True
    dtype: str = "bfloat16"
    distinct: bool = True
    act_quant: str | None = None

    def __str__(self) -> str:
        fmt = f"int{self.bits}-g{self.group_size}-{'zp' if self.has_zp else 'sym'}"
        extra = ("" if self.distinct else "-dup") + (f"-{self.act_quant}" if self.act_quant else "")
        return f"T{self.T}-E{self.E}-k{self.k}-H{self.H}-I{self.I}-{fmt}-{self.dtype}{extra}"


# The grid of the 16-bit-activation backends.
CASES = (
    MoeCase(1, 8, 2, 128, 128, 4, 32, True, "bfloat16"),
    MoeCase(7, 16, 4, 128, 128, 8, 64, False, "float16"),
    MoeCase(33, 8, 2, 256, 128, 4, -1, True, "bfloat16", distinct=False),
    MoeCase(5, 8, 6, 128, 128, 8, 32, True, "float32"),
    MoeCase(12, 64, 6, 128, 128, 4, 64, False, "bfloat16"),
)


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A weight scheme of real checkpoints: bits, group size (-1: per channel), zero points and
    the scales' dtype (bfloat16; float16 as GPTQ stores them; float32; uint8 E8M0 for MXFP4),
    and the codes (QuantizedExperts.codes: "int", or "e2m1" for MXFP4)."""

    bits: int
    group_size: int
    has_zp: bool
    scale_dtype: str
    codes: str = "int"

    def __str__(self) -> str:
        if self.codes == "e2m1":
            return "mxfp4-g32-e8m0-scales"
        zp = "zp" if self.has_zp else "sym"
        return f"int{self.bits}-g{self.group_size}-{zp}-{self.scale_dtype}-scales"


# MXFP4 (gpt-oss's experts): E2M1 codes, one E8M0 scale per 32 inputs, no zero points.
MXFP4 = Scheme(4, 32, False, "uint8", codes="e2m1")
# Every scheme: groups of 32 (Kimi-K2's), 64, 128 and per channel, with and without zero
# points, scales in bfloat16, float16 and float32, int4 and int8; and MXFP4.
SCHEMES = tuple(
    Scheme(bits, group, has_zp, scale_dtype)
    for bits in (4, 8)
    for group in (32, 64, 128, -1)
    for has_zp in (True, False)
    for scale_dtype in ("bfloat16", "float16", "float32")
) + (MXFP4,)
# The spread of random MXFP4 weights in the scheme checks: their E8M0 scales then span 2^-4 to
# 2^4 (bytes 123 to 131), both sides of 1 (byte 127).
MXFP4_STD = 18.0
# The schemes' problem: bf16 activations (every backend's), H and I multiples of every group.
SCHEME_PROBLEM = dict(T=5, E=4, k=2, H=128, I=128)

# Batch invariance: row r of a call with M rows equals the same row computed alone, bit for
# bit, for each M and r at the first, middle and last position. CI runs SAMPLED_SCHEMES (int4
# and int8, with and without zero points, groups of 32, 128 and per channel, each scale dtype);
# WNA16_TEST_ALL_SCHEMES=1 runs every scheme of SCHEMES.
INVARIANT_MS = (1, 2, 7, 64, 300)
ALL_SCHEMES_ENV = "WNA16_TEST_ALL_SCHEMES"
SAMPLED_SCHEMES = (
    Scheme(4, 32, True, "bfloat16"),
    Scheme(8, 128, False, "float16"),
    Scheme(4, -1, False, "float32"),
)


def invariant_schemes() -> tuple[Scheme, ...]:
    """The schemes of the batch-invariance checks: SAMPLED_SCHEMES, or every one under
    WNA16_TEST_ALL_SCHEMES=1."""
    return SCHEMES if os.environ.get(ALL_SCHEMES_ENV) == "1" else SAMPLED_SCHEMES


def invariant_positions(m: int) -> tuple[int, ...]:
    """The rows checked in a call of m rows: first, middle, last."""
    return tuple(sorted({0, m // 2, m - 1}))


def assert_rows_batch_invariant(call, num_rows: int, what: str) -> None:
    """call(rows) -> [len(rows), ...]: for each M of INVARIANT_MS (up to num_rows), the rows at
    `invariant_positions` of call(range(M)) equal call([r]) bit for bit (AssertionError naming
    M, r and the number of differing elements otherwise)."""
    alone: dict[int, np.ndarray] = {}
    for m in (m for m in INVARIANT_MS if m <= num_rows):
        batch = np.asarray(call(np.arange(m)), np.float32)
        for r in invariant_positions(m):
            if r not in alone:
                alone[r] = np.asarray(call(np.array([r])), np.float32)[0]
            differ = int(np.sum(batch[r] != alone[r]))
            assert differ == 0, (
                f"{what}: row {r} of a call with M={m} rows differs from the row alone in "
                f"{differ} of {alone[r].size} elements (max |diff| "
                f"{np.max(np.abs(batch[r] - alone[r]))})"
            )


class SchemeCases:
    """The SCHEMES on fused_moe, the grouped GEMM and the quantized linear, each against the
    float64 layer or product on the dequantized weights (and fused_moe against 'xla'). A
    subclass sets IMPLEMENTATION, BITS, ZERO_POINTS and `prepare` (the layout it reads)."""

    IMPLEMENTATION: str = ""
    # The registered backend whose Backend.codes say which codes run (None: IMPLEMENTATION).
    BACKEND: str | None = None
    BITS: tuple[int, ...] = (4, 8)
    ZERO_POINTS: tuple[bool, ...] = (True, False)
    # True: the backend computes rows batch-invariantly (batch_invariant=True); False: it
    # refuses batch_invariant=True with its reason; None: not checked (no registered name).
    BATCH_INVARIANT: bool | None = True
    # The scheme checks' problem (fused_moe's; the GEMM's K is H).
    PROBLEM: dict = SCHEME_PROBLEM

    def pytest_generate_tests(self, metafunc):
        if "scheme" in metafunc.fixturenames:
            schemes = [s for s in SCHEMES if self.supports_scheme(s)]
            metafunc.parametrize("scheme", schemes, ids=[str(s) for s in schemes])
        if "invariant_scheme" in metafunc.fixturenames:
            schemes = [s for s in invariant_schemes() if self.supports_scheme(s)]
            if self.BATCH_INVARIANT is not True:
                schemes = []  # refused (test_batch_invariant_refused) or not checked
            metafunc.parametrize("invariant_scheme", schemes, ids=[str(s) for s in schemes])

    def supports_scheme(self, scheme: Scheme) -> bool:
        """The backend's bits and zero points, and codes it decodes (its Backend.codes)."""
        codes = _dispatch.get_backend(self.BACKEND or self.IMPLEMENTATION).codes
        return (
            scheme.bits in self.BITS and scheme.has_zp in self.ZERO_POINTS
            and scheme.codes in codes
        )  # fmt: skip

    def prepare(self, w):
        return w

    @staticmethod
    def scheme_weights(rng, scheme: Scheme, e: int, n: int, k: int):
        if scheme.codes == "e2m1":
            w = wj.random_quantized_experts(rng, (e, n, k), scheme="mxfp4", std=MXFP4_STD)
            codes = helpers.numpy_unpack_k(w.qweight, 4)
            scales = np.asarray(w.scales)
            # Every E2M1 code, and scales both above and below 1 (E8M0 byte 127).
            assert set(np.unique(codes)) == set(range(16)), np.unique(codes)
            assert scales.min() < 127 < scales.max(), (scales.min(), scales.max())
            return w
        return helpers.random_quantized_experts(
            rng, e, n, k, scheme.bits, scheme.group_size, scheme.has_zp,
            jnp.dtype(scheme.scale_dtype),
        )  # fmt: skip

    def assert_scheme_close(self, out, ref, what: str) -> None:
        helpers.assert_finite_and_close(
            np.asarray(out, np.float32), np.asarray(ref, np.float64),
            helpers.tolerance(jnp.bfloat16), f"{self.IMPLEMENTATION} {what}",
            slack=ELEMENT_SLACK, require_signal=True,
        )  # fmt: skip

    def test_scheme_fused_moe(self, rng, scheme):
        p = self.PROBLEM
        x = jnp.asarray(rng.normal(size=(p["T"], p["H"])), jnp.bfloat16)
        w13 = self.scheme_weights(rng, scheme, p["E"], 2 * p["I"], p["H"])
        w2 = self.scheme_weights(rng, scheme, p["E"], p["H"], p["I"])
        tw, ti = (jnp.asarray(a) for a in helpers.random_routing(rng, p["T"], p["k"], p["E"]))
        out = jax.block_until_ready(
            wj.fused_moe(
                x, self.prepare(w13), self.prepare(w2), tw, ti,
                implementation=self.IMPLEMENTATION,
            )
        )  # fmt: skip
        assert out.shape == x.shape and out.dtype == x.dtype
        want = helpers.numpy_fused_moe(
            x, helpers.numpy_dequantize(w13), helpers.numpy_dequantize(w2), tw, ti,
            activation_dtype=jnp.dtype(jnp.bfloat16),
        )  # fmt: skip
        self.assert_scheme_close(out, want, f"{scheme} fused_moe vs float64 oracle")
        ref = wj.fused_moe(x, w13, w2, tw, ti, implementation="xla")
        self.assert_scheme_close(out, ref, f"{scheme} fused_moe vs xla")

    def test_scheme_grouped_matmul(self, rng, scheme):
        """The grouped GEMM with silu (w13's [gate; up]) and routed weights, f32 output."""
        p = self.PROBLEM
        t, top_k, e, n, k = p["T"], p["k"], p["E"], 2 * p["I"], p["H"]
        a = jnp.asarray(rng.normal(size=(t, k)), jnp.bfloat16)
        w = self.scheme_weights(rng, scheme, e, n, k)
        _, ids = helpers.random_routing(rng, t, top_k, e)
        wk = self.prepare(w)
        cfg = wj.gemm_config(wk, t * top_k, implementation=self.IMPLEMENTATION)
        routing = wj.moe_align_block_size(
            jnp.asarray(ids), num_experts=e, block_m=cfg.block_m, implementation="xla"
        )
        rw = jnp.asarray(rng.uniform(0.5, 1.5, size=t * top_k), jnp.float32)
        out = wj.grouped_matmul(
            a, wk, routing, rw, top_k=top_k, implementation=self.IMPLEMENTATION,
            out_dtype=jnp.float32, activation="silu",
        )  # fmt: skip
        rows = np.asarray(a, np.float64)[np.arange(t * top_k) // top_k]
        ref = np.einsum("sk,snk->sn", rows, helpers.numpy_dequantize(w)[ids.reshape(-1)])
        gate, up = ref[:, : n // 2], ref[:, n // 2 :]
        ref = 0.5 * gate * (1 + np.tanh(gate / 2)) * up * np.asarray(rw, np.float64)[:, None]
        assert out.shape == ref.shape and out.dtype == jnp.float32
        self.assert_scheme_close(out, ref, f"{scheme} grouped_matmul vs float64")

    def test_scheme_linear(self, rng, scheme):
        """The quantized linear ([1, N, K]) on 3 rows, bf16 output."""
        w = self.scheme_weights(rng, scheme, 1, 192, self.PROBLEM["H"])
        x = jnp.asarray(rng.normal(size=(3, self.PROBLEM["H"])), jnp.bfloat16)
        out = wj.linear.quantized_matmul(x, self.prepare(w), implementation=self.IMPLEMENTATION)
        ref = np.asarray(x, np.float64) @ helpers.numpy_dequantize(w)[0].T
        assert out.shape == ref.shape and out.dtype == jnp.bfloat16
        self.assert_scheme_close(out, ref, f"{scheme} linear vs float64")

    # ---- batch invariance ------------------------------------------------------------------

    def invariant_inputs(self, rng, scheme: Scheme):
        """x [300, H] bf16, w13, w2 in the backend's layout, the routing [300, k] (numpy)."""
        p, t = SCHEME_PROBLEM, max(INVARIANT_MS)
        x = jnp.asarray(rng.normal(size=(t, p["H"])), jnp.bfloat16)
        w13 = self.prepare(self.scheme_weights(rng, scheme, p["E"], 2 * p["I"], p["H"]))
        w2 = self.prepare(self.scheme_weights(rng, scheme, p["E"], p["H"], p["I"]))
        return x, w13, w2, helpers.random_routing(rng, t, p["k"], p["E"])

    def test_batch_invariant_fused_moe(self, rng, invariant_scheme):
        x, w13, w2, (tw, ti) = self.invariant_inputs(rng, invariant_scheme)

        def call(rows):
            return wj.fused_moe(
                x[rows], w13, w2, jnp.asarray(tw[rows]), jnp.asarray(ti[rows]),
                implementation=self.IMPLEMENTATION, batch_invariant=True,
            )  # fmt: skip

        assert_rows_batch_invariant(call, x.shape[0], f"{self.IMPLEMENTATION} fused_moe")

    def test_batch_invariant_grouped_matmul(self, rng, invariant_scheme):
        """GEMM1 with silu and routed weights: each slot's row alone and in M tokens' slots."""
        x, w13, _, (tw, ti) = self.invariant_inputs(rng, invariant_scheme)
        e, top_k = SCHEME_PROBLEM["E"], SCHEME_PROBLEM["k"]
        cfg = wj.gemm_config(w13, top_k, implementation=self.IMPLEMENTATION, batch_invariant=True)
        assert cfg == wj.gemm_config(
            w13, 300 * top_k, implementation=self.IMPLEMENTATION, batch_invariant=True
        ), "a batch-invariant config depends on M"

        def call(rows):
            routing = wj.moe_align_block_size(
                jnp.asarray(ti[rows]), num_experts=e, block_m=cfg.block_m, implementation="xla"
            )
            out = wj.grouped_matmul(
                x[rows], w13, routing, jnp.asarray(tw[rows].reshape(-1)), top_k=top_k,
                implementation=self.IMPLEMENTATION, out_dtype=jnp.float32, activation="silu",
                batch_invariant=True,
            )  # fmt: skip
            return out.reshape(len(rows), -1)  # a token's k slot rows side by side

        assert_rows_batch_invariant(call, x.shape[0], f"{self.IMPLEMENTATION} grouped_matmul")

    def test_batch_invariant_linear(self, rng, invariant_scheme):
        w = self.prepare(self.scheme_weights(rng, invariant_scheme, 1, 192, SCHEME_PROBLEM["H"]))
        x = jnp.asarray(rng.normal(size=(max(INVARIANT_MS), SCHEME_PROBLEM["H"])), jnp.bfloat16)

        def call(rows):
            return wj.linear.quantized_matmul(
                x[rows], w, implementation=self.IMPLEMENTATION, batch_invariant=True
            )

        assert_rows_batch_invariant(call, x.shape[0], f"{self.IMPLEMENTATION} linear")

    def test_batch_invariant_refused(self, rng):
        """A backend that cannot guarantee batch invariance refuses it with its reason, and the
        automatic choice passes over it."""
        if self.BATCH_INVARIANT is not False:
            pytest.skip(f"{self.IMPLEMENTATION} runs batch_invariant=True or is not checked")
        scheme = next(s for s in SCHEMES if self.supports_scheme(s))
        p = SCHEME_PROBLEM
        x = jnp.asarray(rng.normal(size=(3, p["H"])), jnp.bfloat16)
        w13 = self.prepare(self.scheme_weights(rng, scheme, p["E"], 2 * p["I"], p["H"]))
        w2 = self.prepare(self.scheme_weights(rng, scheme, p["E"], p["H"], p["I"]))
        tw, ti = (jnp.asarray(a) for a in helpers.random_routing(rng, 3, p["k"], p["E"]))
        args = (x, w13, w2, tw, ti)
        with np.testing.assert_raises_regex(NotImplementedError, "batch-invariant"):
            wj.fused_moe(*args, implementation=self.IMPLEMENTATION, batch_invariant=True)
        chosen = wj.select_implementation(
            *args, implementation=(self.IMPLEMENTATION, "xla"), batch_invariant=True
        )
        assert chosen == "xla"


class FusedMoeCases(SchemeCases):
    """The checks; see the module docstring for what a subclass sets."""

    IMPLEMENTATION: str = ""  # the backend's name in wj.fused_moe
    # The backend module's layer as the library runs it (helpers.pipeline_fused_moe of its
    # stages, interpret bound): the token chunks' size is the pipeline's argument (chunk_tokens),
    # not the public API's.
    BACKEND_FUSED_MOE = None
    LAYOUT = "canonical"
    BITS: tuple[int, ...] = (4, 8)
    ZERO_POINTS: tuple[bool, ...] = (True, False)
    DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")
    ACTIVATION_QUANTS: tuple[str | None, ...] = (None,)
    CASES: tuple[MoeCase, ...] = CASES
    SMALL = MoeCase(9, 8, 2, 128, 128)

    # ---- what a subclass may override --------------------------------------------------------

    def pytest_generate_tests(self, metafunc):
        """The grid test runs the CASES this backend supports, the scheme checks its SCHEMES."""
        super().pytest_generate_tests(metafunc)
        if "case" in metafunc.fixturenames:
            cases = [c for c in self.CASES if self.supports(c)]
            metafunc.parametrize("case", cases, ids=[str(c) for c in cases])

    def supports_scheme(self, scheme: Scheme) -> bool:
        """16-bit activations (a W8A8 subclass runs its own weights)."""
        return (
            super().supports_scheme(scheme)
            and None in self.ACTIVATION_QUANTS
            and "bfloat16" in self.DTYPES
        )

    def supports(self, case: MoeCase) -> bool:
        return (
            case.bits in self.BITS
            and case.has_zp in self.ZERO_POINTS
            and case.dtype in self.DTYPES
            and case.act_quant in self.ACTIVATION_QUANTS
        )

    def tolerance(self, dtype) -> float:
        """Norm-wise relative error allowed against the 'xla' reference and the oracle."""
        return helpers.tolerance(dtype)

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids, **kwargs):
        """The backend's fused_moe on canonical weights (kwargs: expert_map, out_dtype,
        activation_quant), through the public API; traceable."""
        return wj.fused_moe(
            x, self.prepare(w13), self.prepare(w2), topk_weights, topk_ids,
            implementation=self.IMPLEMENTATION, **kwargs,
        )  # fmt: skip

    def fused_moe_in_chunks(self, x, w13, w2, topk_weights, topk_ids, *, chunk_tokens, **kwargs):
        """The backend's layer in chunks of chunk_tokens tokens."""
        return self.BACKEND_FUSED_MOE(
            x, self.prepare(w13), self.prepare(w2), topk_weights, topk_ids,
            chunk_tokens=chunk_tokens, **kwargs,
        )  # fmt: skip

    def prepare(self, w):
        return wj.layouts.to_kernel_layout(w, self.LAYOUT)

    def oracle(self, x, w13, w2, topk_weights, topk_ids, case: MoeCase, expert_map=None):
        """The float64 layer on the dequantized weights, with GEMM2 reading the activation in
        x's dtype as the kernels do (None: no oracle for this case)."""
        if case.act_quant is not None:  # the int8 oracle is the 'xla' backend (test_w8a8.py)
            return None
        return helpers.numpy_fused_moe(
            x, helpers.numpy_dequantize(w13), helpers.numpy_dequantize(w2), topk_weights,
            topk_ids, expert_map=None if expert_map is None else np.asarray(expert_map),
            activation_dtype=jnp.dtype(case.dtype),
        )  # fmt: skip

    def assert_close(self, out, ref, dtype, what: str) -> None:
        """out is finite everywhere and matches ref (norm-wise tolerance, element-wise with
        ELEMENT_SLACK)."""
        helpers.assert_finite_and_close(
            np.asarray(out, np.float32), np.asarray(ref, np.float64), self.tolerance(dtype),
            f"{self.IMPLEMENTATION} {what}", slack=ELEMENT_SLACK, require_signal=True,
        )  # fmt: skip

    # ---- inputs ------------------------------------------------------------------------------

    @staticmethod
    def inputs(rng, case: MoeCase):
        """(x, w13, w2, topk_weights, topk_ids) for case, weights canonical."""
        return helpers.random_moe_inputs(
            rng, T=case.T, H=case.H, I=case.I, E=case.E, k=case.k, bits=case.bits,
            group_size=case.group_size, has_zp=case.has_zp, dtype=jnp.dtype(case.dtype),
            distinct=case.distinct,
        )  # fmt: skip

    @staticmethod
    def quant_args(case: MoeCase, x) -> dict:
        """fused_moe's activation_quant argument for case ({} for 16-bit activations)."""
        if case.act_quant is None:
            return {}
        if case.act_quant == "int8_static":  # scales a calibration would pick
            s1 = float(np.max(np.abs(np.asarray(x, np.float32)))) / 127
            return {"activation_quant": wj.ActivationQuant("int8_static", s1, 4.0 / 127)}
        return {"activation_quant": wj.ActivationQuant(case.act_quant)}

    def run(self, x, w13, w2, topk_weights, topk_ids, **kwargs):
        """`fused_moe`'s result, waited for before the next computation is dispatched: the
        Mosaic GPU interpreter's callbacks run JAX operations themselves, and one queued behind
        a computation dispatched meanwhile can wait forever."""
        return jax.block_until_ready(self.fused_moe(x, w13, w2, topk_weights, topk_ids, **kwargs))

    def run_both(self, x, w13, w2, topk_weights, topk_ids, case: MoeCase, **kwargs):
        """(backend output, 'xla' output) with the same arguments."""
        kwargs |= self.quant_args(case, x)
        out = self.run(x, w13, w2, topk_weights, topk_ids, **kwargs)
        ref = wj.fused_moe(x, w13, w2, topk_weights, topk_ids, implementation="xla", **kwargs)
        want_dtype = jnp.dtype(kwargs.get("out_dtype") or x.dtype)
        assert out.shape == x.shape and out.dtype == want_dtype, (out.shape, out.dtype)
        return out, ref

    # ---- the checks --------------------------------------------------------------------------

    def test_matches_xla_and_oracle(self, rng, case):
        x, w13, w2, tw, ti = self.inputs(rng, case)
        out, ref = self.run_both(x, w13, w2, tw, ti, case)
        self.assert_close(out, ref, case.dtype, "vs xla")
        want = self.oracle(x, w13, w2, tw, ti, case)
        if want is not None:
            self.assert_close(out, want, case.dtype, "vs float64 oracle")

    def test_expert_map_drops_off_shard_experts(self, rng):
        """A quarter of 4 * E experts local: tokens routed only off-shard give exactly 0, the
        rest matches 'xla' with the same map (a dropped id too)."""
        case = self.SMALL
        e_global = 4 * case.E
        x, w13, w2, tw, _ = self.inputs(rng, case)
        expert_map = np.full(e_global, -1, np.int32)
        local = rng.choice(e_global, size=case.E, replace=False)
        expert_map[local] = rng.permutation(case.E)
        remote = np.flatnonzero(expert_map < 0)
        _, ids = helpers.random_routing(rng, case.T, case.k, e_global)
        ids[:2] = rng.choice(remote, size=(2, case.k), replace=False)  # only off-shard
        ids[2] = rng.choice(local, size=case.k, replace=False)  # only local
        ids[3, 0] = -1
        ti, emap = jnp.asarray(ids), jnp.asarray(expert_map)
        out, ref = self.run_both(x, w13, w2, tw, ti, case, expert_map=emap)
        np.testing.assert_array_equal(
            np.asarray(out[:2], np.float32), 0.0, err_msg="tokens routed only off-shard"
        )
        self.assert_close(out, ref, case.dtype, "with expert_map vs xla")

    def test_out_of_range_ids_are_dropped(self, rng):
        """Ids < 0 or >= E contribute nothing; a token with only such ids gets exactly 0."""
        case = self.SMALL
        x, w13, w2, tw, ti = self.inputs(rng, case)
        ids = np.asarray(ti).copy()
        ids[0] = rng.choice(np.array((*INVALID_IDS, case.E)), size=case.k, replace=False)
        ids[1, -1] = -(2**31)
        ids[4, 0] = case.E + 5
        out, ref = self.run_both(x, w13, w2, tw, jnp.asarray(ids), case)
        np.testing.assert_array_equal(
            np.asarray(out[0], np.float32), 0.0, err_msg="a token whose every id is dropped"
        )
        self.assert_close(out, ref, case.dtype, "with dropped ids vs xla")

    def test_token_chunks(self, rng):
        """chunk_tokens=4 over T=9 (two full chunks and a padded one) matches 'xla'."""
        case = self.SMALL
        x, w13, w2, tw, ti = self.inputs(rng, case)
        args = self.quant_args(case, x)
        chunked = jax.block_until_ready(
            self.fused_moe_in_chunks(x, w13, w2, tw, ti, chunk_tokens=4, **args)
        )
        ref = wj.fused_moe(x, w13, w2, tw, ti, implementation="xla", **args)
        assert chunked.shape == x.shape and chunked.dtype == x.dtype
        self.assert_close(chunked, ref, case.dtype, "in chunks of 4 tokens vs xla")

    def test_under_jit(self, rng):
        """The layer traced under jax.jit, expert_map a traced argument (all local, permuted)."""
        case = self.SMALL
        x, w13, w2, tw, ti = self.inputs(rng, case)
        expert_map = jnp.asarray(rng.permutation(case.E).astype(np.int32))
        args = self.quant_args(case, x)
        layer = jax.jit(lambda *a, expert_map: self.fused_moe(*a, expert_map=expert_map, **args))
        out = jax.block_until_ready(layer(x, w13, w2, tw, ti, expert_map=expert_map))
        ref = wj.fused_moe(x, w13, w2, tw, ti, expert_map=expert_map, implementation="xla", **args)
        assert out.shape == x.shape and out.dtype == x.dtype
        self.assert_close(out, ref, case.dtype, "under jit vs xla")

    def test_out_dtype_float32_is_the_sum_before_rounding(self, rng):
        """out_dtype=float32 returns the f32 sum the default output rounds once to x.dtype."""
        case = self.SMALL
        x, w13, w2, tw, ti = self.inputs(rng, case)
        full, ref = self.run_both(x, w13, w2, tw, ti, case, out_dtype=jnp.float32)
        out, _ = self.run_both(x, w13, w2, tw, ti, case)
        np.testing.assert_array_equal(
            np.asarray(full.astype(x.dtype), np.float32), np.asarray(out, np.float32)
        )
        assert np.any(np.asarray(full) != np.asarray(out, np.float32))  # not just x.dtype values
        self.assert_close(full, ref, case.dtype, "f32 output vs xla")

    def test_act_order_w13(self, rng):
        """w13 with an input permutation per expert (GPTQ act-order, QuantizedExperts.perm):
        one token (a block per slot where the backend has one) and several, an expert_map
        with -1 experts and a dropped id; matches 'xla' and the float64 layer."""
        case = self.SMALL
        x, w13, w2, tw, _ = self.inputs(rng, case)
        w13 = helpers.with_random_perm(rng, w13)
        e_global = 2 * case.E
        expert_map = np.full(e_global, -1, np.int32)
        local = rng.choice(e_global, size=case.E, replace=False)
        expert_map[local] = rng.permutation(case.E)
        _, ids = helpers.random_routing(rng, case.T, case.k, e_global)
        ids[0] = rng.choice(local, size=case.k, replace=False)  # the one-token call's token
        ids[1, 0] = -1
        for t in (1, case.T):
            args = (x[:t], w13, w2, tw[:t], jnp.asarray(ids[:t]))
            out, ref = self.run_both(*args, case, expert_map=jnp.asarray(expert_map))
            self.assert_close(out, ref, case.dtype, f"act-order w13, T={t}, vs xla")
            want = self.oracle(*args, case, expert_map=expert_map)
            if want is not None:
                self.assert_close(out, want, case.dtype, f"act-order w13, T={t}, vs oracle")

    def test_zero_tokens(self, rng):
        case = self.SMALL
        x, w13, w2, tw, ti = self.inputs(rng, case)
        out = self.run(x[:0], w13, w2, tw[:0], ti[:0], **self.quant_args(case, x))
        assert out.shape == (0, case.H) and out.dtype == x.dtype
