"""Collectives the model calls, and process-group setup under torchrun.

`SingleProcess` is the world-size-1 identity. `TensorParallel` sums partial results over the
ranks of one group in the configured precision (`reduce=fp32|bf16`) through NCCL/gloo (`comm=nccl`),
PyTorch's symmetric-memory one-shot all-reduce over NVLink P2P (`comm=symm_mem`, CUDA only;
graph-capturable), or ds4's own one-shot kernel over the same peer memory (`comm=ll`, CUDA only: one
launch that also casts to the output dtype, csrc/allreduce.cu; tensors above its capacity, e.g. long
prompts, go through NCCL). Greedy decoding can use the seed's distributed argmax instead of gathering the
whole vocabulary.
"""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ds4.runtime.sampling import argmax as argmax_first

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class SingleProcess:
    rank, world = 0, 1
    folds_hc = False  # (one rank: the kernel producing a block output forms the hc fold itself)

    @staticmethod
    def stage(site: str) -> str | None:
        """The profiler row of a communication site: none at one rank, where nothing is communicated (a comm.* row
        would time an identity)."""
        return None

    def all_reduce(self, x: Tensor, site: str, out_dtype: torch.dtype | None = None, fold=None) -> Tensor:
        """Sum partial results over ranks (site: 'attn', 'moe', 'embed'), in out_dtype (x's by default).
        fold: a pending hc fold (ds4.ops.base.HcFold) that the reduction may form from its result (see
        TensorParallel.all_reduce); untouched here."""
        return x if out_dtype is None else x.to(out_dtype)

    def gather_vocab(self, logits: Tensor) -> Tensor:
        """Concatenate vocab-parallel logits [..., V/W] over ranks -> [..., V]."""
        return logits

    def argmax(self, logits: Tensor, kernel: bool = False) -> Tensor:
        """Global argmax of vocab-parallel logits [N, V/W] -> global ids [N] (kernel: as sampling.argmax's)."""
        return argmax_first(logits, kernel=kernel)


@dataclass
class DistEnv:
    rank: int
    world: int
    local_rank: int


def env() -> DistEnv:
    """Rank layout from torchrun's environment (1 process when unset)."""
    return DistEnv(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))


def init(device_type: str, expected_world: int) -> DistEnv:
    """Join the process group torchrun set up (NCCL on CUDA, gloo on CPU) and pin the GPU.
    Fails clearly when the launch does not match the configured tensor-parallel size."""
    e = env()
    if e.world != expected_world:
        raise ValueError(f"parallel.tp={expected_world} but {e.world} process(es) were launched; "
                         f"use `torchrun --nproc-per-node {expected_world} -m ds4 parallel.tp={expected_world} ...`")
    if e.world == 1:
        return e
    if device_type == "cuda":
        n = torch.cuda.device_count()
        if n < e.world:
            raise ValueError(f"parallel.tp={e.world} needs {e.world} visible GPUs, found {n}")
        torch.cuda.set_device(e.local_rank)
    # Lent multi-GPU machines must not use NVLink multicast (NVLS); harmless elsewhere.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                device_id=torch.device("cuda", e.local_rank) if device_type == "cuda" else None)
        atexit.register(_leave_group)
    return e


