"""What the tasks share: the job context, timing figures, copy bandwidth, memory, fidelity.

Definitions follow docs BENCHMARKING.md. Nothing here knows about Hydra or wandb.
"""
from __future__ import annotations

import contextlib

import gc
import math
import resource
import statistics
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ds4.model.args import ModelArgs
from ds4.profile import Profiler
from ds4.registry import Impls, Ops


class InputError(ValueError):
    """Bad input found before the weights load (printed as one line)."""


# ---- task options (task.*): read and checked in a task's prepare, before the weights load -------------------
NUMERICS = ("plain", "qat")


def opt_bool(o: dict, key: str, default: bool) -> bool:
    v = o.get(key, default)
    if not isinstance(v, bool):  # Hydra passes `task.chat=off` as the string 'off', which bool() takes as true
        raise InputError(f"task.{key} must be true or false, got {v!r}")
    return v


def opt_int(o: dict, key: str, default: int, lo: int | None = None) -> int:
    v = o.get(key, default)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise InputError(f"task.{key} must be an integer, got {v!r}")
    if lo is not None and v < lo:
        raise InputError(f"task.{key} must be >= {lo}, got {v}")
    return v


def opt_float(o: dict, key: str, default: float) -> float:
    v = o.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InputError(f"task.{key} must be a number, got {v!r}")
    return float(v)


def check_fidelity_opts(o: dict) -> None:
    """The fidelity options of task=bench / eval (fidelity_plan and the comparison read them later)."""
    opt_bool(o, "fidelity", True)
    opt_float(o, "margin", 0.5)
    if str(o.get("reference_numerics", "plain")) not in NUMERICS:
        raise InputError(f"task.reference_numerics={o.get('reference_numerics')}: choose one of {', '.join(NUMERICS)}")


@dataclass(frozen=True)
class RunSpec:
    """Everything a job needs, as plain data (built from the Hydra config by ds4.app)."""
    device: torch.device
    dtype: torch.dtype
    seed: int = 0
    prompt: str = ""
    max_new_tokens: int = 32
    max_seq_len: int = 512
    batch: int = 1
    max_batch: int = 1
    profile: bool = False
    model: str = "tiny"
    n_layers: int | None = None
    model_overrides: dict = field(default_factory=dict)
    weights_kind: str = "synthetic"
    weights_path: str | None = None
    weights_seed: int = 0
    tokenizer: str | None = None
    impls: Impls = field(default_factory=Impls)
    numerics: str = "plain"
    reduce: str = "fp32"
    runtime: str = "eager"
    task: str = "generate"
    task_opts: dict = field(default_factory=dict)
    tp: int = 1                     # tensor-parallel size (torchrun processes)
    comm: str = "nccl"
    experts: str = "tp"             # routed experts over the ranks: tp (sliced, the default) | ep (whole, by id)
    shared_expert: str = "replicate"  # the shared expert over the ranks: replicate | tp (sliced)
    rank: int = 0


@dataclass
class Context:
    """A loaded job: the model built from resolved implementations, plus what tasks reuse."""
    spec: RunSpec
    args: ModelArgs
    ops: Ops
    model: Any            # ds4.model.transformer.Transformer
    tokenizer: Any
    weights: dict | None  # not kept: the model holds the tensors (the reference swaps implementations)
    profiler: Profiler
    generator: Any = None

    def gen(self):
        if self.generator is None:
            from ds4.runtime.generate import Generator
            self.generator = Generator(self.model, max_batch=self.spec.max_batch, max_seq_len=self.spec.max_seq_len,
                                       runtime=self.spec.runtime)
        return self.generator


def source_commit() -> str | None:
    """The commit of the ds4 source tree this process runs (`+dirty` with uncommitted changes to tracked files), for
    records (metrics.json, benchmark JSON); None outside a git checkout (an installed copy) or without git."""
    import subprocess
    root = Path(__file__).resolve().parents[2]  # the repository (ds4/tasks/common.py)
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


