#!/usr/bin/env python
"""Count the SASS instructions of chosen kernels by opcode (what a decode change did to the ALU / FMA pipes).

    cuobjdump --dump-sass .ext_build/ds4_ext.so | python scripts/sass_ops.py 'moe_gate_up_mma_kernelILi4E'

Prints, per function whose mangled name matches the regex (per architecture section), its instruction count and
the count of each opcode: the mnemonic before the first '.', except that IMAD, SHF, I2F and F2F keep their second
part (IMAD.WIDE, IMAD.SHL and IMAD.MOV run differently from IMAD; SHF.L from SHF.R). Exits 1 when nothing matched.
"""
from __future__ import annotations

import re
import sys
from collections import Counter

KEEP_TWO = ("IMAD", "SHF", "I2F", "F2F")


def opcode(line: str) -> str | None:
    m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
    if not m:
        return None
    parts = m.group(2).split(".")
    return ".".join(parts[:2]) if parts[0] in KEEP_TWO else parts[0]


def main() -> int:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__ or "usage: cuobjdump -sass X.o | python scripts/sass_ops.py [FUNCTION_REGEX]")
        return 0
    pat = re.compile(sys.argv[1] if len(sys.argv) > 1 else ".")
    counts: Counter | None = None  # the current function's, None while it does not match
    out: list[tuple[str, Counter]] = []
    for line in sys.stdin:
        f = re.match(r"\s*Function : (\S+)", line)
        if f:
            counts = Counter() if pat.search(f.group(1)) else None
            if counts is not None:
                out.append((f.group(1), counts))
            continue
        op = opcode(line) if counts is not None else None
        if op:
            counts[op] += 1
    for n, c in out:
        print(f"{n}: {sum(c.values())} instructions")
        print("  " + "  ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1])))
    return 0 if out else 1


if __name__ == "__main__":
    raise SystemExit(main())
