"""task=bench: the figures of docs BENCHMARKING.md for one configuration.

Order: warm-up, headline decode with the profiler off, prefill points, bytes/token and the copy
bandwidth of this process, peak memory, fidelity vs the torch reference, then (profile=true) a
separate profiled pass for the stage table.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ds4.tasks.common import (Context, RunSpec, copy_bandwidth, decode_figures, fidelity_plan, graph_figures,
                              greedy_fidelity, peak_memory, sync)
from ds4.tasks.generate import InputError, check_lengths


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
    if o.get("prompt_len") is None:
        ids = tokenizer.encode(spec.prompt, add_bos=True)
    else:
        n = int(o["prompt_len"])
        if n < 1:
            raise InputError(f"task.prompt_len must be >= 1, got {n}")
        if n > spec.max_seq_len:
            raise InputError(f"task.prompt_len={n} is longer than max_seq_len={spec.max_seq_len}")
        ids = _random_prompt(n, args.vocab_size, spec.seed, tokenizer.bos_id)
    check_lengths(len(ids), spec, spec.max_new_tokens)
    lens = []
    for n in o.get("prefill_lens") or []:
        if int(n) <= spec.max_seq_len:
            lens.append(int(n))
        else:
            notes.append(f"prefill point {n} skipped: above max_seq_len={spec.max_seq_len}")
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

    context = len(plan.prompt_ids) + spec.max_new_tokens // 2   # the middle of the decode
    fig["bytes_context"] = context
    fig["bytes_per_token"] = int(ctx.model.bytes_per_token(context))
    fig["copy_gb_s"] = copy_bandwidth(spec.device, int(o.get("copy_bytes", 1 << 30)))
    if fig.get("tpot_ms"):
        fig["achieved_gb_s"] = fig["bytes_per_token"] / (fig["tpot_ms"] / 1e3) / 1e9
        fig["bw_ratio"] = fig["achieved_gb_s"] / fig["copy_gb_s"]
    fig.update(peak_memory(spec.device))

    notes = list(plan.notes)
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
