"""KV compressor (spec §5.4): ratio-4 overlapped (CSA) and plain ratio-m (HCA), prefill and decode.

Per token t: kv_t = wkv(x_t), z_t = wgate(x_t) + ape[t mod m], both fp32. An entry pools, per
channel, softmax(z) * kv over its window's slots; CSA entries pool 2m slots: the lower halves
(dims [0:w]) of the previous window's tokens and the upper halves (dims [w:2w]) of their own.
Entry w is normed, RoPE'd at position w*m and (qat) FP8/FP4-simulated, and is visible from the
token that completes it: token t sees entries 0 .. (t+1)//m - 1.

Decode keeps the reference's state machine in preallocated fp32 buffers (spec §5.4): HCA slots
[m, w]; CSA slots [2m, 2w], 0..m-1 = previous window, m..2m-1 = current. The step itself is an
attention-implementation op (`ops.attn.compress_step`); `decode_step` below is its plain-torch
form: it recomputes the in-progress entry and writes it to cache slot pos//m on every step (it
stays invisible until its window completes, so no host-side branch is needed). Kernels may write
the entry only on the completing step: nothing reads an entry before it is visible.

Deferred projection (opt-in, batch-1 decode, `ops.attn.compress_deferred`): nothing reads a token's slots before its
window completes, so the projection of n tokens (n divides m; 4 at V4's ratios) can wait for the last of them.
Each step puts x into a ring [n, dim]; the step with (pos + 1) % n == 0 projects the ring's n tokens at once (one
read of the BF16 weights for n tokens: the CSA compressors' 21 MB per step, the HCA compressor's 8.4 MB, become a
quarter) and writes their slots; n divides m, so a window's last position is such a step. Same slots, same entries.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from ds4.model.args import ModelArgs
from ds4.model.norm import rms_norm
from ds4.model.rope import apply_rope, rotations
from ds4.model.weights_module import WeightsModule
from ds4.quant import act_quant_sim, fp4_act_quant_sim, hadamard


def defer_tokens(ratio: int, most: int) -> int:
    """Tokens per deferred projection of a compressor of this ratio: the largest divisor of the ratio <= most
    (a window's last position must end a group); below 2: no deferral."""
    return max(d for d in range(1, max(most, 1) + 1) if ratio % d == 0)


class Compressor(WeightsModule):
    def __init__(self, args: ModelArgs, ratio: int, width: int, overlap: bool, for_indexer: bool):
        super().__init__()
        self.args, self.m, self.w, self.overlap, self.for_indexer = args, ratio, width, overlap, for_indexer
        self.coff = 2 if overlap else 1

    def load(self, t: Mapping[str, Tensor], prefix: str) -> None:
        # wkv and wgate read the same input: one [2*coff*w, dim] matrix, one GEMV per step (same bytes;
        # wkv / wgate stay available as views).
        self.register_buffer("wkv_gate", torch.cat((t[f"{prefix}.wkv.weight"], t[f"{prefix}.wgate.weight"])),
                             persistent=False)
        self.wkv, self.wgate = self.wkv_gate.chunk(2)
        self.ape = self.take("ape", t, f"{prefix}.ape")
        self.norm = self.take("norm", t, f"{prefix}.norm.weight")

    # ---- shared pieces ----------------------------------------------------------------------
    def project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [..., dim] -> kv, z [..., coff*w] fp32 (no ape yet)."""
        return project_f32(x, self.wkv_gate).chunk(2, -1)  # the merged [wkv; wgate] rows

    @property
    def quant(self) -> str:
        """The qat simulation of this compressor's entries: FP4 after a Hadamard (indexer keys) or FP8 nope dims."""
        return "fp4" if self.for_indexer else "fp8"

    def finish(self, pooled: Tensor, positions: Tensor, freqs: Tensor, qat: bool, dtype: torch.dtype) -> Tensor:
        """pooled [..., w] fp32 -> cache entry [..., w] in `dtype`: norm, RoPE at `positions`, qat simulation."""
        return finish_entry(pooled.to(dtype), self.norm, self.args.norm_eps, positions, freqs,
                            self.quant if qat else None)

    # ---- prefill: one sequence, positions 0..S-1 ---------------------------------------------
    def prefill(self, x: Tensor, freqs: Tensor, qat: bool, state: dict[str, Tensor]) -> Tensor:
        """x [S, dim] -> entries [S//m, w]; fills state['kv'], state['score'] ([slots, coff*w]) for decode, and
        the deferred projection's ring state['x'] [n, dim] where present (ring[p % n] = x[p] for the tokens after
        the last multiple of n: the decode step that completes their group projects them again)."""
        m, w, S = self.m, self.w, x.shape[0]
        if "x" in state:
            tail = S % state["x"].shape[0]
            state["x"][:tail] = x[S - tail:]
        kv, z = self.project(x)
        z = z + self.ape[torch.arange(S, device=x.device) % m]
        n, cut = S // m, (S // m) * m
        state["kv"].zero_()
        state["score"].fill_(float("-inf"))
        off = m if self.overlap else 0
        rem = S - cut
        if rem:
            state["kv"][off:off + rem] = kv[cut:]
            state["score"][off:off + rem] = z[cut:]
        if self.overlap and n:
            state["kv"][:m] = kv[cut - m:cut]
            state["score"][:m] = z[cut - m:cut]
        if n == 0:
            return kv.new_zeros(0, w, dtype=x.dtype)
        kvw, zw = kv[:cut].view(n, m, -1), z[:cut].view(n, m, -1)
        if self.overlap:
            prev_kv = torch.cat((kvw.new_zeros(1, m, w), kvw[:-1, :, :w]), 0)
            prev_z = torch.cat((zw.new_full((1, m, w), float("-inf")), zw[:-1, :, :w]), 0)
            kvw = torch.cat((prev_kv, kvw[:, :, w:]), 1)                # [n, 2m, w]
            zw = torch.cat((prev_z, zw[:, :, w:]), 1)
        pooled = (kvw * zw.softmax(1)).sum(1)                             # [n, w]
        pos = torch.arange(n, device=x.device) * m
        return self.finish(pooled, pos, freqs, qat, x.dtype)

    # ---- decode: one token per row at positions pos [B] --------------------------------------
    def decode(self, x: Tensor, pos: Tensor, freqs: Tensor, qat: bool, state: dict[str, Tensor],
               cache: Tensor, attn) -> None:
        """x [B, dim]; `attn.compress_project` is the merged projection, `attn.compress_step` writes the token
        into the state and the entry into cache[b, pos//m] (see `decode_step`). With a ring in the state
        (state['x'] [B, n, dim], allocated for batch-1 decode where Attention.defer_compress asks) the projection
        is deferred: `attn.compress_deferred` (see `decode_step_deferred`)."""
        if "x" in state:
            attn.compress_deferred(x, state["x"], self.wkv_gate, self.ape, self.norm, pos, freqs, state["kv"],
                                   state["score"], cache, self.m, self.overlap, self.args.norm_eps,
                                   self.quant if qat else None)
            return
        kvz = attn.compress_project(x, self.wkv_gate)
        attn.compress_step(kvz, self.ape, self.norm, pos, freqs, state["kv"], state["score"], cache, self.m,
                           self.overlap, self.args.norm_eps, self.quant if qat else None)


def project_f32(x: Tensor, w: Tensor) -> Tensor:
    """x [..., dim] @ w[rows, dim]^T in fp32. The reference holds the compressor weights in fp32 (BF16
    values) and multiplies fp32 inputs. BF16 x BF16 products are exact in fp32, so on CUDA a BF16 matmul
    with fp32 accumulation and output gives the same numbers (up to summation order) without an fp32
    copy of the weights."""
    if x.is_cuda and x.dtype == w.dtype == torch.bfloat16:
        return torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)
    return x.float() @ w.float().t()


