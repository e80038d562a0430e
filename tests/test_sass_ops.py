"""scripts/sass_ops.py: opcode counts of the matching kernels in cuobjdump --dump-sass output (no GPU needed)."""
from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

SASS = """
        Function : _ZN3ds43fooILi4EEEvv
        .headerflags    @"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                       /* 0x00000a00ff017b82 */
                                                                                 /* 0x000fe20000000800 */
        /*0010*/              @!P0 IMAD.WIDE.U32 R2, R3, c[0x3][0x8], RZ ;
        /*0020*/                   LOP3.LUT R4, R2, 0x81c081c0, R3, 0xc8, !PT ;
        /*0030*/                   SHF.L.W.U32.HI R5, R4, 0xa, R4 ;
        /*0040*/               @P1 LOP3.LUT R6, R5, 0x1000100, RZ, 0xc0, !PT ;
        /*0050*/                   HMMA.16816.F32.BF16 R8, R8, R4, RZ ;
        Function : _ZN3ds43barEv
        /*0000*/                   EXIT ;
"""


def _run(pattern: str, text: str, monkeypatch, capsys) -> tuple[int, str]:
    path = Path(__file__).resolve().parents[1] / "scripts" / "sass_ops.py"
    spec = importlib.util.spec_from_file_location("sass_ops_for_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", ["sass_ops.py", pattern])
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    rc = mod.main()
    return rc, capsys.readouterr().out


def test_counts_the_matching_kernel_only(monkeypatch, capsys):
    rc, out = _run("fooILi4E", SASS, monkeypatch, capsys)
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 2
    assert lines[0] == "_ZN3ds43fooILi4EEEvv: 6 instructions"
    counts = dict(zip(lines[1].split()[::2], map(int, lines[1].split()[1::2])))
    # predicated instructions count too; IMAD / SHF keep their second part, LOP3 and HMMA their first
    assert counts == {"LOP3": 2, "LDC": 1, "IMAD.WIDE": 1, "SHF.L": 1, "HMMA": 1}


def test_no_match_is_an_error_code(monkeypatch, capsys):
    assert _run("nothing_here", SASS, monkeypatch, capsys) == (1, "")
