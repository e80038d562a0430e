"""Sessions 47-48: the dequant op's own shape errors (runs 1-3 saw a segfault where one was raised). argv[1] picks the
call: fmt (an unknown format: the op's first check), cpu (a CPU weight: the shared check_cuda helper), scale (a scale
of the wrong shape), ok (a valid call)."""
import sys

import torch

from ds4 import kernels

kernels.load()
case = sys.argv[1] if len(sys.argv) > 1 else "scale"
w = torch.zeros(16, 128, dtype=torch.int8, device="cuda")
s = torch.zeros(16, 8, dtype=torch.uint8, device="cuda")
fmt = kernels.ops.FMT["fp4t"]
out = torch.empty(16, 256, device="cuda")
if case == "fmt":
    fmt = 99
elif case == "cpu":
    w = w.cpu()
elif case == "scale":
    s = s[:8]
try:
    torch.ops.ds4.dequant(w, s, fmt, out)
    torch.cuda.synchronize()
    print(case, "no error raised")
except RuntimeError as e:
    print(case, "raised RuntimeError:", str(e).splitlines()[0][:200])
