"""scripts/sass_ctrl.py: the scheduling controls of each instruction decoded from cuobjdump's encodings (no GPU)."""
from __future__ import annotations

import io
import sys

from script_loader import load_script


def _hi(stall=0, yld=0, wb=7, rb=7, wait=()):
    """The second 64-bit word of an instruction with these controls (bits 41.. of it) and nothing else."""
    mask = sum(1 << b for b in wait)
    return (stall | yld << 4 | wb << 5 | rb << 8 | mask << 11) << 41


def _dump(rows):
    """A cuobjdump-like listing of one function: (text, hi word) per instruction."""
    lines = ["        Function : _ZN3ds46kernelEv"]
    for i, (text, hi) in enumerate(rows):
        lines.append(f"        /*{16 * i:04x}*/                   {text} ;   /* 0x000000000000{i:04x} */")
        lines.append(f"                                                        /* 0x{hi:016x} */")
    lines.append("        Function : _ZN3ds45otherEv")
    lines.append("        /*0000*/                   EXIT ;   /* 0x000000000000794d */")
    lines.append("                                                        /* 0x000fea0003800000 */")
    return "\n".join(lines) + "\n"


def test_controls_decode_the_fields():
    sc = load_script("sass_ctrl")
    # an instruction as cuobjdump printed it for sm_90: stall 2, the yield bit, no barriers
    assert sc.controls(0x000FE40000000800) == {"stall": 2, "yield": 1, "wb": 7, "rb": 7, "wait": []}
    assert sc.controls(_hi(stall=13, wb=5, rb=1, wait=(0, 5))) == {"stall": 13, "yield": 0, "wb": 5, "rb": 1,
                                                                    "wait": [0, 5]}


def test_listing_of_the_matching_function(monkeypatch, capsys):
    sc = load_script("sass_ctrl")
    text = _dump([("LDG.E.128 R4, desc[UR4][R2.64]", _hi(wb=5)), ("IADD3 R1, R1, 0x1, RZ", _hi(stall=1)),
                  ("LOP3.LUT R6, R4, 0xff, RZ, 0xc0, !PT", _hi(wait=(5,))), ("@!P0 STS [R0], R6", _hi(rb=2))])
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    monkeypatch.setattr(sys, "argv", ["sass_ctrl.py", "6kernel", "--loads"])
    assert sc.main() == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Function : _ZN3ds46kernelEv (4 instructions)")
    assert len(out) == 4  # the load, the instruction that waits, the predicated store; not the IADD3 nor `other`
    assert "W5 R- wait[" in out[1] and out[1].endswith("LDG.E.128 R4, desc[UR4][R2.64]")
    assert "wait[          5]" in out[2] and "LOP3" in out[2]
    assert "W- R2" in out[3] and out[3].endswith("@!P0 STS [R0], R6")
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    monkeypatch.setattr(sys, "argv", ["sass_ctrl.py", "no_such_kernel"])
    assert sc.main() == 1
