#!/usr/bin/env bash
# NOT RUN (written in session 54, which had no device machine): the plan for the first session lent `nvidia-h200-x2`
# again (none since session 19, whose full model at tp=2 took 4.866 ms; the one-GPU slope has gone from about 125 to
# 104 µs per layer since). #7's targets at tp=2: the full 43-layer model at TPOT <= 3.3 ms, and the seed-phase sweep
# run with tp=2. Three device calls (one call runs at most 600 s; a warm machine keeps the build between them), each
# through scripts/gpu_lease.sh, with `carry: [".whl"]` (the hydra / omegaconf wheels: the device image has neither,
# and the sweep's `python -m ds4` needs them) or, since session 81, `carry: ["build/site"]` (the same packages
# installed into that folder, as sessions 73-81 carried it):
#   bash experiments/s54/next_tp2.sh tests   # build + the 2-GPU tests (tp=2 vs tp=1, graph vs eager, comm=ll's kernel)
#   bash experiments/s54/next_tp2.sh bench   # the full model: comm=ll, shared expert sliced (session 18's best form)
#   bash experiments/s54/next_tp2.sh sweep   # seed_phase1 against ds4_best in one sweep (session 17's form)
# The tp=2 GPU tests run small / tiny, where the dense FP8 GEMVs take the FMA kernels; tests/test_gpu_e2e.py's
# test_tp2_agrees_with_tp1_on_small also runs with DS4_MMA=all (session 54) so the tensor-core forms the full model
# takes are compared at world 2 too.
set -u
case "${1:-}" in
  tests) TP2_K="tp2 or all_reduce" bash scripts/gpu_lease.sh tp2_tests ;;
  bench) TP_LAYERS=43 TP_SHARED=tp TP_VARIANTS=kernels+fused+graph+cap8192+ll,kernels+fused+graph+cap8192+ll+bf16 \
           bash scripts/gpu_lease.sh tp2 ;;
  sweep) SEED_JOBS=experiment=seed_phase1,ds4_best bash scripts/gpu_lease.sh seed_tp2 ;;
  *) echo "usage: $0 tests|bench|sweep" >&2; exit 2 ;;
esac