def finish_entry(x: Tensor, weight: Tensor, eps: float, positions: Tensor, freqs: Tensor,
                 quant: str | None) -> Tensor:
    """A KV entry x [..., w] (window key or pooled compressed entry, activation dtype) -> norm with
    `weight`, RoPE of the last 2*len(freqs) dims at `positions` [...], and the qat simulation:
    "fp8" = FP8 (block 64) on the nope dims, "fp4" = Hadamard + FP4 (block 32), None = none."""
    c = apply_rope(rms_norm(x, weight, eps), rotations(freqs, positions))
    if quant == "fp4":
        return fp4_act_quant_sim(hadamard(c), 32)
    if quant == "fp8":
        nope = c.shape[-1] - 2 * freqs.shape[-1]
        return torch.cat((act_quant_sim(c[..., :nope], 64), c[..., nope:]), -1)
    return c


def decode_step(kvz: Tensor, ape: Tensor, norm: Tensor, pos: Tensor, freqs: Tensor, skv: Tensor, ssc: Tensor,
                cache: Tensor, m: int, overlap: bool, eps: float, quant: str | None) -> None:
    """Plain-torch compressor decode step (the reference's state machine, spec §5.4).

    kvz [B, 2*cw] fp32 = [kv | gate z] of the token (cw = coff*w), ape [m, cw], pos [B]; state
    skv / ssc [B, coff*m, cw] fp32; cache [B, T, w]. Writes the token's slot, pools the (possibly
    in-progress) entry into cache[b, pos//m], and for the overlapped compressor moves the current
    slots to "previous" when the window completes."""
    rows = torch.arange(kvz.shape[0], device=kvz.device)
    kv, z = kvz.chunk(2, -1)
    z = z + ape[pos % m]
    slot = pos % m + (m if overlap else 0)
    skv[rows, slot] = kv
    ssc[rows, slot] = z
    _pool_step(norm, pos, freqs, skv, ssc, cache, m, overlap, eps, quant)


