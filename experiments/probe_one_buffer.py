"""examples/mgpu_probe.py with one output buffer per warpgroup (the session-9 store: each
sub-tile waits until the last copy out has read the buffer), forced by SMEM_BYTES = 0; the A
side of session 10's A/B against each sub-tile through its own buffer. Same arguments."""

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pallas_kernels.mgpu_wna16_gemm as gemm  # noqa: E402

gemm.SMEM_BYTES = 0
sys.argv = ["mgpu_probe.py", *sys.argv[1:]]
runpy.run_path(os.path.join(ROOT, "examples", "mgpu_probe.py"), run_name="__main__")
