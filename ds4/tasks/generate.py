"""task=generate: generate from the prompt, print the text and the timing figures."""
from __future__ import annotations

from dataclasses import dataclass

from ds4.tasks.common import Context, RunSpec, decode_figures, graph_figures, peak_memory


class InputError(ValueError):
    """Bad input found before the weights load (printed as one line)."""


@dataclass
class Plan:
    prompt_ids: list[int]


def check_lengths(n_prompt: int, spec: RunSpec, new_tokens: int) -> None:
    if n_prompt > spec.max_seq_len:
        raise InputError(f"prompt is {n_prompt} tokens, longer than max_seq_len={spec.max_seq_len}")
    if n_prompt + new_tokens > spec.max_seq_len:
        raise InputError(f"prompt ({n_prompt} tokens) + max_new_tokens ({new_tokens}) exceeds "
                         f"max_seq_len={spec.max_seq_len}; raise max_seq_len or lower max_new_tokens")


def prepare(spec: RunSpec, args, tokenizer) -> Plan:
    text, chat = spec.prompt, bool(spec.task_opts.get("chat"))
    if chat:  # the chat encoding starts with the BOS text itself (spec §12)
        text = tokenizer.encode_chat([{"role": "user", "content": text}])
    ids = tokenizer.encode(text, add_bos=not chat)
    if not ids:
        raise InputError("the prompt encodes to no tokens")
    check_lengths(len(ids), spec, spec.max_new_tokens)
    return Plan(ids)


def run(ctx: Context, plan: Plan) -> dict:
    from ds4.runtime.sampling import Sampling
    spec, o = ctx.spec, ctx.spec.task_opts
    sampling = Sampling(temperature=float(o.get("temperature", 0.0)), top_k=int(o.get("top_k", 0)),
                        top_p=float(o.get("top_p", 1.0)), seed=spec.seed)
    out = ctx.gen().generate([plan.prompt_ids] * spec.batch, spec.max_new_tokens, sampling,
                             stop_at_eos=bool(o.get("stop_at_eos", True)))
    figures = decode_figures(out, spec.batch)
    figures.update(graph_figures(ctx.gen()))
    figures.update(peak_memory(spec.device))
    return {"figures": figures, "prompt_ids": plan.prompt_ids, "generated_ids": out.tokens,
            "text": ctx.tokenizer.decode(out.tokens[0]), "profile": ctx.profiler.summary()}
