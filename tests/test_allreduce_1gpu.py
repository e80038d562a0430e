"""comm=ll's kernels on one GPU: two "ranks" as two streams of one device, each with its own buffer and counters
(csrc/allreduce.cu) — the exchange protocol, the rank-order sums and the hc fold checked where no second GPU is
lent. Rank 0's launch spins until rank 1's (issued next, on the other stream) has sent, so both grids must be
resident together: the fold kernel runs with DS4_AR_FOLD_SPREAD=0 here (its blocks sized by their buffers; one
block per SM would leave rank 1 no room). The two-GPU tests (test_allreduce_gpu.py) cover the real layout."""
from __future__ import annotations

import pytest
import torch
from gpu_common import BF16, DEV, gen, ll_sum_expected, randn, require_extension

pytestmark = pytest.mark.gpu
kernels = require_extension("ds4.kernels")
kernels_attn = require_extension("ds4.kernels_attn")

from test_hc_fold_gpu import _check_fold, _site  # noqa: E402

CAP, WORLD = 1 << 13, 2


class _Ranks:
    """The state of WORLD ranks on this device: per rank a zeroed buffer of two regions ([2][W][cap] words
    each: the plain kernel's, the fold kernel's), its counters, and a stream."""

    def __init__(self):
        region = 2 * WORLD * CAP
        self.bufs = [torch.zeros(2 * region * 2, dtype=torch.int32, device=DEV) for _ in range(WORLD)]
        self.peers = [b.data_ptr() for b in self.bufs]
        self.peers_fold = [p + region * 8 for p in self.peers]
        self.counters = [torch.zeros(-(-CAP // kernels.AR_CHUNK), dtype=torch.int32, device=DEV) for _ in range(WORLD)]
        self.counters_fold = [torch.zeros(-(-CAP // kernels.AR_FOLD_ROWS), dtype=torch.int32, device=DEV)
                              for _ in range(WORLD)]
        self.streams = [torch.cuda.Stream(DEV) for _ in range(WORLD)]
        torch.cuda.synchronize()

    def each(self, call):
        """call(rank) on every rank's stream, all issued before any is waited for; their results."""
        outs = []
        for r, s in enumerate(self.streams):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                outs.append(call(r))
        for s in self.streams:
            torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        return outs


def test_all_reduce_ll_two_streams():
    """The plain kernel: every rank gets the rank-order sum of the partials bit for bit (both input dtypes, both
    reduce precisions, both output dtypes, sizes around the block chunk), over several rounds (epochs, slots)."""
    ranks, g = _Ranks(), gen(31)
    for rnd in range(3):
        for n in (1, 511, 512, 513, 4096, CAP):
            for dt in (torch.float32, BF16):
                for rb in (False, True):
                    for out_dtype in (torch.float32, BF16):
                        xs = [(randn(n, g=g) * 4).to(dt) for _ in range(WORLD)]
                        ys = ranks.each(lambda r: kernels.all_reduce_ll(xs[r], ranks.peers, ranks.counters[r], r, CAP,
                                                                        rb, out_dtype))
                        want = ll_sum_expected(xs, rb, out_dtype)
                        for r, y in enumerate(ys):
                            assert y.dtype == out_dtype and torch.equal(y, want), (rnd, n, dt, rb, out_dtype, r)


@pytest.mark.parametrize("n,D", [(4, 4096), (2, 256), (1, 1024), (4, 48)])
def test_all_reduce_ll_fold_two_streams(n, D, monkeypatch):
    """The fold kernel: y as the plain kernel's arithmetic gives it, bit for bit, the fold's streams and partials
    as test_hc_fold_gpu checks the one-GPU fold's, the same bits on both ranks; plain calls between fold calls
    (separate epochs), several rounds, both reduce precisions, both input dtypes."""
    monkeypatch.setenv("DS4_AR_FOLD_SPREAD", "0")
    ranks, g = _Ranks(), gen(32)
    for rnd in range(3):
        for dt in (torch.float32, BF16):
            for rb in (False, True):
                sites = [_site(n, D, gen(33 + rnd)) for _ in range(WORLD)]  # the same streams on both ranks
                xs = [(randn(1, D, g=g) * 4).to(dt) for _ in range(WORLD)]
                ys = ranks.each(lambda r: kernels.all_reduce_ll_fold(xs[r], ranks.peers_fold, ranks.counters_fold[r],
                                                                     r, CAP, rb, sites[r][0]))
                ranks.each(lambda r: kernels.all_reduce_ll(xs[r], ranks.peers, ranks.counters[r], r, CAP, rb, BF16))
                want = ll_sum_expected(xs, rb, BF16)
                for r, (y, (fold, scale, base, norm)) in enumerate(zip(ys, sites)):
                    assert y.dtype == BF16 and torch.equal(y, want), (rnd, dt, rb, r)
                    _check_fold(y, fold, scale, base, norm)
                assert torch.equal(sites[0][0].out, sites[1][0].out) and torch.equal(sites[0][0].part,
                                                                                   sites[1][0].part)
