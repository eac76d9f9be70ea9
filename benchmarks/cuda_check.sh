#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run: the Triton kernels' tests and the end-to-end
# Triton test on the GPU (the interpreter off), then the kernel benchmark's full table. Needs
# the project's Python dependencies importable, a CUDA GPU, and no Redis.
#
#     benchmarks/cuda_check.sh [OUT_DIR]      # logs and kernels_cuda.json go to OUT_DIR
set -u
out=${1:-benchmarks/results}
mkdir -p "$out"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
"$py" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
    torch.cuda.get_device_name(), torch.cuda.get_device_capability())'
"$py" -m pytest -q -p no:cacheprovider \
    tests/test_kernels_decode.py tests/test_kernels_prefill.py tests/test_kernels_cache_ops.py \
    tests/test_kernels_backend.py tests/test_e2e_triton.py \
    tests/test_worker_execute.py::test_the_kv_pool_is_what_kv_cache_memory_holds_on_either_device \
    2>&1 | tee "$out/cuda_tests.log"
tests=${PIPESTATUS[0]}
"$py" -m benchmarks.kernels --out "$out/kernels_cuda.json" 2>&1 | tee "$out/kernels_cuda.log"
bench=${PIPESTATUS[0]}
echo "cuda_check: tests rc=$tests, benchmark rc=$bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
