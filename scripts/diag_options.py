"""Fidelity of each implementation option against the torch reference, per model preset.

    python scripts/diag_options.py --presets tiny,small --steps 32

For every option alone (and all together): relative max logit error of the prefill, and over
`steps` teacher-forced decode steps (fed the reference's greedy tokens) the top-1 agreement,
overall and on confident steps (reference top-2 margin > --margin), plus the relative max error.
Separates real divergence from near-ties of flat synthetic distributions.
"""
from __future__ import annotations

import argparse

import torch

from ds4.model.args import preset
from ds4.model.transformer import Transformer
from ds4.registry import Impls, ImplUnavailable, build_ops, torch_reference_ops
from ds4.runtime.generate import Generator
from ds4.weights.synthetic import random_weights

OPTIONS = {"linear": dict(linear="gemv_cuda"), "moe": dict(moe="fp4_topk"), "attn": dict(attn="fused_cuda"),
           "hc": dict(hc="fused_cuda"), "indexer": dict(indexer="fused_cuda"),
           "all": dict(linear="gemv_cuda", moe="fp4_topk", attn="fused_cuda", hc="fused_cuda", indexer="fused_cuda")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--layers", type=int, default=None, help="trim every preset to this many layers")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--margin", type=float, default=1.0)
    a = ap.parse_args()
    if not torch.cuda.is_available():  # one line, not a traceback from the first CUDA tensor
        raise SystemExit("diag_options: needs a CUDA GPU (the options compared are CUDA implementations)")
    dev = torch.device("cuda")
    print(f"{'preset':<9}{'option':<9}{'prefill rel':>12}{'top1':>7}{'conf top1':>10}{'n conf':>7}{'max rel':>9}")
    for name in a.presets.split(","):
        args = preset(name)
        if a.layers:
            args = args.with_layers(min(a.layers, args.n_layers))
        m = Transformer(args, torch_reference_ops(), "plain", torch.bfloat16, dev)
        m.load_weights(random_weights(args, seed=0, device=dev, include_mtp=False))
        prompt = [(13 * i + 7) % args.vocab_size for i in range(40)]
        g = Generator(m, 1, 40 + a.steps + 8)
        cont = g.generate([prompt], a.steps, stop_at_eos=False).tokens[0]
        ref = g.teacher_forced_logits(prompt, cont).float()
        top2 = ref.topk(2, -1).values
        conf = (top2[:, 0] - top2[:, 1]) > a.margin
        scale = ref.abs().max()
        for opt, kw in OPTIONS.items():
            try:
                ops = build_ops(Impls(**kw), dev)
            except ImplUnavailable as e:
                print(f"{name:<9}{opt:<9} unavailable: {e}")
                continue
            with m.configured(ops=ops):
                got = Generator(m, 1, 40 + a.steps + 8).teacher_forced_logits(prompt, cont).float()
            agree = got.argmax(-1) == ref.argmax(-1)
            print(f"{name:<9}{opt:<9}{float((got[0] - ref[0]).abs().max() / scale):>12.4f}"
                  f"{agree.float().mean().item():>7.3f}{agree[conf].float().mean().item() if conf.any() else float('nan'):>10.3f}"
                  f"{int(conf.sum()):>7}{float((got - ref).abs().max() / scale):>9.4f}", flush=True)
        del m, g
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
