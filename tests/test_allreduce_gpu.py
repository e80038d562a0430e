"""comm=ll on two GPUs: ds4's one-shot all-reduce kernel (csrc/allreduce.cu) against the sums of the gathered
partials, bit for bit, eager and inside a replayed CUDA graph, and the same bits on every rank; its form with
the hc fold against the plain call and the one-GPU fold's checks."""
from __future__ import annotations

import json
import os
import socket

import pytest
import torch
from gpu_common import ll_sum_expected as _expected

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 GPUs", allow_module_level=True)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, path):
    import torch.distributed as dist
    from ds4 import dist as ddist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    ddist.init("cuda", world)
    dev = torch.device("cuda", rank)
    bad = []
    try:
        g = torch.Generator(device=dev).manual_seed(100 + rank)
        comms = {red: ddist.TensorParallel(red, "ll", device=dev, max_numel=1 << 14) for red in ("fp32", "bf16")}

        def check(tag, x, site, red, out_dtype, y):
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x)
            want = _expected(parts, red == "bf16" and site != "embed", out_dtype or x.dtype)
            if y.dtype != want.dtype or y.shape != x.shape or not torch.equal(y, want):
                bad.append(f"{tag}: max diff {float((y.float() - want.float()).abs().max())}")
            everyone = [torch.empty_like(y) for _ in range(world)]
            dist.all_gather(everyone, y)
            if not all(torch.equal(e, y) for e in everyone):
                bad.append(f"{tag}: ranks differ")

        # sizes around the block chunk (512) up to the capacity, both input dtypes, both precisions, an out
        # dtype other than x's, the embedding site (fp32 whatever the reduce precision); 3 rounds so the
        # per-block counters and both buffer slots are exercised with sizes changing between calls
        for rnd in range(3):
            for n in (1, 7, 511, 512, 513, 4096, 1 << 14):
                for dt in (torch.float32, torch.bfloat16):
                    for red, comm in comms.items():
                        for site, out_dtype in (("attn", None), ("moe", torch.bfloat16), ("embed", None)):
                            x = (torch.randn(n, generator=g, device=dev) * 4).to(dt)
                            check(f"r{rnd} n={n} {dt} {red} {site}", x, site, red, out_dtype,
                                  comm.all_reduce(x, site, out_dtype=out_dtype))
        # above the capacity: NCCL, the same result (on a copy: an fp32 NCCL reduce sums in place)
        x = torch.randn(2, 1 << 14, generator=g, device=dev)
        check("over cap", x, "attn", "fp32", None, comms["fp32"].all_reduce(x.clone(), "attn"))

        # inside a CUDA graph: two sites per "layer" as in the decode step, replayed with new inputs each time
        comm = comms["bf16"]
        xa = torch.zeros(1, 4096, device=dev, dtype=torch.bfloat16)
        xm = torch.zeros(1, 4096, device=dev, dtype=torch.float32)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up outside the graph (same call sequence on both ranks)
            comm.all_reduce(xa, "attn"), comm.all_reduce(xm, "moe", out_dtype=torch.bfloat16)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ya = comm.all_reduce(xa, "attn")
            ym = comm.all_reduce(ya.float() + xm, "moe", out_dtype=torch.bfloat16)
        for step in range(300):
            xa.copy_(torch.randn(1, 4096, generator=g, device=dev))
            xm.copy_(torch.randn(1, 4096, generator=g, device=dev))
            graph.replay()
            if step % 50 == 0 or step == 299:
                pa = [torch.empty_like(xa) for _ in range(world)]
                dist.all_gather(pa, xa)
                want_a = _expected(pa, True, torch.bfloat16)
                pm = [torch.empty_like(xm) for _ in range(world)]
                dist.all_gather(pm, xm)
                want_m = _expected([want_a.float() + p for p in pm], True, torch.bfloat16)
                if not (torch.equal(ya, want_a) and torch.equal(ym, want_m)):
                    bad.append(f"graph replay {step}")
        torch.cuda.synchronize(dev)
        _fold_checks(dev, world, comms, g, bad)
    finally:
        if rank == 0:
            json.dump(bad, open(path, "w"))
        dist.destroy_process_group()


