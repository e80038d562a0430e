"""Official (schema) naming <-> transformers naming of DeepSeek-V4 tensors (spec §10.5).

Two transformers spellings exist and both are accepted on input (verified with transformers
5.24 on a tiny config):

* module naming — `DeepseekV4ForCausalLM.state_dict()`: `model.embed_tokens.weight`,
  `model.layers.N.self_attn.q_a_proj.weight`, ..., routed experts stacked as
  `model.layers.N.mlp.experts.gate_up_proj` [E, 2*inter, dim] (w1 ‖ w3 along the out dim) and
  `model.layers.N.mlp.experts.down_proj` [E, dim, inter] (w2), `lm_head.weight`.
* saved naming — what `save_pretrained` writes: transformers applies its conversion mapping in
  reverse, which gives the official names under a `model.` prefix with unstacked experts, except
  where the reverse mapping is not anchored/injective: `model.embed_tokens.weight`,
  `model.hc_head.hc_{fn,base,scale}`, `head.weight` (no prefix) and `model.layers.N.attn.norm.weight`
  for the official `layers.N.attn.kv_norm.weight`.

`official_to_hf` produces module naming (dequantised dense tensors) for `load_state_dict` on the
transformers model; `hf_to_official` maps either spelling back.
"""
from __future__ import annotations

import re

import torch
from torch import Tensor

from ds4.model.args import ModelArgs
from ds4.quant.formats import dequant_fp4, dequant_fp8
from ds4.weights.schema import FP4_PACKED, FP8, I64, expected_tensors

# official global name -> transformers module name
GLOBAL_TO_HF = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}

