"""scripts/fp4_decode_search.py: the bit-layout search behind session 34's FP4 decode finding (no GPU)."""
from __future__ import annotations

from script_loader import load_script


def _decode(regs, q):
    """The registers a found decode builds from word q (left shifts only)."""
    out = []
    for reg in regs:
        r = 0
        for (kind, s), mask in reg:
            assert kind == "L"
            r |= (q << s) & mask & 0xFFFFFFFF
        out.append(r)
    return out


def test_fp16_layout_is_a_bit_permutation_and_bf16_has_none():
    """The fp16 solution uses 6 pieces and moves every word bit to exactly one register bit of the fp16 pattern
    (so a load-time permutation makes it an exact decode); bf16 has no such layout, with or without one SHF."""
    m = load_script("fp4_decode_search")
    regs = m.search(m.FORMATS["fp16"], 6, [])
    assert regs is not None and sum(len(r) for r in regs) == 6
    pattern = sum(1 << p for p in m.FORMATS["fp16"])
    seen = 0
    for bit in range(32):
        out = _decode(regs, 1 << bit)
        assert sum(bin(r).count("1") for r in out) == 1, bit  # each word bit lands once
        assert all(r & ~pattern == 0 for r in out)  # only on the pattern's bits
        seen |= sum(r << (32 * i) for i, r in enumerate(out))
    assert bin(seen).count("1") == 32  # and every register bit of the pattern is reached
    assert m.search(m.FORMATS["bf16"], 6, []) is None
    rot = [("R", s) for s in range(1, 32)] + [("W", s) for s in range(1, 32)]
    assert m.search(m.FORMATS["bf16"], 5, rot) is None


def test_fp8_bf16_needs_four_alu_instructions():
    """E4M3 words (session 45's fp8t): no layout decodes within 3 ALU instructions per word (3 LOP3 with left shifts
    only, or 2 LOP3 and one SHF); 3 LOP3 and one SHF do, and the first one found is csrc/ds4_common.cuh's fp8p_regs,
    whose pieces move every word bit to exactly one register bit of the pattern."""
    m = load_script("fp4_decode_search")
    assert m.search(m.FP8_BITS, 3, []) is None
    assert m.search(m.FP8_BITS, 2, m.ROTATIONS) is None
    regs = m.search(m.FP8_BITS, 3, m.ROTATIONS)
    assert regs == [[(("L", 0), 0x87F087F0)], [(("L", 4), 0x80F080F0), (("R", 4), 0x07000700)]]
    pattern = sum(1 << p for p in m.FP8_BITS)
    hits = [0, 0]
    for bit in range(32):
        q = 1 << bit
        out = [sum(((q << s if kind == "L" else q >> s) & mask) & 0xFFFFFFFF for (kind, s), mask in reg)
               for reg in regs]
        assert sum(bin(r).count("1") for r in out) == 1, bit
        assert all(r & ~pattern == 0 for r in out)
        hits = [h | r for h, r in zip(hits, out)]
    assert hits == [pattern, pattern]
