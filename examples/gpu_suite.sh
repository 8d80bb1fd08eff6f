#!/usr/bin/env bash
# The GPU checks and figures in one go, step by step; results land in ${OUT:-out}/.
#
# Usage: bash examples/gpu_suite.sh [STEP ...]     (default: tests bench)
# Steps:
#   tests       the kernel tests compiled on the GPU (gpu-marked DeepSeek-V3 cases included;
#               the 1536-case full grid of test_wna16_gemm.py only with FULL=1, on 8 workers)
#   tune-decode tune.py at M = 1, 16 (both GEMMs); installs the table for the steps after it
#   tune-large  tune.py at M = 256, 4096 (merged into the same table)
#   tune-tp8    tune.py on the TP=8 slice (I=256) at M = 1, 16 (merged into the same table)
#   bench       benchmark.py, pallas and mgpu: DeepSeek-V3 TP=1 with and without zero points
#               (pallas' stages, JSON, roofline), the TP=8 slice; each row also in a model step
#               of STRAIGHT (default 32; 0: off) calls (benchmark.py --straight)
#   int8        benchmark.py: W8A8 vs W8A16 (per-channel int8) at M = 1, 256, 4096
#   w8a16       benchmark.py: W8A16 (per-channel int8) at M = 1, 256, 4096 (int8 runs it too)
#   model       generate.py --full-width-layers 8 at batch 1, 8, 64 (EXPERTS, default pallas), the
#               quantized linears on xla and on the Pallas GEMM (each model built once)
#   ep2         (2 GPUs) 8 layers at EP=2, batch 1, 8, 64; 30 layers at EP=2, batch 1, 8
#               (LAYERS: which layer counts, default "8 30"; EP2_TIMEOUT: s per run, 400;
#               EXPERTS: the experts' --implementation, default pallas, e.g. mgpu)
#   sharded     (2 GPUs) model on GPU 0 alone, then ep2
#   triton      the triton backend's GPU tests and the pallas/triton benchmark side by side
#   mgpu        the 'mgpu' backend: its tests compiled (MGPU_TESTS=0 skips them), then
#               mgpu_probe.py on DeepSeek-V3 TP=1 with zero points at M = MGPU_MS (default
#               "1 16 256 4096") and the TP=8 slice at M = MGPU_TP8_MS (default "1 16"; an empty
#               list skips a preset); MGPU_SEARCH=1 adds the probe's config search;
#               MGPU_ROUTING=identical routes every token like the first (one prompt, greedy);
#               MGPU_CONFIGS="8,256,3,0,-,128 ..." also times these configs (mgpu_probe.py --configs)
#   splitk      split-K on the TP=8 slice's GEMM1 (N=512, K=7168) in a model step, GEMM1 alone:
#               16 calls written out, each waiting for the last, traced (mgpu_probe.py
#               --gemms-only 1 --straight 16) at M = 1, 4, 8, 16; unsplit and 2 / 4 splits at 2
#               and 3 stages (the issue's >= 1.5x target; session 24)
#   mgpu-profile  mgpu_profile.py: in-kernel profile (time per k-step, share per region, resident
#               warpgroups per SM) and ptxas registers/smem of the mgpu GEMMs, DeepSeek-V3 TP=1 at
#               M = PROFILE_MS (default "1 16 256 4096"), the TP=8 slice at M=1
# A tuned table from an earlier call can be passed in with TUNED=path (copied into the package).
# LINEARS: the model step's --linear-implementation values (default "xla pallas").
# TEST_FILES: the tests step's files (default: every kernel test file).
# TUNE_BUDGET: seconds per (GEMM, M) search (default 40). INSTALL=0: the tune steps leave the
# package's table alone (their table is in $OUT/tuned.json), e.g. while another GPU benchmarks.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests bench)
python3 -c "import jax; print(jax.__version__, jax.devices())"
device=$(python3 -c "from wna16_jax import _configs; print(_configs._device_file_name(_configs.device_kind()))")
table=wna16_jax/data/tuned/$device
if [ -n "${TUNED:-}" ]; then
    mkdir -p "$(dirname "$table")" && cp "$TUNED" "$table"
fi