# ---- timing ----------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def decode_figures(out, batch: int, warmup: int = 0) -> dict[str, float]:
    """TTFT, TPOT median/p90/mean, decode and end-to-end tok/s from one GenerateOutput. The mean is the figure for
    throughput where the steps are not alike (the deferred compressor projection's every fourth step is longer: the
    median then shows the other three)."""
    steps = list(out.step_s)
    timed = steps[warmup:] if len(steps) > warmup else steps
    new_tokens = sum(len(t) for t in out.tokens)
    prompt_tokens = sum(out.prompt_lens)
    f = {"prompt_tokens": out.prompt_lens[0], "new_tokens": new_tokens, "batch": batch,
         "ttft_ms": 1e3 * out.ttft_s,
         "prefill_tok_s": prompt_tokens / out.prefill_s if out.prefill_s > 0 else float("nan"),
         "e2e_tok_s": new_tokens / out.total_s if out.total_s > 0 else float("nan"),
         "decode_steps_timed": len(timed)}
    if timed:
        tpot = 1e3 * statistics.median(timed)
        f.update(tpot_ms=tpot, tpot_ms_p90=1e3 * percentile(timed, 90), tpot_mean_ms=1e3 * statistics.fmean(timed),
                 decode_tok_s=1000.0 / tpot * batch if tpot > 0 else float("nan"))
    return f


