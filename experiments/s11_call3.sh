#!/usr/bin/env bash
# Session 11, device call 3 (one H200): the compiled layer tests with one token's blocks (call 2
# ran them under a second -k that replaced the first, and timed out); M=4096 and symmetric
# weights at the final code; decode under XLA's command buffers (CUDA graphs, the Mosaic GPU
# custom calls and the while loop captured where XLA can), beside the same probe without them.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 170 python3 -m pytest -q -n 4 \
   tests/test_mgpu_gemm.py \
   -k "(one_token or fused_moe) and not expert_parallel and not tensor_parallel and not ragged" \
   > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
P="python3 examples/mgpu_probe.py --chain"
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"
XLA_FLAGS=$CB timeout 50 $P --preset deepseek-v3-tp8 --m 1 --json $OUT/cmdbuf_tp8.json \
   > $OUT/probe.log 2>&1
XLA_FLAGS=$CB timeout 60 $P --m 1 --json $OUT/cmdbuf_tp1.json >> $OUT/probe.log 2>&1
XLA_FLAGS=$CB timeout 40 python3 examples/kernel_timeline.py --m 1 > $OUT/timeline.log 2>&1
grep -E "layer|chained|GEMM|backend|copy|FAILED" $OUT/probe.log; grep -v Warn $OUT/timeline.log
timeout 150 $P --m 4096 --json $OUT/tp1_4096.json > $OUT/probe2.log 2>&1
timeout 100 python3 examples/mgpu_probe.py --m 1 16 --no-zp --json $OUT/tp1_sym.json \
   >> $OUT/probe2.log 2>&1
grep -E "layer|chained|GEMM|backend|copy|FAILED" $OUT/probe2.log
