"""Model hyper-parameters (spec §1) and the presets tiny / small / v4_flash.

`ModelArgs` uses the official reference's field names (spec §1.2). `from_hf_config` reads a
HF `config.json` of DeepSeek-V4-Flash; `to_hf_config` writes one back (for the transformers
oracle and for checkpoint writing). Sizes such as window, ratios and expert counts are
parameters, never constants in the model code.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# Layer types, derived from the per-layer compress ratio (spec §1.3).
SWA, CSA, HCA = "swa", "csa", "hca"
# The overlapped compressor with an indexer is tied to ratio 4 in the reference
# (`overlap = compress_ratio == 4`); any other non-zero ratio is a plain (HCA) compressor.
CSA_RATIO = 4


# int fields that may be 0 (every other int field is a size or count of at least 1). Not rope_head_dim: the model
# rotates x[..., -rope_head_dim:], the whole head at 0, and the indexer's scores kernel refuses an empty RoPE table.
# hc_sinkhorn_iters = 0 computes what 1 does (the reference's loop runs iters - 1 times; ds4.ops.base.sinkhorn_iters).
_MAY_BE_ZERO = frozenset({"n_hash_layers", "n_mtp_layers", "beta_fast", "beta_slow",
                          "hc_sinkhorn_iters", "bos_token_id", "eos_token_id"})


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 129280
    dim: int = 4096
    moe_inter_dim: int = 2048
    n_layers: int = 43
    n_hash_layers: int = 3
    n_mtp_layers: int = 1
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    # One entry per main layer, then one per MTP layer (spec §1.3).
    compress_ratios: tuple[int, ...] = (0, 0, 4) + (128, 4) * 20 + (0,)
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: int = 32
    beta_slow: int = 1
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    bos_token_id: int = 0
    eos_token_id: int = 1
    # Storage formats: "fp8" = e4m3 + E8M0 128x128 blocks; "fp4" = e2m1 + E8M0 per 32 (experts
    # only); "bf16" = plain (a transformers-format checkpoint or a dequantised model).
    weight_dtype: str = "fp8"
    expert_dtype: str = "fp4"
    max_position_embeddings: int = 1048576

    def __post_init__(self):
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        for f in dataclasses.fields(self):  # types first: the checks below and the model compute with them
            v, lo = getattr(self, f.name), 0 if f.name in _MAY_BE_ZERO else 1
            if f.type == "int" and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"invalid ModelArgs: {f.name} must be an integer, got {v!r}")
            if f.type == "float" and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"invalid ModelArgs: {f.name} must be a number, got {v!r}")
            if f.type == "int" and v < lo:
                raise ValueError(f"invalid ModelArgs: {f.name} must be >= {lo}, got {v}")
        need = self.n_layers + self.n_mtp_layers
        if len(self.compress_ratios) < need:
            raise ValueError(f"compress_ratios has {len(self.compress_ratios)} entries, need n_layers + n_mtp_layers = {need}")
        checks = [
            (self.n_heads * self.head_dim % self.o_groups == 0, "n_heads*head_dim must divide by o_groups"),
            (self.n_heads % self.o_groups == 0, "n_heads must divide by o_groups"),
            (self.rope_head_dim % 2 == 0 and self.rope_head_dim <= self.head_dim, "bad rope_head_dim"),
            (self.rope_head_dim <= self.index_head_dim, "rope_head_dim must fit in index_head_dim"),
            (self.n_activated_experts <= self.n_routed_experts, "more activated than routed experts"),
            (self.weight_dtype in ("fp8", "bf16"), f"weight_dtype must be fp8|bf16, got {self.weight_dtype}"),
            (self.expert_dtype in ("fp4", "fp8", "bf16"), f"expert_dtype must be fp4|fp8|bf16, got {self.expert_dtype}"),
            (self.score_func == "sqrtsoftplus", f"only score_func=sqrtsoftplus is supported, got {self.score_func}"),
            (self.n_shared_experts == 1, "exactly one shared expert is supported"),
            (self.index_head_dim & (self.index_head_dim - 1) == 0, "index_head_dim must be a power of two (Hadamard)"),
        ]
        for r in self.compress_ratios:
            checks.append((r >= 0, f"negative compress ratio {r}"))
        if self.weight_dtype == "fp8":
            for n in (self.dim, self.q_lora_rank, self.head_dim, self.moe_inter_dim, self.o_lora_rank):
                checks.append((n % 128 == 0, f"fp8 weights need dims divisible by 128, got {n}"))
        if self.expert_dtype == "fp4":
            checks.append((self.dim % 32 == 0 and self.moe_inter_dim % 32 == 0, "fp4 experts need dims divisible by 32"))
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"invalid ModelArgs: {msg}")

    # ---- derived quantities -------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def layer_type(self, layer: int) -> str:
        r = self.compress_ratios[layer]
        return SWA if r == 0 else (CSA if r == CSA_RATIO else HCA)

    def is_hash(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    @property
    def hca_ratio(self) -> int | None:
        rs = {r for r in self.compress_ratios[: self.n_layers] if r not in (0, CSA_RATIO)}
        if len(rs) > 1:
            raise ValueError(f"several HCA ratios {sorted(rs)}: transformers can express only one")
        return rs.pop() if rs else None

    def with_layers(self, n_layers: int) -> "ModelArgs":
        """Trim (or keep) the main stack to `n_layers`; the MTP ratios stay at the end."""
        if not 1 <= n_layers <= self.n_layers:
            raise ValueError(f"n_layers must be in [1, {self.n_layers}], got {n_layers}")
        ratios = self.compress_ratios[:n_layers] + self.compress_ratios[self.n_layers :]
        return dataclasses.replace(self, n_layers=n_layers, compress_ratios=ratios,
                                   n_hash_layers=min(self.n_hash_layers, n_layers))

    def replace(self, **kw) -> "ModelArgs":
        return dataclasses.replace(self, **kw)

    # ---- HF config.json ---------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], **overrides) -> "ModelArgs":
        """Read a HF `config.json` (official V4-Flash or one written by transformers)."""
        rs = cfg.get("rope_scaling") or {}
        rp = cfg.get("rope_parameters") or {}
        if isinstance(rp.get("compress"), dict):  # written by transformers >= 5.23
            rs = {**rp["compress"], **rs}
        if (rs.get("type") or rs.get("rope_type")) == "default":  # plain RoPE (transformers' name): no YaRN fields
            rs = {k: v for k, v in rs.items() if k == "rope_theta"}
        ratios = cfg.get("compress_ratios")
        if ratios is None and cfg.get("layer_types"):
            rates = cfg.get("compress_rates") or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
            table = {"sliding_attention": 0, **rates}
            ratios = [table[t] for t in cfg["layer_types"]]
            ratios += [0] * int(cfg.get("num_nextn_predict_layers", 1))
        n_hash = cfg.get("num_hash_layers")
        if n_hash is None and cfg.get("mlp_layer_types"):
            n_hash = sum(t == "hash_moe" for t in cfg["mlp_layer_types"])
        qc = cfg.get("quantization_config") or {}
        weight_dtype = "fp8" if qc.get("quant_method") == "fp8" else "bf16"
        expert_dtype = cfg.get("expert_dtype") or qc.get("expert_dtype") or ("fp8" if weight_dtype == "fp8" else "bf16")
        rope_head_dim = cfg.get("qk_rope_head_dim")
        if rope_head_dim is None:
            rope_head_dim = int(cfg.get("head_dim", 512) * cfg.get("partial_rotary_factor", 0.125))
        eos = cfg.get("eos_token_id", 1)
        kw = dict(
            vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], moe_inter_dim=cfg["moe_intermediate_size"],
            n_layers=cfg["num_hidden_layers"], n_hash_layers=3 if n_hash is None else int(n_hash),
            n_mtp_layers=int(cfg.get("num_nextn_predict_layers", 1)), n_heads=cfg["num_attention_heads"],
            head_dim=cfg["head_dim"], rope_head_dim=int(rope_head_dim), q_lora_rank=cfg["q_lora_rank"],
            o_groups=cfg["o_groups"], o_lora_rank=cfg["o_lora_rank"], window_size=cfg["sliding_window"],
            compress_ratios=tuple(ratios), rope_theta=float(cfg.get("rope_theta", 10000.0)),
            compress_rope_theta=float(rs.get("rope_theta", cfg.get("compress_rope_theta", 160000.0))),
            rope_factor=float(rs.get("factor", 1.0)),
            original_seq_len=int(rs.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 65536))),
            beta_fast=int(rs.get("beta_fast", 32)), beta_slow=int(rs.get("beta_slow", 1)),
            index_n_heads=cfg["index_n_heads"], index_head_dim=cfg["index_head_dim"], index_topk=cfg["index_topk"],
            n_routed_experts=cfg["n_routed_experts"], n_shared_experts=cfg.get("n_shared_experts", 1),
            n_activated_experts=cfg["num_experts_per_tok"], score_func=cfg.get("scoring_func", "sqrtsoftplus"),
            route_scale=float(cfg.get("routed_scaling_factor", 1.5)), swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
            hc_mult=cfg.get("hc_mult", 4), hc_sinkhorn_iters=cfg.get("hc_sinkhorn_iters", 20),
            hc_eps=float(cfg.get("hc_eps", 1e-6)), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            bos_token_id=cfg.get("bos_token_id", 0) or 0, eos_token_id=eos[0] if isinstance(eos, list) else eos,
            weight_dtype=weight_dtype, expert_dtype=expert_dtype,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 1048576)),
        )
        if (rs.get("type") or rs.get("rope_type")) not in ("yarn", "default", None):
            raise ValueError(f"unsupported rope scaling {rs}")
        kw.update(overrides)
        return cls(**kw)

    def to_hf_config(self, quantized: bool = True) -> dict[str, Any]:
        """A HF `config.json` dict. `quantized` adds the FP8 quantization_config of the release."""
        cfg: dict[str, Any] = {
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size, "hidden_size": self.dim, "moe_intermediate_size": self.moe_inter_dim,
            "num_hidden_layers": self.n_layers, "num_attention_heads": self.n_heads, "num_key_value_heads": 1,
            "head_dim": self.head_dim, "qk_rope_head_dim": self.rope_head_dim, "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank, "sliding_window": self.window_size,
            "rope_theta": self.rope_theta, "compress_rope_theta": self.compress_rope_theta,
            "rope_scaling": {"type": "yarn", "factor": self.rope_factor,
                             "original_max_position_embeddings": self.original_seq_len,
                             "beta_fast": self.beta_fast, "beta_slow": self.beta_slow},
            "max_position_embeddings": self.max_position_embeddings,
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim, "index_topk": self.index_topk,
            "n_routed_experts": self.n_routed_experts, "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.n_activated_experts, "num_hash_layers": self.n_hash_layers,
            "scoring_func": self.score_func, "topk_method": "noaux_tc", "norm_topk_prob": True,
            "routed_scaling_factor": self.route_scale, "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult, "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps,
            "rms_norm_eps": self.norm_eps, "num_nextn_predict_layers": self.n_mtp_layers, "hidden_act": "silu",
            "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "torch_dtype": "bfloat16",
        }
        main = self.compress_ratios[: self.n_layers]
        if set(main) <= {0, 4, 128}:
            cfg["compress_ratios"] = list(self.compress_ratios)
        else:  # transformers only maps 0/4/128 from compress_ratios; express other HCA ratios as rates
            table = {SWA: "sliding_attention", CSA: "compressed_sparse_attention", HCA: "heavily_compressed_attention"}
            cfg["layer_types"] = [table[self.layer_type(i)] for i in range(self.n_layers)]
            cfg["compress_rates"] = {"compressed_sparse_attention": CSA_RATIO,
                                     "heavily_compressed_attention": self.hca_ratio or 128}
        if quantized and self.weight_dtype == "fp8":
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
        if quantized:  # also beside BF16 projections: without it the experts' format would read back as theirs
            cfg["expert_dtype"] = self.expert_dtype
        return cfg


def v4_flash() -> ModelArgs:
    return ModelArgs()


def small() -> ModelArgs:
    """GPU smoke test: real formats (FP8 128-blocks, FP4 experts), every layer type, ~0.5B params."""
    return ModelArgs(
        vocab_size=32768, dim=1024, moe_inter_dim=512, n_layers=6, n_hash_layers=2, n_heads=16, head_dim=256,
        rope_head_dim=64, q_lora_rank=512, o_groups=4, o_lora_rank=256, window_size=128,
        compress_ratios=(0, 4, 128, 4, 128, 4, 0), index_n_heads=16, index_head_dim=128, index_topk=64,
        n_routed_experts=32, n_activated_experts=6, original_seq_len=4096, max_position_embeddings=65536,
    )


def tiny() -> ModelArgs:
    """CPU-fast (a few million params) yet every layer type: SWA, CSA (ratio 4 + indexer whose top-k
    really selects), HCA (ratio 16 so several entries appear in a few hundred tokens), hash and
    learned MoE, o_groups = 2. Native formats: FP8 with 128-blocks needs dims of 128."""
    return ModelArgs(
        vocab_size=512, dim=128, moe_inter_dim=128, n_layers=5, n_hash_layers=2, n_heads=4, head_dim=128,
        rope_head_dim=32, q_lora_rank=128, o_groups=2, o_lora_rank=128, window_size=16,
        compress_ratios=(0, 4, 16, 4, 16, 0), index_n_heads=8, index_head_dim=64, index_topk=8,
        n_routed_experts=16, n_activated_experts=4, original_seq_len=256, max_position_embeddings=4096,
        rope_factor=16.0,
    )


PRESETS = {"tiny": tiny, "small": small, "v4_flash": v4_flash}


def preset(name: str) -> ModelArgs:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
