#!/usr/bin/env python
"""Search the bit layouts of a 32-bit word of 8 E2M1 nibbles (or 4 E4M3 bytes) for the cheapest decode into MMA
registers.

    python scripts/fp4_decode_search.py

ds4 stores the routed experts' FP4 words with their 32 bits permuted at load time (fp4p / fp4t, ds4.quant.formats),
so the tensor-core kernels may choose where each nibble's bits sit. A register of the A fragment holds two values:
as bf16 (what the kernels use) each is s 000000e1e0 m000000, the bits {6, 7, 8, 15} of a 16-bit half; as fp16 it
would be s 000e1e0 m000000000, the bits {9, 10, 11, 15}. A register is built from pieces, each a shifted copy of
the word ANDed with a mask: one LOP3 per piece (the ALU pipe, which bounds the FP4 kernels: session 22), and a left
shift that drops no kept bit can be an IMAD.SHL (the FMA pipe); a rotation or right shift is an SHF (ALU).

It answers two questions for session 34's record (experiments/decode_session34_h200.md):
  1. With only left shifts, which register formats admit a decode of at most 6 LOP3 per word? (bf16's decode
     today, fp4p_regs in csrc/ds4_common.cuh, is 5 LOP3 + 2 SHF = 7 ALU instructions.)
  2. With one SHF allowed besides 5 LOP3 (6 ALU), does bf16 admit one?
Exhaustive over the shifts; prints each format's first solution or "none". The fp16 form, timed alone
(scripts/probe_fp16_decode.cu, session 34 run 4), was only 3.2 % faster than bf16's: its extra left shifts run on
the FMA pipe, which the arithmetic also needs.

Session 45 asked the same of the FP8 projections' words (fp8t, experiments/decode_session45_h200.md): 4 E4M3 bytes
into 2 bf16x2 registers, each value s 0000eeee mmm0000, the bits {4..10, 15} of a half (FP8_BITS). With left shifts
only, 3 LOP3 admit none; with one SHF beside 3 LOP3 (4 ALU, fp8p_regs in csrc/ds4_common.cuh) they do; 2 LOP3 and
one SHF admit none.
"""
from __future__ import annotations

import itertools
import sys

FORMATS = {"bf16": [6, 7, 8, 15, 22, 23, 24, 31], "fp16": [9, 10, 11, 15, 25, 26, 27, 31]}
FP8_BITS = [*range(4, 11), 15, *range(20, 27), 31]  # E4M3 as bf16 (x 2^-120): a register's bits, two values
ROTATIONS = [("R", s) for s in range(1, 32)] + [("W", s) for s in range(1, 32)]


def source(p: int, op: tuple[str, int]) -> int | None:
    """The word's bit that lands on register bit p: left shift L, right shift R, rotation W (None: shifted out)."""
    kind, s = op
    if kind == "L":
        return p - s if p >= s else None
    if kind == "R":
        return p + s if p + s <= 31 else None
    return (p - s) % 32


def covers(bits: list[int], want: set[int], ops: tuple):
    """Each way to build one register from the pieces ops, every source bit in `want`: (pieces, sources)."""
    options = [[op for op in ops if source(p, op) in want] for p in bits]
    if any(not o for o in options):
        return
    for choice in itertools.product(*options):
        src = {source(p, op) for p, op in zip(bits, choice)}
        if set(choice) == set(ops) and len(src) == len(bits):
            yield [(op, sum(1 << p for p, c in zip(bits, choice) if c == op)) for op in ops], src


def search(bits: list[int], max_lop3: int, extra_ops: list[tuple]) -> list | None:
    """32 / len(bits) registers from at most max_lop3 pieces, shifts from the left shifts that keep every bit plus at
    most one of extra_ops; registers as lists of (op, mask)."""
    n = 32 // len(bits)
    lefts = [("L", s) for s in range(32) if all(p >= s for p in bits)]
    for extra in [None, *extra_ops]:
        ops = lefts + ([extra] if extra else [])
        singles = {op: {source(p, op) for p in bits} for op in ops if all(source(p, op) is not None for p in bits)}
        # k registers of one piece, the others sharing the remaining LOP3s at two pieces or more each: every layout
        # within max_lop3 has at least 2 n - max_lop3 registers of one piece
        for k in range(min(n, max_lop3), max(0, 2 * n - max_lop3) - 1, -1):
            for combo in itertools.combinations(singles, k):
                used = set().union(*(singles[op] for op in combo))
                if len(used) != len(bits) * k:
                    continue
                rest = rest_registers(bits, set(range(32)) - used, n - k, max_lop3 - k, ops)
                if rest is not None:
                    regs = [[(op, sum(1 << p for p in bits))] for op in combo] + rest
                    if extra is None or any(op == extra for r in regs for op, _ in r):
                        return regs
    return None


def rest_registers(bits, want, n, budget, ops):
    """n registers from at most budget pieces whose sources are exactly `want`; a list of registers, or None."""
    if n == 0:
        return [] if not want else None
    for npieces in range(1, budget - (n - 1) + 1):
        for shifts in itertools.combinations(ops, npieces):
            for reg, src in covers(bits, want, shifts):
                rest = rest_registers(bits, want - src, n - 1, budget - npieces, ops)
                if rest is not None:
                    return [reg] + rest
    return None


def show(regs) -> str:
    def piece(op, mask):
        kind, s = op
        shifted = "q" if s == 0 else {"L": f"(q << {s})", "R": f"(q >> {s})", "W": f"rotl(q, {s})"}[kind]
        return f"{shifted} & 0x{mask:08X}"
    return "; ".join(f"r{i} = " + " | ".join(f"({piece(*pc)})" for pc in r) for i, r in enumerate(regs))


def main() -> None:
    if sys.argv[1:2] in (["-h"], ["--help"]):  # it takes no options: say what it does instead of running the search
        print(__doc__)
        return
    for name, bits in FORMATS.items():
        regs = search(bits, 6, [])
        print(f"{name}, at most 6 LOP3, left shifts only: {show(regs) if regs else 'none'}")
    regs = search(FORMATS["bf16"], 5, ROTATIONS)
    print(f"bf16, 5 LOP3 and one SHF: {show(regs) if regs else 'none'}")
    for max_lop3, extra, what in ((3, [], "at most 3 LOP3, left shifts only"), (2, ROTATIONS, "2 LOP3 and one SHF"),
                                  (3, ROTATIONS, "3 LOP3 and one SHF")):
        regs = search(FP8_BITS, max_lop3, extra)
        print(f"fp8 as bf16, {what}: {show(regs) if regs else 'none'}")


if __name__ == "__main__":
    main()
