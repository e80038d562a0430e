"""The torch reference against transformers.DeepseekV4ForCausalLM (the `plain` numerics oracle).

Same synthetic weights in both (FP8/FP4 values dequantised exactly for transformers), fp32,
greedy. ds4 decodes both prompts batched (rows at different positions); transformers runs
each prompt alone. Long enough that the window wraps and both compressor types emit entries.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ds4.model.args import tiny  # noqa: E402
from ds4.model.transformer import Transformer  # noqa: E402
from ds4.registry import torch_reference_ops  # noqa: E402
from ds4.weights.hf_naming import official_to_hf  # noqa: E402
from ds4.weights.synthetic import random_weights  # noqa: E402


def hf_model(args, weights):
    cfg = transformers.DeepseekV4Config(**args.to_hf_config(quantized=False))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    m = transformers.DeepseekV4ForCausalLM(cfg).float().eval()
    missing, unexpected = m.load_state_dict(official_to_hf(args, weights), strict=False)
    buffers = {k for k, _ in m.named_buffers()}
    assert not unexpected, unexpected
    assert not [k for k in missing if k not in buffers or "tid2eid" in k or "bias" in k], missing
    return m


@torch.inference_mode()
def hf_greedy(m, prompt: list[int], steps: int):
    """Prefill + `steps` greedy decode steps with the transformers cache -> (tokens, logits [steps+1, V])."""
    ids = torch.tensor([prompt])
    out = m(input_ids=ids, use_cache=True)
    cache, logits = out.cache if hasattr(out, "cache") else out.past_key_values, [out.logits[0, -1]]
    toks = [int(logits[-1].argmax())]
    for _ in range(steps):
        out = m(input_ids=torch.tensor([[toks[-1]]]), cache=cache, use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        logits.append(out.logits[0, -1])
        toks.append(int(logits[-1].argmax()))
    return toks, torch.stack(logits)


@torch.inference_mode()
def ds4_greedy(model, prompts, steps):
    from ds4.runtime.generate import Generator
    g = Generator(model, len(prompts), max(map(len, prompts)) + steps + 1)
    lg = [g.prefill(prompts)]
    toks = [lg[-1].argmax(-1)]
    for _ in range(steps):
        lg.append(g.decode(toks[-1]))
        toks.append(lg[-1].argmax(-1))
    return torch.stack(toks, 1).tolist(), torch.stack(lg, 1)


CASES = [
    # (seed, overrides) — schedules, hash layers and o_groups vary; index_topk < entries seen
    (0, dict()),
    (1, dict(n_layers=4, compress_ratios=(4, 16, 0, 4, 0), n_hash_layers=1, o_groups=4, o_lora_rank=128)),
    (2, dict(n_layers=3, compress_ratios=(16, 4, 4, 0), n_hash_layers=3, index_topk=5, window_size=8)),
    # a SwiGLU limit the synthetic activations cross (gate and up reach about 5), so its clamps really act
    (3, dict(swiglu_limit=1.0)),
]


@pytest.mark.parametrize("seed,over", CASES)
def test_parity_with_transformers(seed, over):
    args = tiny().replace(**over)
    w = random_weights(args, seed=seed, include_mtp=False)
    steps = 300
    # prompt lengths 13 + 4 * seed and 30 + seed: every remainder mod 4 over the cases (the compressors' partial window)
    prompts = [list(range(3, 3 + 13 + 4 * seed)), [(7 * i + seed) % args.vocab_size for i in range(30 + seed)]]
    model = Transformer(args, torch_reference_ops(), "plain", torch.float32)
    model.load_weights(w)
    toks, logits = ds4_greedy(model, prompts, steps)
    hf = hf_model(args, w)
    for row, p in enumerate(prompts):
        ht, hl = hf_greedy(hf, p, steps)
        # the test is only meaningful when entries appear: the window wraps and compressors emit
        assert len(p) + steps > 4 * args.window_size
        err = (logits[row] - hl).abs().max()
        assert err <= 1e-3 * hl.abs().max(), f"row {row}: max |logit diff| {err:.3g} vs max |logit| {hl.abs().max():.3g}"
        assert toks[row] == ht, f"row {row}: greedy tokens differ at step {next(i for i, (a, b) in enumerate(zip(toks[row], ht)) if a != b)}"


def test_transformers_checkpoint_through_loader(tmp_path):
    """save_pretrained -> ds4's loader (transformers naming, dense F32) -> the same greedy tokens."""
    from ds4.weights.checkpoint import load_checkpoint
    args = tiny()
    w = random_weights(args, seed=5, include_mtp=False)
    hf = hf_model(args, w)
    hf.save_pretrained(tmp_path)
    largs, lw = load_checkpoint(tmp_path, progress=False)
    assert largs.weight_dtype == "bf16" and lw["layers.0.attn.wq_a.weight"].dtype == torch.float32
    model = Transformer(largs, torch_reference_ops(), "plain", torch.float32)
    model.load_weights(lw)
    prompt = [5, 9, 100, 3, 77, 12, 40]
    toks, _ = ds4_greedy(model, [prompt], 80)
    ht, _ = hf_greedy(hf, prompt, 80)
    assert toks[0] == ht


def test_official_checkpoint_generates_like_memory(tmp_path):
    """write_checkpoint -> load_checkpoint -> the same tokens as the in-memory synthetic model."""
    from ds4.runtime.generate import Generator
    from ds4.weights.checkpoint import load_checkpoint
    from ds4.weights.writer import write_checkpoint
    args = tiny()
    w = random_weights(args, seed=6)
    write_checkpoint(tmp_path, args, w, max_shard_bytes=1 << 20)
    largs, lw = load_checkpoint(tmp_path, progress=False)
    assert largs == args
    outs = []
    for tensors in (w, lw):
        m = Transformer(args, torch_reference_ops(), "plain", torch.float32)
        m.load_weights(tensors)
        outs.append(Generator(m, 1, 128).generate([[4, 5, 6, 7]], 40).tokens)
    assert outs[0] == outs[1]