def graph_figures(gen) -> dict[str, float]:
    """runtime=cuda_graph: warm-up and capture time and the graph pool's memory (reported apart
    from TPOT; the capture happens once per batch size, before the timed steps). Times and counts include the steps
    recaptured since (other sampling settings: Generator.graph_step), the pool only the graphs still held."""
    if not getattr(gen, "graphs", None):
        return {}
    g = list(gen.graphs.values())
    old = getattr(gen, "replaced", None) or {"warmup_s": 0.0, "capture_s": 0.0, "graphs": 0}
    return {"graph_warmup_s": old["warmup_s"] + sum(x.warmup_s for x in g),
            "graph_capture_s": old["capture_s"] + sum(x.capture_s for x in g),
            "graph_pool_mib": sum(x.pool_bytes for x in g) / 2**20,
            "graphs": old["graphs"] + sum(len(x.graphs) for x in g)}


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Copy bandwidth in GB/s (bytes read + written) measured here, now: a large device-to-device
    copy timed with CUDA events; on CPU a memcpy of nbytes/8 timed with the host clock (best of)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        n = max(1 << 20, min(nbytes, free // 4))
        src = torch.empty(n, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize(device)
        secs = start.elapsed_time(end) / 1e3
        del src, dst
        return 2 * n * iters / secs / 1e9
    n = max(1 << 20, nbytes // 8)
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(max(3, iters // 2)):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best / 1e9


def reset_memory(device: torch.device) -> None:
    """Called at job start: multirun jobs share a process, so free the last job and reset peaks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:  # Linux: "5" resets the process's peak resident set (VmHWM, ru_maxrss), so the next peak is this job's
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss_kib() -> int:
    """The process's peak resident set in KiB: VmHWM (which reset_memory resets on Linux), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def peak_memory(device: torch.device) -> dict:
    """Peak memory since the job's start (reset_memory). Under tensor parallelism on CUDA also every rank's peak, read
    at the same point of the task (a collective: every rank calls it)."""
    if device.type != "cuda":
        return {"peak_rss_gib": _peak_rss_kib() / 2**20}
    fig = {"peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30,
           "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, fig["peak_mem_gib"])
        fig["peak_mem_gib_per_rank"] = peaks
    return fig


# ---- fidelity --------------------------------------------------------------------------------
def compare_logits(test: torch.Tensor, ref: torch.Tensor, margin: float) -> dict[str, float]:
    """Teacher-forced comparison [T, V] vs [T, V]: top-1 agreement (all steps, and steps whose
    reference top-2 margin exceeds `margin`), max/mean abs logit difference, mean KL(ref || test)."""
    a, b = test.float().cpu(), ref.float().cpu()
    # argmax takes a NaN for the largest value: a step whose logits hold one agrees with nothing
    agree = (a.argmax(-1) == b.argmax(-1)) & ~a.isnan().any(-1)
    top2 = b.topk(2, dim=-1).values
    confident = (top2[:, 0] - top2[:, 1]) > margin
    diff = (a - b).abs()
    kl = F.kl_div(F.log_softmax(a, -1), F.log_softmax(b, -1), log_target=True, reduction="none").sum(-1)
    n_conf = int(confident.sum())
    return {"fid_steps": int(agree.numel()), "fid_top1": float(agree.float().mean()),
            "fid_confident_steps": n_conf,
            "fid_top1_confident": float(agree[confident].float().mean()) if n_conf else float("nan"),
            "fid_max_abs": float(diff.max()), "fid_mean_abs": float(diff.mean()), "fid_kl": float(kl.mean())}


def reference_impls() -> dict[str, str]:
    d = Impls()
    return {f.name: getattr(d, f.name) for f in fields(Impls)}


def is_reference(ctx: Context, ref_numerics: str) -> bool:
    """The run is the torch reference itself: the torch implementations, the reference numerics, the eager runtime
    and (tensor-parallel) the fp32 reduce."""
    return _is_reference(ctx.spec, ctx.ops.chosen, ref_numerics)


def _is_reference(s: RunSpec, chosen: dict[str, str], ref_numerics: str) -> bool:
    return (dict(chosen) == reference_impls() and s.numerics == ref_numerics and s.runtime == "eager"
            and (s.tp == 1 or s.reduce == "fp32"))


def fidelity_plan(ctx: Context) -> tuple[str, str | None]:
    """The reference numerics for the fidelity comparison, and a note saying why it is skipped
    (task.fidelity=false, or this run is the torch reference) — None when it is measured."""
    if not opt_bool(ctx.spec.task_opts, "fidelity", True):  # (off: the choices are not asked)
        return fidelity_plan_for(ctx.spec, {})
    return fidelity_plan_for(ctx.spec, ctx.ops.chosen)


def fidelity_plan_for(spec: RunSpec, chosen: dict[str, str]) -> tuple[str, str | None]:
    """fidelity_plan from the run's settings and resolved choices (before the model exists: the memory check)."""
    o = spec.task_opts
    ref_numerics = str(o.get("reference_numerics", "plain"))
    if not opt_bool(o, "fidelity", True):
        return ref_numerics, "fidelity off (task.fidelity=false)"
    if _is_reference(spec, chosen, ref_numerics):
        return ref_numerics, "fidelity skipped: this run is the torch reference"
    return ref_numerics, None


@contextlib.contextmanager
def reference_generator(ctx: Context, ref_numerics: str):
    """The torch reference on the same loaded weights: inside the block the model runs with the
    torch implementations (and `ref_numerics`), then its own are restored. Nothing is copied, so
    fidelity costs no extra weight memory (and works under tensor parallelism with the same ranks). Tensor-parallel
    all-reduces sum in fp32 inside the block, whatever the run's `reduce` (every comm holds fp32 buffers)."""
    from ds4.registry import torch_reference_ops
    from ds4.runtime.generate import Generator
    comm = ctx.model.comm
    saved = getattr(comm, "reduce_dtype", None)
    with ctx.model.configured(ops=torch_reference_ops(), numerics=ref_numerics):
        try:
            if saved is not None:
                comm.reduce_dtype = torch.float32
            yield Generator(ctx.model, max_batch=1, max_seq_len=ctx.spec.max_seq_len)
        finally:
            if saved is not None:
                comm.reduce_dtype = saved


def greedy_fidelity(ctx: Context, prompt: list[int], n_tokens: int, margin: float, ref_numerics: str) -> dict:
    """Both models fed the reference's greedy continuation (teacher forcing), logits compared."""
    from ds4.runtime.sampling import Sampling
    n_tokens = max(1, min(n_tokens, ctx.spec.max_seq_len - len(prompt) - 1))
    with reference_generator(ctx, ref_numerics) as rgen:
        cont = rgen.generate([prompt], n_tokens, Sampling(), stop_at_eos=False).tokens[0]
        ref_logits = rgen.teacher_forced_logits(prompt, cont)
    test_logits = ctx.gen().teacher_forced_logits(prompt, cont)
    return compare_logits(test_logits, ref_logits, margin)


# ---- printing --------------------------------------------------------------------------------
FIGURES = [  # key, label, format
    ("prompt_tokens", "prompt tokens", "{:.0f}"), ("new_tokens", "new tokens", "{:.0f}"),
    ("batch", "batch", "{:.0f}"),
    ("ttft_ms", "TTFT", "{:.2f} ms"), ("prefill_tok_s", "prefill", "{:.1f} tok/s"),
    ("tpot_ms", "TPOT median", "{:.3f} ms"), ("tpot_ms_p90", "TPOT p90", "{:.3f} ms"),
    ("tpot_mean_ms", "TPOT mean", "{:.3f} ms"),
    ("decode_tok_s", "decode", "{:.2f} tok/s"),
    ("e2e_tok_s", "end-to-end (seed's count)", "{:.2f} tok/s"),
    ("bytes_per_token", "bytes/token", "{:,.0f} B"), ("achieved_gb_s", "achieved", "{:.3g} GB/s"),
    ("copy_gb_s", "copy bandwidth (this run)", "{:.2f} GB/s"), ("bw_ratio", "bw_ratio", "{:.4g}"),
    ("peak_mem_gib", "peak memory", "{:.3f} GiB"),
    ("graph_warmup_s", "CUDA graph warm-up", "{:.2f} s"), ("graph_capture_s", "CUDA graph capture", "{:.2f} s"),
    ("graph_pool_mib", "CUDA graph pool", "{:.1f} MiB"), ("graphs", "CUDA graphs captured", "{:.0f}"),
    ("peak_reserved_gib", "peak reserved", "{:.3f} GiB"), ("peak_rss_gib", "peak RSS (this job)", "{:.3f} GiB"),
    ("ppl", "perplexity", "{:.3f}"), ("ref_ppl", "reference perplexity", "{:.3f}"),
    ("eval_tokens", "tokens scored", "{:.0f}"), ("nll", "mean NLL", "{:.4f} nats"),
    ("eval_tok_s", "eval (teacher-forced)", "{:.1f} tok/s"),
    ("fid_top1", "fidelity top-1 agreement", "{:.4f}"),
    ("fid_top1_confident", "  on confident steps", "{:.4f}"), ("fid_confident_steps", "  confident steps", "{:.0f}"),
    ("fid_max_abs", "  max |dlogit|", "{:.4g}"), ("fid_mean_abs", "  mean |dlogit|", "{:.4g}"),
    ("fid_kl", "  KL(ref||run)", "{:.4g}"),
]


# batch > 1: decode_figures records one row's prompt but every row's new tokens (and prefill tok/s over every row's
# prompt), so the bare labels would not add up (prompt tokens / TTFT != prefill tok/s)
ROWS = {"prompt_tokens": "prompt tokens (per row)", "new_tokens": "new tokens (all rows)"}


def format_figures(fig: dict) -> str:
    lines, seen = [], set()
    rows = isinstance(fig.get("batch"), int) and fig["batch"] > 1
    for key, label, fmt in FIGURES:
        if rows:
            label = ROWS.get(key, label)
        if key in fig and isinstance(fig[key], (int, float)):
            lines.append(f"  {label:<28}{fmt.format(fig[key])}")
            seen.add(key)
        if key == "prefill_tok_s":   # the prefill points of task=bench, by prompt length
            pts = sorted((int(k[len("prefill_tok_s_L"):]), k) for k in fig if k.startswith("prefill_tok_s_L"))
            for n, k in pts:
                lines.append(f"  {'prefill @' + str(n) + ' tokens':<28}{fig[k]:.1f} tok/s")
                seen.add(k)
    for key in sorted(set(fig) - seen - {"decode_steps_timed", "fid_steps", "bytes_context"}):
        lines.append(f"  {key:<28}{fig[key]}")
    return "\n".join(lines)
