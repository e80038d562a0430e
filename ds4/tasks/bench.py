"""task=bench: the figures of docs BENCHMARKING.md for one configuration.

Order: warm-up, headline decode with the profiler off, prefill points, bytes/token and the copy
bandwidth of this process, peak memory, fidelity vs the torch reference, then (profile=true) a
separate profiled pass for the stage table.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ds4.tasks.common import (Context, InputError, RunSpec, check_fidelity_opts, copy_bandwidth, decode_figures,
                              fidelity_plan, graph_figures, greedy_fidelity, opt_int, peak_memory, sync)
from ds4.tasks.generate import check_lengths


@dataclass
class Plan:
    prompt_ids: list[int]
    prefill_lens: list[int]
    notes: list[str]


def _random_prompt(n: int, vocab: int, seed: int, bos: int | None) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g).tolist()
    if bos is not None and n > 0:
        ids[0] = bos
    return ids


def prepare(spec: RunSpec, args, tokenizer) -> Plan:
    o, notes = spec.task_opts, []
    # the options run() reads, checked here, before the weights load
    warmup = opt_int(o, "warmup", 0, lo=0)
    opt_int(o, "copy_bytes", 1 << 30, lo=1)
    opt_int(o, "fidelity_tokens", 16, lo=1)
    check_fidelity_opts(o)
    if o.get("prompt_len") is None:
        ids = tokenizer.encode(spec.prompt, add_bos=True)
    else:
        n = opt_int(o, "prompt_len", 32, lo=1)
        if n > spec.max_seq_len:
            raise InputError(f"task.prompt_len={n} is longer than max_seq_len={spec.max_seq_len}")
        ids = _random_prompt(n, args.vocab_size, spec.seed, tokenizer.bos_id)
        # `prompt=...` on the command line is otherwise dropped without a word (BENCHMARKING.md's fixed-length prompt)
        notes.append(f"prompt: {n} random token ids (task.prompt_len={n}); the prompt text is not used "
                     "(task.prompt_len=null benches it)")
    check_lengths(len(ids), spec, spec.max_new_tokens)
    if 0 < warmup >= spec.max_new_tokens - 1:  # decode_figures times the steps after the warm-up, else all of them
        notes.append(f"task.warmup={warmup} leaves no decode step of {spec.max_new_tokens - 1} out of TPOT: every "
                     "step is timed")
    points = o.get("prefill_lens") or []
    if isinstance(points, (int, str)):  # task.prefill_lens=8192: one point
        points = [points]
    lens = []
    for n in points:
        if isinstance(n, float) and n.is_integer():
            n = int(n)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InputError(f"task.prefill_lens: {n!r} is not a prompt length (an integer >= 1)")
        if n < spec.max_seq_len:  # a prompt takes at most max_seq_len - 1 positions (one is left to decode)
            lens.append(n)
        else:
            notes.append(f"prefill point {n} skipped: a prompt must be shorter than max_seq_len={spec.max_seq_len}")
    return Plan(ids, lens, notes)


def _prefill_tok_s(ctx: Context, n: int, repeats: int = 2) -> float:
    ids = _random_prompt(n, ctx.args.vocab_size, ctx.spec.seed + n, ctx.tokenizer.bos_id)
    best = float("inf")
    for _ in range(repeats):
        sync(ctx.spec.device)
        t0 = time.perf_counter()
        ctx.gen().prefill([ids])
        sync(ctx.spec.device)
        best = min(best, time.perf_counter() - t0)
    return n / best


def run(ctx: Context, plan: Plan) -> dict:
    from ds4.runtime.sampling import Sampling
    spec, o = ctx.spec, ctx.spec.task_opts
    gen, prompts, greedy = ctx.gen(), [plan.prompt_ids] * spec.batch, Sampling(seed=spec.seed)
    profiling = ctx.profiler.enabled
    ctx.profiler.enabled = False   # headline figures are measured with profiling off

    gen.generate(prompts, min(4, spec.max_new_tokens), greedy, stop_at_eos=False)   # warm-up
    out = gen.generate(prompts, spec.max_new_tokens, greedy, stop_at_eos=False)
    fig = decode_figures(out, spec.batch, warmup=int(o.get("warmup", 0)))
    fig.update(graph_figures(gen))
    if plan.prefill_lens:
        gen.prefill([plan.prompt_ids[:1]])   # warm the prefill path at another shape
    for n in plan.prefill_lens:
        fig[f"prefill_tok_s_L{n}"] = _prefill_tok_s(ctx, n)

    notes = list(plan.notes)
    fig.update(peak_memory(spec.device))  # before the copy-bandwidth buffers, which are no part of the job's memory
    fig["copy_gb_s"] = copy_bandwidth(spec.device, int(o.get("copy_bytes", 1 << 30)))
    if spec.batch == 1:
        context = len(plan.prompt_ids) + spec.max_new_tokens // 2   # the middle of the decode
        fig["bytes_context"] = context
        fig["bytes_per_token"] = int(ctx.model.bytes_per_token(context))
        if fig.get("tpot_ms"):
            fig["achieved_gb_s"] = fig["bytes_per_token"] / (fig["tpot_ms"] / 1e3) / 1e9
            fig["bw_ratio"] = fig["achieved_gb_s"] / fig["copy_gb_s"]
        if spec.tp > 1:
            notes.append(f"tp={spec.tp}: bytes/token, achieved GB/s and bw_ratio are rank 0's (its slices; with "
                         "experts=ep its experts' expected share, while each step waits for the busier rank)")
    else:  # the routed experts a step reads depend on how the rows' choices overlap: no one byte count
        notes.append(f"batch {spec.batch}: bytes/token, achieved GB/s and bw_ratio are batch-1 figures, "
                     "not reported")

    ref_numerics, skipped = fidelity_plan(ctx)
    if skipped:
        notes.append(skipped)
    else:
        fig.update(greedy_fidelity(ctx, plan.prompt_ids, int(o.get("fidelity_tokens", 16)),
                                   float(o.get("margin", 0.5)), ref_numerics))

    profile = []
    if profiling:   # a separate pass, so the profiler never touches the headline TPOT
        ctx.profiler.reset()
        ctx.profiler.enabled = True
        gen.generate(prompts, min(spec.max_new_tokens, 32), greedy, stop_at_eos=False)
        profile = ctx.profiler.summary()
    return {"figures": fig, "prompt_ids": plan.prompt_ids, "generated_ids": out.tokens,
            "text": ctx.tokenizer.decode(out.tokens[0]), "profile": profile, "notes": notes}
