"""Whole-step CUDA graph: one graph per batch size covering every layer, routing, indexer top-k,
sparse attention, compressor updates (emission decided on the device), head and the token's
selection (greedy argmax, or seeded sampling: temperature, top-k, top-p and the exponential draw,
from a generator registered with the graph, so a replay draws what eager decoding would).
Replayed per token; the token, positions and caches live in static buffers.

One graph (the default) is enough because the decode step has no host branch: the in-progress
compressed entry is rewritten every step and only becomes visible when its window completes.

DS4_LATE_COMPRESS=1 (opt-in) captures one graph per compressor phase instead: at a step where no
row's window of ratio m ends, the layers of ratio m may join their compressor branches after the
attention instead of before it (Transformer.decode's window_ends). The phases are the sets of
ratios whose window ends at a step: for V4's 4 and 128, {}, {4} and {4, 128}. The caller names the
rows' positions (host ints it counts itself: ds4.runtime.generate.Generator) and the matching
graph is replayed; without positions, the graph of every ratio (all branches joined early, as in
the one graph). On one H200 it measured no faster: 114.2 / 114.2 against 113.5 / 114.2 us per
layer with one graph (experiments/decode_session28_h200.md).

Tensor parallel: collectives are captured too. NCCL needs its communicator warmed up on the
capturing stream's side stream before capture (done by the warm-up steps below); the
symmetric-memory all-reduce is capture-safe as is.
"""
from __future__ import annotations

import math
import os
import time
from typing import Sequence

import torch
from torch import Tensor

from ds4.model.transformer import DecodeState, Transformer
from ds4.runtime.sampling import Sampling, argmax, sample


def step_phases(ratios: Sequence[int]) -> list[frozenset[int]]:
    """Every window_ends a decode step can have (any batch): the ratios whose window ends at one position, over one
    period of the ratios, then unions of those (rows at different positions)."""
    ratios = sorted(set(ratios))
    if not ratios:
        return [frozenset()]
    period = math.lcm(*ratios)
    if period > 1 << 16:  # not V4's shapes: every subset
        one = {frozenset(r for i, r in enumerate(ratios) if k >> i & 1) for k in range(1 << len(ratios))}
    else:
        one = {frozenset(r for r in ratios if (p + 1) % r == 0) for p in range(period)}
    out = set(one)
    while True:
        more = {a | b for a in out for b in one} - out
        if not more:
            return sorted(out, key=lambda f: (len(f), sorted(f)))
        out |= more


def late_compress_enabled() -> bool:
    """DS4_LATE_COMPRESS=1 (read at capture; opt-in): capture a graph per compressor phase (see the module)."""
    return os.environ.get("DS4_LATE_COMPRESS", "0") == "1"


def _clear_cublas_workspaces() -> None:
    getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()


def pool_bytes(graph, device: torch.device) -> int:
    """Bytes reserved by a captured graph's private memory pool on `device` (the allocator's segments of that pool)."""
    pool, idx = tuple(graph.pool()), device.index if device.index is not None else torch.cuda.current_device()
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
               if tuple(s.get("segment_pool_id", ())) == pool and s.get("device", idx) == idx)


MODES = ("argmax", "dist_argmax", "sample", "logits")


def _check_device(model: Transformer) -> None:
    if model.device.type != "cuda":
        raise RuntimeError("runtime=cuda_graph needs a CUDA device")


