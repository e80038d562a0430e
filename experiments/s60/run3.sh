#!/usr/bin/env bash
# Session 60, run 3 (one lent GPU, one call; not run: the device refused its starts): a regression sweep of the
# current tree's GPU modules. The kernel modules first (each fast; the attention wrappers that session 59 changed
# before the rest), then test_gpu_e2e.py less what run 1 ran, while time is left (BUDGET seconds from the start).
# It runs session 59's runner with its sweep_* groups; logs and summary.txt in $OUT.
ONLY="sweep_attn sweep_kernels sweep_glue_qat sweep_capture_ar sweep_e2e" BUDGET=${BUDGET:-560} \
  exec bash experiments/s59/gpu_tests.sh
