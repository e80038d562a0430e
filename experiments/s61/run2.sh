#!/usr/bin/env bash
# Session 61, run 2 (one lent GPU, one call): what run 1's regression sweep (experiments/s60/run3.sh, BUDGET=560)
# left: the fixed test_router_refuses_a_ride_it_cannot_take (group router_ride, -k ride: it and a dequant test whose
# name holds "strided"), then the test_gpu_e2e.py tests that its sweep_e2e group did not reach before its limit (the
# graph tests first, then the options rows).
ONLY="router_ride e2e_rest_graph e2e_rest_options" BUDGET=${BUDGET:-570} exec bash experiments/s59/gpu_tests.sh
# Run 3 (the same warm machine): the two options rows run 2's time did not reach.
#   ONLY="e2e_ffn" BUDGET=280 bash experiments/s59/gpu_tests.sh
