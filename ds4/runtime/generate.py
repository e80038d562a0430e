"""Generation loop: per-row prefill into the preallocated state, then batched one-token decode.

Each prompt is prefilled into its own row (no padding, no teacher forcing of longer prompts),
so rows sit at different positions; `decode` advances all rows together. The only host
synchronisations are between steps: the EOS check every `eos_check_every` steps, and the end.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ds4.model.transformer import DecodeState, Transformer
from ds4.runtime.sampling import Sampling, sample

if TYPE_CHECKING:
    from ds4.runtime.cuda_graph import CudaGraphStep


@dataclass
class GenerateOutput:
    tokens: list[list[int]]        # generated ids per prompt, truncated after the first EOS (kept)
    prompt_lens: list[int]
    ttft_s: float                  # prefill of all prompts + first token
    prefill_s: float
    step_s: list[float] = field(default_factory=list)  # per decode step
    total_s: float = 0.0           # whole call, prefill included (the seed's end-to-end clock)
    truncated: bool = False        # max_new_tokens was cut to fit max_seq_len

    @property
    def n_generated(self) -> int:
        return sum(len(t) for t in self.tokens)


class Generator:
    def __init__(self, model: Transformer, max_batch: int, max_seq_len: int, runtime: str = "eager"):
        if runtime not in ("eager", "cuda_graph"):
            raise ValueError(f"runtime must be eager|cuda_graph, got {runtime!r}")
        if runtime == "cuda_graph" and model.device.type != "cuda":
            raise ValueError("runtime=cuda_graph needs a CUDA device")
        self.model, self.max_batch, self.max_seq_len, self.runtime = model, max_batch, max_seq_len, runtime
        self.state: DecodeState = model.alloc_state(max_batch, max_seq_len)
        self.batch = 0
        # where state.pos stands, counted on the host (no device read): the captured step picks its graph by it
        self.host_pos: list[int] = [0] * max_batch
        self.graphs: dict[tuple[int, str], "CudaGraphStep"] = {}  # (batch, mode) -> captured step
        # what the steps recaptured in place of (graph_step) cost: their warm-up and capture seconds, graphs captured
        self.replaced = {"warmup_s": 0.0, "capture_s": 0.0, "graphs": 0}

    def graph_step(self, batch: int, mode: str, sampling: Sampling | None = None):
        """The captured decode step for this batch size and selection mode (captured on first use). Mode 'sample'
        bakes in the sampling settings but the seed: other settings recapture it, in place of the old one."""
        from ds4.runtime.cuda_graph import CudaGraphStep
        key = (batch, mode)
        settings = dataclasses.replace(sampling, seed=0) if mode == "sample" else None
        if key in self.graphs and self.graphs[key].sampling != settings:
            old = self.graphs.pop(key)  # (its pool goes back to the allocator before the new capture)
            self.replaced["warmup_s"] += old.warmup_s
            self.replaced["capture_s"] += old.capture_s
            self.replaced["graphs"] += len(old.graphs)
            del old
        if key not in self.graphs:
            self.graphs[key] = CudaGraphStep(self.model, self.state, batch, mode, sampling=settings)
        return self.graphs[key]

    def _check(self, prompts: list[list[int]]) -> None:
        if not prompts:
            raise ValueError("no prompts given")
        if len(prompts) > self.max_batch:
            raise ValueError(f"{len(prompts)} prompts but the decode state holds max_batch={self.max_batch}")
        for p in prompts:
            if not p:
                raise ValueError("empty prompt")
            if len(p) >= self.max_seq_len:
                raise ValueError(f"prompt of {len(p)} tokens does not fit max_seq_len={self.max_seq_len} "
                                 "(it needs room for at least one generated token)")

    def prefill(self, prompts: list[list[int]], full_vocab: bool = True) -> Tensor:
        """Reset and prefill one row per prompt -> logits [B, V] for each prompt's last position."""
        self._check(prompts)
        dev = self.model.device
        out = []
        for row, p in enumerate(prompts):
            self.state.reset_row(row)
            try:
                out.append(self.model.prefill(torch.tensor(p, dtype=torch.long, device=dev), self.state, row,
                                              full_vocab=full_vocab))
            except torch.OutOfMemoryError as e:  # the memory check before loading counts no prompt's working set
                raise torch.OutOfMemoryError(
                    f"the prefill of a {len(p)}-token prompt ran out of memory: the check before loading counts the "
                    "weights and the decode state, not a prompt's activations, which grow with its length; use a "
                    f"shorter prompt or fewer layers, or free memory ({str(e).splitlines()[0]})") from None
            self.host_pos[row] = len(p)
        self.batch = len(prompts)
        return torch.stack(out)

    def decode(self, tokens: Tensor, full_vocab: bool = True) -> Tensor:
        """tokens [B] (device) -> logits [B, V]; every row advances one position."""
        self._room(tokens.shape[0])
        out = self.model.decode(tokens, self.state, full_vocab)
        self._advance(tokens.shape[0])
        return out

    def replay(self, step: "CudaGraphStep", tokens: Tensor) -> Tensor:
        """One captured step (graph_step) on tokens [B] at the rows' positions; every row advances one position."""
        self._room(tokens.shape[0])
        out = step(tokens, self.host_pos[: tokens.shape[0]])
        self._advance(tokens.shape[0])
        return out

    def _room(self, batch: int) -> None:
        """A step writes each row's position into the caches sized for max_seq_len: refused at max_seq_len (host ints;
        past it the compressed caches are indexed out of bounds, which a captured step does not check)."""
        if max(self.host_pos[:batch]) >= self.max_seq_len:
            raise ValueError(f"decode at positions {self.host_pos[:batch]}: the state holds max_seq_len="
                             f"{self.max_seq_len} positions")

    def _advance(self, batch: int) -> None:
        for row in range(batch):
            self.host_pos[row] += 1

    def check_positions(self) -> None:
        """Raises if the host's count of positions left the device's (a device read: call it where the host waits
        anyway). A captured step at a wrong count could read a compressed entry its branch is still writing."""
        dev = self.state.pos[: self.batch].tolist()
        if dev != self.host_pos[: self.batch]:
            raise RuntimeError(f"decode positions: device {dev}, host count {self.host_pos[: self.batch]} "
                               "(state.pos was changed outside Generator.prefill / decode / replay)")

    def next_token(self, logits: Tensor, sampling: Sampling, gen) -> Tensor:
        """Greedy under tensor parallelism takes the distributed argmax of vocab slices;
        everything else samples the full logits (every rank draws the same token: same seed)."""
        kernel = self.model.ops.ds4_ext  # the run's choices pick the argmax (ds4.runtime.sampling.argmax)
        if sampling.greedy and self.model.comm.world > 1:
            return self.model.comm.argmax(logits, kernel=kernel)
        return sample(logits, sampling, gen, kernel=kernel)

    def teacher_forced_logits(self, prompt: list[int], continuation: list[int]) -> Tensor:
        """Logits predicting continuation[i] at step i, feeding the given tokens through the decode step the
        runtime runs (runtime=cuda_graph: the captured step, so fidelity measures what the run decodes with)."""
        step = self.graph_step(1, "logits") if self.runtime == "cuda_graph" else None
        logits = [self.prefill([prompt])[0]]
        dev = self.model.device
        for t in continuation[:-1]:
            tok = torch.tensor([t], device=dev)
            logits.append(self.decode(tok)[0] if step is None else self.replay(step, tok)[0].clone())
        if step is not None:
            self.check_positions()
        return torch.stack(logits)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(),
                 stop_at_eos: bool = True, eos_check_every: int = 8) -> GenerateOutput:
        self._check(prompts)  # before a capture below, which would fail less clearly
        dev = self.model.device
        cuda = dev.type == "cuda"
        steps = min(max_new_tokens, self.max_seq_len - max(len(p) for p in prompts))
        truncated = steps < max_new_tokens
        eos = self.model.args.eos_token_id
        step = None
        if self.runtime == "cuda_graph":  # captured before the clock starts; its cost is reported separately
            mode = ("dist_argmax" if self.model.comm.world > 1 else "argmax") if sampling.greedy else "sample"
            step = self.graph_step(len(prompts), mode, sampling)
        gen = None
        if not sampling.greedy:  # the first token is drawn eagerly, the rest by the graph: one generator for both
            gen = step.gen if step is not None else torch.Generator(device=dev)
            gen.manual_seed(sampling.seed)
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        local = sampling.greedy and self.model.comm.world > 1  # distributed argmax on vocab slices
        logits = self.prefill(prompts, full_vocab=not local)
        if cuda:
            torch.cuda.synchronize(dev)
        prefill_s = time.perf_counter() - t0
        tok = self.next_token(logits, sampling, gen)
        out = [tok]
        if cuda:
            torch.cuda.synchronize(dev)
        ttft = time.perf_counter() - t0
        done = tok == eos
        events, host_steps = [], []
        for i in range(1, steps):
            if stop_at_eos and i % eos_check_every == 0 and bool(done.all()):
                break
            if cuda:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            ts = time.perf_counter()
            if step is None:
                tok = self.next_token(self.decode(tok, full_vocab=not local), sampling, gen)
            else:  # the graph's next tokens (a buffer the next replay overwrites)
                tok = self.replay(step, tok).clone()
            if cuda:
                ev[1].record()
                events.append(ev)
            else:
                host_steps.append(time.perf_counter() - ts)
            out.append(tok)
            done = done | (tok == eos)
        if cuda:
            torch.cuda.synchronize(dev)
        total = time.perf_counter() - t0
        if step is not None:
            self.check_positions()
        step_s = [a.elapsed_time(b) / 1e3 for a, b in events] if cuda else host_steps
        ids = torch.stack(out, 1).tolist()
        tokens = []
        for row in ids:
            if stop_at_eos and eos in row:
                row = row[: row.index(eos) + 1]
            tokens.append(row)
        return GenerateOutput(tokens, [len(p) for p in prompts], ttft, prefill_s, step_s, total, truncated)
