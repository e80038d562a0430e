#!/usr/bin/env python
"""Build the ds4 CUDA extension once (ninja, into .ext_build or $DS4_EXT_BUILD_DIR).

    python scripts/build_ext.py                 # sm_80 + sm_90
    TORCH_CUDA_ARCH_LIST=9.0 python scripts/build_ext.py

Run it before parallel jobs so they only load the built library (never compile concurrently)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from ds4 import kernels
    t0 = time.time()
    kernels.load(verbose="-q" not in sys.argv)
    print(f"ds4 CUDA extension ready in {kernels.build_dir()} ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
