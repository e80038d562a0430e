#!/usr/bin/env bash
# Session 88, call 3 (the H100 of call 2, warm): seed_phase1 alone (8 layers of V4-Flash, the torch reference path:
# no extension) from this tree ("new") and from session 77's tree `bbfe2dd` ("old", a git worktree), alternating,
# two runs each. Why: call 2's baseline (67-71 ms) against 57.4-58.2 ms in the H100 sweeps of sessions 69-77 - the
# code or the host? The device tool ran this one line (a first try without task=bench model=v4_flash failed on
# the argument check: the ablation sets those); it is kept here as it ran. Logs: $OUT/{new,old}_{1,2}.log.
set -u; export WANDB_SILENT=true PYTHONUNBUFFERED=1; R=$PWD; git worktree add -f /tmp/old bbfe2dd >/dev/null 2>&1; echo "old $(git -C /tmp/old log -1 --format=%h)"; for i in 1 2; do for t in new old; do d=$R; [ $t = old ] && d=/tmp/old; (cd $d && PYTHONPATH=$d:$R/build/site timeout 90 python3 -m ds4 task=bench model=v4_flash experiment=seed_phase1 model.n_layers=8 tracking=none max_new_tokens=32 hydra.run.dir=/tmp/r_${t}_$i > $OUT/${t}_$i.log 2>&1; echo "$t $i rc=$?"; grep -E "TPOT median|TPOT p90" $OUT/${t}_$i.log); done; done
