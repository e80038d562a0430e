#!/usr/bin/env python
"""Print the SASS of chosen kernels with each instruction's scheduling controls decoded (sm_70+ encodings).

    cuobjdump -sass .ext_build/ds4_ext.so | python scripts/sass_ctrl.py 'moe_down_mma_kernelILi4ELi1ELi2E' [--loads]

Per instruction: its offset, the dependency barrier it sets when its result is written (W, 0-5; variable-latency
ops: global / shared loads, ...), the one it sets when its sources have been read (R), the barriers it waits for
before issuing (wait mask, as the list of indices), the stall cycles and the yield bit, then the text. --loads: only
the loads, stores and the instructions that wait on a barrier. Why: a load's consumer waits on the load's barrier;
when the compiler has put an earlier, slower load (a weight round from HBM) on the same barrier, the consumer waits
for that one too. The controls are the high 23 bits of the 128-bit instruction: stall 4, yield 1, write barrier 3,
read barrier 3 (7: none), wait mask 6, reuse 4.
"""
from __future__ import annotations

import argparse
import re
import sys

INSN = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);?\s*/\*\s*0x([0-9a-f]{16})\s*\*/")
HI = re.compile(r"^\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")
MEMORY = ("LDG", "STG", "LDS", "STS", "LDGSTS", "LDSM", "UBLKCP", "UTMALDG", "SYNCS", "LDC", "ATOM", "RED", "BAR",
          "DEPBAR")


def controls(hi: int) -> dict:
    c = hi >> 41
    return {"stall": c & 0xF, "yield": (c >> 4) & 1, "wb": (c >> 5) & 7, "rb": (c >> 8) & 7,
            "wait": [i for i in range(6) if (c >> (11 + i)) & 1]}


def functions(lines):
    """(name, [(offset, text, controls)]) per function of the dump."""
    name, body, pending = None, [], None
    for line in lines:
        f = re.match(r"\s*Function : (\S+)", line)
        if f:
            if name is not None:
                yield name, body
            name, body, pending = f.group(1), [], None
            continue
        m = INSN.match(line)
        if m:
            pending = (m.group(1), m.group(2).strip())
            continue
        h = HI.match(line)
        if h and pending is not None:
            body.append((pending[0], pending[1], controls(int(h.group(1), 16))))
            pending = None
    if name is not None:
        yield name, body


def fmt(off: str, text: str, c: dict) -> str:
    bar = lambda b: "-" if b == 7 else str(b)  # noqa: E731
    wait = ",".join(map(str, c["wait"])) or "-"
    yld = "y" if c["yield"] else " "
    return f"{off}  W{bar(c['wb'])} R{bar(c['rb'])} wait[{wait:>11}] s{c['stall']:<2}{yld} {text}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pattern", help="regex over the mangled function names")
    ap.add_argument("--loads", action="store_true", help="only memory instructions and those that wait")
    a = ap.parse_args()
    pat, found = re.compile(a.pattern), False
    for name, body in functions(sys.stdin):
        if not pat.search(name):
            continue
        found = True
        print(f"Function : {name} ({len(body)} instructions)")
        for off, text, c in body:
            op = re.sub(r"^@!?U?P\w+\s+", "", text).split(" ")[0].split(".")[0]
            if not a.loads or op in MEMORY or c["wait"]:
                print(fmt(off, text, c))
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
