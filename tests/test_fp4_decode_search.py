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
