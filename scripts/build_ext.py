#!/usr/bin/env python
"""Build the ds4 CUDA extensions once (ninja, into .ext_build or $DS4_EXT_BUILD_DIR).

    python scripts/build_ext.py                 # sm_80 + sm_90
    TORCH_CUDA_ARCH_LIST=9.0 python scripts/build_ext.py

Run it before parallel jobs so they only load the built library (never compile concurrently)."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__ + "\n\n    -q   quiet (no compiler output)")
        return 0
    os.environ.pop("DS4_NO_JIT", None)  # (this script is the build DS4_NO_JIT=1 asks for)
    from ds4 import kernels, kernels_attn
    for mod in (kernels, kernels_attn):  # the GEMV/MoE extension and the attention/indexer/mHC one
        t0 = time.time()
        try:
            mod.load(verbose="-q" not in sys.argv)
        except (RuntimeError, OSError) as e:  # no CUDA torch, no nvcc / ninja, a compile error: one line, exit 1
            print(f"build_ext: {mod.__name__} cannot be built here: {e}", file=sys.stderr)
            return 1
        print(f"{mod.__name__} CUDA extension ready in {mod.build_dir()} ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