for step in "${steps[@]}"; do
    echo "=== $step ($(date -u +%H:%M:%S))"
    case $step in
    tests)
        # Compiling dominates: 4 workers share the GPU (the DeepSeek-V3 cases hold ~6 GB of
        # weights each). Serially the step took 315 s on the H200.
        select="not full_grid"
        workers=(-n 4 --dist loadgroup)  # DeepSeek-sized cases on one worker (conftest.py)
        if [ "${FULL:-0}" = 1 ]; then
            select="full_grid"
            workers=(-n 8)
        fi
        # The platform allocator returns freed memory to the GPU: the BFC allocator (even
        # without preallocation) keeps what each worker once held, and 4 workers then ran out.
        XLA_PYTHON_CLIENT_ALLOCATOR=platform python3 -m pytest -q -p no:cacheprovider \
            --durations=10 "${workers[@]}" ${TEST_FILES:-tests/test_wna16_gemm.py \
            tests/test_fused_moe_kernels.py tests/test_align_kernel.py tests/test_w8a8.py \
            tests/test_gemm_epilogue.py tests/test_linear.py} -k "$select" 2>&1 |
            tee "$OUT/gpu_tests.log" | tail -40
        ;;
    tune-decode | tune-large | tune-tp8)
        ms="1 16"
        preset=deepseek-v3
        [ "$step" = tune-large ] && ms="256 4096"
        [ "$step" = tune-tp8 ] && preset=deepseek-v3-tp8
        [ -f "$table" ] && cp "$table" "$OUT/tuned.json"
        python3 examples/tune.py --preset $preset --m $ms --out "$OUT/tuned.json" \
            --budget-s "${TUNE_BUDGET:-40}" --trials "$OUT/$step-trials.json" \
            2>"$OUT/$step.log" | tee "$OUT/$step.txt"
        if [ "${INSTALL:-1}" = 1 ]; then
            mkdir -p "$(dirname "$table")" && cp "$OUT/tuned.json" "$table"
        fi
        ;;
    bench)
        python3 examples/benchmark.py --m 1 16 256 4096 --stages --implementations pallas mgpu \
            --straight "${STRAIGHT:-32}" --json "$OUT/bench_zp.json" --plot "$OUT/roofline.png" 2>&1 | tee "$OUT/bench_zp.log"
        python3 examples/benchmark.py --m 1 16 256 4096 --no-zp --implementations pallas mgpu \
            --straight "${STRAIGHT:-32}" --json "$OUT/bench_sym.json" 2>&1 | tee "$OUT/bench_sym.log"
        python3 examples/benchmark.py --preset deepseek-v3-tp8 --m 1 16 --stages \
            --implementations pallas mgpu --straight "${STRAIGHT:-32}" --json "$OUT/bench_tp8.json" 2>&1 | tee "$OUT/bench_tp8.log"
        ;;
    int8)
        python3 examples/benchmark.py --activation-quant int8_per_token --m 1 256 4096 \
            --implementations pallas --json "$OUT/bench_w8a8.json" 2>&1 | tee "$OUT/bench_w8a8.log"
        ;&
    w8a16)
        python3 examples/benchmark.py --bits 8 --group-size -1 --no-zp --m 1 256 4096 \
            --implementations pallas --json "$OUT/bench_w8a16.json" 2>&1 |
            tee "$OUT/bench_w8a16.log"
        ;;
    model) # one GPU, 8 layers; the linears dequantize + dot (xla) or run the Pallas GEMM, A/B
        for lin in ${LINEARS:-xla pallas}; do
            timeout 300 python3 examples/generate.py --full-width-layers 8 \
                --implementation ${EXPERTS:-pallas} --linear-implementation $lin --batch-size 1 8 64 \
                --max-new-tokens 32 2>&1 | tee "$OUT/generate_1gpu_$lin.log" |
                grep -E "===|decode|speed|backend"
        done
        ;;
    ep2) # 2 GPUs: the 8-layer model at EP=2 (compare with "model"), then 30 layers at EP=2
        for layers in ${LAYERS:-8 30}; do
            batches="1 8 64"
            [ "$layers" -gt 8 ] && batches="1 8"  # too large for one GPU: that it runs, and how fast
            # shellcheck disable=SC2086
            timeout ${EP2_TIMEOUT:-400} python3 examples/generate.py --full-width-layers $layers --mesh expert=2 \
                --implementation ${EXPERTS:-pallas} --batch-size $batches --max-new-tokens 32 2>&1 |
                tee "$OUT/generate_ep2_${layers}layers.log" | grep -E "===|decode|speed|mesh|model"
        done
        ;;
    sharded) # 2 GPUs: the 8-layer model on GPU 0 alone, then the ep2 step
        CUDA_VISIBLE_DEVICES=0 OUT=$OUT bash "$0" model
        OUT=$OUT bash "$0" ep2
        ;;
    mgpu-profile)
        # shellcheck disable=SC2086  # a list of M
        python3 examples/mgpu_profile.py --m ${PROFILE_MS:-1 16 256 4096} \
            --out "$OUT/profile_tp1" 2>&1 | tee "$OUT/mgpu_profile_tp1.log"
        python3 examples/mgpu_profile.py --preset deepseek-v3-tp8 --m 1 \
            --out "$OUT/profile_tp8" 2>&1 | tee "$OUT/mgpu_profile_tp8.log"
        ;;
    mgpu)
        if [ "${MGPU_TESTS:-1}" = 1 ]; then
            python3 -m pytest -q -p no:cacheprovider --durations=5 tests/test_mgpu_gemm.py \
                tests/test_gather_rows.py 2>&1 |
                tee "$OUT/mgpu_tests.log" | tail -30
        fi
        search="${MGPU_SEARCH:+--search} ${MGPU_ROUTING:+--routing $MGPU_ROUTING}"
        search="$search ${MGPU_CONFIGS:+--configs $MGPU_CONFIGS}"
        ms=${MGPU_MS-1 16 256 4096}
        tp8_ms=${MGPU_TP8_MS-1 16}
        # shellcheck disable=SC2086  # lists of M
        [ -n "$ms" ] && python3 examples/mgpu_probe.py --m $ms $search \
            --json "$OUT/mgpu_tp1.json" 2>&1 | tee "$OUT/mgpu_tp1.log"
        # shellcheck disable=SC2086
        [ -n "$tp8_ms" ] && python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 \
            --m $tp8_ms $search --json "$OUT/mgpu_tp8.json" 2>&1 | tee "$OUT/mgpu_tp8.log"
        ;;
    splitk)
        python3 examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 1 4 8 16 --gemms-only 1 \
            --straight 16 --configs default:splits=1,stages=2 default:splits=1,stages=3 \
            default:splits=2,stages=2 default:splits=2,stages=3 default:splits=4,stages=2 \
            default:splits=4,stages=3 --json "$OUT/splitk.json" 2>&1 | tee "$OUT/splitk.log" |
            grep -E "GEMM1 traced|copy"
        ;;
    triton)
        bash examples/gpu_triton.sh 2>&1 | tee "$OUT/triton.log" | tail -40
        ;;
    *)
        echo "unknown step $step" >&2
        exit 2
        ;;
    esac
done
