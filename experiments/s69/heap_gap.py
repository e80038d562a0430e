"""Whether session 68's unexplained remainder (a CPU run's peak resident set above the host-memory check's count,
growing with the layers) is memory glibc's malloc holds freed but resident: runs `python -m ds4 ARGS...` beside a
thread that samples VmRSS every 20 ms and prints the peak with the heap's free bytes (mallinfo2's fordblks: freed
chunks glibc keeps in its arenas, resident or not) and its mmapped bytes (hblkhd), read at the last sample that raised
the peak by 64 MiB (mallinfo2 locks the arenas and walks their bins, so it is read only then).
With HEAP_TRIM=block, malloc_trim(0) runs after every Block.forward (the mitigation's test); the check's count
(ds4.app.memory_need) and the resident set when it ran are printed beside the peak.
Usage: [HEAP_TRIM=block] python experiments/s69/heap_gap.py model=v4_flash model.n_layers=1 max_new_tokens=2 \
         tracking=none hydra.run.dir=/tmp/heapout"""
from __future__ import annotations

import atexit
import ctypes
import runpy
import sys
import threading
import os
import time

import ds4.app as app
from ds4.model.transformer import Block
from ds4.weights.heap import trim_heap

G = 2**30


class MallInfo2(ctypes.Structure):  # glibc >= 2.33
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
seen = {"peak": (0, 0, 0), "max_free": 0, "check": None}


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def watch() -> None:
    while True:
        r = rss()
        if r > seen["peak"][0] + (64 << 20):  # mallinfo2 locks the arenas and walks their bins: only at a new peak
            m = libc.mallinfo2()
            seen["peak"] = (r, m.fordblks, m.hblkhd)
            seen["max_free"] = max(seen["max_free"], m.fordblks)
        elif r > seen["peak"][0]:
            seen["peak"] = (r,) + seen["peak"][1:]
        time.sleep(0.02)


_check = app.check_memory


def check_memory(spec, args, chosen):
    seen["check"] = (rss(), sum(b for _, b in app.memory_need(spec, args, chosen)))
    return _check(spec, args, chosen)


app.check_memory = check_memory
if os.environ.get("HEAP_TRIM") == "block":
    _forward = Block.forward

    def forward(self, *a, **k):
        out = _forward(self, *a, **k)
        trim_heap()
        return out

    Block.forward = forward


def report() -> None:
    r, free, mapped = seen["peak"]
    if seen["check"] is not None:
        c, n = seen["check"]
        print(f"HEAP_TRIM={os.environ.get('HEAP_TRIM', '')}: RSS at the check {c / G:.3f} GiB, counted {n / G:.3f} GiB;"
              f" peak - both = {(r - c - n) / G:+.3f} GiB", file=sys.stderr)
    m = libc.mallinfo2()
    print(f"peak RSS {r / G:.3f} GiB; at it: heap free (fordblks) {free / G:.3f} GiB, mmapped {mapped / G:.3f} GiB; "
          f"largest heap free seen {seen['max_free'] / G:.3f} GiB; at exit: RSS {rss() / G:.3f}, heap free "
          f"{m.fordblks / G:.3f}, heap in use {m.uordblks / G:.3f}", file=sys.stderr)


threading.Thread(target=watch, daemon=True).start()
atexit.register(report)
sys.argv = ["ds4"] + sys.argv[1:]
runpy.run_module("ds4", run_name="__main__", alter_sys=True)
