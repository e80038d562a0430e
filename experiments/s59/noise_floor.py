"""How much of the greedy agreement on `small` rounding alone moves (session 59, CPU): the torch reference in bf16
(what the GPU e2e tests take as reference) against the same reference in fp32 activations, teacher-forced on the
bf16 reference's 256 greedy tokens, with the tests' prompts, agreement measured as tests/test_gpu_e2e.py does.

    python experiments/s59/noise_floor.py [--steps 256] [--numerics plain,qat] [--head 1,8]
"""
from __future__ import annotations

import argparse
import time

import torch

from ds4.model.args import small
from ds4.model.transformer import Transformer
from ds4.registry import torch_reference_ops
from ds4.runtime.generate import Generator
from ds4.weights.synthetic import random_weights

MARGIN = 2.0  # tests/test_gpu_e2e.py's confident-step margin


def agreement(got_top1, ref_logits):
    top2 = ref_logits.float().topk(2, -1).values
    conf = (top2[:, 0] - top2[:, 1]) > MARGIN
    agree = got_top1 == ref_logits.float().argmax(-1)
    return agree.float().mean().item(), agree[conf].float().mean().item(), int(conf.sum())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--numerics", default="plain,qat")
    p.add_argument("--head", default="1,8")
    o = p.parse_args()
    torch.manual_seed(0)
    args = small()
    base = random_weights(args, seed=0, include_mtp=False)
    for scale in [int(s) for s in o.head.split(",")]:
        w = dict(base)
        if scale != 1:
            w["head.weight"] = base["head.weight"] * scale
        # the prompts of test_qat_options_agree_with_reference_on_small / test_all_fused_agree_99_percent_...
        prompt = [((13 * i + 7) if scale == 1 else (17 * i + 3)) % args.vocab_size for i in range(32)]
        for numerics in o.numerics.split(","):
            t0 = time.perf_counter()
            out = {}
            for dtype in (torch.bfloat16, torch.float32):
                m = Transformer(args, torch_reference_ops(), numerics, dtype)
                m.load_weights(w)
                g = Generator(m, 1, 512)
                if dtype == torch.bfloat16:
                    toks = g.generate([prompt], o.steps, stop_at_eos=False).tokens[0]
                out[dtype] = g.teacher_forced_logits(prompt, toks).float()
            overall, conf, n = agreement(out[torch.float32].argmax(-1), out[torch.bfloat16])
            print(f"head x{scale} numerics={numerics}: fp32 reference against the bf16 reference over {len(toks)} "
                  f"steps: top-1 agreement {overall:.4f} overall, {conf:.4f} on {n} steps with margin > {MARGIN} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