def _leave_group() -> None:
    """Leave the process group at exit while the interpreter is still whole. Why: left to interpreter finalization,
    gloo's worker threads may still hold work whose tensors need the GIL, and the process aborts (pytorch/pytorch
    #179291); CI saw rank 0 of `test_torchrun_tp2_on_cpu` die with SIGABRT once (session 31)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def symm_dtypes(reduce_dtype: torch.dtype) -> list[torch.dtype]:
    """The dtypes of the symmetric-memory buffers, in rendezvous order: the activation reduce dtype, then fp32
    (the embedding's exact sums) unless they are the same."""
    return [reduce_dtype] + ([torch.float32] if reduce_dtype != torch.float32 else [])


COMMS = ("nccl", "symm_mem", "ll")
# comm=symm_mem / ll: the largest sum (values) their peer buffers take; a larger one (a prompt's) goes over NCCL
PEER_MAX_NUMEL = 1 << 16


class TensorParallel:
    def __init__(self, reduce: str = "fp32", comm: str = "nccl", group=None, device: torch.device | None = None,
                 max_numel: int = PEER_MAX_NUMEL):
        if reduce not in REDUCE_DTYPES:
            raise ValueError(f"reduce must be one of {sorted(REDUCE_DTYPES)}, got {reduce!r}")
        if comm not in COMMS:
            raise ValueError(f"comm must be one of {'|'.join(COMMS)}, got {comm!r}")
        self.group = group or dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.reduce_dtype, self.comm = REDUCE_DTYPES[reduce], comm
        self._bufs: dict[torch.dtype, Tensor] = {}
        self._ll: _LowLatency | None = None
        if comm in ("symm_mem", "ll") and (device is None or device.type != "cuda"):
            raise ValueError(f"comm={comm} needs CUDA devices")
        if comm == "ll":
            self._ll = _LowLatency(self.group, device, max_numel)
        if comm == "symm_mem":
            import torch.distributed._symmetric_memory as symm_mem
            self._group_name = self.group.group_name
            # One symmetric buffer per reduce dtype, allocated and exchanged once (never per step), in the same
            # order on every rank (symm_dtypes: a list; a set's order follows the dtype objects' addresses,
            # which differ between processes, and a rendezvous of a bf16 buffer on one rank with an fp32 one on
            # the other fails on their sizes)
            for dt in symm_dtypes(self.reduce_dtype):
                buf = symm_mem.empty(max_numel, dtype=dt, device=device)
                symm_mem.rendezvous(buf, self._group_name)
                self._bufs[dt] = buf

    def _sum(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        y = x.to(dtype).contiguous()
        if self.comm == "symm_mem" and y.numel() <= self._bufs[dtype].numel():
            flat = torch.ops.symm_mem.one_shot_all_reduce_copy(self._bufs[dtype][: y.numel()], y.view(-1),
                                                                "sum", self._group_name)
            return flat.view(y.shape)
        dist.all_reduce(y, group=self.group)
        return y

    @staticmethod
    def stage(site: str) -> str:
        """The profiler row of a communication site (SingleProcess.stage)."""
        return f"comm.{site}"

    @property
    def folds_hc(self) -> bool:
        """Whether the model should hand the block's hc fold to all_reduce (comm=ll: csrc/allreduce.cu's fold
        kernel). Opt-in, DS4_AR_FOLD=1 (read per call): on two H200s it has not yet measured faster than the
        all-reduce and the hc site's own first launch (experiments/decode_session19_h200.md)."""
        return self._ll is not None and os.environ.get("DS4_AR_FOLD") == "1"

    def all_reduce(self, x: Tensor, site: str, out_dtype: torch.dtype | None = None, fold=None) -> Tensor:
        """The sum over the ranks of x, reduced in the reduce precision, returned in out_dtype (x's by default).
        fold: the block's pending hc fold (ds4.ops.base.HcFold), for a block output: with comm=ll, one bf16 row
        whose length is the fold's D, the same launch also forms the fold (the post onto the streams and the next
        mHC site's partials; then fold.fused), so that site's first launch leaves the step; else untouched."""
        # Embedding rows are exact sums of one rank's row and zeros: keep them fp32 (exact) whatever the
        # activation reduce precision.
        dtype = torch.float32 if site == "embed" else self.reduce_dtype
        out_dtype = out_dtype or x.dtype
        if (fold is not None and self._ll is not None and site != "embed" and out_dtype == torch.bfloat16
                and x.numel() == fold.out.shape[-1] and x.numel() % 16 == 0 and x.numel() <= self._ll.cap):
            y = self._ll.sum_fold(x, dtype == torch.bfloat16, fold).view(x.shape)
            fold.fused = True
            return y
        if self._ll is not None and x.numel() <= self._ll.cap:  # one launch: the casts are part of it
            return self._ll.sum(x, dtype == torch.bfloat16, out_dtype)
        return self._sum(x, dtype).to(out_dtype)

    def gather_vocab(self, logits: Tensor) -> Tensor:
        parts = [torch.empty_like(logits) for _ in range(self.world)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, -1)

    def argmax(self, logits: Tensor, kernel: bool = False) -> Tensor:
        """The seed's distributed argmax: each rank offers (local max, global index); the largest
        value wins, ties go to the lowest global index. Sends 2 values per row per rank."""
        v_local = logits.shape[-1]
        idx = argmax_first(logits, kernel=kernel)
        val = logits.float().gather(-1, idx[..., None]).squeeze(-1)
        mine = torch.stack((val, (idx + self.rank * v_local).float()), -1)           # [N, 2]
        allp = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(allp, mine.contiguous(), group=self.group)
        allp = torch.stack(allp, 0)                                                    # [W, N, 2]
        best = allp[..., 0].max(0).values
        cand = torch.where(allp[..., 0] == best, allp[..., 1], torch.full_like(allp[..., 1], float("inf")))
        return cand.min(0).values.long()


class _LowLatency:
    """comm=ll: the state of ds4's one-shot all-reduce kernels (ds4.kernels.all_reduce_ll, all_reduce_ll_fold): one
    symmetric buffer per rank of two regions (one per kernel: their epochs are separate sequences) of [2 slots]
    [W ranks][cap] 8-byte words, exchanged once, and this rank's per-block call counters of each kernel. All
    start at zero; the barrier after zeroing keeps a peer from writing its first values before they are."""

    def __init__(self, group, device: torch.device, cap: int):
        from ds4 import kernels
        reason = kernels.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"comm=ll needs the ds4 CUDA kernels: {reason}")
        import torch.distributed._symmetric_memory as symm_mem
        world = dist.get_world_size(group)
        if world > kernels.AR_MAX_WORLD:
            raise ValueError(f"comm=ll takes at most {kernels.AR_MAX_WORLD} ranks, got {world}")
        self.cap, self.rank = cap, dist.get_rank(group)
        region = 2 * world * cap  # words
        self.buf = symm_mem.empty(2 * region * 2, dtype=torch.int32, device=device)  # 2 int32 = one word
        self.buf.zero_()
        hdl = symm_mem.rendezvous(self.buf, group.group_name)
        # buffer_ptrs are the allocations' bases; the tensor sits at the same offset in each
        off = self.buf.data_ptr() - int(hdl.buffer_ptrs[self.rank])
        self.peers = [int(p) + off for p in hdl.buffer_ptrs]
        self.peers_fold = [p + region * 8 for p in self.peers]
        self.counters = torch.zeros(-(-cap // kernels.AR_CHUNK), dtype=torch.int32, device=device)
        self.counters_fold = torch.zeros(-(-cap // kernels.AR_FOLD_ROWS), dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)

    def sum(self, x: Tensor, round_bf16: bool, out_dtype: torch.dtype) -> Tensor:
        from ds4 import kernels
        return kernels.all_reduce_ll(x.contiguous(), self.peers, self.counters, self.rank, self.cap, round_bf16,
                                     out_dtype).view(x.shape)

    def sum_fold(self, x: Tensor, round_bf16: bool, fold) -> Tensor:
        from ds4 import kernels
        return kernels.all_reduce_ll_fold(x.contiguous(), self.peers_fold, self.counters_fold, self.rank, self.cap,
                                          round_bf16, fold)
