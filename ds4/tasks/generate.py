"""task=generate: generate from the prompt, print the text and the timing figures."""
from __future__ import annotations

from dataclasses import dataclass, field

from ds4.runtime.sampling import Sampling
from ds4.tasks.common import (Context, InputError, RunSpec, decode_figures, graph_figures, opt_bool, opt_float,
                              opt_int, peak_memory)

__all__ = ["InputError", "Plan", "check_lengths", "prepare", "run"]


@dataclass
class Plan:
    prompt_ids: list[int]
    sampling: Sampling
    stop_at_eos: bool
    notes: list[str] = field(default_factory=list)  # said with the figures


def check_lengths(n_prompt: int, spec: RunSpec, new_tokens: int) -> None:
    if n_prompt > spec.max_seq_len:
        raise InputError(f"prompt is {n_prompt} tokens, longer than max_seq_len={spec.max_seq_len}")
    if n_prompt + new_tokens > spec.max_seq_len:
        raise InputError(f"prompt ({n_prompt} tokens) + max_new_tokens ({new_tokens}) exceeds "
                         f"max_seq_len={spec.max_seq_len}; raise max_seq_len or lower max_new_tokens")


def sampling_of(spec: RunSpec) -> Sampling:
    o = spec.task_opts
    try:
        return Sampling(temperature=opt_float(o, "temperature", 0.0), top_k=opt_int(o, "top_k", 0),
                        top_p=opt_float(o, "top_p", 1.0), seed=spec.seed)
    except InputError:
        raise
    except ValueError as e:
        raise InputError(f"task: {e}") from None


def prepare(spec: RunSpec, args, tokenizer) -> Plan:
    o = spec.task_opts
    sampling, stop_at_eos = sampling_of(spec), opt_bool(o, "stop_at_eos", True)
    text, chat = spec.prompt, opt_bool(o, "chat", False)
    if chat:  # the chat encoding starts with the BOS text itself (spec §12)
        text = tokenizer.encode_chat([{"role": "user", "content": text}])
    ids = tokenizer.encode(text, add_bos=not chat)
    if not ids:
        raise InputError("the prompt encodes to no tokens")
    check_lengths(len(ids), spec, spec.max_new_tokens)
    notes = []
    if sampling.greedy and (sampling.top_k or sampling.top_p < 1):  # greedy takes the argmax: the filters do nothing
        notes.append(f"task.top_k={sampling.top_k} / task.top_p={sampling.top_p} have no effect at "
                     "task.temperature=0 (greedy); set a temperature to sample")
    return Plan(ids, sampling, stop_at_eos, notes)


def run(ctx: Context, plan: Plan) -> dict:
    spec = ctx.spec
    out = ctx.gen().generate([plan.prompt_ids] * spec.batch, spec.max_new_tokens, plan.sampling,
                             stop_at_eos=plan.stop_at_eos)
    figures = decode_figures(out, spec.batch)
    figures.update(graph_figures(ctx.gen()))
    figures.update(peak_memory(spec.device))
    # runtime=cuda_graph: the captured step holds no profiler events (its replays are no rows of the stage table)
    notes = list(plan.notes)
    if ctx.profiler.enabled and spec.runtime != "cuda_graph":
        notes.append("timed with the stage profiler on (profile=true), which adds events to every step; task=bench "
                     "times its headline TPOT with it off")
    return {"figures": figures, "prompt_ids": plan.prompt_ids, "generated_ids": out.tokens,
            "text": ctx.tokenizer.decode(out.tokens[0]), "profile": ctx.profiler.summary(), "notes": notes}
