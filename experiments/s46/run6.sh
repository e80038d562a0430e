#!/usr/bin/env bash
# Session 46, run 6 (one lent H200): the final code (MoE prefill chunk limit 4096): the prefill tests again.
set -u
export PYTEST_ARGS="tests/test_kernels_gpu.py tests/test_gpu_e2e.py" PYTEST_K="moe_prefill_chunks or long_prompt"
bash scripts/gpu_lease.sh pytest 2>&1 | sed -n '/^--- /,$p'
