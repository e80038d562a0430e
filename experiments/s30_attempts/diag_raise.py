"""Which error paths of the ride's ops crash (each case in its own process)."""
import shutil
import subprocess
import sys

PRE = """
import torch
from ds4 import kernels, kernels_attn
from ds4.ops.base import SinkhornRide
D = torch.device('cuda')
x = torch.randn(1, 128, device=D).to(torch.bfloat16)
gate = (torch.randn(16, 128, device=D) * 0.1).to(torch.bfloat16)
bias = torch.randn(16, device=D)
try:
"""
LOAD_ATTN = "    kernels_attn.hc_sinkhorn(torch.rand(1, 4, 4, device=D), 20, 1e-6)\n"
CASES = {
    "router_bad_bias": "    kernels.router(x, gate, bias[:3].contiguous(), None, None, 6, 1.5)",
    "attn_then_router_bad_bias": LOAD_ATTN + "    kernels.router(x, gate, bias[:3].contiguous(), None, None, 6, 1.5)",
    "attn_then_router_bad_comb": LOAD_ATTN + "    kernels.router(x, gate, bias, None, None, 6, 1.5, ride=SinkhornRide(torch.rand(2, 4, 4, device=D), 20, 1e-6))",
    "router_bad_comb": "    kernels.router(x, gate, bias, None, None, 6, 1.5, ride=SinkhornRide(torch.rand(2, 4, 4, device=D), 20, 1e-6))",
    "router_iters0": "    kernels.router(x, gate, bias, None, None, 6, 1.5, ride=SinkhornRide(torch.rand(1, 4, 4, device=D), 0, 1e-6))",
    "hc_sinkhorn_n3": "    kernels_attn.hc_sinkhorn(torch.rand(1, 3, 3, device=D), 20, 1e-6)",
    "hc_sinkhorn_iters0": "    kernels_attn.hc_sinkhorn(torch.rand(1, 4, 4, device=D), 0, 1e-6)",
}
POST = """
except RuntimeError as e:
    print('RAISED', str(e).splitlines()[0][:200])
"""
for name, body in CASES.items():
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", PRE + body + POST], capture_output=True, text=True)
    out = (r.stdout + r.stderr).strip().splitlines()
    print(f"{name}: rc={r.returncode} | " + " / ".join(out[-3:])[:600], flush=True)
    if r.returncode < 0 and shutil.which("gdb"):
        g = subprocess.run(["gdb", "-batch", "-ex", "run", "-ex", "bt 25", "--args", sys.executable, "-c",
                            PRE + body + POST], capture_output=True, text=True)
        print("\n".join(l for l in g.stdout.splitlines() if l.startswith("#"))[:4000], flush=True)
