"""Where a CPU run's resident set peaks: runs `python -m ds4 ARGS...` in this process beside a thread that samples
VmRSS every 50 ms and keeps the main thread's Python stack at each new maximum by 64 MiB (printed at exit: every
maximum past 5 GiB, its innermost 4 frames).
Usage: python experiments/s67/rss_peak_stack.py model=v4_flash model.n_layers=1 max_new_tokens=2 tracking=none \
         hydra.run.dir=/tmp/peakout"""
from __future__ import annotations

import atexit
import runpy
import sys
import threading
import time
import traceback


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


peaks: list[tuple[float, int, str]] = []
main_id = threading.main_thread().ident
t0 = time.time()


def watch() -> None:
    best = 0
    while True:
        r = rss()
        if r > best + (64 << 20):  # a new maximum by 64 MiB or more
            best = r
            frame = sys._current_frames().get(main_id)
            stack = "".join(traceback.format_stack(frame)[-4:]) if frame is not None else "?"
            peaks.append((time.time() - t0, r, stack))
        time.sleep(0.05)


def report() -> None:
    for t, r, stack in [p for p in peaks if p[1] > 5 << 30]:
        print(f"--- {r / 2**30:.3f} GiB at {t:.1f} s\n{stack}", file=sys.stderr)


threading.Thread(target=watch, daemon=True).start()
atexit.register(report)
sys.argv = ["ds4"] + sys.argv[1:]
runpy.run_module("ds4", run_name="__main__", alter_sys=True)
