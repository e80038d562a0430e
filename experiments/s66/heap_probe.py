import ctypes, sys, time, resource
import torch
from ds4.model.args import preset
from ds4.weights import synthetic
trim = sys.argv[1] == "trim"
libc = ctypes.CDLL("libc.so.6")
if sys.argv[1] == "mmap": print("mallopt", libc.mallopt(-3, int(sys.argv[2]) << 20))
def rss():
    for l in open("/proc/self/status"):
        if l.startswith(("VmRSS", "VmHWM")): print(l.strip(), end="  ")
    print(flush=True)
import dataclasses; a = dataclasses.replace(preset("v4_flash"), n_layers=1)

orig = synthetic._full_tensors
n = [0]
def wrapped(*k, **kw):
    out = orig(*k, **kw)
    n[0] += 1
    if trim and n[0] % 16 == 0: libc.malloc_trim(0)
    return out
synthetic._full_tensors = wrapped
t = time.time()
w = synthetic.random_weights(a, include_mtp=False)
print("tensors", len(w), "bytes", sum(x.numel()*x.element_size() for x in w.values())/2**30, "GiB", time.time()-t, "s")
rss()
