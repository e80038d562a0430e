"""The GPU-only scripts end with one line saying why where CUDA cannot run, not with a traceback from inside torch."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs these scripts")
@pytest.mark.parametrize("script", ["ncu_kernels", "diag_graph_state", "diag_options", "bench_kernels",
                                    "probe_moe_step"])
def test_gpu_script_says_why_it_cannot_run(script):
    env = dict(os.environ, DS4_NO_JIT="1", PYTHONPATH=str(ROOT))  # never a compile attempt here
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / f"{script}.py")], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(f"{script}: needs a CUDA GPU")


@pytest.mark.parametrize("layers", ["1", "17"])
def test_probe_moe_step_refuses_layers_past_its_slots(layers):
    """The MoE step probe records 16 launches of each kind per replay: a 17th layer would overwrite layer 0's records
    and be summarised as it (session 81's review), so the script refuses such counts before it needs a GPU."""
    env = dict(os.environ, DS4_NO_JIT="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "probe_moe_step.py"), "--layers", layers],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 2
    assert f"--layers {layers}: 2 to 16" in r.stderr
