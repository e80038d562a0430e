"""Whole-step CUDA graph: one graph per batch size covering every layer, routing, indexer top-k,
sparse attention, compressor updates (emission decided on the device), head and greedy
selection. Replayed per token; the token, positions and caches live in static buffers.

One graph (not one per compressor phase) is enough because the decode step has no host
branch: the in-progress compressed entry is rewritten every step and only becomes visible
when its window completes.

Tensor parallel: collectives are captured too. NCCL needs its communicator warmed up on the
capturing stream's side stream before capture (done by the warm-up steps below); the
symmetric-memory all-reduce is capture-safe as is.
"""
from __future__ import annotations

import time

import torch
from torch import Tensor

from ds4.model.transformer import DecodeState, Transformer
from ds4.runtime.sampling import argmax


class CudaGraphStep:
    def __init__(self, model: Transformer, state: DecodeState, batch: int, mode: str, warmup: int = 2):
        """mode: 'argmax' (greedy, full vocab), 'dist_argmax' (greedy on vocab slices under TP),
        or 'logits' (sampling happens outside the graph on the returned logits)."""
        if model.device.type != "cuda":
            raise RuntimeError("runtime=cuda_graph needs a CUDA device")
        self.model, self.state, self.batch, self.mode = model, state, batch, mode
        self.tok = torch.zeros(batch, dtype=torch.long, device=model.device)
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
        mem0 = torch.cuda.memory_allocated(model.device)  # after the snapshot: pool_bytes is the graph's
        side = torch.cuda.Stream(model.device)
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):  # warm-up: allocator, cuBLAS workspaces, NCCL communicators
            for _ in range(warmup):
                self._step()
        torch.cuda.current_stream(model.device).wait_stream(side)
        torch.cuda.synchronize(model.device)
        self.warmup_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._step()
        torch.cuda.synchronize(model.device)
        self.capture_s = time.perf_counter() - t1
        self.pool_bytes = torch.cuda.memory_allocated(model.device) - mem0
        for st, saved in zip(state.layers, snapshot[0]):  # undo the warm-up steps' writes
            for k, v in st.items():
                v.copy_(saved[k])
        state.pos.copy_(snapshot[1])

    def _step(self) -> Tensor:
        logits = self.model.decode(self.tok, self.state, full_vocab=self.mode != "dist_argmax")
        if self.mode == "argmax":
            return argmax(logits)
        if self.mode == "dist_argmax":
            return self.model.comm.argmax(logits)
        return logits

    def __call__(self, tok: Tensor) -> Tensor:
        """Feed tokens [batch] and replay: next tokens (greedy modes) or logits."""
        self.tok.copy_(tok)
        self.graph.replay()
        return self.out
