"""Count the tensor ops one decode step issues, per profiler stage (CPU, no GPU needed).

    python scripts/count_decode_ops.py [--model tiny] [--glue]

At batch 1 inside a CUDA graph every op is a kernel of a few microseconds, so this count is a
GPU-free proxy for the launch-bound part of TPOT. `--glue` counts each call into a swappable
implementation (linear, moe, hc, sparse attention, indexer scores) as one op, leaving the
plain-torch glue between them — what the fused kernels have not absorbed yet.
"""
from __future__ import annotations

import argparse
import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds4.model.args import preset
from ds4.model.transformer import Transformer
from ds4.profile import Profiler
from ds4.registry import torch_reference_ops
from ds4.runtime.generate import Generator
from ds4.weights.synthetic import random_weights

VIEWS = {"view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "expand", "slice", "select", "alias",
         "as_strided", "detach", "unflatten", "permute", "split", "unbind", "_reshape_alias", "reshape",
         "view_as_real", "view_as_complex"}


class OpCounter(TorchDispatchMode):
    """Counts non-view aten ops, attributed to the current profiler stage."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.stage = "other"
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func.__name__.split(".")[0] not in VIEWS:
            self.counts[self.stage] += 1
        return func(*args, **(kwargs or {}))


class StageTracker(Profiler):
    """A profiler whose regions only tell the counter which stage is running."""

    def __init__(self, counter: OpCounter):
        super().__init__(False)
        self.counter = counter

    @contextlib.contextmanager
    def region(self, name: str):
        old, self.counter.stage = self.counter.stage, name
        try:
            yield
        finally:
            self.counter.stage = old

    __call__ = region


def _as_one_op(counter: OpCounter, fn):
    def wrapped(*a, **k):
        counter.paused += 1
        try:
            return fn(*a, **k)
        finally:
            counter.paused -= 1
            counter.counts[counter.stage] += 1
    return wrapped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--glue", action="store_true")
    a = ap.parse_args()
    args = preset(a.model)
    counter = OpCounter()
    ops = torch_reference_ops()
    if a.glue:
        for comp, names in (("linear", ("__call__", "grouped")), ("moe", ("route", "routed", "shared")),
                            ("hc", ("pre", "post", "head")),
                            ("attn", ("sparse", "decode", "rms_norm", "head_rope", "kv_store", "compress_step")),
                            ("indexer", ("scores", "rope", "topk"))):
            impl = getattr(ops, comp)
            for n in names:
                bound = getattr(impl, n)
                if n == "__call__":
                    setattr(ops, comp, _CallableProxy(impl, _as_one_op(counter, bound)))
                else:
                    setattr(impl, n, _as_one_op(counter, bound))
    m = Transformer(args, ops, "plain", torch.float32, profiler=StageTracker(counter))
    m.load_weights(random_weights(args, include_mtp=False))
    g = Generator(m, 1, 256)
    g.prefill([[1, 2, 3, 4, 5, 6, 7, 8, 9]])
    with counter:
        g.decode(torch.tensor([3]))
    total = sum(counter.counts.values())
    print(f"{a.model}: {total} ops per decode step, {total / args.n_layers:.1f} per layer"
          + (" (implementation calls counted as one op)" if a.glue else ""))
    for k, v in counter.counts.most_common():
        print(f"  {k:<16}{v}")


class _CallableProxy:
    """Forwards attributes to the implementation but routes calls through `call`."""

    def __init__(self, impl, call):
        self._impl, self._call = impl, call

    def __call__(self, *a, **k):
        return self._call(*a, **k)

    def __getattr__(self, name):
        return getattr(self._impl, name)


if __name__ == "__main__":
    main()
