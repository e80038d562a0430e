"""task=eval: perplexity of a text file through the decode path (teacher-forced), and agreement
with the torch reference on the same tokens."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch.nn.functional as F

from ds4.tasks.common import (Context, InputError, RunSpec, check_fidelity_opts, compare_logits, fidelity_plan,
                              graph_figures, opt_int, peak_memory, reference_generator, sync)

BUILTIN_TEXT = (
    "The history of computing is a story of machines that learned to do more with less. Early "
    "computers filled rooms and consumed enormous amounts of power, yet they performed only a few "
    "thousand operations per second. Over the following decades, transistors replaced vacuum tubes, "
    "integrated circuits replaced individual transistors, and the number of components on a chip "
    "doubled again and again. Today a single graphics processor performs trillions of operations "
    "per second, and the limit is often not arithmetic but the rate at which data can be moved "
    "from memory to the processor."
)


@dataclass
class Plan:
    ids: list[int]
    source: str
    note: str = ""      # what of the text is scored, where it is cut


def prepare(spec: RunSpec, args, tokenizer) -> Plan:
    o = spec.task_opts
    check_fidelity_opts(o)
    path = o.get("text_file")
    if path:
        p = Path(str(path)).expanduser()
        if not p.is_file():
            raise InputError(f"task.text_file={path}: no such file")
        text, source = p.read_text(encoding="utf-8", errors="replace"), str(p)
    else:
        text, source = BUILTIN_TEXT, "built-in paragraph"
    max_tokens = opt_int(o, "max_tokens", 256, lo=2)
    limit = min(max_tokens, spec.max_seq_len)
    full = tokenizer.encode(text, add_bos=True)
    ids = full[:limit]
    if len(ids) < 2:
        raise InputError(f"{source} encodes to {len(ids)} token(s); perplexity needs at least 2")
    note = (f" (its first {len(ids)} of {len(full)} tokens: task.max_tokens={max_tokens}, "
            f"max_seq_len={spec.max_seq_len})" if len(full) > len(ids) else "")
    if spec.batch > 1:
        note += f"; batch={spec.batch} not used: eval scores one sequence"
    return Plan(ids, source, note)


def _ppl(nll: float) -> float:
    """exp(nll); inf where that overflows (mean NLL above ~709.78 nats: logits far off, which the fidelity
    figures then show, rather than the job failing before them)."""
    try:
        return math.exp(nll)
    except OverflowError:
        return float("inf")


def _nll(logits, targets) -> float:
    import torch
    return float(F.cross_entropy(logits.float().cpu(), torch.tensor(targets, dtype=torch.long)))


def run(ctx: Context, plan: Plan) -> dict:
    o = ctx.spec.task_opts
    prompt, cont = plan.ids[:1], plan.ids[1:]
    if ctx.spec.runtime == "cuda_graph":  # captured before the clock: its cost is reported apart (graph_figures)
        ctx.gen().graph_step(1, "logits")
    sync(ctx.spec.device)
    t0 = time.perf_counter()
    logits = ctx.gen().teacher_forced_logits(prompt, cont)
    sync(ctx.spec.device)
    secs = time.perf_counter() - t0
    nll = _nll(logits, cont)
    fig = {"eval_tokens": len(cont), "nll": nll, "ppl": _ppl(nll), "eval_tok_s": len(cont) / secs}
    fig.update(graph_figures(ctx.gen()))
    notes = [f"text: {plan.source}{plan.note}"]
    if ctx.profiler.enabled and ctx.spec.runtime != "cuda_graph":  # as task=generate says of its TPOT
        notes.append("eval tok/s timed with the stage profiler on (profile=true), which adds events to every step")
    ref_numerics, skipped = fidelity_plan(ctx)
    if skipped:
        notes.append(skipped)
    else:
        with reference_generator(ctx, ref_numerics) as rgen:
            ref_logits = rgen.teacher_forced_logits(prompt, cont)
        fig["ref_ppl"] = _ppl(_nll(ref_logits, cont))
        fig.update(compare_logits(logits, ref_logits, float(o.get("margin", 0.5))))
    fig.update(peak_memory(ctx.spec.device))
    return {"figures": fig, "prompt_ids": plan.ids, "generated_ids": [], "text": None,
            "profile": ctx.profiler.summary(), "notes": notes}
