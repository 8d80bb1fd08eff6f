#!/usr/bin/env bash
# The repository's GPU checks and figures, step by step; each step's output lands in ${OUT:-out}/.
#
# Usage: bash examples/gpu_suite.sh [STEP ...]     (default: tests bench)
# Steps:
#   tests    the suite's compiled cases: every gpu-marked test (pytest -m gpu; DeepSeek-V3-sized
#            cases included), then the kernel test files' other cases (their kernels compiled on
#            a GPU); FULL=1: the full grid of test_wna16_gemm.py (1536 cases) instead
#   tune     tune.py: the pallas and mgpu tables on DeepSeek-V3 TP=1 (M = 1 16 256 4096) and on
#            the TP=8 slice (M = 1 16), merged into $OUT/tuned.json and installed as the
#            package's table for this GPU (INSTALL=0: not installed); TUNE_BUDGET: seconds per
#            search (default 40)
#   bench    benchmark.py, mgpu and pallas at M = 1 16 256 4096, each row also in a model step of
#            STRAIGHT (default 32) calls: DeepSeek-V3 TP=1 and the TP=8 slice, each with zero
#            points and symmetric (JSON; roofline of TP=1 with zero points)
#   int8     benchmark.py, pallas: W8A16 (int8 per-channel weights) and W8A8 (int8 per-token
#            activations) at M = 1 256 4096
#   model    generate.py --full-width-layers 8 at batch 1, 8, 64 (EXPERTS: the experts'
#            --implementation, default: the automatic choice)
#   profile  profile.py: the kernels of a model step of mgpu and pallas with ptxas' report,
#            DeepSeek-V3 TP=1 at M = 1 16 256 4096 and the TP=8 slice at M = 1 16
#   sharded  (2 GPUs) generate.py --full-width-layers 8 --mesh expert=2 at batch 1, 8, 64
# TUNED=path: a tuned table copied into the package before the steps run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests bench)
python3 -c "import jax; print(jax.__version__, jax.devices())"
# The package's tuned table for this GPU: wna16_jax/data/tuned/<device kind, lower case, runs of
# other characters as "_">.json (wna16_jax/_configs.py, device_file_name).
table=wna16_jax/data/tuned/$(python3 -c "import jax, re
print(re.sub('[^a-z0-9]+', '_', jax.devices()[0].device_kind.lower()).strip('_'))").json
if [ -n "${TUNED:-}" ]; then
    mkdir -p "$(dirname "$table")" && cp "$TUNED" "$table"
fi
run_bench() { # NAME ARGS...: benchmark.py with ARGS; its JSON and log are $OUT/NAME.*
    local name=$1
    shift
    python3 examples/benchmark.py "$@" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" |
        grep -v "^WARNING"
}
run_tests() { # pytest ARGS...: compiling dominates, so 4 workers share the GPU; the
    # DeepSeek-V3-sized cases (~6 GB of weights each) run on one of them (tests/conftest.py). The
    # platform allocator returns freed memory to the GPU (the default keeps what a worker held).
    XLA_PYTHON_CLIENT_ALLOCATOR=platform python3 -m pytest -q -p no:cacheprovider \
        --durations=10 -n 4 --dist loadgroup "$@"
}

for step in "${steps[@]}"; do
    echo "=== $step ($(date -u +%H:%M:%S))"
    case $step in
    tests)
        kernel_tests=(tests/test_wna16_gemm.py tests/test_fused_moe_kernels.py
            tests/test_align_kernel.py tests/test_gather_rows.py tests/test_mgpu_gemm.py
            tests/test_w8a8.py tests/test_gemm_epilogue.py tests/test_linear.py
            tests/test_triton_backend.py)
        if [ "${FULL:-0}" = 1 ]; then
            run_tests -k full_grid tests/test_wna16_gemm.py 2>&1 |
                tee "$OUT/gpu_tests_full.log" | tail -20
        else
            { run_tests -m gpu -k "not full_grid" tests
                run_tests -m "not gpu" "${kernel_tests[@]}"; } 2>&1 |
                tee "$OUT/gpu_tests.log" | tail -40
        fi
        ;;
    tune)
        [ -f "$table" ] && cp "$table" "$OUT/tuned.json"
        for preset_ms in "deepseek-v3:1 16 256 4096" "deepseek-v3-tp8:1 16"; do
            preset=${preset_ms%%:*}
            # shellcheck disable=SC2086  # a list of M
            python3 examples/tune.py --backends pallas mgpu --preset "$preset" \
                --m ${preset_ms#*:} --out "$OUT/tuned.json" --budget-s "${TUNE_BUDGET:-40}" \
                --trials "$OUT/tune_$preset-trials.json" 2>"$OUT/tune_$preset.log" |
                tee "$OUT/tune_$preset.txt"
        done
        if [ "${INSTALL:-1}" = 1 ]; then
            mkdir -p "$(dirname "$table")" && cp "$OUT/tuned.json" "$table"
        fi
        ;;
    bench)
        common=(--implementations mgpu pallas --straight "${STRAIGHT:-32}")
        run_bench bench_tp1_zp "${common[@]}" --m 1 16 256 4096 --plot "$OUT/roofline.png"
        run_bench bench_tp1_sym "${common[@]}" --m 1 16 256 4096 --no-zp
        run_bench bench_tp8_zp "${common[@]}" --preset deepseek-v3-tp8 --m 1 16 256 4096
        run_bench bench_tp8_sym "${common[@]}" --preset deepseek-v3-tp8 --m 1 16 256 4096 \
            --no-zp
        ;;
    int8)
        int8=(--implementations pallas --m 1 256 4096)
        run_bench bench_w8a16 "${int8[@]}" --bits 8 --group-size -1 --no-zp
        run_bench bench_w8a8 "${int8[@]}" --activation-quant int8_per_token
        ;;
    model)
        timeout 600 python3 examples/generate.py --full-width-layers 8 \
            ${EXPERTS:+--implementation "$EXPERTS"} --batch-size 1 8 64 --max-new-tokens 32 2>&1 |
            tee "$OUT/generate_1gpu.log" | grep -E "===|decode|speed|backend|model"
        ;;
    profile)
        python3 examples/profile.py --implementations mgpu pallas --m 1 16 256 4096 --ptxas \
            --json "$OUT/profile_tp1.json" 2>&1 | tee "$OUT/profile_tp1.log"
        python3 examples/profile.py --preset deepseek-v3-tp8 --implementations mgpu pallas \
            --m 1 16 --ptxas --json "$OUT/profile_tp8.json" 2>&1 | tee "$OUT/profile_tp8.log"
        ;;
    sharded)
        timeout 600 python3 examples/generate.py --full-width-layers 8 --mesh expert=2 \
            ${EXPERTS:+--implementation "$EXPERTS"} --batch-size 1 8 64 --max-new-tokens 32 2>&1 |
            tee "$OUT/generate_ep2.log" | grep -E "===|decode|speed|mesh|model"
        ;;
    *)
        echo "unknown step $step" >&2
        exit 2
        ;;
    esac
done
