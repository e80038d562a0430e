"""A composed config -> (ModelArgs, Impls, task) -> a finished job (metrics.json + wandb run).

Order matters: the config is checked and every implementation is resolved (registry.build_ops)
before any weights load, so an explicit choice that cannot run here fails in a second, naming
component, choice and reason. Bad input ends with one clear line and a non-zero exit; in a
multirun the failing job is recorded (metrics.json status=failed) and the sweep goes on.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ds4 import dist as ddist
from ds4 import tracking
from ds4.kernels.ops import kind_switch_problems
from ds4.model.args import ModelArgs, preset
from ds4.registry import COMPONENTS, Impls, ImplUnavailable, Setup, build_ops
from ds4.tasks.common import Context, RunSpec, format_figures, reset_memory, source_commit
from ds4.weights.schema import EXPERT_LAYOUTS, SHARED_LAYOUTS

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
CHOICES = {"numerics": ("plain", "qat"), "reduce": ("fp32", "bf16"), "runtime": ("eager", "cuda_graph"),
           "task": ("generate", "bench", "eval"), "tracking": ("wandb", "none"),
           "weights": ("synthetic", "checkpoint")}


class UserError(ValueError):
    """Bad input: printed as one line, non-zero exit (never a traceback)."""


# Errors that are the user's input or this machine, not a bug: one line, no traceback.
CLEAN_ERRORS = (UserError, ImplUnavailable, ValueError, OSError, OmegaConfBaseException, torch.OutOfMemoryError)


# ---- config -> plain data ----------------------------------------------------------------------
def _get(cfg: DictConfig, key: str):
    try:
        return OmegaConf.select(cfg, key, throw_on_missing=True)
    except OmegaConfBaseException as e:
        if "Missing mandatory value" in str(e):
            hint = " (weights=checkpoint weights.path=DIR)" if key == "weights.path" else ""
            raise UserError(f"{key} is required{hint}") from None
        raise UserError(f"{key}: {e}") from None


def _int(cfg, key: str, lo: int | None = None, optional: bool = False) -> int | None:
    v = _get(cfg, key)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise UserError(f"{key} must be an integer, got {v!r}")
    if lo is not None and v < lo:
        raise UserError(f"{key} must be >= {lo}, got {v}")
    return v


def _bool(cfg, key: str) -> bool:
    v = _get(cfg, key)
    if not isinstance(v, bool):
        raise UserError(f"{key} must be true or false, got {v!r}")
    return v


def _choice(cfg, key: str) -> str:
    v = str(_get(cfg, f"{key}.name"))
    if v not in CHOICES[key]:
        raise UserError(f"{key}={v} is not available; choose one of {list(CHOICES[key])}")
    return v


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"device={name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if d.type not in ("cpu", "cuda"):
        raise UserError(f"device={name}: only cpu and cuda are supported")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device={name}: CUDA is not available on this machine (use device=cpu or device=auto)")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise UserError(f"device={name}: only {torch.cuda.device_count()} CUDA device(s) here")
    return d


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise UserError(f"dtype={name!r}: choose one of auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


def build_spec(cfg: DictConfig) -> RunSpec:
    device = pick_device(str(_get(cfg, "device")))
    tp = _int(cfg, "parallel.tp", 1)
    rank = 0
    if tp > 1 or ddist.env().world > 1:  # launched by torchrun: join the group, one GPU per rank
        try:
            e = ddist.init(device.type, tp)
        except ValueError as err:
            raise UserError(str(err)) from None
        rank = e.rank
        if device.type == "cuda":
            device = torch.device("cuda", e.local_rank)
    prompt = _get(cfg, "prompt")
    if prompt is None:  # prompt=null: no text (generation from BOS alone), not the text "None"
        prompt = ""
    elif not isinstance(prompt, str):  # prompt=123: Hydra's number back to its text
        prompt = str(prompt)
    batch = _int(cfg, "batch", 1)
    max_batch = _int(cfg, "max_batch", 1)
    if batch > max_batch:
        raise UserError(f"batch={batch} is larger than the allocated max_batch={max_batch}")
    overrides = _get(cfg, "model.overrides") or {}
    if not isinstance(overrides, DictConfig) and not isinstance(overrides, dict):
        raise UserError("model.overrides must be a mapping of ModelArgs fields")
    impls = {}
    for c in COMPONENTS:
        impls[c] = str(_get(cfg, f"{c}.name"))
    kind = str(_get(cfg, "weights.kind"))
    if kind not in CHOICES["weights"]:
        raise UserError(f"weights.kind={kind}: choose one of {list(CHOICES['weights'])}")
    task_opts = OmegaConf.to_container(_get(cfg, "task"), resolve=True)
    task = str(task_opts.get("name"))
    if task not in CHOICES["task"]:
        raise UserError(f"task={task}: choose one of {list(CHOICES['task'])}")
    _choice(cfg, "tracking")
    return RunSpec(
        device=device, dtype=pick_dtype(str(_get(cfg, "dtype")), device), seed=_int(cfg, "seed"),
        prompt=prompt, max_new_tokens=_int(cfg, "max_new_tokens", 1), max_seq_len=_int(cfg, "max_seq_len", 2),
        batch=batch, max_batch=max_batch, profile=_bool(cfg, "profile"),
        model=str(_get(cfg, "model.preset")), n_layers=_int(cfg, "model.n_layers", 1, optional=True),
        model_overrides=OmegaConf.to_container(overrides) if isinstance(overrides, DictConfig) else dict(overrides),
        weights_kind=kind, weights_path=_get(cfg, "weights.path") if kind == "checkpoint" else None,
        weights_seed=_int(cfg, "weights.seed") if kind == "synthetic" else 0,
        tokenizer=_get(cfg, "weights.tokenizer"), impls=Impls(**impls),
        numerics=_choice(cfg, "numerics"), reduce=_choice(cfg, "reduce"), runtime=_choice(cfg, "runtime"),
        task=task, task_opts=task_opts, tp=tp, comm=_one_of(cfg, "parallel.comm", ddist.COMMS),
        experts=_one_of(cfg, "parallel.experts", EXPERT_LAYOUTS),
        shared_expert=_one_of(cfg, "parallel.shared_expert", SHARED_LAYOUTS), rank=rank)


def _one_of(cfg, key: str, choices: tuple[str, ...]) -> str:
    v = str(_get(cfg, key))
    if v not in choices:
        raise UserError(f"{key}={v}: choose one of {', '.join(choices)}")
    return v


def index_len(args: ModelArgs, max_seq_len: int) -> int:
    """The longest indexer cache (entries per row) of a CSA layer whose decode selects (more entries than
    index_topk: Attention.decode's `select`), or 0: what the indexer's top-k scans every decode step."""
    return max((n for i in range(args.n_layers) if args.layer_type(i) == "csa"
                for n in [-(-max_seq_len // args.ratio(i))] if n > args.index_topk), default=0)


def check_setup(spec: RunSpec, args: ModelArgs) -> None:
    """Setups that cannot run (tensor-parallel split, runtime) fail before any weights load (GPU memory: check_memory,
    once the implementations are resolved)."""
    from ds4.weights.schema import local_tensors
    try:
        local_tensors(args, spec.rank, spec.tp, include_mtp=False, experts=spec.experts, shared=spec.shared_expert)
    except ValueError as e:
        raise UserError(f"parallel.tp={spec.tp} (experts {spec.experts}, shared expert {spec.shared_expert}) "
                        f"does not fit this model: {e}") from None
    if spec.comm in ("symm_mem", "ll") and spec.device.type != "cuda":
        raise UserError(f"parallel.comm={spec.comm} needs CUDA devices")
    if spec.comm == "ll" and spec.tp > 1:
        from ds4 import kernels
        reason = kernels.unavailable_reason()
        if reason is not None:
            raise UserError(f"parallel.comm=ll runs ds4's all-reduce kernel, which cannot run here: {reason}")
    if spec.runtime == "cuda_graph" and spec.device.type != "cuda":
        raise UserError("runtime=cuda_graph needs a CUDA device")


def memory_need(spec: RunSpec, args: ModelArgs, chosen: dict[str, str]) -> list[tuple[str, int]]:
    """(what, bytes) a rank's GPU holds at the run's peak beyond its activations: the weights as stored, the decode
    state at (max_batch, max_seq_len) (every rank holds all of it: one KV head), the copy of it that a CUDA-graph
    capture takes, the fidelity reference's batch-1 state beside it, attn=fused_cuda_wo_bf16's BF16 wo_b.wo_a. On
    the CPU also the torch MoE's fp32 dequantisation of the routed experts in its largest forward (its largest
    transient: a one-layer V4-Flash run's resident set rose 0.63 GiB in a decode step of 6 rows, session 68)."""
    from ds4.model.transformer import Transformer
    from ds4.tasks.common import fidelity_plan_for
    from ds4.weights.schema import local_tensors
    local = local_tensors(args, spec.rank, spec.tp, include_mtp=False, experts=spec.experts, shared=spec.shared_expert)
    parts = [("weights", sum(ls.nbytes for ls, _ in local.values()))]
    state = Transformer.state_bytes(args, spec.max_batch, spec.max_seq_len, spec.dtype)
    parts.append((f"decode state (max_batch={spec.max_batch}, max_seq_len={spec.max_seq_len})", state))
    if spec.runtime == "cuda_graph":  # CudaGraphStep._capture's snapshot of the whole state
        parts.append(("its copy while the CUDA graph is captured", state))
    if spec.task in ("bench", "eval") and fidelity_plan_for(spec, chosen)[1] is None:  # the tasks that compare
        parts.append(("the fidelity reference's decode state", Transformer.state_bytes(args, 1, spec.max_seq_len,
                                                                                       spec.dtype)))
    if spec.device.type != "cuda":  # moe_torch.routed: w1, w3, w2 of the gathered (token, slot) rows, or one expert
        from ds4.ops.moe_torch import GATHER_MAX_ROWS
        k = args.n_activated_experts
        # any forward of n tokens with n x k <= GATHER_MAX_ROWS gathers: a decode step (n = max_batch) and a short
        # prompt's prefill too (n = batch x its length: V4-Flash's 6 experts, a 10-token prompt, 60 rows); longer
        # ones loop over the experts (one expert's rows)
        prefill_n = GATHER_MAX_ROWS // (spec.batch * k) * spec.batch
        rows = max((n * k for n in (spec.max_batch, prefill_n) if 0 < n * k <= GATHER_MAX_ROWS), default=1)
        parts.append(("the largest forward's routed experts in fp32", 3 * rows * args.moe_inter_dim * args.dim * 4))
    if chosen.get("attn") == "fused_cuda_wo_bf16":  # [dim, local heads x head_dim] BF16 per layer, formed in fp32
        gr, i = args.o_groups // spec.tp * args.o_lora_rank, args.n_heads * args.head_dim // args.o_groups
        per = args.dim * args.n_heads // spec.tp * args.head_dim
        merged = args.n_layers * per * 2 + 4 * (gr * i + args.dim * gr + per)  # + one layer's fp32 operands
        parts.append(("attn=fused_cuda_wo_bf16's BF16 wo_b.wo_a", merged))
    return parts


def host_available(meminfo: str = "/proc/meminfo", cgroup_root: str = "/sys/fs/cgroup",
                   self_cgroup: str = "/proc/self/cgroup") -> int | None:
    """The memory this process may still take, in bytes (Linux): the host's MemAvailable, or less where the process's
    memory cgroup (a container's limit) leaves less; None where neither can be read."""
    host = None
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    host = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    known = [b for b in (host, _cgroup_room(cgroup_root, self_cgroup)) if b is not None]
    return min(known) if known else None


def _cgroup_room(root: str, self_cgroup: str) -> int | None:
    """The least limit - usage over the process's memory cgroup and its parents (v2: memory.max / memory.current;
    v1: memory.limit_in_bytes / memory.usage_in_bytes), the reclaimable file cache (memory.stat's inactive_file)
    not counted as used, as container tools count it. None where no limit is set or none can be read. (Inside a
    container's cgroup namespace the listed path may not exist under `root`; the parents walked up to the
    controller's root then include the container's own files.)"""
    try:
        with open(self_cgroup) as f:
            lines = [ln.rstrip("\n").split(":", 2) for ln in f if ln.count(":") >= 2]
    except OSError:
        return None
    rooms = []
    for _, ctl, path in lines:
        if ctl == "":  # v2's unified hierarchy
            top, files = Path(root), ("memory.max", "memory.current", "inactive_file")
        elif "memory" in ctl.split(","):
            top, files = Path(root) / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for n in range(len(parts), -1, -1):  # the cgroup itself, then each parent up to the root
            room = _cgroup_dir_room(top.joinpath(*parts[:n]), *files)
            if room is not None:
                rooms.append(room)
    return min(rooms) if rooms else None


def _cgroup_dir_room(d: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        lim = (d / limit_file).read_text().strip()
        use = int((d / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    if not lim.isdigit() or int(lim) >= 1 << 60:  # "max" (v2) or v1's page-rounded 2^63: no limit here
        return None
    inactive = 0
    try:
        for line in (d / "memory.stat").read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == inactive_key:
                inactive = int(v)
    except (OSError, ValueError):
        pass
    return max(0, int(lim) - max(0, use - inactive))


def check_memory(spec: RunSpec, args: ModelArgs, chosen: dict[str, str]) -> None:
    """Fail before loading, not with an out-of-memory error minutes later. Under tensor parallelism every rank says
    the same (the rank with the least room), so rank 0's one line names a shortage on any rank."""
    if spec.device.type != "cuda":
        _check_host_memory(spec, args, chosen)
        return
    parts = memory_need(spec, args, chosen)
    need, free, where = sum(b for _, b in parts), torch.cuda.mem_get_info(spec.device)[0], str(spec.device)
    import torch.distributed as dist
    if spec.tp > 1 and dist.is_available() and dist.is_initialized():
        room = [None] * dist.get_world_size()
        dist.all_gather_object(room, (free - need, free, need))
        r = min(range(len(room)), key=lambda k: room[k][0])
        _, free, need = room[r]
        where = f"rank {r}'s GPU"
    if need > free:
        raise UserError(f"this run needs {_size(need)} per GPU ({_said(parts)}) but {where} has {_size(free)} free; "
                        "use more GPUs (torchrun ... parallel.tp=N), fewer layers (model.n_layers=N), or a smaller "
                        "max_seq_len or max_batch")


def _check_host_memory(spec: RunSpec, args: ModelArgs, chosen: dict[str, str]) -> None:
    """On CPU the same count against the host's available memory: `device=auto` on a machine without CUDA runs the
    README's `model=v4_flash model.n_layers=4` on the CPU (15 GiB of weights), which the kernel's OOM killer would
    otherwise end with no message and no metrics.json. The ranks of a CPU torchrun share the host: all are counted."""
    free = host_available()
    if free is None:
        return
    parts = memory_need(spec, args, chosen)
    need = sum(b for _, b in parts) * spec.tp
    if need > free:
        ranks = f" x {spec.tp} ranks" if spec.tp > 1 else ""
        raise UserError(f"this run needs {_size(need)} of host memory ({_said(parts)}{ranks}) but {_size(free)} are "
                        "available; use fewer layers (model.n_layers=N), a smaller max_seq_len or max_batch, or a GPU")


def _size(b: int) -> str:
    return f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def _said(parts: list[tuple[str, int]]) -> str:
    """memory_need's parts as the memory checks' messages list them."""
    return ", ".join(f"{what} {_size(b)}" for what, b in parts if b)


def model_args(spec: RunSpec) -> ModelArgs:
    """From the preset, or from the checkpoint's config.json (checked before anything loads)."""
    try:
        if spec.weights_kind == "checkpoint":
            p = Path(str(spec.weights_path)).expanduser()
            if not p.is_dir():
                raise UserError(f"weights.path={spec.weights_path}: no such directory")
            if not (p / "config.json").is_file():
                raise UserError(f"weights.path={spec.weights_path}: no config.json there (not a HF checkpoint)")
            from ds4.weights.checkpoint import CheckpointError, checkpoint_args
            try:  # the formats as the loader will hold them (the memory check counts them): where config.json
                args = checkpoint_args(p)  # is silent, the stored dtypes; transformers naming, BF16
            except CheckpointError as e:
                raise UserError(str(e)) from None
        else:
            args = preset(spec.model)
        if spec.model_overrides:
            args = args.replace(**spec.model_overrides)
        if spec.n_layers is not None:
            args = args.with_layers(spec.n_layers)
    except UserError:
        raise
    except TypeError as e:
        raise UserError(f"model.overrides: {e}") from None
    except (KeyError, ValueError) as e:
        raise UserError(f"model: {e}") from None
    return args


# ---- one job -----------------------------------------------------------------------------------
def _task_module(name: str):
    from ds4.tasks import bench, eval as eval_, generate
    return {"generate": generate, "bench": bench, "eval": eval_}[name]


def load_weights(spec: RunSpec, args: ModelArgs) -> tuple[ModelArgs, dict]:
    """This rank's tensors only (slices and owned experts); MTP is not used by decode."""
    if spec.weights_kind == "checkpoint":
        from ds4.weights.checkpoint import load_checkpoint
        # a bf16 run holds F32-stored tensors (a dequantised FP32 checkpoint) as the schema's BF16: the CUDA
        # implementations take BF16 weights, and the torch ones convert them to the activations' dtype anyway
        policy = "schema" if spec.dtype == torch.bfloat16 else "keep"
        return load_checkpoint(str(Path(str(spec.weights_path)).expanduser()), args=args, device=spec.device,
                               rank=spec.rank, world=spec.tp, include_mtp=False, progress=spec.rank == 0,
                               experts=spec.experts, shared=spec.shared_expert, dtype_policy=policy)
    from ds4.weights.synthetic import random_weights
    return args, random_weights(args, seed=spec.weights_seed, device=spec.device, rank=spec.rank, world=spec.tp,
                                include_mtp=False, experts=spec.experts, shared=spec.shared_expert,
                                progress=spec.rank == 0)


def execute(spec: RunSpec, record: dict, log=print) -> dict:
    from ds4.profile import Profiler
    from ds4.tokenizer import load_tokenizer
    reset_memory(spec.device)
    torch.manual_seed(spec.seed)
    args = model_args(spec)
    if spec.max_seq_len > args.max_position_embeddings:
        raise UserError(f"max_seq_len={spec.max_seq_len} exceeds the model's max_position_embeddings="
                        f"{args.max_position_embeddings}")
    check_setup(spec, args)
    # raises before any weights load; the notes say what the choices leave to other code for this setup
    setup = Setup(spec.dtype, spec.max_batch, args.weight_dtype, args.n_activated_experts,
                  index_len(args, spec.max_seq_len), args.n_routed_experts, args.dim, args.expert_dtype)
    ops = build_ops(spec.impls, spec.device, setup)
    if spec.runtime == "cuda_graph" and ops.decode_syncs:  # a step that waits on the host cannot be captured
        c, sync = next(iter(ops.decode_syncs.items()))
        raise UserError(f"runtime=cuda_graph cannot capture {c}={ops.chosen[c]}: a decode step syncs with "
                        f"the host ({sync}); use runtime=eager, another {c}, or a smaller max_batch")
    check_memory(spec, args, ops.chosen)
    record["resolved"] = dict(ops.chosen)
    record["notes"] = {c: ops.notes[c] for c in ops.notes}
    # the DS4_* switches (ablations, diagnostics) change what runs under the same names: recorded and printed
    record["env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("DS4_")}
    if bad := kind_switch_problems(record["env"]):
        raise UserError("; ".join(bad))
    log(f"ds4 {spec.task}: model={spec.model if spec.weights_kind == 'synthetic' else spec.weights_path} "
        f"({args.n_layers} layers, dim {args.dim}), weights={spec.weights_kind}, device={spec.device}, "
        f"dtype={str(spec.dtype).removeprefix('torch.')}")
    log("implementations:")
    for c in COMPONENTS:
        note = ops.notes[c]
        log(f"  {c:<9}{ops.chosen[c]:<12}" + (f"({note})" if note != ops.chosen[c] else ""))
    peer = (f" (sums of up to {ddist.PEER_MAX_NUMEL} values; larger ones, a prompt's, over NCCL)"
            if spec.comm in ("symm_mem", "ll") else "")
    reduce = (f"reduce {spec.reduce}, comm {spec.comm}{peer}, experts {spec.experts}, shared expert {spec.shared_expert}"
              if spec.tp > 1
              else "reduce (world 1: no reduction)")
    log(f"  numerics {spec.numerics}, {reduce}, runtime {spec.runtime}, tp {spec.tp}")
    if record["env"]:
        log("  environment " + " ".join(f"{k}={v}" for k, v in record["env"].items()))

    tok = load_tokenizer(spec.tokenizer, args.vocab_size)
    missing = spec.tokenizer is not None and tok.name == "byte"
    log(f"  tokenizer {tok.name}" + (f" (no tokenizer files in {spec.tokenizer})" if missing else ""))
    task = _task_module(spec.task)
    plan = task.prepare(spec, args, tok)              # input checks, still before the weights
    t0 = time.perf_counter()
    args, weights = load_weights(spec, args)
    from ds4.model.transformer import Transformer
    profiler = Profiler(spec.profile, spec.device)
    comm = None
    if spec.tp > 1:
        from ds4.dist import TensorParallel
        comm = TensorParallel(spec.reduce, spec.comm, device=spec.device)
    model = Transformer(args, ops, numerics=spec.numerics, dtype=spec.dtype, device=spec.device, profiler=profiler,
                        rank=spec.rank, world=spec.tp, comm=comm)
    # consume: each layer's per-expert originals are freed as they are stacked (held twice, the full
    # model's experts overflow an H200 at tp=2)
    model.load_weights(weights, consume=True)
    del weights
    record["load_s"] = time.perf_counter() - t0
    log(f"  weights loaded in {record['load_s']:.1f} s")  # also printed: it can be most of a job's wall time
    ctx = Context(spec=spec, args=args, ops=ops, model=model, tokenizer=tok, weights=None, profiler=profiler)
    return task.run(ctx, plan)  # (each task reads the peak memory, every rank's under tensor parallelism)


def report(result: dict, log=print) -> None:
    if result.get("text") is not None:
        log("--- generated ---")
        log(result["text"])
        log("-----------------")
    for n in result.get("notes") or []:
        log(f"note: {n}")
    log("figures:")
    log(format_figures(result.get("figures", {})))
    rows = result.get("profile") or []
    log("stage profile:")
    if rows:
        log(f"  {'stage':<24}{'calls':>8}{'total ms':>12}{'mean us':>12}")
        for r in rows:
            log(f"  {r['stage']:<24}{r['calls']:>8}{r['total_ms']:>12.3f}{r['mean_us']:>12.1f}")
    else:
        log("  (profiling off: run with profile=true)")


def _quiet(*_args, **_kw) -> None:
    pass


def _failure_tracker(cfg: DictConfig, job: tracking.JobInfo):
    try:
        return tracking.Tracker(OmegaConf.to_container(cfg.tracking, resolve=True), job, tracking.config_dict(cfg),
                                str(OmegaConf.select(cfg, "task.name", default="unknown")))
    except Exception:
        return None


def run(cfg: DictConfig) -> dict:
    """One Hydra job. Returns the record written to metrics.json."""
    job = tracking.job_info()
    t_start = time.time()
    record = {"status": "failed", "error": None, "task": None, "output_dir": job.output_dir,
              "override_dirname": job.override_dirname, "overrides": job.overrides, "choices": job.choices,
              "resolved": {}, "notes": {}, "figures": {}, "profile": [], "prompt_ids": [], "generated_ids": [],
              "torch": torch.__version__, "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t_start)),
              "commit": source_commit()}
    tracker, error, unexpected, main = None, None, False, ddist.env().rank == 0
    try:
        spec = build_spec(cfg)
        main = spec.rank == 0  # under torchrun only rank 0 prints, writes metrics.json and logs to wandb
        record.update(task=spec.task, device=str(spec.device), dtype=str(spec.dtype).removeprefix("torch."),
                      gpu=torch.cuda.get_device_name(spec.device) if spec.device.type == "cuda" else None,
                      tp=spec.tp, experts=spec.experts, shared_expert=spec.shared_expert)
        if main:
            tracker = tracking.Tracker(OmegaConf.to_container(cfg.tracking, resolve=True), job,
                                       tracking.config_dict(cfg), spec.task)
        result = execute(spec, record, log=print if main else _quiet)
        record.update(status="ok", figures=result.get("figures", {}), profile=result.get("profile", []),
                      prompt_ids=result.get("prompt_ids", []), generated_ids=result.get("generated_ids", []),
                      text=result.get("text"), task_notes=result.get("notes", []))
        if main:
            report(result)
    except CLEAN_ERRORS as e:
        error = f"{e}"
        record.update(error=error, error_type=type(e).__name__)
    except Exception as e:   # a bug: keep the traceback (printed in a single run, recorded in a sweep)
        error, unexpected = f"{type(e).__name__}: {e}", True
        record.update(error=error, error_type=type(e).__name__, traceback=traceback.format_exc())
        if not job.multirun:
            raise
    finally:
        record["wall_s"] = time.time() - t_start
        record["config"] = tracking.config_dict(cfg)
        # under torchrun other ranks leave the output directory and wandb to rank 0
        path = tracking.write_metrics(job.output_dir, record) if main else None
        if main and tracker is None and job.multirun and error is not None:
            tracker = _failure_tracker(cfg, job)      # a sweep shows its failed jobs in wandb too
        if tracker is not None:
            try:
                tracker.log(record)
            finally:
                tracker.finish(record["status"] == "ok")
    if error is None:
        if main:
            print(f"metrics: {path}")
        return record
    if unexpected:  # every rank's own (under torchrun each rank may fail differently)
        where = f"rank {ddist.env().rank}: " if not main else ""
        sys.stderr.write(record.get("traceback", ""))
        sys.stderr.write(f"ds4: error: {where}{error}\n")
    elif main:  # a clean error is the same on every rank: said once
        sys.stderr.write(f"ds4: error: {error}\n")
    sys.stderr.flush()
    if not job.multirun:
        sys.exit(2)
    print(f"job {job.num} failed (recorded in {path}); the sweep goes on")
    return record