def _fold_checks(dev, world, comms, g, bad):
    """all_reduce with the hc fold (comm=ll's fold kernel): y as the plain call gives it, bit for bit; the fold's
    streams and partials as test_hc_fold_gpu checks the one-GPU fold's; the same bits on every rank; eager calls
    mixed with plain ones (separate epochs), then 200 graph replays."""
    import torch.distributed as dist
    from test_hc_fold_gpu import _check_fold, _site
    same = torch.Generator(device=dev).manual_seed(7)  # the streams and weights: replicated, as in the model

    def check(tag, x, red, y, fold, scale, base, norm):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        want = _expected(parts, red == "bf16", torch.bfloat16)
        if not (fold.fused and y.dtype == torch.bfloat16 and torch.equal(y, want)):
            bad.append(f"fold {tag}: y, fused {fold.fused}")
            return
        try:
            _check_fold(y.view(1, -1), fold, scale, base, norm)
        except AssertionError as e:
            bad.append(f"fold {tag}: {str(e)[:200]}")
        for t in (fold.out, fold.part):
            everyone = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(everyone, t.contiguous())
            if not all(torch.equal(e, t) for e in everyone):
                bad.append(f"fold {tag}: ranks differ")

    for rnd in range(2):
        for n, D in ((4, 4096), (2, 256), (1, 1024), (4, 48)):
            for dt in (torch.float32, torch.bfloat16):
                for red, comm in comms.items():
                    fold, scale, base, norm = _site(n, D, same)
                    x = (torch.randn(1, D, generator=g, device=dev) * 4).to(dt)
                    y = comm.all_reduce(x, "moe", out_dtype=torch.bfloat16, fold=fold)
                    check(f"r{rnd} n={n} D={D} {dt} {red}", x, red, y, fold, scale, base, norm)
                    comm.all_reduce(x, "attn")  # a plain call between fold calls
    # not taken (left unfused, the plain result): fp32 out, the embedding site, a length other than the fold's
    fold = _site(4, 256, same)[0]
    x = torch.randn(1, 256, generator=g, device=dev)
    comms["fp32"].all_reduce(x, "attn", fold=fold)
    comms["fp32"].all_reduce(x, "embed", out_dtype=torch.bfloat16, fold=fold)
    comms["fp32"].all_reduce(torch.randn(1, 512, generator=g, device=dev), "attn", torch.bfloat16, fold=fold)
    if fold.fused:
        bad.append("fold taken where it does not apply")

    comm = comms["bf16"]
    fold, scale, base, norm = _site(4, 4096, same)
    xm = torch.zeros(1, 4096, device=dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        comm.all_reduce(xm, "moe", out_dtype=torch.bfloat16, fold=fold)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ya = comm.all_reduce(xm, "attn", out_dtype=torch.bfloat16)
        ym = comm.all_reduce(xm, "moe", out_dtype=torch.bfloat16, fold=fold)
    for step in range(200):
        xm.copy_(torch.randn(1, 4096, generator=g, device=dev))
        fold.out.fill_(float("nan"))
        fold.part.fill_(float("nan"))
        graph.replay()
        if step % 40 == 0 or step == 199:
            check(f"graph replay {step}", xm, "bf16", ym, fold, scale, base, norm)
            if not torch.equal(ya, ym):
                bad.append(f"fold graph replay {step}: the plain call differs")
    torch.cuda.synchronize(dev)


def test_all_reduce_ll_bit_exact_eager_and_graph(tmp_path):
    """Every call gives the rank-order sum of the gathered partials bit for bit (both input dtypes, both reduce
    precisions, sizes around the block chunk up to the capacity, out dtypes), identical on both ranks; larger
    tensors go through NCCL; 300 graph replays with new inputs each time stay exact (epochs, both slots). The
    fold kernel likewise, with its streams and partials checked (_fold_checks)."""
    import torch.multiprocessing as mp
    from gpu_common import require_extension
    require_extension("ds4.kernels")  # (two GPUs here: a broken build fails, not skips)
    path = str(tmp_path / "bad.json")
    mp.start_processes(_worker, args=(2, _free_port(), path), nprocs=2, start_method="spawn")
    assert json.load(open(path)) == []