def decode_step_deferred(x: Tensor, ring: Tensor, w: Tensor, ape: Tensor, norm: Tensor, pos: Tensor, freqs: Tensor,
                         skv: Tensor, ssc: Tensor, cache: Tensor, m: int, overlap: bool, eps: float,
                         quant: str | None) -> None:
    """Plain-torch compressor decode step with the projection deferred (module docstring).

    x [B, dim] this step's token; ring [B, n, dim] (n divides m) the tokens since the last multiple of n; w the
    merged [wkv; wgate] rows. Every step: ring[b, pos % n] = x. Where (pos + 1) % n == 0 (on the device): the
    slots of positions pos - n + 1 .. pos from one projection of the ring; elsewhere the slots are unchanged.
    Then the pooling of `decode_step` (the in-progress entry, and the window's shift where it completes)."""
    B, n = ring.shape[:2]
    rows = torch.arange(B, device=x.device)
    ring[rows, pos % n] = x
    kv, z = project_f32(ring, w).chunk(2, -1)                          # [B, n, cw]
    phase = (pos[:, None] + torch.arange(1 - n, 1, device=x.device)) % m  # [B, n]: positions pos - n + 1 .. pos
    slot, r = phase + (m if overlap else 0), rows[:, None]
    due = ((pos + 1) % n == 0).view(B, 1, 1)
    skv[r, slot] = torch.where(due, kv, skv[r, slot])
    ssc[r, slot] = torch.where(due, z + ape[phase], ssc[r, slot])
    # the entry only where its window completes (as the kernel writes it): between, a window's slots may all be
    # unwritten (-inf scores, a NaN pool), and an attention over masked entries may still multiply their values
    _pool_step(norm, pos, freqs, skv, ssc, cache, m, overlap, eps, quant, complete_only=True)


def _pool_step(norm: Tensor, pos: Tensor, freqs: Tensor, skv: Tensor, ssc: Tensor, cache: Tensor, m: int,
               overlap: bool, eps: float, quant: str | None, complete_only: bool = False) -> None:
    """The pooling half of a decode step: the (possibly in-progress; complete_only: only a completed) entry into
    cache[b, pos//m], and for the overlapped compressor the current slots moved to "previous" where the window
    completes."""
    B, w = pos.shape[0], cache.shape[-1]
    rows = torch.arange(B, device=pos.device)
    done = ((pos + 1) % m == 0).view(B, 1, 1)
    if overlap:
        kvw = torch.cat((skv[:, :m, :w], skv[:, m:, w:]), 1)          # [B, 2m, w]
        zw = torch.cat((ssc[:, :m, :w], ssc[:, m:, w:]), 1)
    else:
        kvw, zw = skv, ssc
    pooled = (kvw * zw.softmax(1)).sum(1)                             # [B, w]
    entry = finish_entry(pooled.to(cache.dtype), norm, eps, (pos // m) * m, freqs, quant)
    if complete_only:
        entry = torch.where(done[:, 0], entry, cache[rows, pos // m])
    cache[rows, pos // m] = entry
    if overlap:  # window complete: current slots become the previous window
        skv[:, :m] = torch.where(done, skv[:, m:], skv[:, :m])
        ssc[:, :m] = torch.where(done, ssc[:, m:], ssc[:, :m])