class CudaGraphStep:
    def __init__(self, model: Transformer, state: DecodeState, batch: int, mode: str, warmup: int = 2,
                 sampling: Sampling | None = None):
        """mode: 'argmax' (greedy, full vocab), 'dist_argmax' (greedy on vocab slices under TP), 'sample' (the
        settings of `sampling`, temperature > 0, drawing from self.gen, which the caller seeds before its first
        token: Generator.generate), or 'logits' (the step returns the logits: teacher forcing)."""
        _check_device(model)
        if mode not in MODES:
            raise ValueError(f"graph mode must be one of {'|'.join(MODES)}, got {mode!r}")
        if (mode == "sample") != (sampling is not None and not sampling.greedy):
            raise ValueError(f"graph mode {mode!r} with sampling {sampling}: 'sample' and temperature > 0 go together")
        self.model, self.state, self.batch, self.mode = model, state, batch, mode
        self.sampling = sampling
        # the sampler's own generator: a graph replays the draws of a generator registered before its capture
        # (torch adds the graph's offset increment to it at each replay), so it must be this one, for good
        self.gen = torch.Generator(device=model.device) if mode == "sample" else None
        self.tok = torch.zeros(batch, dtype=torch.long, device=model.device)
        self.full = model.compress_ratios  # every ratio's window ends: every branch joined early (no positions given)
        self.phases = step_phases(sorted(self.full)) if late_compress_enabled() else [self.full]
        # Profiler events cannot be recorded inside a capture: the captured step is one opaque
        # region (profile the eager runtime for the per-stage table).
        profiling, model.prof.enabled = model.prof.enabled, False
        try:
            self._capture(warmup)
        finally:
            model.prof.enabled = profiling

    def _capture(self, warmup: int) -> None:
        model, state = self.model, self.state
        t0 = time.perf_counter()
        snapshot = ([{k: v.clone() for k, v in st.items()} for st in state.layers], state.pos.clone())
        rng = self.gen.get_state() if self.gen is not None else None  # the warm-up's draws are undone too
        try:
            # the warm-up steps run at positions 0, 1, ...: the rows may stand anywhere (a sequence an earlier call
            # ran to max_seq_len - 1), and a step past max_seq_len indexes past the compressed caches
            state.pos.zero_()
            side = torch.cuda.Stream(model.device)
            side.wait_stream(torch.cuda.current_stream(model.device))
            with torch.cuda.stream(side):  # warm-up: allocator, cuBLAS workspaces, NCCL communicators
                for _ in range(warmup):
                    self._step(None)
            torch.cuda.current_stream(model.device).wait_stream(side)
            torch.cuda.synchronize(model.device)
            self.warmup_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            # one private memory pool per graph: they replay in any order, so none may reuse another's blocks
            self.graphs: dict[frozenset[int], torch.cuda.CUDAGraph] = {}
            self.outs: dict[frozenset[int], Tensor] = {}
            # cuBLAS caches a workspace per (handle, stream): one made while capturing would stay allocated in the
            # graph's pool (pinning it after the graph is gone); cleared before and after, as torch's cudagraph trees
            # do, a capture's workspace is a block of its own pool (counted there, freed with it)
            _clear_cublas_workspaces()
            for phase in self.phases:
                graph = torch.cuda.CUDAGraph()
                if self.gen is not None:  # (the device's default generator is registered by torch itself)
                    graph.register_generator_state(self.gen)
                with torch.cuda.graph(graph):
                    self.outs[phase] = self._step(phase)
                self.graphs[phase] = graph
            _clear_cublas_workspaces()
            torch.cuda.synchronize(model.device)
            self.capture_s = time.perf_counter() - t1
            # the pools' reserved bytes (live outputs and the freed intermediates a replay writes alike);
            # memory_allocated counts only the tensors still referenced when the capture ends
            self.pool_bytes = sum(pool_bytes(g, model.device) for g in self.graphs.values())
        finally:
            for st, saved in zip(state.layers, snapshot[0]):  # undo the warm-up steps' writes
                for k, v in st.items():
                    v.copy_(saved[k])
            state.pos.copy_(snapshot[1])
            if rng is not None:
                self.gen.set_state(rng)

    def _step(self, window_ends: frozenset[int] | None) -> Tensor:
        logits = self.model.decode(self.tok, self.state, full_vocab=self.mode != "dist_argmax",
                                   window_ends=window_ends)
        if self.mode == "argmax":
            return argmax(logits, kernel=self.model.ops.ds4_ext)
        if self.mode == "dist_argmax":
            return self.model.comm.argmax(logits, kernel=self.model.ops.ds4_ext)
        if self.mode == "sample":  # full-vocab logits on every rank, every rank's generator seeded alike
            return sample(logits, self.sampling, self.gen)
        return logits

    def phase(self, positions: Sequence[int] | None) -> frozenset[int]:
        """The graph for a step at these positions (one per row; None: unknown, the graph of every ratio)."""
        if positions is None or len(self.phases) == 1:
            return self.full
        if len(positions) != self.batch:
            raise ValueError(f"{len(positions)} positions for a step of batch {self.batch}")
        return self.model.window_ends(positions)

    def __call__(self, tok: Tensor, positions: Sequence[int] | None = None) -> Tensor:
        """Feed tokens [batch] at the rows' positions (host ints: where state.pos stands, see phase) and replay:
        next tokens (argmax and sample modes) or logits."""
        if tuple(tok.shape) != (self.batch,):  # copy_ would broadcast one token over every row
            raise ValueError(f"{tuple(tok.shape)} tokens for a step captured at batch {self.batch}")
        phase = self.phase(positions)
        self.tok.copy_(tok)
        self.graphs[phase].replay()
        return self.outs[phase]