# official per-layer suffix (after `layers.N.`) -> transformers suffix (after `model.layers.N.`)
LAYER_TO_HF = {
    "hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"

_HF_TO_GLOBAL = {v: k for k, v in GLOBAL_TO_HF.items()}
_HF_TO_LAYER = {v: k for k, v in LAYER_TO_HF.items()}
# save_pretrained spellings (reverse conversion mapping) that differ from `model.` + official
_SAVED_GLOBAL = {"model.embed_tokens.weight": "embed.weight", "head.weight": "head.weight",
                 "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
                 "model.hc_head.hc_scale": "hc_head_scale"}
_SAVED_LAYER = {"attn.norm.weight": "attn.kv_norm.weight"}
_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^ffn\.experts\.(\d+)\.w([123])\.weight$")
_OFFICIAL_LAYER = set(LAYER_TO_HF)


def dense_args(args: ModelArgs) -> ModelArgs:
    """The args of a dense (transformers-format or dequantised) checkpoint: BF16 everywhere."""
    return args.replace(weight_dtype="bf16", expert_dtype="bf16")


def is_hf_name(key: str) -> bool:
    """True for a key in either transformers spelling (`model.` prefix or `lm_head.weight`)."""
    return key.startswith("model.") or key == "lm_head.weight"


def hf_key_to_official(key: str) -> tuple[str, str | None]:
    """Map one transformers key (module or saved spelling) to the official naming.

    Returns (official name, None) for a 1:1 tensor, (f"layers.N", "gate_up"|"down") for a stacked
    expert tensor, or ("", None) when the key is not a DeepSeek-V4 tensor.
    `mtp.*` keys map to themselves (transformers ignores them; callers decide)."""
    if key in _HF_TO_GLOBAL:
        return _HF_TO_GLOBAL[key], None
    if key in _SAVED_GLOBAL:
        return _SAVED_GLOBAL[key], None
    k = key[len("model."):] if key.startswith("model.") else key
    if k in GLOBAL_TO_HF:  # official global name, with or without `model.`
        return k, None
    if k.startswith("mtp."):
        return k, None
    m = _LAYER_RE.match(key)
    if not m or not key.startswith("model."):
        return "", None
    layer, rest = m.group(1), m.group(2)
    if rest == GATE_UP:
        return f"layers.{layer}", "gate_up"
    if rest == DOWN:
        return f"layers.{layer}", "down"
    if rest in _HF_TO_LAYER:
        return f"layers.{layer}.{_HF_TO_LAYER[rest]}", None
    if rest in _SAVED_LAYER:
        return f"layers.{layer}.{_SAVED_LAYER[rest]}", None
    if rest in _OFFICIAL_LAYER or _EXPERT_RE.match(rest):
        return f"layers.{layer}.{rest}", None
    return "", None


def official_to_hf_name(name: str) -> str | None:
    """Transformers module name of an official tensor; None for `mtp.*` and `.scale` tensors.
    Routed experts map to their stacked tensor (gate_up_proj for w1/w3, down_proj for w2)."""
    if name in GLOBAL_TO_HF:
        return GLOBAL_TO_HF[name]
    if name.startswith("mtp.") or name.endswith(".scale"):
        return None
    m = _LAYER_RE.match(name)
    if not m or name.startswith("model."):
        raise KeyError(f"not an official DeepSeek-V4 tensor name: {name}")
    layer, rest = m.group(1), m.group(2)
    e = _EXPERT_RE.match(rest)
    if e:
        return f"model.layers.{layer}.{DOWN if e.group(2) == '2' else GATE_UP}"
    if rest not in LAYER_TO_HF:
        raise KeyError(f"not an official DeepSeek-V4 tensor name: {name}")
    return f"model.layers.{layer}.{LAYER_TO_HF[rest]}"


def dequant_weight(tensors: dict[str, Tensor], name: str, dtype: torch.dtype) -> Tensor:
    """Dense value of official tensor `name` (an FP8/FP4 `.weight` uses its `.scale`)."""
    t = tensors[name]
    if t.dtype == FP8:
        return dequant_fp8(t, tensors[name[: -len("weight")] + "scale"], dtype)
    if t.dtype == FP4_PACKED and name.endswith(".weight"):
        return dequant_fp4(t, tensors[name[: -len("weight")] + "scale"], dtype)
    if t.dtype == I64 or t.dtype == torch.int32:
        return t.to(I64)
    return t.to(dtype)


def official_to_hf(args: ModelArgs, tensors: dict[str, Tensor], dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Full (world=1) official tensors in any format -> transformers module naming, dense `dtype`.

    `mtp.*` is dropped (transformers has no MTP). Routed experts are stacked per layer."""
    out: dict[str, Tensor] = {}
    for name in expected_tensors(args, include_mtp=False):
        if name.endswith(".scale") or ".experts." in name and ".shared_experts." not in name:
            continue
        if name not in tensors:
            raise KeyError(f"official_to_hf: missing tensor {name}")
        out[official_to_hf_name(name)] = dequant_weight(tensors, name, dtype)
    for i in range(args.n_layers):
        p = f"layers.{i}.ffn.experts"
        try:
            w1 = [dequant_weight(tensors, f"{p}.{e}.w1.weight", dtype) for e in range(args.n_routed_experts)]
            w2 = [dequant_weight(tensors, f"{p}.{e}.w2.weight", dtype) for e in range(args.n_routed_experts)]
            w3 = [dequant_weight(tensors, f"{p}.{e}.w3.weight", dtype) for e in range(args.n_routed_experts)]
        except KeyError as e:
            raise KeyError(f"official_to_hf needs every routed expert (world=1 weights): missing {e}") from None
        out[f"model.layers.{i}.{GATE_UP}"] = torch.stack([torch.cat([a, b], 0) for a, b in zip(w1, w3)])
        out[f"model.layers.{i}.{DOWN}"] = torch.stack(w2)
    return out


def hf_to_official(args: ModelArgs, hf_tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Transformers tensors (module or saved spelling) -> official naming of `dense_args(args)`.

    Dense weights keep their dtype (BF16 or F32) as `<name>.weight` without scale; stacked
    experts are unstacked; tid2eid becomes int64; `mtp.*` keys are dropped. Unknown keys raise."""
    inter = args.moe_inter_dim
    got: dict[str, Tensor] = {}
    unknown = []
    for key, t in hf_tensors.items():
        name, stacked = hf_key_to_official(key)
        if not name:
            unknown.append(key)
        elif name.startswith("mtp."):
            continue
        elif stacked == "gate_up":
            for e in range(t.shape[0]):
                got[f"{name}.ffn.experts.{e}.w1.weight"] = t[e, :inter]
                got[f"{name}.ffn.experts.{e}.w3.weight"] = t[e, inter:]
        elif stacked == "down":
            for e in range(t.shape[0]):
                got[f"{name}.ffn.experts.{e}.w2.weight"] = t[e]
        else:
            got[name] = t.to(I64) if name.endswith("tid2eid") else t
    if unknown:
        raise KeyError(f"hf_to_official: {len(unknown)} unknown tensors, e.g. {unknown[:5]}")
    order = expected_tensors(dense_args(args), include_mtp=False)
    missing = [n for n in order if n not in got]
    if missing:
        raise KeyError(f"hf_to_official: {len(missing)} missing tensors, e.g. {missing[:5]}")
    extra = [n for n in got if n not in order]
    if extra:
        raise KeyError(f"hf_to_official: {len(extra)} unexpected tensors, e.g. {extra[:5]}")
    return {n: got[n] for n in order}


__all__ = ["dense_args", "official_to_hf", "hf_to_official", "official_to_hf_name", "hf_key_to_official",
           "is_hf_name", "dequant_weight", "GLOBAL_TO_HF", "LAYER_TO_HF"]
