"""How far a CPU run's resident set rises past what the host-memory check counts: runs `python -m ds4 ARGS...` in
this process beside a thread that samples VmRSS every 20 ms, wraps `ds4.app.check_memory` to note the resident set
when the check runs (what MemAvailable has already paid for) and the check's count (`memory_need`), and prints at
exit: rss at the check, the count, the resident set (and the peak so far) after the weights load and after each
prefill, the peak, and the peak's excess over (rss at the check + the count), with the innermost frames at each new
maximum by 128 MiB past the check.
Usage: python experiments/s68/rss_gap.py model=v4_flash model.n_layers=1 max_new_tokens=2 tracking=none \
         hydra.run.dir=/tmp/gapout"""
from __future__ import annotations

import atexit
import runpy
import sys
import threading
import time
import traceback

import ds4.app as app

G = 2**30
main_id = threading.main_thread().ident
seen: dict = {"check_rss": None, "need": None, "parts": None, "peak": 0, "stacks": []}


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def watch() -> None:
    last = 0
    while True:
        r = rss()
        seen["peak"] = max(seen["peak"], r)
        if seen["check_rss"] is not None and r > max(last, seen["check_rss"]) + (128 << 20):
            last = r
            frame = sys._current_frames().get(main_id)
            stack = "".join(traceback.format_stack(frame)[-3:]) if frame is not None else "?"
            seen["stacks"].append((r, stack))
        time.sleep(0.02)


_check = app.check_memory


def check_memory(spec, args, chosen):
    seen["check_rss"] = rss()
    seen["parts"] = app.memory_need(spec, args, chosen)
    seen["need"] = sum(b for _, b in seen["parts"])
    return _check(spec, args, chosen)


app.check_memory = check_memory

from ds4.model.transformer import Transformer  # noqa: E402

marks: list[tuple[str, int, int]] = []


def _marked(name, fn):
    def wrapped(*a, **k):
        out = fn(*a, **k)
        marks.append((name, rss(), seen["peak"]))
        return out
    return wrapped


Transformer.load_weights = _marked("after load_weights", Transformer.load_weights)
Transformer.prefill = _marked("after prefill", Transformer.prefill)


def report() -> None:
    for r, stack in seen["stacks"]:
        print(f"--- {r / G:.3f} GiB\n{stack}", file=sys.stderr)
    for name, r, pk in marks:
        print(f"{name}: RSS {r / G:.3f} GiB (peak so far {pk / G:.3f})", file=sys.stderr)
    c, n, p = seen["check_rss"], seen["need"], seen["peak"]
    if c is None:
        print("the memory check did not run", file=sys.stderr)
        return
    print(f"RSS at the check {c / G:.3f} GiB; counted {n / G:.3f} GiB "
          f"({', '.join(f'{w} {b / G:.3f}' for w, b in seen['parts'])}); peak {p / G:.3f} GiB; "
          f"peak - (RSS at the check + counted) = {(p - c - n) / G:+.3f} GiB", file=sys.stderr)


threading.Thread(target=watch, daemon=True).start()
atexit.register(report)
sys.argv = ["ds4"] + sys.argv[1:]
runpy.run_module("ds4", run_name="__main__", alter_sys=True)
