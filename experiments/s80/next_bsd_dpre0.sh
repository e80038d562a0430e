#!/usr/bin/env bash
# Written in session 80 (not run: no device time), then superseded by experiments/s81/call1.sh, which holds this
# script's steps unchanged (the probe and slope of bsd / dpre0 / bsd+dpre0 / bsd+dpre1 against the defaults) plus the
# plain GEMV's bulk-staging GPU test. The reading it tests: the routed down's 3.2-3.5 us of staging h come back behind
# the block's own weight rounds; with DS4_BULK_STAGE=d and DS4_PREFETCH_DOWN=0, h is the block's first request.
# Usage (carry build/site): OUT=$OUT bash experiments/s80/next_bsd_dpre0.sh (runs experiments/s81/call1.sh)
exec bash "$(dirname "$0")/../s81/call1.sh" "$@"
